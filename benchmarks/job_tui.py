"""How the job screen holds up with 64 ranks (or 1,024 on 128 nodes): the real ``tdbg-tui --job
JOB`` in a real tmux pane (120x40) attached to live rank sockets in a runtime directory of its own,
measuring how long a key takes to show on screen, the TUI's CPU and each node's bridge's.

    .venv/bin/python benchmarks/job_tui.py            # 64 ranks, 3 repeats
    .venv/bin/python benchmarks/job_tui.py --quick    # one repeat, shorter windows (< 2 minutes)
    .venv/bin/python benchmarks/job_tui.py --quick --ranks 1024 --nodes 128 --procs 8
    .venv/bin/python benchmarks/job_tui.py --profile  # also cProfile the TUI (top entries)
    .venv/bin/python benchmarks/job_tui.py --head     # the last commit's tdbg, not the working tree

The ranks are synthetic streams served as real probes (benchmarks/fake_ranks.py): ``--procs``
processes each serve their share of the ranks, one Unix socket and one metadata file per rank in
the runtime directory (``--nodes``: in one directory per simulated node), and speak the probe's
side of the wire. A job of more than 16 ranks is read through node bridges that send summaries:
one local bridge, or with ``--nodes`` one per node, started through a stand-in for ssh from a
hostfile, as ``tdbg-tui --hostfile`` reaches real nodes. Every rank
steps at ``--rate`` steps/s in lockstep (as DDP ranks do) with the same gradients (so the
divergence check runs and finds nothing); rank ``--slow`` waits a fifth of a step more for each
batch (20 ms at 10 steps/s), so a
straggler is found and stays on screen. Nothing of torch is loaded: 64 torch processes would
bury a 2-core machine and measure torch's start-up, not the screen.

CPU is the TUI process's CPU time (user + system) over wall time while steps arrive ("data") and
while the rank servers are stopped (SIGSTOP: sockets open, nothing arrives), as a share of one
core. A key's latency is ``tmux send-keys`` to the first ``capture-pane`` showing its effect
(polled every ~2 ms): the cursor moving (Down, Up), help (``?``, Esc), one rank's full screen
(Enter, Esc back). Medians over repeats of each repeat's p50 and p95.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tui  # noqa: E402
from tui import (  # noqa: E402
    KEY_TIMEOUT,
    PYTHON,
    SIZE,
    TUI,
    Key,
    Pane,
    _cpu,
    _median,
    cpu_share,
)
from tui_bench import add_bench_options, save_results, shorten_for_quick, workdir  # noqa: E402

JOB = "bench-job"
FAKE = HERE / "fake_ranks.py"
# Stands in for `ssh [options] -- host WORDS`: runs WORDS here with a shell, as sshd would there,
# at the lowest priority: on a cluster each node's bridge has that node's cores; here 128 of them
# (~1.3 % of a core each at rest, 0.4 s of CPU to start: 1.7 cores and 52 s in all) share the
# viewer's 2, and at equal priority they starved it (load 80-250).
LOCAL_SSH = (
    '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift 2\nexec nice -n 19 sh -c "$*"\n'
)
NICE = ["nice", "-n", "19"]  # the simulated nodes' ranks, likewise


# --- one measurement -----------------------------------------------------------------------------


def _ranks_panel(text: str) -> str | None:
    """The rank panel's subtitle (which rank the cursor is on): it moves with Down and Up."""
    for line in text.splitlines():
        if "rank " in line and " of " in line and "row " in line:
            return line.strip()
    return None


CURSOR_DOWN = Key("Down", "Down", _ranks_panel)
CURSOR_UP = Key("Up", "Up", _ranks_panel)
HELP_SHOWN = Key("?", "?", lambda t: "— keys" in t)
HELP_CLOSED = Key("Esc (help)", "Escape", lambda t: "— keys" in t)
OPEN_RANK = Key("Enter", "Enter", lambda t: "Gradient norms per layer" in t)
BACK = Key("Esc (rank)", "Escape", lambda t: "Gradient norms per layer" in t)
# One round leaves the screen as it found it.
ROUND = [CURSOR_DOWN, CURSOR_UP, HELP_SHOWN, HELP_CLOSED, OPEN_RANK, BACK]


