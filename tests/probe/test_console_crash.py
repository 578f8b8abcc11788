"""A crash's last words with the default console capture: a script that prints, then aborts,
segfaults (faulthandler's report on fd 2) or calls os._exit(), shows a terminal, a pipe and a file
exactly what it shows without tdbg's capture: nothing held back, nothing lost, nothing reordered."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ptys import read_pty

CRASH = textwrap.dedent(
    r"""
    import faulthandler, os, sys, torch, tdbg
    faulthandler.enable()
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    probe = tdbg.watch(m, opt)
    for i in range(3):
        print(f"line {i}", flush=True)
        print(f"err {i}", file=sys.stderr)
    print("last words", flush=True)
    sys.stderr.write("last on stderr\n")
    os.write(2, b"c-level last\n")
    how = sys.argv[1]
    if how == "abort":
        os.abort()
    elif how == "segv":
        faulthandler._sigsegv()
    else:
        print("buffered, lost with or without tdbg when not a terminal")
        os._exit(3)
    """
)


def _env(tmp_path: Path, console: str | None) -> dict[str, str]:
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(tmp_path))
    env.pop("TDBG_CONSOLE")
    if console is not None:
        env["TDBG_CONSOLE"] = console
    return env


def _crash(tmp_path: Path, how: str, to: str, console: str | None) -> tuple[int, bytes, bytes]:
    """The script's exit status and what its stdout and stderr received."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    argv = [sys.executable, str(script), how]
    env = _env(tmp_path, console)
    if to == "pipe":
        out = subprocess.run(argv, env=env, capture_output=True, timeout=120)
        return out.returncode, out.stdout, out.stderr
    if to == "file":
        with open(tmp_path / "out", "wb") as o, open(tmp_path / "err", "wb") as e:
            code = subprocess.run(argv, env=env, stdout=o, stderr=e, timeout=120).returncode
        return code, (tmp_path / "out").read_bytes(), (tmp_path / "err").read_bytes()
    master, slave = os.openpty()
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True
    )
    os.close(slave)
    seen = read_pty(master)
    os.close(master)
    return proc.wait(timeout=120), seen, b""


def _before_the_dump(stderr: bytes) -> bytes:
    """What came before faulthandler's report (its thread list names addresses and where each
    thread was, which differ from run to run)."""
    return stderr.partition(b"Fatal Python error")[0]


@pytest.mark.parametrize("how", ["abort", "segv", "exit"])
def test_a_crash_shows_what_it_shows_without_the_capture(tmp_path: Path, how: str) -> None:
    for to in ("pipe", "file", "pty"):
        off_code, off_out, off_err = _crash(tmp_path, how, to, "0")
        code, out, err = _crash(tmp_path, how, to, None)  # the default
        assert code == off_code != 0, (to, code, off_code)
        whole = out + err
        if to == "pty":  # stdout and stderr interleaved on one terminal
            out, off_out = _before_the_dump(out), _before_the_dump(off_out)
        assert out == off_out, (to, out, off_out)
        assert _before_the_dump(err) == _before_the_dump(off_err), (to, err, off_err)
        for seen in (out + err, off_out + off_err):
            assert b"line 2" in seen and b"last words" in seen, (to, seen)
            assert b"last on stderr" in seen and b"c-level last" in seen, (to, seen)
        if how != "exit":
            # faulthandler's report, on fd 2 itself, whole: the script's frame is named.
            assert re.search(rb"Fatal Python error: (Aborted|Segmentation fault)", whole), to
            assert re.search(rb'File ".*crash\.py", line \d+ in <module>', whole), (to, whole)
