"""The probe's cost in training-thread CPU time, resolved to a few tenths of a percent.

``thread_cpu.py`` runs each arm in blocks of ~0.2 s; on this shared VM a block's CPU time per
step drifts by several percent from one block to the next (other tenants, the caches), so 200
rounds resolve only +-1-1.5 % (2 SE). Here the arms take turns every few steps instead: one
model, three arms (``unwatched``, ``unwatched again``: the noise, ``watched``: one long-lived
``tdbg.watch()``), a *turn* of ``--turn`` steps per arm, the arms' order shuffled per cycle.
The first step of each turn is run but not timed: it absorbs what the previous arm left behind
(its caches, a probe's spill-over into the next step), so each timed step follows a step of
its own arm. Drift slower than a few steps cancels in the per-cycle pairs; 1,000 cycles take a
few minutes per model and resolve +-0.3-0.6 %.

For the unwatched turns the probe's hooks come off the model and optimizer and its taps off
torch (as in a process with no probe), outside the timed steps (``thread_cpu.unhook``). Its
step clock restarts at each watched turn, so its step time, cost and gradient interval are
those of its own steps. ``--grad-every 1000000000`` measures the fixed per-step work alone;
``--pace-ms 20`` sleeps between each update and ``probe.step()`` in every arm (a loop blocked
on its data: the sleep is not CPU time, the cold caches it leaves are). CPU time is
``time.thread_time_ns()`` of the training thread with ``torch.set_num_threads(1)`` (every op
of the step runs on it); the probe thread's work is not in it (``thread_cpu.py`` reports
that).

``--device cuda`` runs the same on a GPU: there a launch-bound step's thread CPU time is the
host's work, kernel launches and the probe's alike (the device's own time is not in it), the
figure the probe's "host time per step" is held to; the device's queue is drained before each
turn so that no arm waits on another's kernels.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import MAKERS, Batch, Task  # noqa: E402
from overhead import POOL  # noqa: E402
from thread_cpu import (  # noqa: E402
    ARMS,
    UNWATCHED,
    WATCHED,
    add_grad_every,
    add_pace,
    chosen_models,
    own_cost,
    rehook,
    run_models,
    unhook,
)

import tdbg  # noqa: E402
from tdbg.probe.training import forward_tap  # noqa: E402

# --hook-arm: the probe as before issue 36's forward wrapper, its forward marked by a pre-hook.
HOOKED = "watched, pre-hook"


def rehook_with_pre_hook(probe: tdbg.Probe) -> None:
    """The probe's hooks and taps back on, its forward marked by the pre-hook (forward_tap's
    wrapper refused), as watch() put them before the wrapper."""
    wrappable = forward_tap.wrappable
    forward_tap.wrappable = lambda module: False
    try:
        rehook(probe)
    finally:
        forward_tap.wrappable = wrappable


# --old-hooks REV: the probe with REV's optimizer step hooks (hooks.py's _StepStart/_StepEnd as
# REV has them, loaded as a module of their own), its other hooks as they are now.
OLD_HOOKS = "watched, old update hooks"
HOOKS = "tdbg/probe/training/hooks.py"


def old_update_hooks(revision: str) -> Any:
    """REV's hooks.py as a module of its own (it must import what the working tree has)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{HOOKS}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    spec = importlib.util.spec_from_loader(f"old_hooks_{revision}", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{revision}:{HOOKS}", "exec"), module.__dict__)
    return module


def rehook_with_old_update_hooks(probe: tdbg.Probe, old: Any) -> None:
    """The probe's hooks and taps back on, its optimizer step hooks replaced in place (same
    slots in torch's hook dicts, so the same order) by ``old``'s."""
    rehook(probe)
    hooks = probe._hooks
    # What REV's pre-hook calls on a step without a closure.
    hooks._on_optimizer_step = functools.partial(  # type: ignore[attr-defined]
        probe._sampler.on_optimizer_pre, grads_ready=True
    )
    for key, (pre, post) in hooks._by_optimizer.items():
        for handle, hook_class in ((pre, old._StepStart), (post, old._StepEnd)):
            hook_dict = handle.hooks_dict_ref()
            assert hook_dict is not None and handle.id in hook_dict
            hook_dict[handle.id] = hook_class.owned_by(hooks, key)


