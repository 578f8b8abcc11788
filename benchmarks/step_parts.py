"""Where a usual step's cost goes, whole: the probe with each of its entry points taken out.

``entry_cost.py`` times each place torch calls into the probe, inside the span where it runs;
what a hook costs the rest of the step (caches it evicts, torch's slower path for a module with
hooks, the probe thread's work competing for the GIL) is outside those spans. Here the whole
step's training-thread CPU is measured, as in ``interleaved.py`` (arms taking turns every few
steps, the order shuffled per cycle, paired differences), for these arms:

- ``unwatched``: no probe (its hooks and taps off, as in ``interleaved.py``);
- ``watched``: the probe as ``watch()`` leaves it;
- ``watched - X``: the probe with one entry point X taken out of torch for the turn (``forward``
  its forward wrapper or pre-hook, ``backward`` the backward tap, ``optimizer pre`` /
  ``optimizer post`` its step hooks, ``any optimizer`` the process-wide optimizer tap,
  ``probe.step()`` the call), so ``watched`` minus it is what X costs the whole step;
- ``probe thread idle``: the probe thread drops what it is handed instead of resolving it (what
  its per-step work costs the training thread: the GIL, the caches).

The rows do not add up to the whole: an entry point taken out also changes what the others do
(without ``probe.step()`` no step ends). Default model: ``tiny`` (4 x Linear(32, 32), batch 8),
where the probe's fixed microseconds are a large share of a ~0.4 ms step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from interleaved import turn  # noqa: E402
from models import MAKERS  # noqa: E402
from overhead import POOL  # noqa: E402
from thread_cpu import rehook, unhook  # noqa: E402
from torch.optim import optimizer as optimizer_mod  # noqa: E402

import tdbg  # noqa: E402

UNWATCHED, WATCHED, IDLE = "unwatched", "watched", "probe thread idle"
PARTS = ("forward", "backward", "optimizer pre", "optimizer post", "any optimizer", "probe.step()")


class Parts:
    """Takes one of the probe's entry points out of torch for a turn, and puts it back."""

    def __init__(self, probe: tdbg.Probe, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.probe, self.model, self.opt = probe, model, opt
        self._back: Callable[[], None] | None = None
        # Turns on which the probe's step pre-hook was out of its dict already (lean steps:
        # the process-wide optimizer tap does its work, PhaseHooks.take_pre_out).
        self.pre_held_out = 0

    def take_out(self, part: str) -> None:
        mine = {h.id for h in self.probe._hooks.handles}
        hooks: dict[str, Any] = {
            "forward": self.model._forward_pre_hooks,
            "optimizer pre": self.opt._optimizer_step_pre_hooks,
            "optimizer post": self.opt._optimizer_step_post_hooks,
            "any optimizer": optimizer_mod._global_optimizer_pre_hooks,
        }
        wrapper = self.model.__dict__.get("forward")
        if part == "forward" and wrapper is not None:
            # The probe's forward wrapper (forward_tap), where it stands for the pre-hook.
            del self.model.__dict__["forward"]

            def back() -> None:
                self.model.__dict__["forward"] = wrapper

            self._back = back
        elif part in hooks:
            table = hooks[part]
            # The process-wide optimizer tap is the probe's only global step pre-hook here.
            ids = list(table) if part == "any optimizer" else [i for i in table if i in mine]
            if not ids and part == "optimizer pre" and self.probe._hooks._pre_out is not None:
                self.pre_held_out += 1  # nothing to take out: the arm is the whole probe
                return
            if not ids:  # else the arm would silently be the whole probe
                raise SystemExit(f"{part}: the probe has no such hook here; this torch differs")
            order = list(table)
            kept = {i: table.pop(i) for i in ids}

            def back() -> None:
                table.update(kept)
                for key in order:  # torch runs them in insertion order: as they were
                    if key in table:
                        table.move_to_end(key)

            self._back = back
        elif part == "backward":
            tapped = torch.autograd.backward
            if not hasattr(tapped, "__wrapped__"):
                raise SystemExit("backward: the probe's tap is not on torch.autograd.backward")
            torch.autograd.backward = tapped.__wrapped__  # type: ignore[attr-defined]

            def back() -> None:
                torch.autograd.backward = tapped

            self._back = back
        elif part == IDLE:
            server = self.probe._server
            tick = server._tick

            def drop(now: float) -> None:
                server.inbox.clear()

            server._tick = drop  # type: ignore[method-assign]

            def back() -> None:
                server._tick = tick  # type: ignore[method-assign]

            self._back = back

    def put_back(self) -> None:
        if self._back is not None:
            self._back()
            self._back = None


class NoStep:
    """A probe whose ``step()`` does nothing (the arm without ``probe.step()``)."""

    def __init__(self, probe: tdbg.Probe) -> None:
        self._sampler = probe._sampler

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass


def paired(values: list[float], base: list[float]) -> str:
    diffs = [a - b for a, b in zip(values, base, strict=True)]
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    return f"{mean * 1e6:+7.2f} us +- {2 * se * 1e6:4.2f}"


def bench(name: str, cycles: int, steps: int, seed: int) -> None:
    task = MAKERS[name](seed=seed)
    pool = [task.batch() for _ in range(POOL)]
    for i in range(20):  # optimizer state, allocator
        task.train_step(*pool[i % POOL])
    probe = tdbg.watch(task.model, task.optimizer, name=name)
    for i in range(50):  # the interval settles, plans are built
        probe.step(task.train_step(*pool[i % POOL]), samples=task.batch_size, tokens=task.tokens)
    parts = Parts(probe, task.model, task.optimizer)
    arms = [UNWATCHED, WATCHED, *PARTS, IDLE]
    per_step: dict[str, list[float]] = {arm: [] for arm in arms}
    rng = random.Random(seed)
    for _ in range(cycles):
        order = list(arms)
        rng.shuffle(order)
        for arm in order:
            watched = arm != UNWATCHED
            hooked = bool(probe._hooks.handles)
            if watched and not hooked:
                rehook(probe)
            elif not watched and hooked:
                unhook(probe)
            runner: Any = probe if watched else None
            if arm == "probe.step()":
                runner = NoStep(probe)
            elif arm not in (UNWATCHED, WATCHED):
                parts.take_out(arm)
            try:
                per_step[arm].append(turn(task, pool, steps, runner, rng.randrange(POOL)))
            finally:
                parts.put_back()
    if not probe._hooks.handles:
        rehook(probe)
    probe.close()
    base = per_step[UNWATCHED]
    whole = per_step[WATCHED]
    print(
        f"\n=== {name}: {cycles} cycles x {steps} steps per arm; unwatched"
        f" {statistics.median(base) * 1e3:.3f} ms CPU/step"
    )
    print(f"  {'watched - unwatched':<40} {paired(whole, base)}  (the whole probe)")
    for part in PARTS:
        print(f"  {'watched - (watched - ' + part + ')':<40} {paired(whole, per_step[part])}")
        if part == "optimizer pre" and parts.pre_held_out:
            print(
                f"    ({parts.pre_held_out} of {cycles} turns began on a lean step, the hook out"
                " of its dict: the process-wide tap, 'any optimizer', did its work)"
            )
    print(f"  {'watched - ' + IDLE:<40} {paired(whole, per_step[IDLE])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="tiny", help="comma-separated (default tiny)")
    p.add_argument("--cycles", type=int, default=1500, help="default 1500")
    p.add_argument("--steps", type=int, default=10, help="timed steps per turn (default 10)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MAKERS]
    if unknown or args.cycles < 2 or args.steps < 1:
        p.error(f"models from {', '.join(MAKERS)}; --cycles >= 2; --steps >= 1")
    torch.set_num_threads(1)
    for name in models:
        bench(name, args.cycles, args.steps, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
