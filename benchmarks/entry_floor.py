"""The floor under the probe's per-step cost: its entry points with next to nothing in them.

On a usual CPU step torch enters the probe six times: the forward wrapper on the watched
model, the backward tap on ``torch.autograd.backward`` (which reads the CPU loss), the
process-wide optimizer step pre-hook, the optimizer's own step pre-hook and post-hook, and
``probe.step()`` (five on a lean step: the process-wide hook does the step pre-hook's work).
The *floor* arm puts entry points of the same kinds in the same places with
minimal bodies: a clock read and a store each, ``loss.item()`` in the backward tap, one tuple
appended to a bounded deque in ``step()`` (a thread drains it at 10 Hz, as the probe thread
does). What the probe costs beyond the floor is what its bodies cost, not being called at all.

Arms alternate in one process as in ``interleaved.py`` (a turn of ``--turn`` timed steps after
one untimed step, the order shuffled per cycle, training-thread CPU): ``unwatched``,
``unwatched again`` (the noise), ``floor``, ``floor, no optimizer hooks``, ``floor, no
.item()`` (what those parts of the structure cost), ``floor, step() alone`` (no hook at all:
``step()`` reads the loss passed with ``.item()``, its clock and appends: the floor of a
probe whose usual steps run ``probe.step()`` alone, issue 36's "physical floor"), and
``probe`` (one long-lived
``tdbg.watch(grad_every=10**9)``: its fixed per-step work, no gradient pass; its hooks and
taps off for the other arms, as ``thread_cpu.unhook`` takes them off), and ``probe, every
step timed`` (the same probe with its hooks and taps timing themselves on every step, not one
in ``self_timing.TIMED_EVERY``: what sampling its own timing saves), and ``probe, no lean
steps`` (every step's bookkeeping the whole way, ``lean.ENABLED`` off: what lean steps save),
and ``probe, pre-hook kept`` (lean steps with the optimizer's own step pre-hook left in its
dict, ``hooks.PRE_OUT`` off: what taking it out for the process-wide tap to do its work saves),
and ``probe, through the sampler`` (a lean CPU step handed over through ``StepSampler.step``,
not straight from ``Probe.step``: what the straight way saves).

The default model, ``micro`` (one ``Linear(4, 4)`` at batch 1, Adam: a ~0.25 ms CPU step that
is mostly the optimizer's Python), varies less from step to step than the demos' ``tiny``
(four ``Linear(32, 32)`` at batch 8): 1,500 cycles resolve about +-1 us where ``tiny`` resolves
+-2.5-4 us, and the probe's cost is the same within a few us on both.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import random
import statistics
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from interleaved import turn  # noqa: E402
from models import MAKERS, Batch, Task  # noqa: E402
from thread_cpu import rehook, run_models, unhook  # noqa: E402

import tdbg  # noqa: E402

optimizer_mod = importlib.import_module("torch.optim.optimizer")
perf = time.perf_counter
POOL = 64

UNWATCHED, AGAIN, FLOOR, NO_OPT, NO_ITEM, STEP_ONLY = (
    "unwatched",
    "unwatched again",
    "floor",
    "floor, no optimizer hooks",
    "floor, no .item()",
    "floor, step() alone",
)
PROBE, ALL_TIMED, NOT_LEAN, PRE_KEPT, THROUGH = (
    "probe",
    "probe, every step timed",
    "probe, no lean steps",
    "probe, pre-hook kept",
    "probe, through the sampler",
)
ARMS = (UNWATCHED, AGAIN, FLOOR, NO_OPT, NO_ITEM, STEP_ONLY, PROBE, ALL_TIMED, NOT_LEAN, PRE_KEPT)
ARMS += (THROUGH,)
PROBE_ARMS = (PROBE, ALL_TIMED, NOT_LEAN, PRE_KEPT, THROUGH)
sampler_mod = importlib.import_module("tdbg.probe.training.sampler")
lean_mod = importlib.import_module("tdbg.probe.training.lean")
hooks_mod = importlib.import_module("tdbg.probe.training.hooks")


def make_micro(*, seed: int = 0) -> Task:
    """One ``Linear(4, 4)`` at batch 1 with Adam: a short step that varies little."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4))

    def batch() -> Batch:
        x = torch.randn(1, 4, generator=generator)
        return x, x.flip(1)

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Task("micro", model, optimizer, batch, F.mse_loss, 1)