@dataclass
class Result:
    ranks: int
    first_frame: float | None = None
    cpu_data: float = 0.0
    cpu_idle: float = 0.0
    servers_cpu: float = 0.0
    bridges: int = 0
    bridge_cpu: float = 0.0  # one node's bridge, share of a core (mean over the bridges)
    keys: dict[str, list[float | None]] = field(default_factory=dict)


def _nodes(workdir: Path, runtime: Path, nodes: int) -> Path:
    """A hostfile naming each simulated node with its runtime directory, and the ssh stand-in
    in ``workdir`` (put first on the TUI's PATH)."""
    ssh = workdir / "ssh"
    ssh.write_text(LOCAL_SSH)
    ssh.chmod(0o755)
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"ssh://node{n:03d}{runtime}/node{n:03d}\n" for n in range(nodes)))
    return hostfile


def _bridges(tui: psutil.Process) -> list[psutil.Process]:
    """The TUI's ``tdbg bridge`` processes (one per node: local, or behind the ssh stand-in)."""
    out = []
    for child in tui.children(recursive=True):
        try:
            if "bridge" in child.cmdline():
                out.append(child)
        except psutil.Error:
            continue
    return out


def measure_key(pane: Pane, key: Key, settle: float) -> float | None:
    """``tui.measure_key``, then ``settle`` seconds so a repaint backlog cannot carry over."""
    elapsed = tui.measure_key(pane, key)
    time.sleep(settle)
    return elapsed


