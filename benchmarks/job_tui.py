"""How the job screen holds up with 64 ranks: the real ``tdbg-tui --job JOB`` in a real tmux pane
(120x40) attached to 64 live rank sockets in a runtime directory of its own, measuring how long a
key takes to show on screen and the TUI's CPU.

    .venv/bin/python benchmarks/job_tui.py            # 64 ranks, 3 repeats
    .venv/bin/python benchmarks/job_tui.py --quick    # one repeat, shorter windows (< 2 minutes)
    .venv/bin/python benchmarks/job_tui.py --profile  # also cProfile the TUI (top entries)
    .venv/bin/python benchmarks/job_tui.py --head     # the last commit's tdbg, not the working tree

The ranks are synthetic streams served as real probes: ``--procs`` processes each serve their
share of the ranks, one Unix socket and one metadata file per rank in the runtime directory, and
speak the probe's side of the wire (preamble, welcome with the rank's run description, layers,
the step history, then a ``steps`` batch every 100 ms, ``system`` every second). Every rank
steps at ``--rate`` steps/s in lockstep (as DDP ranks do) with the same gradients (so the
divergence check runs and finds nothing); rank ``--slow`` waits 20 ms more for each batch, so a
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
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
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
TICK = 0.1  # seconds between a rank's step batches (the probe's own rate)
HISTORY = 200  # steps a rank has already run when the TUI attaches
MAX_BACKLOG = 8 << 20  # bytes queued to a client that does not read before it is dropped


# --- the ranks: synthetic streams served as live probe sockets -------------------------------


@dataclass
class _Client:
    sock: socket.socket
    rank: int
    inbox: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)
    ready: bool = False


def serve(ranks: list[int], world: int, runtime: Path, rate: float, layers: int, slow: int) -> int:
    """Serve ``ranks`` of a ``world``-rank job until killed (their sockets in ``runtime``)."""
    from tdbg import __version__
    from tdbg.connect.runtime import socket_basename, write_private_json
    from tdbg.protocol.framing import MAX_INBOUND_FRAME, Decoder, negotiate, pack, preamble
    from tdbg.protocol.steps import StepRecord, pack_steps
    from tdbg.tui.sources.synthetic import layer_names, step_records, system_message

    selector = selectors.DefaultSelector()
    pid, host, started = os.getpid(), socket.gethostname(), time.time()
    names = layer_names(layers)
    runs: dict[int, dict[str, object]] = {}
    for rank in ranks:
        path = runtime / f"{socket_basename(rank, pid)}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(8)
        listener.setblocking(False)
        selector.register(listener, selectors.EVENT_READ, rank)
        runs[rank] = {
            "name": f"bench-rank{rank}", "pid": pid, "rank": rank, "host": host,
            "argv": ["train.py"], "start_time": started, "cwd": str(runtime),
            "torch": "none", "device": "cpu", "commands": {}, "world_size": world,
            "local_rank": rank % 8, "job": JOB, "socket": str(path), "proto_min": 1,
            "proto_max": 1,
        }  # fmt: skip
        write_private_json(path.with_suffix(".json"), runs[rank])
    clients: list[_Client] = []
    decoders: dict[int, Decoder] = {}

    t0 = started - HISTORY / rate
    made: dict[int, StepRecord] = {}  # step -> its record: the same on every rank, as under DDP

    def steps(rank: int, start: int, count: int) -> bytes:
        for s in range(start, start + count):
            if s not in made:  # one step at a time: its numbers depend on the step alone
                made[s] = step_records(s, 1, layers, t0=t0, seed=0)[0]
        for s in [s for s in made if s < start - HISTORY]:
            del made[s]
        period = 1.0 / rate
        out = []
        for r in (made[s] for s in range(start, start + count)):
            data = period * 0.1 + (0.02 if rank == slow else 0.0)
            busy = period * 0.9
            out.append(
                replace(
                    r,
                    time=t0 + r.step * period,
                    step_time=data + busy,
                    data_time=data,
                    forward_time=busy * 0.3,
                    backward_time=busy * 0.55,
                    optimizer_time=busy * 0.1,
                )
            )
        return pack(dict(pack_steps(out, layers)))

    def system() -> bytes:
        return pack(dict(system_message(), time=time.time()))

    def welcome(client: _Client, message: dict[str, object], step: int) -> None:
        args = message.get("args") or {}
        assert isinstance(args, dict)
        proto = negotiate((int(args["proto_min"]), int(args["proto_max"])))
        run = runs[client.rank]
        client.out += pack({"type": "welcome", "proto": proto, "server_version": __version__,
                            "run": run})  # fmt: skip
        client.out += pack({"type": "layers", "names": names, "numel": [1000] * layers})
        client.out += steps(client.rank, max(0, step - HISTORY), min(step, HISTORY))
        client.out += system() + pack({"type": "synced"})
        client.ready = True

    def flush(client: _Client) -> bool:
        try:
            while client.out:
                sent = client.sock.send(client.out)
                del client.out[:sent]
        except BlockingIOError:
            return len(client.out) < MAX_BACKLOG
        except OSError:
            return False
        return True

    def drop(client: _Client) -> None:
        if client in clients:
            clients.remove(client)
            selector.unregister(client.sock)
            client.sock.close()

    step = HISTORY
    begun = time.monotonic() - HISTORY / rate
    next_tick = next_system = time.monotonic()
    while True:
        timeout = max(0.0, next_tick - time.monotonic())
        for key, _ in selector.select(timeout):
            if isinstance(key.data, int):  # a listener: a new client for that rank
                sock, _ = key.fileobj.accept()  # type: ignore[union-attr]
                sock.setblocking(False)
                client = _Client(sock, key.data, out=bytearray(preamble()))
                clients.append(client)
                decoders[id(client)] = Decoder(MAX_INBOUND_FRAME)
                selector.register(sock, selectors.EVENT_READ, client)
                continue
            client = key.data
            try:
                chunk = client.sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                drop(client)
                continue
            for message in decoders[id(client)].feed(chunk):
                if message.get("type") == "hello" and not client.ready:
                    welcome(client, message, step)
        now = time.monotonic()
        if now < next_tick:
            continue
        next_tick = now + TICK
        due = int((now - begun) * rate)
        batches = {rank: steps(rank, step, due - step) for rank in ranks} if due > step else {}
        step = max(step, due)
        sys_frame = system() if now >= next_system else b""
        if sys_frame:
            next_system = now + 1.0
        for client in list(clients):
            if client.ready:
                client.out += batches.get(client.rank, b"") + sys_frame
            if not flush(client):
                drop(client)


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
    keys: dict[str, list[float | None]] = field(default_factory=dict)


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
    servers = [
        subprocess.Popen(
            [PYTHON, __file__, "--serve", *map(str, range(lo, min(lo + share, args.ranks))),
             "--world", str(args.ranks), "--runtime", str(runtime), "--rate", str(args.rate),
             "--layers", str(args.layers), "--slow", str(args.slow)],
            env={**os.environ, **env},
        )
        for lo in range(0, args.ranks, share)
    ]  # fmt: skip
    pane: Pane | None = None
    result = Result(args.ranks)
    try:
        deadline = time.monotonic() + 60
        while len(list(runtime.glob("*.json"))) < args.ranks:
            if time.monotonic() > deadline or any(s.poll() is not None for s in servers):
                raise RuntimeError("the rank servers did not start")
            time.sleep(0.05)
        command = [TUI, "--job", JOB]
        if args.profile:
            command = [PYTHON, "-m", "cProfile", "-o", str(workdir / f"tui{k}.prof"), TUI,
                       "--job", JOB]  # fmt: skip
        pane = Pane(command, {"TERM": "xterm-256color", **env})
        want = f"{args.ranks} of {args.ranks} ranks"
        shown = pane.wait_for(lambda t: want in t and "straggler" in t, 120)
        result.first_frame = None if shown is None else time.perf_counter() - pane.started
        time.sleep(args.warmup)
        tui = psutil.Process(pane.pid)
        procs = [psutil.Process(s.pid) for s in servers]
        c0 = sum(_cpu(p) for p in procs)
        result.cpu_data = cpu_share(tui, args.window)
        result.servers_cpu = (sum(_cpu(p) for p in procs) - c0) / args.window
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
    p.add_argument("--serve", type=int, nargs="+", help=argparse.SUPPRESS)  # a rank server
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--runtime", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve, args.world, args.runtime, args.rate, args.layers, args.slow)
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
