"""What the console capture costs a flood of output: a loop printing N lines as fast as it can.

Each round runs four fresh interpreters, in turn: the loop unwatched; watched with the console
left alone (``TDBG_CONSOLE=0``); watched with it captured (the default, ``sys.stdout`` and
``sys.stderr`` teed; ``--capture fd``: the fd-level tee, ``TDBG_CONSOLE=fd``); watched with it
left alone again (the baseline against itself: the machine's noise). The loop is timed inside the
child, from its first print to its last, flushed, so imports and the probe's start are left
out: its wall time, the printing thread's CPU time and the whole process's (the probe thread's
pumping too, or the fd-level tee's tdbg-console thread). Output goes to a pseudo-terminal
drained by this process (``--to tty``, the default: line-buffered, one write a line, an
interactive run) or to a file (``--to file``: Python writes 8 KiB at a time). Printed: each
figure's median over the rounds, the ratio captured / console off and console off against
itself (median, min-max over the rounds), and the lines the console held at the end (at most
5,000).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Unwatched; watched, TDBG_CONSOLE=0; watched, captured; watched, TDBG_CONSOLE=0 again (the
# machine's noise: the baseline against itself).
ARMS = ("bare", "off", "on", "off2")

CHILD = textwrap.dedent(
    r"""
    import os, sys, time
    lines, watched, report = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
    probe = None
    if watched:
        import torch, tdbg
        m = torch.nn.Linear(4, 1)
        probe = tdbg.watch(m, torch.optim.SGD(m.parameters(), 0.1))
    start, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    for i in range(lines):
        print(f"step {i} loss 0.12345 lr 0.001 | some more text to make it a line")
    sys.stdout.flush()
    seconds = time.perf_counter() - start
    cpu, own = time.process_time() - cpu, time.thread_time() - own
    held = -1
    if probe is not None:
        from tdbg.probe import console
        tee = console.current()
        if tee is not None:
            tee.settle()
        held = tee.held if tee is not None else 0
        probe.close()
    os.write(report, f"{seconds} {own} {cpu} {held}\n".encode())
    """
)


def _drain(master: int) -> None:
    while True:
        try:
            if not os.read(master, 1 << 16):
                return
        except OSError:
            return


def run_once(
    lines: int, arm: str, to: str, script: Path, runtime: str, capture: str = "default"
) -> tuple[float, float, float, int]:
    env = dict(os.environ, TDBG_RUNTIME_DIR=runtime, TDBG_CONSOLE="0")
    if arm == "on":
        env["TDBG_CONSOLE"] = capture
        if capture == "default":
            del env["TDBG_CONSOLE"]
    env["PYTHONPATH"] = str(ROOT)
    watched = "0" if arm == "bare" else "1"
    report_r, report_w = os.pipe()
    master = -1
    drain: threading.Thread | None = None
    if to == "tty":
        master, out = os.openpty()
        drain = threading.Thread(target=_drain, args=(master,), daemon=True)
        drain.start()
    else:
        out = os.open(os.devnull if to == "null" else tempfile.mktemp(), os.O_WRONLY | os.O_CREAT)
    try:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(lines), watched, str(report_w)],
            env=env,
            stdout=out,
            stderr=subprocess.DEVNULL,
            pass_fds=(report_w,),
        )
        os.close(out)
        os.close(report_w)
        report = b""
        while chunk := os.read(report_r, 256):
            report += chunk
        if proc.wait(120) != 0:
            raise SystemExit(f"the {arm} child failed")
    finally:
        os.close(report_r)
        if drain is not None:
            drain.join(5)
            os.close(master)
    seconds, own, cpu, held = report.split()
    return float(seconds), float(own), float(cpu), int(held)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lines", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--to", choices=("file", "tty", "null"), default="tty")
    p.add_argument("--capture", choices=("default", "fd"), default="default")
    args = p.parse_args(argv)
    figures: dict[str, dict[str, list[float]]] = {
        arm: {"wall": [], "thread": [], "cpu": []} for arm in ARMS
    }
    held = 0
    with tempfile.TemporaryDirectory(prefix="tdbg-b-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o700)
        script = Path(tmp) / "flood.py"
        script.write_text(CHILD)
        for r in range(args.rounds):
            for arm in ARMS:
                wall, own, cpu, kept = run_once(args.lines, arm, args.to, script, tmp, args.capture)
                for key, value in (("wall", wall), ("thread", own), ("cpu", cpu)):
                    figures[arm][key].append(value)
                held = kept if arm == "on" else held
            print(
                f"round {r + 1}: "
                + ", ".join(f"{arm} {figures[arm]['wall'][-1]:.3f} s" for arm in ARMS),
                flush=True,
            )
    print(
        f"{args.lines:,} lines to a {args.to}, capture {args.capture}, {args.rounds} rounds "
        "(median, min-max of ratios):"
    )
    for key, what in (
        ("wall", "the loop's wall time"),
        ("thread", "the printing thread's CPU"),
        ("cpu", "the whole process's CPU (the probe thread's pumping too)"),
    ):
        med = {arm: statistics.median(figures[arm][key]) for arm in ARMS}
        on_off = [a / b for a, b in zip(figures["on"][key], figures["off"][key], strict=True)]
        noise = [a / b for a, b in zip(figures["off2"][key], figures["off"][key], strict=True)]
        print(
            f"  {what}: unwatched {med['bare']:.3f} s, console off {med['off']:.3f} s, "
            f"captured {med['on']:.3f} s; captured / console off {statistics.median(on_off):.2f} "
            f"({min(on_off):.2f}-{max(on_off):.2f}), console off against itself "
            f"{statistics.median(noise):.2f} ({min(noise):.2f}-{max(noise):.2f})"
        )
    print(f"  lines the console held at the end: {held:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
