"""Accelerate needs no integration: the README's loop, with plain ``watch()``, records true numbers
(one step per synced update, the window's mean micro-batch loss, the LR it used)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import tdbg

accelerate = pytest.importorskip("accelerate")


def test_the_readme_accelerate_loop(runtime_dir: Path, tmp_path: Path) -> None:
    from tdbg.protocol.steps import unpack_steps
    from tdbg.recording.reader import Recording

    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen))
    loader = DataLoader(data, batch_size=4)  # 8 batches: 4 updates of 2
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    path = tmp_path / "acc.tdbg"

    # As in README.md: the unwrapped model, the torch optimizer under Accelerate's wrapper.
    probe = tdbg.watch(
        accelerator.unwrap_model(model), optimizer.optimizer, record=path, serve=False
    )
    micro: list[float] = []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            micro.append(loss.item())
            accelerator.backward(loss)  # divides by gradient_accumulation_steps
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            probe.step()
    probe.close()

    messages = list(Recording(path).messages())
    records = [r for m in messages if m.get("type") == "steps" for r in unpack_steps(m)]
    assert len(records) == 4
    assert [r.loss for r in records] == pytest.approx(
        [(micro[i] + micro[i + 1]) / 2 for i in range(0, 8, 2)], rel=1e-6
    )
    assert [r.micro_batches for r in records] == [2, 2, 2, 2]
    # Accelerate steps the scheduler only with the optimizer: update k used 0.1 * 0.5**k.
    assert [r.lr for r in records] == [[pytest.approx(0.1 * 0.5**k)] for k in range(4)]
