"""The probe's cost in CPU time: the training thread's, watched against unwatched, and the probe's.

Step-time ratios cannot resolve a 1 % budget on a shared machine (the baseline against itself
moves by 10-50 %); CPU time charged to the training thread does not count the time it waits for
a core, so it can. Torch runs on one thread (``torch.set_num_threads(1)``), so all of a step's
work — forward, backward, optimizer, the probe's hooks and ``probe.step()`` — is charged to
the thread that calls it, measured with ``time.thread_time_ns()``.

Per demo model, three arms: ``unwatched``, ``unwatched again`` (the measurement's own noise)
and ``watched`` (one long-lived ``tdbg.watch()`` with default settings: the 1 % budget, automatic
gradient interval). Blocks of steps run interleaved, the order shuffled per round; per round the
ratio is an arm's CPU per step over ``unwatched``'s. By default all three train **one** model:
for the unwatched blocks the probe's hooks come off the model and optimizer and its process-wide
taps off torch (as in a process with no probe), and go back on for the watched blocks, outside
the timed steps. (``--copies 3``: three identical copies, one per arm, as this benchmark did
first: two copies of one model differ by up to 2 % on their own — where their memory landed —
a bias the noise arm shows and the comparison cannot remove.) Also: the probe's
threads' CPU (Linux ``/proc/self/task/*/schedstat``) during the watched blocks per watched step
(work left at a block's end spills into the next block: the idle blocks' share is shown too),
and the probe's own ``cost_fraction`` (its time over step time, last 200 steps: what it reports
to clients).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "demos"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import MAKERS, Batch, Task  # noqa: E402
from overhead import POOL, PROBE_THREADS, thread_cpu  # noqa: E402

import tdbg  # noqa: E402
from tdbg.probe.training import taps  # noqa: E402

UNWATCHED, AGAIN, WATCHED = "unwatched", "unwatched again", "watched"
ARMS = (UNWATCHED, AGAIN, WATCHED)


def minor_faults() -> int:
    """Minor page faults of this thread so far (Linux); 0 where it cannot tell."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def context_switches() -> int:
    """Context switches of this thread so far, voluntary (a wait: the GIL, a lock, I/O) and
    not (preempted) (Linux); 0 where it cannot tell. A thread that hands the GIL to another
    and waits for it back switches once per hand-off."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            return sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
    except (OSError, IndexError, ValueError):
        return 0


class Block:
    """One block's figures, per step: CPU and wall seconds, minor page faults, context
    switches."""

    def __init__(self, cpu: float, wall: float, faults: float, switches: float) -> None:
        self.cpu, self.wall, self.faults, self.switches = cpu, wall, faults, switches


def block_cpu(task: Task, pool: list[Batch], steps: int, probe: tdbg.Probe | None) -> Block:
    """This thread's CPU (and wall, faults) per step over ``steps`` steps of ``task``."""
    if probe is not None:
        # The other arms' blocks since this probe's last step are not one long step: its step
        # time (and so its cost_fraction and interval) starts again with this block.
        probe._sampler._last_host = None
    s0, f0 = context_switches(), minor_faults()
    w0, t0 = time.perf_counter_ns(), time.thread_time_ns()
    for i in range(steps):
        inputs, targets = pool[i % len(pool)]
        loss = task.train_step(inputs, targets)
        if probe is not None:
            probe.step(loss, samples=task.batch_size, tokens=task.tokens)
    cpu = (time.thread_time_ns() - t0) / 1e9 / steps
    wall = (time.perf_counter_ns() - w0) / 1e9 / steps
    faults, switches = (minor_faults() - f0) / steps, (context_switches() - s0) / steps
    return Block(cpu, wall, faults, switches)


def fix_malloc() -> bool:
    """Stop glibc trimming and mmapping this process's heap (mallopt: M_TRIM_THRESHOLD,
    M_MMAP_THRESHOLD, M_TOP_PAD). Otherwise whether a block's freed activations go back to the
    kernel, to be faulted in again next step (hundreds of page faults a step), turns on the
    heap's layout at that moment: a lottery that moves one arm by 5-20 % and has nothing to do
    with the probe. Both arms run with the same settings."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all(
        libc.mallopt(option, value) == 1
        for option, value in ((-1, 1 << 30), (-3, 1 << 30), (-2, 64 << 20))
    )


def unhook(probe: tdbg.Probe) -> None:
    """As if the process had no probe: its hooks off the model and optimizer, its taps off."""
    probe._hooks.remove()
    taps.detach(probe._sampler)


def rehook(probe: tdbg.Probe) -> None:
    """The probe's hooks and taps back on, as ``watch()`` put them."""
    probe._hooks = probe._make_hooks(probe.options)
    taps.attach(probe._sampler)
    # The next step the whole way, as after watch(): at its end lean steps are armed on the
    # new hooks (which takes the optimizer's pre-hook out of its dict, PhaseHooks.take_pre_out).
    probe._sampler.forget_step()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} ({min(values):.4f}-{max(values):.4f})"


