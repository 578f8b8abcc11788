"""DataLoader with 2 forked workers, plus a spawned child that trains a model of its own."""

from __future__ import annotations

import multiprocessing
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zc_common import hold, watch_if_asked


def child_trains(queue: multiprocessing.Queue) -> None:
    """A spawned process that backpropagates: it must never start a probe of its own."""
    model = nn.Linear(3, 1)
    torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    auto = sys.modules.get("tdbg.probe.zero_code.autowatch")
    queue.put(
        {
            "preloaded": auto is not None,
            "claimed": getattr(auto, "_auto", None) is not None,
            "probe_imported": "tdbg.probe.watch" in sys.modules,
        }
    )


def main() -> None:
    torch.manual_seed(3)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(96, 5), torch.randn(96, 1))
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=2)  # fork on Linux
    model = nn.Sequential(nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    probe = watch_if_asked(model, optimizer)
    for _epoch in range(2):  # the second epoch forks its workers after the probe started
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            if probe is not None:
                probe.step(loss)
    if os.environ.get("ZC_SPAWN_PRELOAD"):
        # Worst case: the script hands the preload on to its children itself.
        os.environ["PYTHONPATH"] = os.environ["ZC_SPAWN_PRELOAD"]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=child_trains, args=(queue,))
    child.start()
    print(f"spawned child {queue.get(timeout=60)}", flush=True)
    child.join(60)
    print(f"final loss {loss.item():.6f}")
    hold()


if __name__ == "__main__":
    main()
