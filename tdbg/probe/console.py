"""Which console capture runs (Python-level by default, fd-level on request): its one instance."""

from __future__ import annotations

import atexit
import os

from tdbg.probe.console_stream import StreamTee
from tdbg.probe.console_tee import ConsoleTee
from tdbg.probe.log import warn

ENV = "TDBG_CONSOLE"  # unset or 1: sys.stdout/sys.stderr teed; fd: fds 1 and 2; 0: off
PYTHON, FD = "python", "fd"
_ON = ("", "1", "true", "yes", "on", PYTHON)
_OFF = ("0", "false", "no", "off")

Capture = StreamTee | ConsoleTee


def parse(value: str) -> str | None:
    """``python``, ``fd`` or None (off) for a ``$TDBG_CONSOLE`` or ``console=`` string; a
    ValueError names the values it takes."""
    word = value.strip().lower()
    if word in _ON:
        return PYTHON
    if word in _OFF:
        return None
    if word == FD:
        return FD
    raise ValueError(f"console must be one of 1, 0, fd (got {value!r})")


def mode(option: bool | str | None = None) -> str | None:
    """What to capture: ``console=`` when given (True: the default capture), else
    ``$TDBG_CONSOLE``. On by default, at Python's level: ``sys.stdout`` and ``sys.stderr`` are
    teed after the real write, so nothing a crash prints can be held back by tdbg."""
    if isinstance(option, bool):
        return PYTHON if option else None
    if option is not None:
        return parse(option)
    value = os.environ.get(ENV, "")
    try:
        return parse(value)
    except ValueError:
        warn(f"tdbg: ${ENV}={value!r} is not 1, 0 or fd: the default console capture is used")
        return PYTHON


_tee: Capture | None = None


def capture(kind: str = PYTHON, pin: bool = False) -> Capture | None:
    """The process's one capture, started on first use, for one more user (a probe, which
    :func:`release` s it when it closes; ``pin``: ``tdbg run``'s preload, held until exit);
    None where it could not start. A capture already running is shared, whatever its kind.
    Whatever holds it, it is given back at exit."""
    global _tee
    if _tee is not None and (_tee._pid != os.getpid() or not _tee.running):
        _tee = None  # a forked child (the parent's capture is not its own), or given back
    if _tee is None:
        tee: Capture = ConsoleTee() if kind == FD else StreamTee()
        if not tee.start():
            return None
        _tee = tee
        atexit.register(tee.stop)
    if pin:
        _tee.pinned = True
    else:
        _tee.users += 1
    return _tee


def release(tee: Capture) -> None:
    """A probe closed: the capture is given back when no probe (nor ``tdbg run``) holds it."""
    if os.getpid() != tee._pid:
        return
    tee.users -= 1
    if tee.users <= 0 and not tee.pinned:
        tee.stop()  # the last lines, an unfinished one too, reach the probe's final tick
    else:
        tee.settle(finish=True)


def current() -> Capture | None:
    """The capture running in this process, if any (never starts one)."""
    return _tee if _tee is not None and _tee._pid == os.getpid() else None


def _after_fork_in_child() -> None:
    if _tee is not None:
        _tee.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