def paired(values: list[float], base: list[float]) -> str:
    """Rounds are paired: the mean of their differences over the base's mean, with two
    standard errors. Many short rounds make this resolve what a median of few cannot."""
    diffs = [a - b for a, b in zip(values, base, strict=True)]
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    scale = statistics.fmean(base)
    return (
        f"{mean * 1e6:+.1f} us/step = {mean / scale * 100:+.2f} %"
        f" +- {2 * se / scale * 100:.2f} % (2 SE)"
    )


def own_cost(probe: tdbg.Probe) -> tuple[float, int]:
    """The probe's own cost_fraction over its recent steps (NaN: none), and how many."""
    costs = [(p, s) for p, s in probe._server.recent_costs if p == p and s == s]
    spent = sum(s for _, s in costs)
    return (sum(p for p, _ in costs) / spent if spent else float("nan")), len(costs)


def bench(name: str, args: argparse.Namespace, rng: random.Random) -> None:
    if args.copies == 1:
        one = MAKERS[name](seed=args.seed)
        tasks = dict.fromkeys(ARMS, one)
    else:
        tasks = {arm: MAKERS[name](seed=args.seed) for arm in ARMS}
    pool = [tasks[UNWATCHED].batch() for _ in range(POOL)]
    for task in {id(t): t for t in tasks.values()}.values():
        for i in range(20):  # optimizer state, allocator
            task.train_step(*pool[i % POOL])
    t0 = time.thread_time_ns()
    for i in range(5):
        tasks[UNWATCHED].train_step(*pool[i % POOL])
    step = (time.thread_time_ns() - t0) / 5e9
    steps = max(10, round(args.block_seconds / step))
    probe = tdbg.watch(
        tasks[WATCHED].model, tasks[WATCHED].optimizer, name=name, grad_every=args.grad_every
    )
    block_cpu(tasks[WATCHED], pool, 50, probe)  # the interval settles, plans are built
    per_step: dict[str, list[float]] = {arm: [] for arm in ARMS}
    off_cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}  # wall - CPU: waits (GIL)
    faults: dict[str, list[float]] = {arm: [] for arm in ARMS}
    switches: dict[str, list[float]] = {arm: [] for arm in ARMS}
    probe_cpu = {WATCHED: 0.0, UNWATCHED: 0.0}  # the probe threads' CPU during those blocks
    intervals: list[int] = []
    for _ in range(args.rounds):
        order = list(ARMS)
        rng.shuffle(order)
        for arm in order:
            watched = probe if arm == WATCHED else None
            hooked = bool(probe._hooks.handles)
            if watched and not hooked:
                rehook(probe)
            elif not watched and hooked:
                unhook(probe)
            before = thread_cpu()
            block = block_cpu(tasks[arm], pool, steps, watched)
            per_step[arm].append(block.cpu)
            off_cpu[arm].append(block.wall - block.cpu)
            faults[arm].append(block.faults)
            switches[arm].append(block.switches)
            after = thread_cpu()
            used = sum(after.get(n, 0.0) - before.get(n, 0.0) for n in PROBE_THREADS)
            probe_cpu[WATCHED if watched else UNWATCHED] += used
        intervals.append(probe.grad_interval)
    if not probe._hooks.handles:
        rehook(probe)
    fraction, recent = own_cost(probe)
    probe.close()
    watched_steps = steps * args.rounds
    base = per_step[UNWATCHED]
    ratios = {arm: [a / b for a, b in zip(per_step[arm], base, strict=True)] for arm in ARMS}
    watched_cpu = statistics.fmean(per_step[WATCHED])
    print(
        f"\n=== {name}: {args.rounds} rounds x {steps} steps per block,"
        f" unwatched {statistics.median(base) * 1e3:.2f} ms CPU/step"
    )
    for arm in (AGAIN, WATCHED):
        r = ratios[arm]
        print(f"  training thread CPU, {arm:<16} / unwatched: {spread(r)}")
    for arm in (AGAIN, WATCHED):
        print(f"  {arm:<16} - unwatched, mean of paired rounds: {paired(per_step[arm], base)}")
    print(
        "  off the CPU (wall - CPU: waiting for the GIL or a core), us/step: "
        + ", ".join(f"{arm} {statistics.fmean(off_cpu[arm]) * 1e6:.1f}" for arm in ARMS)
        + "; minor page faults/step: "
        + ", ".join(f"{arm} {statistics.fmean(faults[arm]):.0f}" for arm in ARMS)
        + "; context switches/step: "
        + ", ".join(f"{arm} {statistics.fmean(switches[arm]):.1f}" for arm in ARMS)
    )
    over = statistics.median(ratios[WATCHED]) - 1
    noise = max(abs(r - 1) for r in ratios[AGAIN])
    print(
        f"  watched: {over * 100:+.2f} % training-thread CPU (median), noise"
        f" (unwatched again, worst round) +-{noise * 100:.2f} %"
    )
    during, idle = probe_cpu[WATCHED] / watched_steps, probe_cpu[UNWATCHED] / watched_steps / 2
    print(
        f"  probe threads' CPU during the watched blocks: {during * 1e6:.0f} us per step ="
        f" {during / watched_cpu * 100:.2f} % of the watched training thread's CPU; during an"
        f" unwatched block of the same length (idle ticks, spill-over): {idle * 1e6:.0f} us"
        f" per step = {idle / watched_cpu * 100:.2f} %"
    )
    print(
        f"  probe's own cost_fraction (last {recent} steps): {fraction * 100:.2f} %;"
        f" grad_interval per round: {intervals}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="8 rounds, 0.3 s blocks")
    p.add_argument("--models", default="mlp,transformer,cnn", help="comma-separated")
    p.add_argument("--rounds", type=int, default=None, help="default 20 (8 with --quick)")
    p.add_argument("--block-seconds", type=float, default=None, help="CPU seconds per block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--copies",
        type=int,
        choices=(1, 3),
        default=1,
        help="1: every arm trains one model, the probe's hooks on and off (default); 3: a copy"
        " per arm",
    )
    p.add_argument(
        "--glibc-heap",
        action="store_true",
        help="leave glibc's heap trimming on (default: off, see fix_malloc)",
    )
    add_grad_every(p)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (8 if args.quick else 20)
    args.block_seconds = args.block_seconds or (0.3 if args.quick else 1.0)
    models = chosen_models(args.models)
    if models is None:
        return 2
    run_models(models, bench, args, trim_heap=not args.glibc_heap)
    return 0


def chosen_models(spec: str) -> list[str] | None:
    """The demo models a comma-separated ``--models`` names; None, once it has said which
    are unknown."""
    models = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in models if m not in MAKERS]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MAKERS)}")
        return None
    return models


