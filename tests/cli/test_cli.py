"""`tdbg dump` and `tdbg ls` against a real demo job; bad targets give one line and exit 2."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

from demo_job import demo_job
from waiting import wait_until

TDBG = [sys.executable, "-m", "tdbg.cli"]


def run_cli(*args: str, runtime: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime))
    return subprocess.run([*TDBG, *args], env=env, capture_output=True, text=True, timeout=timeout)


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_dump_streams_documented_events(runtime_dir: Path) -> None:
    # Gradients every 10 steps, not the automatic interval: on a busy machine that interval
    # grows past the 40 steps read here (the probe's cost is a larger share of a slow step),
    # and what is tested is the events' form.
    args = ("--delay", "0.005", "--grad-every", "10")
    with demo_job("mlp", *args, runtime=runtime_dir) as (proc, entry):
        out = run_cli("dump", "--count", "40", runtime=runtime_dir)
    assert out.returncode == 0, out.stderr
    evs = events(out.stdout)
    hello = evs[0]
    assert hello["type"] == "hello"
    assert hello["run"]["pid"] == proc.pid
    assert hello["layers"] and "head" in hello["layers"]
    steps = [e for e in evs if e["type"] == "step"]
    assert len(steps) == 40
    assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[0]["step"] + 40))
    for s in steps:
        assert isinstance(s["loss"], float) and math.isfinite(s["loss"])
        assert isinstance(s["lr"], list) and len(s["lr"]) >= 1
    sampled = [s for s in steps if s["grad_norms"] is not None]
    assert sampled, "no step carried per-layer gradient norms"
    first = sampled[0]
    assert set(first["grad_norms"]) == set(hello["layers"])
    total = math.sqrt(sum(v * v for v in first["grad_norms"].values()))
    assert math.isclose(first["grad_norm"], total, rel_tol=1e-4)


def test_dump_reports_nan_alert_naming_the_layer(runtime_dir: Path) -> None:
    """``tdbg dump`` read until it has shown everything asked of it (not for a fixed 20 s,
    which a busy machine may not fill with a system sample)."""
    args = ("--delay", "0", "--nan-at", "30", "--layer", "body.1", "--steps", "100000")
    evs: list[dict] = []

    def seen_all() -> bool:
        line = dump.stdout.readline() if dump.stdout else ""
        assert line, f"tdbg dump ended early: {evs[-3:]}"
        evs.extend(events(line))
        kinds = {e["type"] for e in evs} | {e.get("kind") for e in evs if e["type"] == "alert"}
        nan_step = any(e["type"] == "step" and e["loss"] == "nan" for e in evs)
        return nan_step and {"nonfinite_loss", "nonfinite_grad", "memory", "gpu"} <= kinds

    with demo_job("nan", *args, runtime=runtime_dir):
        env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir))
        dump = subprocess.Popen([*TDBG, "dump"], env=env, stdout=subprocess.PIPE, text=True)
        try:
            wait_until(seen_all, what="a NaN step, both alerts and the system events")
        finally:
            dump.kill()
            dump.communicate()
    grad = [e for e in evs if e["type"] == "alert" and e["kind"] == "nonfinite_grad"]
    assert "body.1" in grad[0]["layers"], grad


def test_ls_lists_the_run(runtime_dir: Path) -> None:
    with demo_job("mlp", "--delay", "0.01", runtime=runtime_dir) as (proc, _):
        out = run_cli("ls", "--json", runtime=runtime_dir)
    assert out.returncode == 0
    runs = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["pid"] for r in runs] == [proc.pid]


def test_bad_targets_one_line_exit_2(runtime_dir: Path, tmp_path: Path) -> None:
    missing = run_cli("dump", str(tmp_path / "nope.sock"), runtime=runtime_dir)
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "no such socket" in missing.stderr
    assert "Traceback" not in missing.stderr

    # A Unix socket that speaks something else entirely.
    path = tmp_path / "other.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    child = os.fork()
    if child == 0:  # answers like an HTTP server would, then closes
        conn, _ = server.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()
        os._exit(0)
    server.close()
    other = run_cli("dump", str(path), runtime=runtime_dir)
    os.waitpid(child, 0)
    assert other.returncode == 2
    assert "not a tdbg probe" in other.stderr and other.stderr.count("\n") == 1

    nothing = run_cli("dump", runtime=runtime_dir)
    assert nothing.returncode == 2 and "no tdbg run found" in nothing.stderr
