"""`tdbg alerts --webhook-template`: a body of the user's own, JSON or text, posted to a real
loopback HTTP server with each alert's fields filled in and escaped; a bad template is one line
and exit 2 before any run is read."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from test_alerts_command import alerts
from test_report import _nan_recording

from tdbg.cli.webhook_template import TemplateError, WebhookTemplate


@pytest.fixture
def nan_run(tmp_path: Path) -> Path:
    path = tmp_path / "nan.tdbg"
    _nan_recording(path)
    return path


class _Raw(BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]] = []  # (Content-Type, body)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.headers["Content-Type"], body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Raw]]]:
    handler = type("Raw", (_Raw,), {"received": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}/hook", handler
    httpd.shutdown()
    httpd.server_close()


TEAMS_LIKE = """{
  "title": "tdbg: ${kind} in ${run}",
  "text": "${level}: ${message} (step ${step}, ${where}) on ${host} at ${time}",
  "step": ${step},
  "alert": ${json}
}"""


def test_a_json_template_is_posted_filled_in_for_each_alert(nan_run: Path, server: Any) -> None:
    url, hooks = server
    out = alerts(str(nan_run), "--json", "--webhook", url, "--webhook-template", TEAMS_LIKE)
    assert out.returncode == 0, out.stderr
    printed = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(hooks.received) == len(printed) >= 2
    for (kind, body), alert in zip(hooks.received, printed, strict=True):
        assert kind == "application/json"
        got = json.loads(body)  # every field escaped as JSON needs: it parses
        assert got["alert"] == alert and got["step"] == alert["step"]
        assert got["title"].startswith(f"tdbg: {alert['kind']} in ")
        assert got["text"].startswith(f"{alert['severity']}: {alert['message']} (step ")
        assert f" on {socket.gethostname()} at 20" in got["text"]


def test_a_text_template_from_a_file_is_posted_as_text(
    nan_run: Path, server: Any, tmp_path: Path
) -> None:
    url, hooks = server
    template = tmp_path / "ntfy.txt"
    template.write_text("${level}: ${kind} at step ${step} costs $$0: ${message}")
    out = alerts(str(nan_run), "--json", "--webhook", url, "--webhook-template", f"@{template}")
    assert out.returncode == 0, out.stderr
    first = json.loads(out.stdout.splitlines()[0])
    kind, body = hooks.received[0]
    assert kind == "text/plain; charset=utf-8"
    assert body.decode() == (
        f"{first['severity']}: {first['kind']} at step {first['step']} costs $0: {first['message']}"
    )


def test_a_bad_template_is_one_line_and_exit_2(tmp_path: Path) -> None:
    junk = str(tmp_path / "none.tdbg")  # never read: the template is checked first
    url = "http://127.0.0.1:9/"
    for args, said in (
        (("--webhook", url, "--webhook-template", "${kind} ${rank}"), "unknown field ${rank}"),
        (("--webhook", url, "--webhook-template", '{"a": ${kind}'), "not JSON"),
        (("--webhook", url, "--webhook-template", "costs $5"), "starts no field"),
        (("--webhook", url, "--webhook-template", f"@{tmp_path}/gone"), "gone"),
        (("--webhook-template", "${kind}"), "needs --webhook"),
    ):
        out = alerts(junk, *args)
        assert out.returncode == 2, (args, out.stdout)
        assert out.stderr.count("\n") == 1 and said in out.stderr, out.stderr


def test_fields_are_escaped_as_the_json_around_them_needs() -> None:
    template = WebhookTemplate.parse('{"m": "<${message}>", "s": ${step}, "w": ${where}}')
    fields = {"message": 'a "quoted"\nline\\', "step": None, "where": "x.py:3"}
    assert json.loads(template.render(fields)) == {
        "m": '<a "quoted"\nline\\>',
        "s": None,
        "w": "x.py:3",
    }
    # A "$" inside a JSON string before a field does not confuse where the strings are.
    template = WebhookTemplate.parse('{"a": "\\" $$", "b": ${kind}}')
    assert json.loads(template.render({"kind": "stalled"})) == {"a": '" $', "b": "stalled"}
    with pytest.raises(TemplateError):
        WebhookTemplate.parse("${json")
