"""What the weight and gradient histograms cost a sampled step: one counting pass, how often.

On each demo model the probe samples every step (``grad_every=1``); sampled steps alternate,
ten with the histograms allowed and ten without (``LayerHistograms.due`` answering no), and
the probe's own accounting of a sampled step's surplus work (what the gradient interval goes
by: ``StepSampler._grad_seconds`` at the step's end) is read for each. Printed per model: one
counting pass, the elements it counts of the model's, the share of sampled steps that count,
and a sampled step's timed work with and without (their difference is what the histograms add
to a sampled step; through the adaptive interval, nothing to the budget).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))

from models import MAKERS  # noqa: E402
from per_model import run_over_models  # noqa: E402

import tdbg  # noqa: E402
from tdbg.probe.training import histograms  # noqa: E402


def bench(name: str, steps: int) -> None:
    task = MAKERS[name](seed=0)
    pool = [task.batch() for _ in range(16)]
    probe = tdbg.watch(task.model, task.optimizer, name=name, grad_every=1)
    sampler = probe._sampler
    original = histograms.LayerHistograms.due
    skip: Any = lambda self, seconds: False  # noqa: E731  # not due: nothing counted
    seconds: dict[bool, list[float]] = {True: [], False: []}
    counted = {True: 0, False: 0}
    for i in range(2 * steps + 20):
        # Blocks of 10 steps each way: the histograms' credit builds over the steps it is on.
        on = (i // 10) % 2 == 0
        histograms.LayerHistograms.due = original if on else skip  # type: ignore[method-assign]
        inputs, targets = pool[i % len(pool)]
        task.optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(task.model(inputs), targets)
        loss.backward()
        task.optimizer.step()
        spent = sampler._grad_seconds  # the pass, the ratios, the histograms: before step()
        parts = [s.histogram_result for s in sampler._slots if s.histogram_result is not None]
        probe.step(loss.detach())
        if i >= 20:
            seconds[on].append(spent)
            counted[on] += bool(parts)
    histograms.LayerHistograms.due = original  # type: ignore[method-assign]
    slots = [s.histograms for s in sampler._slots if s.histograms is not None]
    cost = max(h._cost for h in slots)
    per_pass = max(min(sum(h._sizes), h._pass_elements) for h in slots)
    probe.close()
    with_, without = statistics.fmean(seconds[True]), statistics.fmean(seconds[False])
    numel = 2 * sum(p.numel() for p in task.model.parameters() if p.requires_grad)
    share = counted[True] / max(1, len(seconds[True]))
    print(
        f"{name:<12} a counting pass {cost * 1e6:8.1f} us ({per_pass / 1e6:.2f} M of"
        f" {numel / 1e6:.2f} M weight and gradient elements), on {share * 100:5.1f} % of"
        f" sampled steps; a sampled step's timed work {with_ * 1e6:7.1f} us with the"
        f" histograms, {without * 1e6:7.1f} us without: +{(with_ - without) / without * 100:5.1f} %"
    )


def main(argv: list[str] | None = None) -> int:
    return run_over_models(
        __doc__,
        bench,
        list(MAKERS),
        default_models="tiny,mlp,transformer,cnn",
        steps=200,
        steps_help="sampled steps per model",
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main())
