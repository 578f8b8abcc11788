"""What the activation histograms add to a step the activation-statistics dive samples.

On each demo model activation statistics run on every step (``activations_every=1``); steps
alternate in blocks of ten with the histograms and without (``sample_stride`` taking one
element a call, ``counts_per_tensor`` answering zeros: the dive's statistics unchanged). Printed
per model: a sampled step's median wall time each way and their difference, and the counting
pass alone (the boundary's ``counts_per_tensor``, timed where it runs), with the elements it
counts. On a CPU every kernel is synchronous, so the pass's time is its cost; on a GPU run
``benchmarks/gpu_cost.py``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))

import torch  # noqa: E402
from models import MAKERS  # noqa: E402
from per_model import run_over_models  # noqa: E402

import tdbg  # noqa: E402
from tdbg.probe.dives import activations  # noqa: E402
from tdbg.protocol.messages.histograms import N_BINS  # noqa: E402

BLOCK = 10  # steps each way in turn


def bench(name: str, steps: int) -> None:
    task = MAKERS[name](seed=0)
    pool = [task.batch() for _ in range(16)]
    # A recording, not a socket: dives need the probe's worker, which a recording starts.
    record = Path(tempfile.mkdtemp()) / f"{name}.tdbg"
    probe = tdbg.watch(
        task.model, task.optimizer, name=name, serve=False, record=record, activations_every=1
    )
    counting, stride = activations.counts_per_tensor, activations.sample_stride
    passes: list[float] = []
    elements: list[int] = []

    def timed(samples: list[torch.Tensor]) -> torch.Tensor:
        started = time.perf_counter()
        out = counting(samples)
        passes.append(time.perf_counter() - started)
        elements.append(sum(s.numel() for s in samples))
        return out

    def none(samples: list[torch.Tensor]) -> torch.Tensor:
        return torch.zeros(len(samples), N_BINS, device=samples[0].device)

    one: Any = lambda numel: max(1, numel)  # noqa: E731  # one element a call: no copy to speak of
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * steps + 2 * BLOCK):
        on = (i // BLOCK) % 2 == 0
        activations.counts_per_tensor = timed if on else none  # type: ignore[assignment]
        activations.sample_stride = stride if on else one  # type: ignore[assignment]
        inputs, targets = pool[i % len(pool)]
        started = time.perf_counter()
        task.optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(task.model(inputs), targets)
        loss.backward()
        task.optimizer.step()
        probe.step(loss.detach())
        took = time.perf_counter() - started
        if i >= 2 * BLOCK:  # the first round each way warms up
            seconds[on].append(took)
    activations.counts_per_tensor, activations.sample_stride = counting, stride
    probe.close()
    with_, without = statistics.median(seconds[True]), statistics.median(seconds[False])
    cost = statistics.median(passes[BLOCK:])
    print(
        f"{name:<12} sampled step {with_ * 1e3:7.2f} ms with the histograms,"
        f" {without * 1e3:7.2f} ms without: {(with_ - without) * 1e3:+6.2f} ms"
        f" ({(with_ - without) / without * 100:+5.1f} %); the counting pass"
        f" {cost * 1e6:7.1f} us over {elements[-1] / 1e3:.1f} k elements"
    )


def main(argv: list[str] | None = None) -> int:
    torch.set_flush_denormal(True)
    return run_over_models(
        __doc__,
        bench,
        list(MAKERS),
        default_models="tiny,mlp,transformer,cnn",
        steps=100,
        steps_help="sampled steps each way",
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main())
