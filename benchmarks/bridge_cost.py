"""What one node's ``tdbg bridge --job --summaries`` costs: its CPU to start (until its first
summary is out) and its share of a core at rest, over synthetic ranks (benchmarks/fake_ranks.py).

    .venv/bin/python benchmarks/bridge_cost.py                       # 8 ranks, 10 steps/s
    .venv/bin/python benchmarks/bridge_cost.py --rate 1 --against /tmp/before --repeats 3

With ``--against TREE`` the bridge of that tree (its ``tdbg`` package on PYTHONPATH) and this
one's run alternately over the same ranks, so both see the same load. One rank server serves
the ranks; the bridge's stdout is read (and decoded) here, its stdin held open as the viewer's.
CPU is the bridge process's user + system time; "at rest" is over ``--window`` seconds after
``--warmup``, as a share of one core. ``--profile`` samples the bridge with py-spy (the
``--source`` one) into ``--profile-out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable
FAKE = HERE / "fake_ranks.py"
JOB = "bench-job"
PY_SPY = Path("/work/main/.venv/bin/py-spy")


@dataclass
class Run:
    tree: str
    start_cpu: float | None = None  # seconds of CPU until the first summary
    start_wall: float | None = None
    rest: float = 0.0  # share of a core at rest
    summaries: int = 0  # over the window
    bytes_per_s: float = 0.0
    ranks_seen: list[int] = field(default_factory=list)


class Reader(threading.Thread):
    """Reads the bridge's node stream: counts summaries and bytes; notes the first summary."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        sys.path.insert(0, str(ROOT))
        from tdbg.protocol.framing import NODE_MAGIC, NODE_MAX_FRAME, Decoder

        self.fd = fd
        self.decoder = Decoder(NODE_MAX_FRAME, magic=NODE_MAGIC)
        self.first = threading.Event()
        self.summaries = 0
        self.bytes = 0
        self.ranks: set[int] = set()

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except OSError:
                return
            if not chunk:
                return
            self.bytes += len(chunk)
            for raw in self.decoder.feed(chunk):
                if isinstance(raw, dict) and raw.get("type") == "summary":
                    self.summaries += 1
                    self.ranks.update((raw.get("ranks") or {}).get("rank") or ())
                    self.first.set()


def one_run(tree: Path, runtime: Path, args: argparse.Namespace, profile: Path | None) -> Run:
    env = {**os.environ, "PYTHONPATH": str(tree), "TDBG_RUNTIME_DIR": str(runtime)}
    rfd, wfd = os.pipe()  # the bridge's stdout
    sin, sout = os.pipe()  # its stdin, held open
    started = time.perf_counter()
    bridge = subprocess.Popen(
        [PYTHON, "-m", "tdbg.cli", "bridge", "--job", JOB, "--summaries", "--runtime-dir",
         str(runtime)],
        stdin=sin, stdout=wfd, env=env, cwd=runtime.parent,
    )  # fmt: skip
    # (cwd: `python -m` puts it first on sys.path; in a checkout it would shadow PYTHONPATH.)
    os.close(wfd)
    os.close(sin)
    reader = Reader(rfd)
    reader.start()
    proc = psutil.Process(bridge.pid)
    run = Run(str(tree))
    spy = None
    try:
        if reader.first.wait(60):
            t = proc.cpu_times()
            run.start_cpu = t.user + t.system
            run.start_wall = time.perf_counter() - started
        time.sleep(args.warmup)
        if profile is not None:
            spy = subprocess.Popen(
                [str(PY_SPY), "record", "-r", str(args.profile_rate), "-d",
                 str(int(args.window)), "-f", "raw", "-o", str(profile), "-p", str(bridge.pid),
                 "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        t0, n0, b0 = proc.cpu_times(), reader.summaries, reader.bytes
        w0 = time.perf_counter()
        time.sleep(args.window)
        t1, wall = proc.cpu_times(), time.perf_counter() - w0
        run.rest = (t1.user + t1.system - t0.user - t0.system) / wall
        run.summaries = reader.summaries - n0
        run.bytes_per_s = (reader.bytes - b0) / wall
        run.ranks_seen = sorted(reader.ranks)
        if spy is not None:
            spy.wait(args.window + 30)
    finally:
        os.close(sout)
        bridge.terminate()
        bridge.wait(10)
        os.close(rfd)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rate", type=float, default=10.0, help="training steps per second")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs of each tree, alternated")
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--source", type=Path, default=ROOT, help="the tree measured")
    p.add_argument("--against", type=Path, help="a second tree, run alternately")
    p.add_argument("--profile", action="store_true", help="py-spy the --source bridge at rest")
    p.add_argument("--profile-out", type=Path, default=Path("/tmp/bridge_cost.txt"))
    p.add_argument("--profile-rate", type=int, default=500, help="py-spy samples a second")
    args = p.parse_args(argv)
    trees = [args.source] + ([args.against] if args.against else [])
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="tdbg-bridge-bench-") as tmp:
        runtime = Path(tmp) / "runs"
        runtime.mkdir(mode=0o700)
        server = subprocess.Popen(
            [PYTHON, str(FAKE), "--ranks", *map(str, range(args.ranks)), "--world",
             str(args.ranks), "--runtime", str(runtime), "--rate", str(args.rate), "--layers",
             str(args.layers), "--slow", "1", "--slow-by", str(0.2 / args.rate), "--job", JOB],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while len(list(runtime.glob("*.json"))) < args.ranks:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the rank server did not start")
                time.sleep(0.05)
            for k in range(args.repeats):
                for i, tree in enumerate(trees):
                    prof = args.profile_out if args.profile and i == 0 and k == 0 else None
                    run = one_run(tree, runtime, args, prof)
                    runs.append(run)
                    load = os.getloadavg()[0]
                    start = "n/a" if run.start_cpu is None else f"{run.start_cpu:.2f} s CPU"
                    wall = "" if run.start_wall is None else f" ({run.start_wall:.2f} s wall)"
                    print(
                        f"{tree}: start {start}{wall}; at rest {100 * run.rest:.2f} % of a "
                        f"core, {run.summaries} summaries, {run.bytes_per_s / 1e3:.1f} kB/s, "
                        f"ranks {len(run.ranks_seen)}; load {load:.2f}",
                        flush=True,
                    )
        finally:
            server.kill()
            server.wait()
    print(f"\n{args.ranks} ranks at {args.rate:g} steps/s, {args.layers} layers; medians:")
    for tree in trees:
        mine = [r for r in runs if r.tree == str(tree)]
        starts = [r.start_cpu for r in mine if r.start_cpu is not None]
        start = f"{statistics.median(starts):.2f} s" if starts else "n/a"
        rest = statistics.median(r.rest for r in mine)
        print(f"  {tree}: start {start} CPU, at rest {100 * rest:.2f} % of a core")
    if args.profile:
        print(f"profile: {args.profile_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