def add_grad_every(p: argparse.ArgumentParser) -> None:
    """``--grad-every N``: the watched probe's fixed gradient interval (the fixed per-step
    cost alone with 1000000000)."""
    p.add_argument(
        "--grad-every",
        type=int,
        default=None,
        help="the watched probe samples gradients every N steps (default: the automatic"
        " interval; 1000000000: never, the fixed per-step cost alone)",
    )


def add_pace(p: argparse.ArgumentParser) -> None:
    """``--pace-ms MS``: a paced loop (one that blocks on its data), for the timed arms."""
    p.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="sleep this long between each update and probe.step() (a paced loop)",
    )


def run_models(
    models: list[str],
    bench: Callable[[str, argparse.Namespace, random.Random], None],
    args: argparse.Namespace,
    trim_heap: bool = True,
) -> None:
    """Set this process up for measuring CPU time (every torch op on the calling thread,
    glibc's heap trimming off unless ``trim_heap`` is False, a runtime dir of its own), say
    so, and run ``bench`` on each model in turn with one seeded random source."""
    fixed = fix_malloc() if trim_heap else False
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)  # every op on the calling thread: its CPU time is the step's
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    print(
        f"tdbg {tdbg.__version__}, torch {torch.__version__}, python"
        f" {platform.python_version()}, {os.cpu_count()} CPUs, torch threads 1,"
        f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, glibc heap"
        f" {'trimming off' if fixed else 'as is'}"
    )
    rng = random.Random(args.seed)
    started = time.perf_counter()
    for name in models:
        bench(name, args, rng)
    print(
        f"\ntotal {time.perf_counter() - started:.0f} s, load average"
        f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


if __name__ == "__main__":
    sys.exit(main())
