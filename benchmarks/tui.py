"""How fast tdbg-tui is: its CPU with data arriving and without, its first frame, and how long a
key takes to show on screen, for the real ``tdbg-tui`` in a real tmux pane at 120x40 attached to a
real probe (a subprocess training a chain of small Linear layers at a fixed step rate).

    .venv/bin/python benchmarks/tui.py            # 100 and 1,000 layers, 3 repeats
    .venv/bin/python benchmarks/tui.py --quick    # one repeat, shorter windows (< 2 minutes)
    .venv/bin/python benchmarks/tui.py --profile  # also py-spy the TUI under data (top entries)
    .venv/bin/python benchmarks/tui.py --head     # the last commit's tdbg, not the working tree

``--head`` (or ``--source DIR``) measures a snapshot of the committed code: the working tree of
a shared checkout can be mid-edit.

CPU is the TUI process's CPU time (user + system, psutil) over wall time in a steady window, as
a share of one core: "data" while steps arrive at ``--rate``, "no data" while the probe process
is stopped (SIGSTOP: the socket stays open, nothing arrives). A key's latency is the time from
``tmux send-keys`` to the first ``capture-pane`` that shows its effect (the pane is polled every
~2 ms), so it includes the terminal round trip a user sees; each key is pressed ``--presses``
times, spaced so a repaint backlog cannot carry over. Medians over repeats are printed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from tui_bench import add_bench_options, save_results, shorten_for_quick, workdir

PYTHON = sys.executable
TUI = str(Path(PYTHON).with_name("tdbg-tui"))
SIZE = (120, 40)
KEY_TIMEOUT = 3.0  # seconds: a key whose effect has not shown by then counts as this long
POLL = 0.002  # seconds between pane captures while waiting for a key's effect

# --- the probe: a real training loop in a subprocess ------------------------------------------


def serve(layers: int, rate: float) -> int:
    """Train a chain of ``layers`` tiny Linear layers at ``rate`` steps/s under tdbg.watch,
    gradient norms every step (the most a run can send); print the socket, run until killed."""
    import torch
    from torch import nn

    import tdbg

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(2, 4)
    probe = tdbg.watch(model, opt, grad_every=1, name=f"tui-bench-{layers}")
    print(probe.socket_path, flush=True)
    period = 1.0 / rate
    due = time.monotonic()
    while True:
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
        due += period
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            due = time.monotonic()  # behind: do not try to catch up in a burst


# --- the TUI in a tmux pane ---------------------------------------------------------------------


class Pane:
    """``tdbg-tui SOCKET`` in a detached tmux session of its own server (our own -L socket, so
    nobody else's tmux is touched)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.server = f"tdbg-bench-{os.getpid()}"
        self.started = time.perf_counter()
        line = " ".join(_quote(part) for part in command)
        self._tmux(
            "-f", "/dev/null", "new-session", "-d", "-s", "bench",
            "-x", str(SIZE[0]), "-y", str(SIZE[1]), f"exec env {_env_words(env)} {line}",
        )  # fmt: skip
        # tmux holds an Escape 500 ms by default (is it a meta key?): not the app's latency.
        self._tmux("set-option", "-s", "escape-time", "0")
        self.pid = int(self._tmux("display-message", "-p", "-t", "bench", "#{pane_pid}").strip())

    def _tmux(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.server, *args], capture_output=True, text=True, check=True
        )
        return out.stdout

    def text(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "bench")

    def press(self, key: str) -> None:
        self._tmux("send-keys", "-t", "bench", key)

    def wait_for(self, ok: Callable[[str], bool], timeout: float) -> float | None:
        """Seconds until the pane shows what ``ok`` wants, or None after ``timeout``."""
        start = time.perf_counter()
        while True:
            if ok(self.text()):
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                return None
            time.sleep(POLL)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True)


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def _env_words(env: dict[str, str]) -> str:
    return " ".join(_quote(f"{k}={v}") for k, v in env.items())


# --- the keys and how their effect shows --------------------------------------------------------


def _group(pattern: str, text: str) -> str | None:
    found = re.search(pattern, text)
    return found.group(1) if found else None


@dataclass(frozen=True)
class Key:
    """A key to press, and the change on screen that means it took effect. ``indicator``
    reads the relevant state off the pane; the key has shown once it differs from before."""

    name: str
    tmux: str
    indicator: Callable[[str], object]


