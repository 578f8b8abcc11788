"""`tdbg alerts`: each alert once per kind until it clears, as a line, JSON, a command run and a
webhook posted to a real loopback HTTP server; a hung or failing sink never holds the stream."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from test_cli import TDBG
from test_report import _nan_recording
from waiting import wait_until

from tdbg.cli.alert_fold import AlertFold


def alerts(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TDBG, "alerts", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def nan_run(tmp_path: Path) -> Path:
    path = tmp_path / "nan.tdbg"
    _nan_recording(path)
    return path


def test_each_kind_once_until_it_clears(nan_run: Path) -> None:
    out = alerts(str(nan_run), "--json")
    assert out.returncode == 0, out.stderr
    got = [json.loads(line) for line in out.stdout.splitlines()]
    kinds = [a["kind"] for a in got]
    # Four NaN steps, each with a non-finite loss alert: one notice, the repeats folded.
    assert kinds.count("nonfinite_loss") == 1, kinds
    assert all(a["notice"] == "started" for a in got)
    first = next(a for a in got if a["kind"] == "nonfinite_loss")
    assert first["step"] == 8 and "nan" in first["message"]
    lines = alerts(str(nan_run)).stdout.splitlines()
    assert len(lines) == len(got) and lines[0].startswith(("error: ", "warning: "))


def test_exec_runs_once_per_alert_with_it_on_stdin(nan_run: Path, tmp_path: Path) -> None:
    sink = tmp_path / "got.jsonl"
    out = alerts(str(nan_run), "--exec", f"cat >> {sink}")
    assert out.returncode == 0, out.stderr
    delivered = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [d["kind"] for d in delivered] == [line.split()[1] for line in out.stdout.splitlines()]


def test_a_failing_command_is_said_once_and_the_stream_goes_on(nan_run: Path) -> None:
    out = alerts(str(nan_run), "--exec", "echo broken >&2; exit 3")
    assert out.returncode == 0
    assert len(out.stdout.splitlines()) >= 2  # every alert still printed
    said = [line for line in out.stderr.splitlines() if "--exec" in line]
    assert len(said) == 2 and "exit 3: broken" in said[0]  # retrying, then gave up: once each


class _Hooks(BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []
    status = 200

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, type[_Hooks]]]:
    handler = type("Hooks", (_Hooks,), {"received": [], "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", handler
    server.shutdown()
    server.server_close()


def test_a_webhook_receives_each_alert_once(nan_run: Path, webhook: Any) -> None:
    url, hooks = webhook
    out = alerts(str(nan_run), "--webhook", url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [h["text"] for h in hooks.received] == lines  # Slack's field
    assert [h["content"] for h in hooks.received] == lines  # Discord's
    assert [h["alert"]["kind"] for h in hooks.received] == [line.split()[1] for line in lines]


def test_a_webhook_that_never_answers_does_not_hold_the_stream(nan_run: Path) -> None:
    # A server that takes connections and never answers: each post waits for its timeout.
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(64)
    port = mute.getsockname()[1]
    proc = subprocess.Popen(
        [*TDBG, "alerts", str(nan_run), "--webhook", f"http://127.0.0.1:{port}/"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    quick = alerts(str(nan_run))  # the same alerts without a webhook
    # Every alert is printed while the first post still waits for its answer.
    wait_until(lambda: len(lines) == len(quick.stdout.splitlines()), 60, "every alert printed")
    assert proc.poll() is None  # still waiting on the webhook (a bounded drain), not the stream
    proc.kill()
    proc.wait(timeout=60)
    mute.close()


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    for args in (
        ("--webhook", "file:///etc/passwd", str(tmp_path)),
        (str(tmp_path / "nothing.tdbg"),),
    ):
        out = alerts(*args)
        assert out.returncode == 2, (args, out.stdout)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_the_fold_clears_a_stall_on_resumed_and_a_nan_on_a_finite_loss() -> None:
    fold = AlertFold(rearm=50)
    stall = {"type": "alert", "kind": "stalled", "step": 5, "message": "no step", "rank": 1}
    assert len(fold.feed(stall)) == 1 and not fold.feed(dict(stall, step=6))
    resumed = fold.feed({"type": "alert", "kind": "resumed", "step": 7, "rank": 1})
    assert [n.cleared for n in resumed] == [True] and "cleared: rank 1 stalled" in resumed[0].line
    assert len(fold.feed(dict(stall, step=9))) == 1  # a new stall is news again
    nan = {"type": "alert", "kind": "nonfinite_loss", "step": 10, "message": "loss is nan"}
    assert len(fold.feed(nan)) == 1 and not fold.feed(dict(nan, step=11))
    assert fold.feed({"type": "step", "step": 12, "loss": 0.5})[0].cleared
    spike = {"type": "alert", "kind": "loss_spike", "step": 20, "message": "spike"}
    assert fold.feed(spike) and not fold.feed(dict(spike, step=60))
    assert fold.feed(dict(spike, step=111))  # quiet for 50 steps since its last repeat
    job = {"type": "job_alert", "kind": "straggler", "ranks": [2], "step": 30, "message": "slow"}
    assert fold.feed(job) and not fold.feed(job)
    assert fold.feed(dict(job, cleared=True))[0].cleared


@pytest.mark.slow
def test_a_live_run_s_alerts_as_they_start_then_the_end(runtime_dir: Path, tmp_path: Path) -> None:
    from demo_job import demo_job

    sink = tmp_path / "got.jsonl"
    args = ("--steps", "120", "--nan-at", "60", "--eval-every", "0")
    with demo_job("nan", *args, runtime=runtime_dir) as (proc, entry):
        out = subprocess.run(
            [*TDBG, "alerts", "--exec", f"cat >> {sink}", str(entry.socket)],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "TDBG_RUNTIME_DIR": str(runtime_dir)},
        )
        assert proc.wait(120) == 0
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    kinds = [line.split()[1] for line in lines]
    assert "nonfinite_loss" in kinds and kinds.count("nonfinite_loss") == 1, lines
    assert [json.loads(x)["kind"] for x in sink.read_text().splitlines()] == kinds


class _Redirects(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_POST(self) -> None:
        type(self).seen.append(f"POST {self.path}")
        self.send_response(302)
        self.send_header("Location", "/elsewhere")
        self.end_headers()

    def do_GET(self) -> None:
        type(self).seen.append(f"GET {self.path}")
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_webhook_that_redirects_is_refused_not_followed(nan_run: Path) -> None:
    # urllib would re-send the POST as a GET without its body: the alert lost, counted as sent.
    class Handler(_Redirects):
        seen: list[str] = []  # this test's own

    handler = Handler
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = alerts(str(nan_run), "--webhook", f"http://127.0.0.1:{server.server_port}/hook")
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0
    assert handler.seen and all(s == "POST /hook" for s in handler.seen)  # no GET /elsewhere
    assert "HTTP 302: redirected to" in out.stderr and "/hook" not in out.stderr  # redacted


def test_a_command_that_leaves_a_child_behind_is_delivered_once(
    nan_run: Path, tmp_path: Path
) -> None:
    # The command is done when it exits; a child it leaves in the background (`notify-send &`)
    # must not make the try time out, be killed and be run again.
    sink = tmp_path / "got.jsonl"
    out = alerts(
        str(nan_run), "--exec", f"cat >> {sink}; (sleep 8) & exit 0", "--exec-timeout", "5"
    )
    assert out.returncode == 0, out.stderr
    kinds = [json.loads(line)["kind"] for line in sink.read_text().splitlines()]
    assert kinds == [line.split()[1] for line in out.stdout.splitlines()]  # each once
    assert "killed" not in out.stderr


def test_what_a_sink_could_not_deliver_by_the_end_is_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tdbg.cli.deliver import Sink, close_all

    release = threading.Event()

    def hang(payload: dict[str, Any]) -> None:
        release.wait(30)

    stuck = Sink("--webhook test", hang)
    for n in range(3):
        stuck.put({"line": f"alert {n}", "alert": {}})
    close_all([stuck], drain=0.3)
    release.set()
    assert "--webhook test: 3 alerts not delivered when the stream ended" in capsys.readouterr().err


def test_a_gradient_alert_clears_on_finite_gradients_not_on_a_finite_loss() -> None:
    fold = AlertFold()
    grad = {"type": "alert", "kind": "nonfinite_grad", "step": 3, "message": "inf gradient"}
    assert len(fold.feed(grad)) == 1
    # fp16 without a scaler: the loss is finite, the gradients are not (or not measured).
    assert not fold.feed({"type": "step", "step": 4, "loss": 0.5, "grad_norm": "inf"})
    assert not fold.feed({"type": "step", "step": 5, "loss": 0.5, "grad_norm": None})
    assert not fold.feed(dict(grad, step=6))  # still the same trouble: folded
    cleared = fold.feed({"type": "step", "step": 7, "loss": 0.5, "grad_norm": 1.2})
    assert [n.cleared for n in cleared] == [True] and "gradients are finite" in cleared[0].line