def turn(
    task: Task,
    pool: list[Batch],
    steps: int,
    probe: Any,
    at: int,
    pace: float = 0.0,
) -> float:
    """CPU seconds per step of ``steps`` steps of ``task`` after one untimed step; ``at``:
    which batch of the pool to start from; ``pace``: seconds slept between each update and
    ``probe.step()`` (a paced loop: the probe's step then runs with cold caches). ``probe``: a
    ``tdbg.Probe``, None, or anything with the same ``step(loss, samples=, tokens=)``."""
    batches = [pool[(at + i) % len(pool)] for i in range(steps + 1)]
    if batches[0][0].is_cuda:
        torch.cuda.synchronize()  # no arm waits on the kernels another arm queued
    sampler = getattr(probe, "_sampler", None)
    if sampler is not None:
        sampler._last_host = None  # the other arms' steps are not this probe's
    loss = task.train_step(*batches[0])  # absorbs what the previous arm left behind
    if pace:
        time.sleep(pace)
    if probe is not None:
        probe.step(loss, samples=task.batch_size, tokens=task.tokens)
    clock = time.thread_time_ns
    t0 = clock()
    for inputs, targets in batches[1:]:
        loss = task.train_step(inputs, targets)
        if pace:
            time.sleep(pace)  # not thread CPU time: only what it leaves cold counts
        if probe is not None:
            probe.step(loss, samples=task.batch_size, tokens=task.tokens)
    return (clock() - t0) / 1e9 / steps


def paired(values: list[float], base: list[float]) -> str:
    """Mean over cycles of (arm - unwatched), with two standard errors; and the mean with
    the 5 % most extreme differences each side left out (a burst of another process)."""
    diffs = [a - b for a, b in zip(values, base, strict=True)]
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    cut = len(diffs) // 20
    trimmed = statistics.fmean(sorted(diffs)[cut : len(diffs) - cut])
    scale = statistics.fmean(base)
    return (
        f"{mean * 1e6:+7.1f} us/step = {mean / scale * 100:+.2f} % +- {2 * se / scale * 100:.2f} %"
        f" (2 SE); trimmed {trimmed / scale * 100:+.2f} %"
    )


def count_reported(probe: tdbg.Probe) -> list[float]:
    """From now on, the sum of the probe_time the probe reports of its steps and how many
    (as its thread takes them into ``recent_costs``, whose window is only the last ~200)."""
    totals = [0.0, 0.0]
    server = probe._server

    class Counting(deque):  # type: ignore[type-arg]
        def append(self, item: Any) -> None:
            if item[0] == item[0]:
                totals[0] += item[0]
                totals[1] += 1
            super().append(item)

    server.recent_costs = Counting(server.recent_costs, maxlen=server.recent_costs.maxlen)
    return totals