HELP_SHOWN = Key("?", "?", lambda t: "— keys" in t)
HELP_CLOSED = Key("Esc (help)", "Escape", lambda t: "— keys" in t)
LOG = Key("l", "l", lambda t: _group(r"\b(linear|log) \(l\)", t))
HEATMAP = Key("h", "h", lambda t: _group(r"h: (table|heatmap)", t))
SORT = Key("o", "o", lambda t: _group(r"sort (\w+) \(o\)", t))
# z maximises a panel: the others (the learning-rate panel among them) leave the screen.
ZOOM = Key("z", "z", lambda t: "Learning rate" in t)
UNZOOM = Key("Esc (zoom)", "Escape", lambda t: "Learning rate" in t)
# One round leaves the screen as it found it (l, h twice; o cycles; z then Esc).
ROUND = [HELP_SHOWN, HELP_CLOSED, LOG, LOG, HEATMAP, HEATMAP, SORT, ZOOM, UNZOOM]


def measure_key(pane: Pane, key: Key) -> float | None:
    """Seconds from the press to the frame that shows it; None when the indicator cannot be
    read on this screen (the layout changed) or nothing changed within KEY_TIMEOUT."""
    before = key.indicator(pane.text())
    if before is None:
        return None
    start = time.perf_counter()
    pane.press(key.tmux)
    shown = pane.wait_for(lambda t: key.indicator(t) != before, KEY_TIMEOUT)
    if shown is None:
        return KEY_TIMEOUT
    return time.perf_counter() - start


# --- one measurement ---------------------------------------------------------------------------


@dataclass
class Result:
    layers: int
    first_frame: float | None = None
    cpu_data: float = 0.0
    cpu_idle: float = 0.0
    probe_cpu: float = 0.0
    steps_per_s: float | None = None
    keys: dict[str, list[float | None]] = field(default_factory=dict)


