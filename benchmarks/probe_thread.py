"""The probe thread's CPU per sampled step: resolving norms, alerts, packing, for 10-1000 layers.

The training thread's share of the probe is measured by overhead.py and step_cost.py; this
measures the other thread's, which competes with training for the GIL: the CPU time of the
``tdbg-server`` thread (from /proc, per thread) divided by the steps it resolved, on a real
probe watching a real loop with every step sampled. The loop runs through a baseline and the
probe thread's figure is reported as a median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
from torch import nn

import tdbg


def thread_cpu_seconds(name: str) -> float:
    """User + system CPU seconds of this process's thread called ``name`` (Linux /proc)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks = os.sysconf("SC_CLK_TCK")
            return (int(fields[11]) + int(fields[12])) / ticks
    raise RuntimeError(f"no thread named {name}")


def one_round(layers: int, steps: int, usual: bool = False) -> float:
    """Microseconds of probe-thread CPU per resolved step; ``usual``: no step sampled (the
    usual step of a CPU run, what the probe thread does on every step of a short-step loop)."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    every = 10**9 if usual else 1
    probe = tdbg.watch(model, opt, grad_every=every, name=f"thread-{layers}")
    try:
        start = thread_cpu_seconds("tdbg-server")
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            probe.step(0.5)
        deadline = time.monotonic() + 60
        while probe._server.consumed < steps and time.monotonic() < deadline:
            time.sleep(0.01)
        spent = thread_cpu_seconds("tdbg-server") - start
        return spent / steps * 1e6
    finally:
        probe.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="10,100,1000")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--usual", action="store_true", help="no step sampled: the usual step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    print(f"tdbg {tdbg.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'layers':>7} {'median us/step':>15} {'min':>8} {'max':>8}  (probe thread CPU)")
    for layers in (int(v) for v in args.layers.split(",")):
        one_round(layers, 200, args.usual)  # warm-up
        figures = [one_round(layers, args.steps, args.usual) for _ in range(args.rounds)]
        print(
            f"{layers:>7} {statistics.median(figures):>15.1f} {min(figures):>8.1f}"
            f" {max(figures):>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
