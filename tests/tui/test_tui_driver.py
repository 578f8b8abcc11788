"""tdbg's Linux driver in a real pty: a lone Esc is the Esc key, an arrow's sequence the arrow."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

from ptys import read_pty
from waiting import wait_until

from tdbg.tui.driver import IDLE_POLL, poll_timeout

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "keys" / "key_log_app.py"


def _keys(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_esc_and_an_arrow_through_a_pty(tmp_path: Path) -> None:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    log = tmp_path / "keys.log"
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "TERM": "xterm-256color"}
    env.pop("ESCDELAY", None)
    env.pop("TEXTUAL_DRIVER", None)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(log)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    # The screen is drained as it is drawn, or the app would block on a full pty.
    screen: list[bytes] = []
    drain = threading.Thread(target=lambda: screen.append(read_pty(master)), daemon=True)
    drain.start()
    try:
        wait_until(lambda: any(k.startswith("ready") for k in _keys(log)), what="the app up")
        assert _keys(log)[0] == "ready TdbgLinuxDriver"
        os.write(master, b"\x1b")
        wait_until(lambda: "escape" in _keys(log), what="Esc as the escape key")
        os.write(master, b"\x1b[A")
        wait_until(lambda: "up" in _keys(log), what="ESC [ A as the up arrow")
        os.write(master, b"x\x1b")
        wait_until(lambda: _keys(log).count("escape") == 2, what="a second Esc after a letter")
        os.write(master, b"q")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        drain.join(timeout=10)
        os.close(master)
    # Every key once, in order, and the arrow's bytes never read as Esc, '[' and 'A'.
    assert _keys(log)[1:] == ["escape", "up", "x", "escape", "q"]


def test_the_poll_ends_with_a_pending_sequence() -> None:
    assert poll_timeout(None, 5.0) == IDLE_POLL
    assert abs(poll_timeout(5.03, 5.0) - 0.03) < 1e-9
    assert poll_timeout(4.9, 5.0) == 0.0
    assert poll_timeout(9.0, 5.0) == IDLE_POLL
