"""What a client that stops reading costs the training thread: its CPU time per step (which
other load on the machine does not inflate as it does wall time) before, while and after a
never-reading client is attached, until the probe drops it as a slow consumer.

    .venv/bin/python benchmarks/slow_client.py
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tdbg
from tdbg.protocol import messages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--window", type=float, default=5.0, help="seconds per phase (before/after)")
    p.add_argument("--layers", type=int, default=200, help="layers: how much each step sends")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(args.layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(8, 16)
    probe = tdbg.watch(model, opt, grad_every=1, name="slow-client-bench")
    path = probe.socket_path
    assert path is not None

    def step() -> float:
        t0 = time.thread_time()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        probe.step()
        return time.thread_time() - t0

    def phase(seconds: float, until: object = None) -> list[float]:
        cpu: list[float] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end or (until is not None and not until()):  # type: ignore[operator]
            cpu.append(step())
            if until is not None and until() and time.monotonic() >= end:  # type: ignore[operator]
                break
        return cpu

    before = phase(args.window)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(path)
    stalled.sendall(messages.hello("bench-stalled"))  # and never reads again
    attached = time.monotonic()

    clients = probe._server._clients  # the probe's own list: when our stalled client leaves it
    during = phase(1.0, lambda: len(clients) == 0 or time.monotonic() - attached > 120)
    held_for = time.monotonic() - attached
    after = phase(args.window)
    probe.close()
    stalled.close()

    def us(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e6:8.1f} us (n={len(values)})"

    print(f"tdbg {tdbg.__version__}, torch {torch.__version__}, {args.layers} layers, grad_every=1")
    print(f"training thread CPU per step, median: before {us(before)}")
    print(f"  while a never-reading client is attached ({held_for:.1f} s): {us(during)}")
    print(f"  after it was dropped:                    {us(after)}")
    ratio = statistics.median(during) / statistics.median(before)
    print(f"during / before: {ratio:.3f}; dropped after {held_for:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
