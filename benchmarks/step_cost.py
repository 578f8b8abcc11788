"""Micro-benchmark of ``probe.step()`` itself with nothing pending, against an empty call."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import tdbg

TARGET_P99_US = 20.0  # docs/guarantees.md, training thread


def empty(loss: Any = None, *, samples: Any = None, tokens: Any = None) -> None:
    """The same signature as ``probe.step``, doing nothing: the floor of a Python call."""


def measure(fn: Callable[[], object], calls: int, pause: float) -> list[float]:
    """Microseconds per call, timed one by one (the timer's own ~0.1 us is in every figure)."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000)
        if pause:
            time.sleep(pause)  # releases the GIL, as a real step's kernels do
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument(
        "--pause",
        type=float,
        default=0.0002,
        help="seconds between calls in the paced run (default 0.0002)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = tdbg.watch(model, optimizer, name="step-cost", grad_every=10**9)
    loss_tensor = torch.tensor(0.5)
    probe.step(loss_tensor)  # the first step samples gradients (none here); nothing after it
    cases: list[tuple[str, Callable[[], object]]] = [
        ("empty function call", lambda: empty(loss_tensor, samples=32)),
        ("probe.step()", lambda: probe.step()),
        ("probe.step(0.5, samples=32)", lambda: probe.step(0.5, samples=32)),
        ("probe.step(cpu tensor, samples=32)", lambda: probe.step(loss_tensor, samples=32)),
    ]
    print(
        f"tdbg {tdbg.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs;"
        f" {args.calls} calls each, grad_every=10**9 (nothing pending)"
    )
    print(f"{'case':<36} {'run':<10} {'p50 us':>7} {'p99 us':>7} {'mean us':>8} {'max us':>8}")
    worst = 0.0
    for pause, run in ((0.0, "b2b"), (args.pause, "paced")):
        for label, fn in cases:
            measure(fn, 1000, pause)  # warm-up
            us = measure(fn, args.calls, pause)
            p99 = percentile(us, 0.99)
            if label.startswith("probe"):
                worst = max(worst, p99)
            print(
                f"{label:<36} {run:<10} {percentile(us, 0.5):>7.2f} {p99:>7.2f}"
                f" {statistics.fmean(us):>8.2f} {max(us):>8.1f}"
            )
    dropped = probe._server.dropped() if hasattr(probe, "_server") else "n/a"
    probe.close()
    verdict = "PASS" if worst <= TARGET_P99_US else "over target"
    print(
        f"b2b: back to back, the probe thread contending for the GIL; paced: {args.pause * 1e6:.0f}"
        f" us sleep between calls. Steps the probe thread dropped (inbox full): {dropped}"
    )
    print(f"worst probe.step p99 {worst:.2f} us vs target <= {TARGET_P99_US:.0f} us -> {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
