"""The probe's cost on a GPU: the demo models' wall-clock step time, watched against unwatched.

On a GPU the step time a user sees is wall-clock time with the device's queue drained, so that
is what this measures (``thread_cpu.py`` measures CPU time, the right figure on a CPU-only
machine). Per demo model three arms train **one** model, as in ``thread_cpu.py``: ``unwatched``,
``unwatched again`` (the measurement's own noise) and ``watched`` (one long-lived
``tdbg.watch()`` with default settings: the 1 % budget, automatic gradient interval; for the
unwatched blocks its hooks and taps come off). Blocks run interleaved, order shuffled per round,
each block between two ``torch.cuda.synchronize()`` calls; per round the ratio is an arm's wall
time per step over ``unwatched``'s. Also the host thread's CPU per step (near the wall time: the
loop is bound by the host's kernel launches, where the probe's host work shows most) and the
probe's own ``cost_fraction`` and gradient interval.

    python benchmarks/gpu_cost.py                       (CUDA; without it: says so, exit 0)
    python benchmarks/gpu_cost.py --batch-size 1024     (the same models kept busier)
    python benchmarks/gpu_cost.py --device cpu --quick  (the script itself, on a CPU)
    python benchmarks/gpu_cost.py --breakdown           (where the watched arm's cost goes)
    python benchmarks/gpu_cost.py --oom-stacks          (what watch(oom_stacks=True) adds)

``--breakdown`` adds three watched arms that each change one part of the probe, so one run says
how the cost splits: ``watched, thread paused`` (the probe thread does no step work during the
block: what its GIL-holding work costs the loop), ``watched, no marks`` (the hooks' and the
sampler's timing marks are NaN: what the CUDA events cost; the loss copy's own event stays) and
``watched, every step timed`` (every step's phases timed with CUDA events, as before the probe
timed one short step in a few: what that sampling saves). Between blocks every arm waits for
the probe thread to finish the steps already handed over, so no arm's probe work spills into
the next block.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import MAKERS, Batch, Task  # noqa: E402
from overhead import POOL  # noqa: E402
from thread_cpu import (  # noqa: E402
    AGAIN,
    ARMS,
    UNWATCHED,
    WATCHED,
    chosen_models,
    own_cost,
    paired,
    rehook,
    spread,
    unhook,
)

import tdbg  # noqa: E402
from tdbg.probe.training import cost_model, oom  # noqa: E402
from tdbg.probe.training.hooks import marker  # noqa: E402

PAUSED, NO_MARKS = "watched, thread paused", "watched, no marks"
OOM_STACKS = "watched, oom stacks"
EVERY_MARK = "watched, every step timed"
TIMED_FROM = cost_model.MARK_EVERY_STEP_FROM
NAN = float("nan")


def nan_mark() -> float:
    return NAN


def settle(probe: tdbg.Probe, seconds: float = 5.0) -> None:
    """Wait (outside any timed block) until the probe thread has taken every step handed to
    it: a block's steps are then resolved before the next block starts, in every arm."""
    server = probe._server
    deadline = time.monotonic() + seconds
    while server.consumed < server.appended and time.monotonic() < deadline:
        time.sleep(0.002)


def arrange(probe: tdbg.Probe, arm: str) -> tdbg.Probe | None:
    """The probe's hooks, taps, thread and marks as ``arm`` has them; the probe to step, or
    None for an unwatched arm."""
    watched = arm not in (UNWATCHED, AGAIN)
    hooked = bool(probe._hooks.handles)
    if watched and not hooked:
        rehook(probe)
    elif not watched and hooked:
        unhook(probe)
    server = probe._server
    if arm == PAUSED:
        server._tick = lambda now: None  # type: ignore[method-assign]  # the loop calls self._tick
    elif "_tick" in vars(server):
        del server._tick
    sampler = probe._sampler
    if arm == NO_MARKS:
        sampler._cuda_mark = sampler._mark = probe._hooks._mark = nan_mark
    else:
        sampler._cuda_mark = probe._hooks._mark = marker(sampler._cuda_device)
        sampler.use_marks(probe._hooks, sampler._marked)
    # Steps of any length have their phases timed: every step's (0.0), or the probe's own rule.
    cost_model.MARK_EVERY_STEP_FROM = 0.0 if arm == EVERY_MARK else TIMED_FROM
    # watch(oom_stacks=True)'s stack record: on for its arm's block only (it applies to the
    # allocations made while it is on, cache hits included).
    if arm == OOM_STACKS:
        oom.record_stacks()
    elif oom.stacks_recording():
        oom.stop_stacks()
    return probe if watched else None


def drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block(
    task: Task, pool: list[Batch], steps: int, probe: tdbg.Probe | None, device: torch.device
) -> tuple[float, float]:
    """Wall and host-thread CPU seconds per step over ``steps`` steps, the queue drained at
    both ends."""
    if probe is not None:
        probe._sampler._last_host = None  # the other arms' blocks are not one long step
    drain(device)
    w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for i in range(steps):
        inputs, targets = pool[i % len(pool)]
        loss = task.train_step(inputs, targets)
        if probe is not None:
            probe.step(loss, samples=task.batch_size, tokens=task.tokens)
    drain(device)
    return (time.perf_counter_ns() - w0) / 1e9 / steps, (time.thread_time_ns() - c0) / 1e9 / steps


def bench(name: str, args: argparse.Namespace, device: torch.device, rng: random.Random) -> None:
    sizes = {"batch_size": args.batch_size} if args.batch_size else {}
    task = MAKERS[name](seed=args.seed, **sizes)
    pool = task.on_device(device, POOL)
    block(task, pool, 20, None, device)  # optimizer state, allocator, cuBLAS/cuDNN handles
    wall, _ = block(task, pool, 10, None, device)
    steps = max(10, round(args.block_seconds / wall))
    probe = tdbg.watch(task.model, task.optimizer, name=name)
    block(task, pool, 100, probe, device)  # the interval settles, plans are built
    arms = [*ARMS, PAUSED, NO_MARKS, EVERY_MARK] if args.breakdown else list(ARMS)
    if args.oom_stacks:
        arms.append(OOM_STACKS)
    walls: dict[str, list[float]] = {arm: [] for arm in arms}
    cpus: dict[str, list[float]] = {arm: [] for arm in arms}
    intervals: list[int] = []
    for _ in range(args.rounds):
        order = list(arms)
        rng.shuffle(order)
        for arm in order:
            watched = arrange(probe, arm)
            w, c = block(task, pool, steps, watched, device)
            arrange(probe, WATCHED)  # the paused thread takes the block's steps now, untimed
            settle(probe)
            walls[arm].append(w)
            cpus[arm].append(c)
        intervals.append(probe.grad_interval)
    fraction, recent = own_cost(probe)
    errors = probe.errors
    probe.close()
    base = walls[UNWATCHED]
    print(
        f"\n=== {name} (batch {task.batch_size}): {args.rounds} rounds x {steps} steps per"
        f" block, unwatched {statistics.median(base) * 1e3:.3f} ms/step wall,"
        f" host thread CPU {statistics.median(cpus[UNWATCHED]) * 1e3:.3f} ms/step"
    )
    for arm in arms[1:]:
        ratios = [a / b for a, b in zip(walls[arm], base, strict=True)]
        print(
            f"  {arm:<22} / unwatched, wall per step: {spread(ratios)}; mean of paired rounds"
            f" {paired(walls[arm], base)}"
        )
    print(
        "  host thread CPU per step, ms: "
        + ", ".join(f"{arm} {statistics.median(cpus[arm]) * 1e3:.3f}" for arm in arms)
    )
    print(
        f"  probe's own cost_fraction (last {recent} steps): {fraction * 100:.2f} %;"
        f" internal errors {errors}; grad_interval per round: {intervals}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda", help="default cuda")
    p.add_argument("--quick", action="store_true", help="6 rounds, 0.1 s blocks")
    p.add_argument("--models", default="mlp,transformer,cnn", help="comma-separated")
    p.add_argument("--rounds", type=int, default=None, help="default 40 (6 with --quick)")
    p.add_argument("--block-seconds", type=float, default=None, help="wall seconds per block")
    p.add_argument("--batch-size", type=int, default=None, help="default: each demo's own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also the watched arm with the probe thread paused and with no timing marks",
    )
    p.add_argument(
        "--oom-stacks",
        action="store_true",
        help="also the watched arm with the allocator's stack record on (watch(oom_stacks=True))",
    )
    args = p.parse_args(argv)
    if args.oom_stacks and args.device != "cuda" and not args.device.startswith("cuda"):
        p.error("--oom-stacks: the allocator's stack record is CUDA's (use --device cuda)")
    args.rounds = args.rounds or (6 if args.quick else 40)
    if args.rounds < 2:
        p.error("--rounds: at least 2 (the paired rounds' spread needs two)")
    args.block_seconds = args.block_seconds or (0.1 if args.quick else 0.25)
    models = chosen_models(args.models)
    if models is None:
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu-cost: no CUDA device on this machine: nothing to measure (exit 0)")
        return 0
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"tdbg {tdbg.__version__}, torch {torch.__version__}, python"
        f" {platform.python_version()}, {where}, {os.cpu_count()} CPUs"
    )
    rng = random.Random(args.seed)
    started = time.perf_counter()
    for name in models:
        bench(name, args, device, rng)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
