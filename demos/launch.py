"""Run a demo training job in the background and the tdbg TUI attached to it in the foreground."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import IO, Any

from tdbg.connect.runtime import RunEntry, discover, runtime_dir

DEMOS = Path(__file__).resolve().parent
CHOICES = ("mlp", "transformer", "nan", "cnn")
START_TIMEOUT = 30.0  # seconds for the job to import torch, build its model and serve
POLL = 0.05
TERM_GRACE = 3.0  # seconds between SIGTERM and SIGKILL
TAIL = 2000  # characters of the job's stderr shown when it fails


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[launcher args] -- [demo args]``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-TAIL:].rstrip()


def wait_for_probe(job: subprocess.Popen[bytes], runtime: Path, timeout: float) -> RunEntry | None:
    """The job's run entry once its socket is up; None if the job exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = [e for e in discover(runtime) if e.pid == job.pid]
        if entries:
            return entries[0]
        if job.poll() is not None:
            return None
        time.sleep(POLL)
    return None


def stop(job: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the demo closes its probe and exits 0), then SIGKILL after a grace period."""
    if job.poll() is not None:
        return
    job.send_signal(signal.SIGTERM)
    try:
        job.wait(TERM_GRACE)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()


# The signal that ends the launcher, once one has (SIGHUP: the terminal closed; SIGTERM).
_signalled: list[int] = []
# What the TUI turned on in the terminal (alternate screen, mouse reporting, a hidden cursor),
# turned off where it could not do so itself.
_TERMINAL_RESET = "\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?1015l\x1b[?1049l\x1b[?25h"


def _exit_on_signal(signum: int, frame: object) -> None:
    _ignore_signals()  # one exit: a second signal must not cut it short
    _signalled.append(signum)
    raise SystemExit(128 + signum)


def _ignore_signals() -> None:
    for signum in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def _terminal_settings() -> list[Any] | None:
    """The terminal's settings before the TUI changes them (None: not a terminal)."""
    try:
        return termios.tcgetattr(sys.__stdin__.fileno())  # type: ignore[union-attr]
    except (OSError, ValueError, AttributeError, termios.error):
        return None


def _restore_terminal(settings: list[Any] | None) -> None:
    """Best effort, after a SIGTERM cut the TUI short: the terminal as it was before it.
    Written to the process's own descriptors (the TUI replaces sys.stdout while it runs)."""
    for stream in (sys.__stderr__, sys.__stdout__):
        with contextlib.suppress(Exception):
            if stream is not None and os.isatty(stream.fileno()):
                os.write(stream.fileno(), _TERMINAL_RESET.encode())
                break
    if settings is not None:
        with contextlib.suppress(Exception):
            termios.tcsetattr(sys.__stdin__.fileno(), termios.TCSANOW, settings)  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    ours, demo_args = split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description=__doc__,
        usage="%(prog)s [mlp|transformer|nan|cnn] [-- demo args]",
        epilog="example: %(prog)s nan -- --nan-at 300 --layer body.4",
    )
    p.add_argument("demo", nargs="?", default="mlp", choices=CHOICES, help="default: mlp")
    args = p.parse_args(ours)
    # A closed terminal (SIGHUP) or a kill (SIGTERM) must not leave the job training on its
    # own (it runs in its own session): both unwind through the `finally` that stops it.
    for signum in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, _exit_on_signal)
    # The usual runtime directory: `tdbg ls` / `tdbg status` in another terminal see the demo;
    # the TUI attaches to the job's own socket, so another run there cannot get in the way.
    runtime = runtime_dir()
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1")
    print(
        f"tdbg demo: starting the {args.demo} training job (torch takes a few seconds to load)…",
        flush=True,
    )
    settings = _terminal_settings()
    with tempfile.TemporaryFile() as log:
        job: subprocess.Popen[bytes] | None = None
        try:
            # The job must not write to the terminal the TUI owns: stdout dropped, stderr kept.
            job = subprocess.Popen(
                [sys.executable, str(DEMOS / f"{args.demo}.py"), *demo_args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # Ctrl-C at the terminal reaches us; we stop the job
            )
            entry = wait_for_probe(job, runtime, START_TIMEOUT)
            if entry is None:
                if job.poll() is None:
                    reason = f"its probe did not start serving within {START_TIMEOUT:g} s"
                else:
                    reason = f"it exited with code {job.returncode} before serving"
                print(f"launch: the {args.demo} demo failed: {reason}", file=sys.stderr)
                stop(job)
                text = tail(log)
                if text:
                    print(text, file=sys.stderr)
                return 1
            from tdbg.cli.launch import launch  # after the job starts: the imports overlap

            code = launch(str(entry.socket))
            if job.poll() not in (None, 0):
                print(
                    f"launch: the {args.demo} demo exited with code {job.returncode}:",
                    file=sys.stderr,
                )
                print(tail(log), file=sys.stderr)
            return code
        except KeyboardInterrupt:
            return 130
        finally:
            _ignore_signals()  # the job is stopped whatever comes now
            if job is not None:
                stop(job)
            if _signalled and _signalled[0] != signal.SIGHUP:
                _restore_terminal(settings)  # a kill, the terminal still there
            artifacts = runtime / "artifacts"
            if (
                artifacts.is_dir()
                and any(artifacts.iterdir())
                and _signalled[:1] != [signal.SIGHUP]
            ):
                # Kept: the screen said to open the traces in Perfetto; they outlive the demo.
                print(
                    f"tdbg demo: profiler traces and memory snapshots are in {artifacts}",
                    file=sys.__stdout__,  # not the TUI's stand-in, where a kill cut it short
                    flush=True,
                )
            if _signalled:
                # A signal cut the TUI short inside its event loop: its input thread was never
                # told to stop, and on a closed terminal it spins on the dead tty for ever, so
                # the interpreter would wait for it at exit. The job is stopped: leave now.
                with contextlib.suppress(Exception):
                    sys.__stdout__.flush()  # type: ignore[union-attr]
                os._exit(128 + _signalled[0])


if __name__ == "__main__":
    sys.exit(main())