class Floor:
    """Entry points of the probe's kinds in the probe's places, each with a minimal body."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.marks: list[Any] = [None] * 6
        self.handed: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=4096)
        self.read_item = True
        self.alone = False  # step() the only entry point: it reads the loss itself
        self._handles: list[Any] = []
        self._backward = torch.autograd.backward
        self._stop = threading.Event()
        threading.Thread(target=self._drain, daemon=True, name="floor-drain").start()

    def _drain(self) -> None:
        while not self._stop.wait(0.1):
            handed = self.handed
            for _ in range(len(handed)):
                handed.popleft()

    def on(self, optimizer_hooks: bool, read_item: bool, alone: bool = False) -> None:
        marks = self.marks
        self.read_item = read_item
        self.alone = alone
        if alone:
            return
        original = self._backward
        floor = self

        def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            marks[0] = perf()
            return type(module).forward(module, *args, **kwargs)

        def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
            marks[1] = perf()
            if floor.read_item and grad_tensors is None and type(tensors) is torch.Tensor:
                marks[2] = tensors.item()
            return original(tensors, grad_tensors, *args, **kwargs)

        def any_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            marks[3] = perf()

        def step_start(optimizer: Any, args: Any, kwargs: Any) -> None:
            marks[4] = perf()

        def step_end(optimizer: Any, args: Any, kwargs: Any) -> None:
            marks[5] = perf()

        model, optimizer = self.task.model, self.task.optimizer
        model.__dict__["forward"] = types.MethodType(forward, model)
        torch.autograd.backward = backward  # type: ignore[assignment]
        if optimizer_hooks:
            self._handles = [
                optimizer_mod.register_optimizer_step_pre_hook(any_step),
                optimizer.register_step_pre_hook(step_start),
                optimizer.register_step_post_hook(step_end),
            ]

    def off(self) -> None:
        self.task.model.__dict__.pop("forward", None)
        torch.autograd.backward = self._backward  # type: ignore[assignment]
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def step(self, loss: Any, *, samples: Any = None, tokens: Any = None) -> None:
        marks = self.marks
        if self.alone and type(loss) is torch.Tensor:
            loss = loss.item()  # no backward tap read it
        self.handed.append((perf(), loss, samples, tokens, *marks))

    def close(self) -> None:
        self._stop.set()


def paired(values: list[float], base: list[float]) -> str:
    diffs = [a - b for a, b in zip(values, base, strict=True)]
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    return (
        f"{mean * 1e6:+6.1f} us +- {2 * se * 1e6:.1f} (2 SE), median"
        f" {statistics.median(diffs) * 1e6:+.1f}"
    )


def bench(name: str, args: argparse.Namespace, rng: random.Random) -> None:
    task = make_micro(seed=args.seed) if name == "micro" else MAKERS[name](seed=args.seed)
    pool = [task.batch() for _ in range(POOL)]
    for i in range(20):  # optimizer state, allocator
        task.train_step(*pool[i % POOL])
    probe = tdbg.watch(task.model, task.optimizer, name=name, grad_every=10**9)
    for i in range(50):
        probe.step(task.train_step(*pool[i % POOL]), samples=task.batch_size)
    unhook(probe)
    floor = Floor(task)
    off_record = lean_mod.LeanStep()
    timed_every = sampler_mod.TIMED_EVERY
    per_step: dict[str, list[float]] = {arm: [] for arm in ARMS}
    started = time.perf_counter()
    for _ in range(args.cycles):
        order = list(ARMS)
        rng.shuffle(order)
        for arm in order:
            stepper: Any = None
            if arm in PROBE_ARMS:
                rehook(probe)
                stepper = probe
                # Probe.step's straight way for a lean CPU step off (a record never lean
                # where it looks): the step goes through StepSampler.step, two frames more.
                probe._lean = off_record if arm == THROUGH else probe._sampler.lean
                # What timing itself on every step would cost (self_timing: one in N), and
                # every step's bookkeeping the whole way (lean.py).
                sampler_mod.TIMED_EVERY = 1 if arm == ALL_TIMED else timed_every
                lean_mod.ENABLED = arm != NOT_LEAN
                hooks_mod.PRE_OUT = arm != PRE_KEPT
            elif arm in (FLOOR, NO_OPT, NO_ITEM, STEP_ONLY):
                floor.on(
                    optimizer_hooks=arm not in (NO_OPT, STEP_ONLY),
                    read_item=arm != NO_ITEM,
                    alone=arm == STEP_ONLY,
                )
                stepper = floor
            try:
                per_step[arm].append(turn(task, pool, args.turn, stepper, rng.randrange(POOL)))
            finally:
                if stepper is probe:
                    unhook(probe)
                elif stepper is floor:
                    floor.off()
    floor.close()
    probe.close()
    base = per_step[UNWATCHED]
    print(
        f"\n=== {name}: {args.cycles} cycles x {args.turn} timed steps per arm"
        f" ({time.perf_counter() - started:.0f} s), unwatched"
        f" {statistics.median(base) * 1e6:.1f} us CPU/step"
    )
    for arm in ARMS[1:]:
        print(f"  {arm:<26} - unwatched: {paired(per_step[arm], base)}")
    print(f"  {PROBE:<26} - floor:     {paired(per_step[PROBE], per_step[FLOOR])}")
    print(f"  {PROBE:<26} - timed:     {paired(per_step[PROBE], per_step[ALL_TIMED])}")
    print(f"  {PROBE:<26} - not lean:  {paired(per_step[PROBE], per_step[NOT_LEAN])}")
    print(f"  {PROBE:<26} - pre kept:  {paired(per_step[PROBE], per_step[PRE_KEPT])}")
    print(f"  {PROBE:<26} - through:   {paired(per_step[PROBE], per_step[THROUGH])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="micro", help="comma-separated: micro, tiny")
    p.add_argument("--cycles", type=int, default=1500)
    p.add_argument("--turn", type=int, default=10, help="timed steps per arm per cycle")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in ("micro", "tiny")]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}; choose from micro, tiny")
        return 2
    run_models(models, bench, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
