"""What the probe adds to an unsampled training step, counted: Python frames, C calls, torch ops.

On a CPU run every Python function the probe enters around the update costs microseconds (the
loop's kernels have just flushed the caches: an empty call right after ``backward()`` takes
~4 us on the cnn demo, ~0.1 us in a tight loop), so what a step pays is close to proportional to
how much the probe runs there. Timings of that size drown in this VM's noise; counts do not.
Per demo model, the same loop runs unwatched and watched (``grad_every=10**9``: no gradient
pass, the fixed per-step work only), once under ``sys.setprofile`` (Python frames and C calls
entered on the training thread), once under ``sys.settrace`` with opcode events (the bytecodes
the probe's own functions run: right after the update each costs tens of nanoseconds, its code
and data cold) and once under a counting ``TorchDispatchMode`` (ops dispatched); the table is
watched minus unwatched, per step. The same figures on any machine: a change that
moves them moves the probe's fixed cost.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "demos"))

from models import MAKERS  # noqa: E402

import tdbg  # noqa: E402

Counts = tuple[
    collections.Counter[str],
    collections.Counter[str],
    collections.Counter[str],
    collections.Counter[str],
]
TDBG = str(Path(tdbg.__file__).resolve().parent)
CPU = torch.device("cpu")


class OpCounter(TorchDispatchMode):
    def __init__(self, ops: collections.Counter[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def counted(name: str, watched: bool, steps: int, clip: bool, device: torch.device = CPU) -> Counts:
    """(Python frames, C calls, ops, the probe's bytecodes by function) over ``steps`` steps
    of the demo ``name`` on ``device``;
    ``clip``: the loop clips the gradients (``clip_grad_norm_(model.parameters(), 1.0)``)."""
    task = MAKERS[name](seed=0)
    pool = task.on_device(device, 4)
    probe = tdbg.watch(task.model, task.optimizer, name=name, grad_every=10**9) if watched else None

    def clip_grads() -> None:
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), 1.0)

    def run(n: int) -> None:
        for i in range(n):
            loss = task.train_step(*pool[i % len(pool)], clip_grads if clip else None)
            if probe is not None:
                probe.step(loss, samples=task.batch_size, tokens=task.tokens)

    run(10)  # past the first, sampled step and the optimizer's state
    frames: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            frames[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        elif event == "c_call":
            calls[getattr(arg, "__qualname__", repr(arg))] += 1

    sys.setprofile(profile)
    try:
        run(steps)
    finally:
        sys.setprofile(None)
    ops: collections.Counter[str] = collections.Counter()
    with OpCounter(ops):
        run(steps)
    bytecodes: collections.Counter[str] = collections.Counter()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(TDBG):
            return None
        frame.f_trace_opcodes = True
        name = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_qualname}"

        def opcode(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                bytecodes[name] += 1
            return opcode

        return opcode

    sys.settrace(trace)
    try:
        run(steps)
    finally:
        sys.settrace(None)
    if probe is not None:
        probe.close()
    return frames, calls, ops, bytecodes


def added(
    watched: collections.Counter[str], plain: collections.Counter[str], steps: int
) -> dict[str, float]:
    keys = set(watched) | set(plain)
    return {k: (watched[k] - plain[k]) / steps for k in keys if watched[k] != plain[k]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="mlp,transformer,cnn", help="comma-separated")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--clip", action="store_true", help="the loop clips the gradients")
    p.add_argument("--verbose", action="store_true", help="list the probe's frames and ops")
    p.add_argument("--device", default="cpu", help="default cpu (cuda: a GPU run's usual step)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("probe_calls: no CUDA device on this machine: nothing to count (exit 0)")
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MAKERS]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MAKERS)}")
        return 2
    torch.set_num_threads(1)
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    print(
        f"tdbg {tdbg.__version__}, torch {torch.__version__}; per unsampled step, watched minus"
        " unwatched"
    )
    print(
        f"{'model':<12} {'Python frames':>14} {'C calls':>8} {'torch ops':>10}"
        f" {'probe bytecodes':>16}"
    )
    for name in models:
        plain = counted(name, False, args.steps, args.clip, device)
        watched = counted(name, True, args.steps, args.clip, device)
        frames, calls, ops, bytecodes = (
            added(w, u, args.steps) for w, u in zip(watched, plain, strict=True)
        )
        print(
            f"{name:<12} {sum(frames.values()):>14.1f} {sum(calls.values()):>8.1f}"
            f" {sum(ops.values()):>10.1f} {sum(bytecodes.values()):>16.1f}"
        )
        if args.verbose:
            for rows in (frames, ops, bytecodes):
                for key, value in sorted(rows.items()):
                    print(f"    {value:+5.1f} {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