def bench(name: str, args: argparse.Namespace, rng: random.Random) -> None:
    task = MAKERS[name](seed=args.seed)
    device = torch.device(args.device)
    pool = task.on_device(device, POOL)
    for i in range(20):  # optimizer state, allocator
        task.train_step(*pool[i % POOL])
    probe = tdbg.watch(task.model, task.optimizer, name=name, grad_every=args.grad_every)
    client = attach_client(probe) if args.attached else None
    for i in range(50):  # the interval settles, plans are built
        probe.step(task.train_step(*pool[i % POOL]), samples=task.batch_size, tokens=task.tokens)
    reported_total = count_reported(probe)
    arms = (*ARMS, HOOKED) if args.hook_arm else ARMS
    old = old_update_hooks(args.old_hooks) if args.old_hooks else None
    if old is not None:
        arms = (*arms, OLD_HOOKS)
    per_step: dict[str, list[float]] = {arm: [] for arm in arms}
    intervals: list[int] = []
    started = time.perf_counter()
    on: str | None = WATCHED  # how the probe is on the model now (None: off)
    for cycle in range(args.cycles):
        order = list(arms)
        rng.shuffle(order)
        for arm in order:
            watched = arm in (WATCHED, HOOKED, OLD_HOOKS)
            if on != (arm if watched else None):
                if on is not None:
                    unhook(probe)
                if arm == OLD_HOOKS:
                    rehook_with_old_update_hooks(probe, old)
                elif arm == HOOKED:
                    rehook_with_pre_hook(probe)
                elif watched:
                    rehook(probe)
                on = arm if watched else None
            at = rng.randrange(POOL)
            per_step[arm].append(
                turn(task, pool, args.turn, probe if watched else None, at, args.pace_ms / 1e3)
            )
        if cycle % 50 == 0:
            intervals.append(probe.grad_interval)
    if not probe._hooks.handles:
        rehook(probe)
    fraction, recent = own_cost(probe)
    reported = [p for p, s in probe._server.recent_costs if p == p and s == s]
    reported_us = statistics.fmean(reported) * 1e6 if reported else float("nan")
    clients = len(probe._server.clients) if client is not None else 0
    probe.close()
    if client is not None:
        client.kill()
        client.wait()
    base = per_step[UNWATCHED]
    print(
        f"\n=== {name} ({device}): {args.cycles} cycles x {args.turn} timed steps per arm"
        f" ({time.perf_counter() - started:.0f} s), unwatched"
        f" {statistics.median(base) * 1e3:.2f} ms CPU/step"
    )
    for arm in arms[1:]:
        print(f"  {arm:<17} - unwatched: {paired(per_step[arm], base)}")
    if args.hook_arm:
        print(f"  {WATCHED} - {HOOKED}: {paired(per_step[WATCHED], per_step[HOOKED])}")
    if old is not None:
        print(f"  {WATCHED} - {OLD_HOOKS}: {paired(per_step[WATCHED], per_step[OLD_HOOKS])}")
    print(
        f"  probe's own cost_fraction (last {recent} steps): {fraction * 100:.2f} %"
        f" ({reported_us:.1f} us/step reported);"
        f" grad_interval every 50 cycles: {intervals}"
    )
    if client is not None:
        print(f"  a client attached throughout (`tdbg dump --follow`): {clients} at the end")
    if reported_total[1]:
        # Every watched step's, not the last ~200's: the figure to hold against the measured.
        mean = reported_total[0] / reported_total[1] * 1e6
        print(f"  reported over the run: {mean:.1f} us/step ({reported_total[1]} steps)")


def attach_client(probe: tdbg.Probe) -> subprocess.Popen[bytes]:
    """A client in a process of its own reading everything the probe sends, as a TUI would
    (``tdbg dump --follow``, its output discarded); back once the probe has it."""
    assert probe.socket_path is not None, "the probe is not serving"
    code = "import sys; from tdbg.cli.entry import main; sys.exit(main())"
    command = [sys.executable, "-c", code, "dump", "--follow", probe.socket_path]
    client = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not probe._server.clients:  # its hello answered: attached
        if client.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("interleaved: the client did not attach")
        time.sleep(0.05)
    return client


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="mlp,transformer,cnn", help="comma-separated")
    p.add_argument("--cycles", type=int, default=1000, help="default 1000")
    p.add_argument("--turn", type=int, default=2, help="timed steps per turn (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hook-arm",
        action="store_true",
        help="a fourth arm: the probe with its forward marked by a pre-hook (before issue 36)",
    )
    p.add_argument(
        "--old-hooks",
        metavar="REV",
        help="one more arm: the probe with REV's optimizer step hooks (a git revision)",
    )
    p.add_argument(
        "--attached",
        action="store_true",
        help="a client (tdbg dump --follow, a process of its own) reads the probe throughout",
    )
    p.add_argument("--device", default="cpu", help="default cpu (cuda: the host's CPU time)")
    add_pace(p)
    add_grad_every(p)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("interleaved: no CUDA device on this machine: nothing to measure (exit 0)")
        return 0
    if args.cycles < 2 or args.turn < 1 or not args.pace_ms >= 0:
        p.error("--cycles: at least 2; --turn: at least 1; --pace-ms: at least 0")
    models = chosen_models(args.models)
    if models is None:
        return 2
    run_models(models, bench, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