def cpu_share(process: psutil.Process, seconds: float) -> float:
    """The process's CPU time over ``seconds`` of wall time, as a share of one core."""
    t0, c0 = time.perf_counter(), _cpu(process)
    time.sleep(seconds)
    return (_cpu(process) - c0) / (time.perf_counter() - t0)


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def one_run(layers: int, args: argparse.Namespace, workdir: Path) -> Result:
    env = {
        "TDBG_RUNTIME_DIR": str(workdir / "runs"),
        "PYTHONPATH": str(args.source),
        # The viewer keeps its view (table or heatmap, sort, scales) in the user's settings:
        # a run must start from the defaults, not from what the last run's keys left there.
        "XDG_CONFIG_HOME": str(workdir / f"config-{layers}-{time.monotonic_ns()}"),
    }
    probe = subprocess.Popen(
        [PYTHON, __file__, "--serve", str(layers), "--rate", str(args.rate)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    pane: Pane | None = None
    result = Result(layers)
    try:
        assert probe.stdout is not None
        socket_path = probe.stdout.readline().strip()
        if not socket_path:
            raise RuntimeError("the probe subprocess did not start")
        pane = Pane([TUI, socket_path], {"TERM": "xterm-256color", **env})
        shown = pane.wait_for(lambda t: "Gradient" in t and "steps/s" in t, 60)
        result.first_frame = None if shown is None else time.perf_counter() - pane.started
        time.sleep(args.warmup)
        tui = psutil.Process(pane.pid)
        trainer = psutil.Process(probe.pid)
        c0 = _cpu(trainer)
        result.cpu_data = cpu_share(tui, args.window)
        result.probe_cpu = (_cpu(trainer) - c0) / args.window
        rate = _group(r"([\d.]+) steps/s", pane.text())
        result.steps_per_s = float(rate) if rate else None
        if args.profile:
            profile(pane.pid, args.window, workdir / f"profile-{layers}.txt")
        for _ in range(args.presses):
            for key in ROUND:
                result.keys.setdefault(key.name, []).append(measure_key(pane, key))
                time.sleep(args.gap)
        probe.send_signal(signal.SIGSTOP)  # nothing arrives; the socket stays open
        try:
            time.sleep(2.0)
            result.cpu_idle = cpu_share(tui, args.window)
        finally:
            probe.send_signal(signal.SIGCONT)
    finally:
        if pane is not None:
            pane.close()
        probe.kill()
        probe.wait()
    return result


def profile(pid: int, seconds: float, out: Path) -> None:
    """py-spy the TUI for ``seconds``; print the top entries by own and by total time."""
    spy = shutil.which("py-spy") or str(Path(PYTHON).with_name("py-spy"))
    raw = out.with_suffix(".raw")
    subprocess.run(
        [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
         "--format", "raw", "--output", str(raw), "--nonblocking"],
        capture_output=True, check=False,
    )  # fmt: skip
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines() if raw.exists() else []:
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [f for f in stack.split(";") if f and "thread" not in f.split(" ")[0]]
        if not frames:
            continue
        samples += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n
    lines = [f"py-spy, {samples} samples of the TUI over {seconds:.0f} s with data arriving"]
    ours = {f: n for f, n in total.items() if "tdbg/" in f or "textual/widgets/" in f}
    for title, table in (
        ("own time", own),
        ("total time (incl. callees)", total),
        ("total time, tdbg's and Textual's widget frames only", ours),
    ):
        lines.append(f"-- top by {title}")
        for frame, n in sorted(table.items(), key=lambda kv: -kv[1])[:25]:
            lines.append(f"{100 * n / max(samples, 1):5.1f}%  {frame}")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


# --- the report --------------------------------------------------------------------------------


def _ms(values: list[float | None], q: float) -> str:
    got = sorted(v for v in values if v is not None)
    if not got:
        return "n/a"
    k = min(len(got) - 1, max(0, round(q * (len(got) - 1))))
    return f"{got[k] * 1000:.0f}"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: list[Result], args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(f"\ntdbg-tui at {SIZE[0]}x{SIZE[1]} in tmux, probe at {args.rate:g} steps/s, "
          f"grads every step; {os.cpu_count()} CPUs, load average now "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip
    layers = sorted({r.layers for r in results})
    print(f"\n{'layers':>7} {'runs':>5} {'steps/s':>8} {'first frame':>12} "
          f"{'CPU data':>9} {'CPU no data':>12} {'probe CPU':>10}")  # fmt: skip
    for n in layers:
        mine = [r for r in results if r.layers == n]
        rates = [r.steps_per_s for r in mine if r.steps_per_s is not None]
        frames = [r.first_frame for r in mine if r.first_frame is not None]
        print(
            f"{n:>7} {len(mine):>5} {_median(rates):>8.1f} {_median(frames):>11.2f}s "
            f"{100 * _median([r.cpu_data for r in mine]):>8.1f}% "
            f"{100 * _median([r.cpu_idle for r in mine]):>11.1f}% "
            f"{100 * _median([r.probe_cpu for r in mine]):>9.1f}%"
        )
    print("\nkey → visible change, ms (median over repeats of each repeat's p50 / p95; "
          f"{args.presses} presses per repeat; {KEY_TIMEOUT * 1000:.0f} = not shown)")  # fmt: skip
    print(f"{'key':>12} " + " ".join(f"{f'{n} layers p50/p95':>22}" for n in layers))
    for key in dict.fromkeys(k.name for k in ROUND):
        cells = []
        for n in layers:
            p50s, p95s = [], []
            for r in (r for r in results if r.layers == n):
                values = r.keys.get(key, [])
                if all(v is None for v in values):
                    continue
                p50s.append(float(_ms(values, 0.5)))
                p95s.append(float(_ms(values, 0.95)))
            cell = f"{_median(p50s):.0f} / {_median(p95s):.0f}" if p50s else "n/a"
            cells.append(f"{cell:>22}")
        print(f"{key:>12} " + " ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_bench_options(p, presses=20, profile_help="py-spy the TUI in the data window")
    p.add_argument("--layers", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--rate", type=float, default=20.0, help="training steps per second")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: the probe process
    args = p.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve, args.rate)
    if shutil.which("tmux") is None:
        print("benchmarks/tui.py needs tmux", file=sys.stderr)
        return 2
    shorten_for_quick(args)
    results: list[Result] = []
    with workdir(args, "tdbg-tui-bench-") as tmp:
        for k in range(args.repeats):
            for layers in args.layers:
                print(f"repeat {k + 1}/{args.repeats}: {layers} layers ...", flush=True)
                results.append(one_run(layers, args, tmp))
    report(results, args)
    save_results(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