def one_run(args: argparse.Namespace, workdir: Path, k: int) -> Result:
    runtime = workdir / f"runs{k}"
    runtime.mkdir(mode=0o700)
    env = {"TDBG_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(args.source)}
    share = -(-args.ranks // args.procs)
    per_node = args.ranks // args.nodes if args.nodes > 1 else 0
    servers = [
        subprocess.Popen(
            [*(NICE if per_node else []), PYTHON, str(FAKE), "--ranks",
             *map(str, range(lo, min(lo + share, args.ranks))),
             "--world", str(args.ranks), "--runtime", str(runtime), "--rate", str(args.rate),
             "--layers", str(args.layers), "--slow", str(args.slow), "--job", JOB,
             "--slow-by", str(0.2 / args.rate),
             "--per-node", str(per_node)],
            env={**os.environ, **env},
        )
        for lo in range(0, args.ranks, share)
    ]  # fmt: skip
    pane: Pane | None = None
    result = Result(args.ranks)
    try:
        deadline = time.monotonic() + 60
        while len(list(runtime.glob("**/*.json"))) < args.ranks:
            if time.monotonic() > deadline or any(s.poll() is not None for s in servers):
                raise RuntimeError("the rank servers did not start")
            time.sleep(0.05)
        where = ["--job", JOB]
        if per_node:  # the nodes reached as ssh reaches them: a stand-in runs the bridges here
            where += ["--hostfile", str(_nodes(workdir, runtime, args.nodes))]
            env["PATH"] = f"{workdir}:{Path(PYTHON).parent}:{os.environ['PATH']}"
        command = [TUI, *where]
        if args.profile:
            command = [PYTHON, "-m", "cProfile", "-o", str(workdir / f"tui{k}.prof"), TUI,
                       *where]  # fmt: skip
        pane = Pane(command, {"TERM": "xterm-256color", **env})
        want = f"{args.ranks} of {args.ranks} ranks"
        # 1,024 ranks: 128 bridges start (52 s of CPU) on this machine's 2 cores.
        wait = 120 if args.ranks <= 256 else 420
        shown = pane.wait_for(lambda t: want in t and "straggler" in t, wait)
        result.first_frame = None if shown is None else time.perf_counter() - pane.started
        time.sleep(args.warmup)
        tui = psutil.Process(pane.pid)
        procs = [psutil.Process(s.pid) for s in servers]
        bridges = _bridges(tui)
        c0 = sum(_cpu(p) for p in procs)
        b0 = sum(_cpu(p) for p in bridges)
        result.cpu_data = cpu_share(tui, args.window)
        result.servers_cpu = (sum(_cpu(p) for p in procs) - c0) / args.window
        result.bridges = len(bridges)
        spent = sum(_cpu(p) for p in bridges) - b0
        result.bridge_cpu = spent / args.window / max(1, len(bridges))
        for _ in range(args.presses):
            for key in ROUND:
                result.keys.setdefault(key.name, []).append(measure_key(pane, key, args.gap))
        for s in servers:
            s.send_signal(signal.SIGSTOP)
        try:
            time.sleep(2.0)
            result.cpu_idle = cpu_share(tui, args.window)
        finally:
            for s in servers:
                s.send_signal(signal.SIGCONT)
        if args.profile:
            pane.press("q")
            pane.wait_for(lambda t: False, 3.0)
    finally:
        if pane is not None:
            pane.close()
        for s in servers:
            s.kill()
            s.wait()
    if args.profile:
        _print_profile(workdir / f"tui{k}.prof")
    return result


def _print_profile(path: Path) -> None:
    import pstats

    if not path.exists():
        print(f"no profile at {path} (the TUI did not exit cleanly)")
        return
    stats = pstats.Stats(str(path))
    stats.sort_stats("cumulative").print_stats(r"tdbg|textual/(widgets|_compositor|screen)", 30)
    stats.sort_stats("tottime").print_stats(25)


# --- the report --------------------------------------------------------------------------------


def _quantile(values: list[float | None], q: float) -> float | None:
    got = sorted(v for v in values if v is not None)
    if not got:
        return None
    return got[min(len(got) - 1, max(0, round(q * (len(got) - 1))))]


def report(results: list[Result], args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(f"\ntdbg-tui --job at {SIZE[0]}x{SIZE[1]} in tmux, {args.ranks} ranks at {args.rate:g} "
          f"steps/s ({args.layers} layers, grads every step) from {args.procs} processes; "
          f"{os.cpu_count()} CPUs, load average now {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}")  # fmt: skip
    frames = [r.first_frame for r in results if r.first_frame is not None]
    print(f"repeats {len(results)}; first full frame {_median(frames):.2f} s; TUI CPU with data "
          f"{100 * _median([r.cpu_data for r in results]):.1f} %, without "
          f"{100 * _median([r.cpu_idle for r in results]):.1f} %; rank servers "
          f"{100 * _median([r.servers_cpu for r in results]):.1f} %")  # fmt: skip
    if any(r.bridges for r in results):
        print(f"bridges {max(r.bridges for r in results)}, each "
              f"{100 * _median([r.bridge_cpu for r in results]):.1f} % of a core "
              f"({args.ranks // max(1, max(r.bridges for r in results))} ranks each)")  # fmt: skip
    print(f"\nkey → visible change, ms (median over repeats of each repeat's p50 / p95; "
          f"{args.presses} presses per repeat; {KEY_TIMEOUT * 1000:.0f} = not shown)")  # fmt: skip
    every: list[float | None] = []
    for key in dict.fromkeys(k.name for k in ROUND):
        p50s, p95s = [], []
        for r in results:
            values = r.keys.get(key, [])
            every.extend(values)
            lo, hi = _quantile(values, 0.5), _quantile(values, 0.95)
            if lo is not None and hi is not None:
                p50s.append(lo)
                p95s.append(hi)
        cell = f"{1000 * _median(p50s):.0f} / {1000 * _median(p95s):.0f}" if p50s else "n/a"
        print(f"{key:>12} {cell:>12}")
    lo, hi = _quantile(every, 0.5), _quantile(every, 0.95)
    if lo is not None and hi is not None:
        print(f"{'all keys':>12} {f'{1000 * lo:.0f} / {1000 * hi:.0f}':>12}  (pooled)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_bench_options(p, presses=10, profile_help="cProfile the TUI (a repeat each)")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--procs", type=int, default=4, help="processes serving the ranks")
    p.add_argument("--rate", type=float, default=10.0, help="training steps per second")
    p.add_argument("--layers", type=int, default=16, help="layers per rank")
    p.add_argument("--slow", type=int, default=5, help="the straggling rank")
    p.add_argument(
        "--nodes", type=int, default=1,
        help="simulated nodes: past 1, each node's ranks are read by a bridge of its own, "
        "reached through a stand-in for ssh (tdbg-tui --hostfile)",
    )  # fmt: skip
    args = p.parse_args(argv)
    shorten_for_quick(args, presses=5)
    results: list[Result] = []
    with workdir(args, "tdbg-job-bench-") as tmp:
        for k in range(args.repeats):
            print(f"repeat {k + 1}/{args.repeats}: {args.ranks} ranks ...", flush=True)
            results.append(one_run(args, tmp, k))
    report(results, args)
    save_results(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
