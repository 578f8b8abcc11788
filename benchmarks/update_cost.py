"""What the update ratios cost a sampled step: the weights' copy, the subtraction and two norms.

On each demo model the probe samples every step (``grad_every=1``); sampled steps alternate,
ten with the update ratios allowed and ten without (``UpdateRatios.due`` answering no), and
the probe's own accounting of a sampled step's surplus work (what the gradient interval goes
by: ``StepSampler._grad_seconds`` at the step's end) is read for each. Printed per model: the
median surplus with and without, their difference (what the ratios add to a sampled step, and
so, through the adaptive interval, nothing to the budget: the interval lengthens to pay for
it), that difference as a share of the model's step, and the bytes the copy takes.
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
from tdbg.probe.training import update_ratio  # noqa: E402


def bench(name: str, steps: int) -> None:
    task = MAKERS[name](seed=0)
    pool = [task.batch() for _ in range(16)]
    probe = tdbg.watch(task.model, task.optimizer, name=name, grad_every=1)
    sampler = probe._sampler
    original = update_ratio.UpdateRatios.due
    skip: Any = lambda self, seconds: False  # noqa: E731  # not due: no copy, no ratios
    seconds: dict[bool, list[float]] = {True: [], False: []}
    measured = {True: 0, False: 0}
    step_times: list[float] = []
    for i in range(2 * steps + 20):
        # Blocks of 10 steps each way: the ratios' credit builds over the steps it is on.
        on = (i // 10) % 2 == 0
        update_ratio.UpdateRatios.due = original if on else skip  # type: ignore[method-assign]
        inputs, targets = pool[i % len(pool)]
        task.optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(task.model(inputs), targets)
        loss.backward()
        task.optimizer.step()
        # The step's timed work so far (the pass, the copy, the ratios), before probe.step()
        # folds it into its averages and zeroes it.
        spent = sampler._grad_seconds
        took = any(slot.update_result is not None for slot in sampler._slots)
        probe.step(loss.detach())
        if i >= 20:
            seconds[on].append(spent)
            measured[on] += took
            step_times.append(sampler._step_ema)
    update_ratio.UpdateRatios.due = original  # type: ignore[method-assign]
    cost = max(slot.updates._cost for slot in sampler._slots if slot.updates is not None)
    probe.close()
    with_, without = statistics.fmean(seconds[True]), statistics.fmean(seconds[False])
    step = statistics.median(step_times)
    params = sum(p.numel() * p.element_size() for p in task.model.parameters())
    copied = min(params, update_ratio.COPY_BYTES)
    share = measured[True] / max(1, len(seconds[True]))
    print(
        f"{name:<12} a measurement {cost * 1e6:8.1f} us (copy {copied / 2**20:.2f} MiB of"
        f" {params / 2**20:.2f} MiB), on {share * 100:5.1f} % of sampled steps; a sampled"
        f" step's timed work {with_ * 1e6:7.1f} us with the ratios, {without * 1e6:7.1f} us"
        f" without: +{(with_ - without) / without * 100:5.1f} % (a {step * 1e3:.2f} ms step)"
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
