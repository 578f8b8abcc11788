"""Delivering alerts beside the run, never in it: a command run with the alert on its stdin, or a
webhook posted; each on a thread of its own behind a bounded queue, retried with backoff, its
failures said once, so a slow, failing or unreachable sink never delays the stream."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from email.message import Message as HTTPMessage
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tdbg.cli.webhook_template import WebhookTemplate

QUEUE_SIZE = 256  # notices waiting for a sink; past it the newest are dropped (and said once)
TRIES = 4  # one delivery, then three retries
BACKOFF_S = (1.0, 2.0, 4.0)  # waits between tries
EXEC_TIMEOUT_S = 30.0  # a command that runs longer is killed (and said once)
HTTP_TIMEOUT_S = 10.0
DRAIN_S = 15.0  # at the end of the stream, how long all the sinks together may take to finish


class DeliveryError(Exception):
    """One try failed; the message says why in a few words."""


class Sink:
    """A delivery target with its own thread: ``put`` never blocks; ``close`` waits (bounded)
    for what is queued and says how many alerts it could not deliver in time."""

    def __init__(
        self,
        name: str,
        send: Callable[[dict[str, Any]], None],
        abort: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._send = send
        self._abort = abort  # stops a delivery in flight (a command's process group)
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(QUEUE_SIZE)
        self._closing = threading.Event()
        self._busy = False
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        # A sink that just gave up on an alert gets one try per alert until one goes through:
        # a dead webhook must not hold every later alert for a whole backoff.
        self.failing = False
        self._said: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"tdbg-sink-{name}", daemon=True)
        self._thread.start()

    def put(self, payload: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1
            self._say("dropped", f"{self.name}: too slow, dropping alerts it cannot keep up with")

    def close(self, deadline: float) -> None:
        """Deliver what is queued until ``deadline`` (``time.monotonic()``); then stop what is in
        flight and say how many alerts were not delivered."""
        self._closing.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            return
        left = self._queue.qsize() + (1 if self._busy else 0)
        if self._abort is not None:
            self._abort()
        if left:
            print(
                f"tdbg: {self.name}: {left} alert{'s' if left != 1 else ''} not delivered "
                "when the stream ended",
                file=sys.stderr,
                flush=True,
            )

    def _run(self) -> None:
        while True:
            try:
                payload = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            self._busy = True
            try:
                self._deliver(payload)
            finally:
                self._busy = False

    def _deliver(self, payload: dict[str, Any]) -> None:
        tries = 1 if self.failing else TRIES
        for attempt in range(tries):
            try:
                self._send(payload)
                self.sent += 1
                self.failing = False
                return
            except DeliveryError as exc:
                if attempt == tries - 1:
                    self.failed += 1
                    self.failing = True
                    self._say("gave up", f"{self.name}: {exc}; gave up on this alert")
                    return
                self._say("retrying", f"{self.name}: {exc}; retrying with backoff")
                time.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])

    def _say(self, what: str, line: str) -> None:
        """Each kind of trouble once: a dead webhook is one line, not one per alert."""
        if what not in self._said:
            self._said.add(what)
            print(f"tdbg: {line} (said once)", file=sys.stderr, flush=True)


def close_all(sinks: list[Sink], drain: float = DRAIN_S) -> None:
    """Close every sink against one deadline: the end of the stream waits ``drain`` s at most."""
    deadline = time.monotonic() + drain
    for sink in sinks:
        sink.close(deadline)


def exec_sink(command: str, timeout: float = EXEC_TIMEOUT_S) -> Sink:
    """``--exec CMD``: CMD run by the shell with the alert as JSON on its standard input. A try
    is over when the command exits (a child it left in the background may keep running, as it
    would from a shell); one still running after ``timeout`` is killed with its group."""
    running: list[subprocess.Popen[bytes]] = []

    def kill(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def send(payload: dict[str, Any]) -> None:
        with tempfile.TemporaryFile() as err:  # not a pipe: a background child may hold it
            try:
                # A session of its own: on a timeout the whole group goes, its children too.
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", command],  # the user's own command line, as typed
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                )
            except OSError as exc:
                raise DeliveryError(str(exc)) from None
            running.append(proc)
            try:
                with contextlib.suppress(BrokenPipeError, OSError):  # it need not read it all
                    assert proc.stdin is not None
                    proc.stdin.write(json.dumps(payload["alert"]).encode() + b"\n")
                    proc.stdin.close()
                try:
                    code = proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    kill(proc)
                    raise DeliveryError(f"still running after {timeout:g} s: killed") from None
            finally:
                running.remove(proc)
            if code != 0:
                err.seek(0)
                lines = err.read(4096).decode(errors="replace").strip().splitlines()
                tail = lines[-1] if lines else ""
                raise DeliveryError(f"exit {code}" + (f": {tail}" if tail else ""))

    def abort() -> None:
        for proc in list(running):
            kill(proc)

    return Sink(f"--exec {command!r}", send, abort)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A webhook that redirects is a wrong URL: urllib would re-send the POST as a GET with no
    body (the alert lost, reported as sent) to wherever it points."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirected to {newurl}", headers, fp)


def redacted(url: str) -> str:
    """A webhook URL as it may be printed: its path and query are the secret (Slack's are)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/…" if parts.path not in ("", "/") else url


def webhook_sink(url: str, template: WebhookTemplate | None = None) -> Sink:
    """``--webhook URL``: a JSON POST that Slack (``text``) and Discord (``content``) both show,
    with the alert itself under ``alert`` for anything else; or, with ``--webhook-template``,
    the template filled in with the alert's fields (``payload["fields"]``). Redirects are
    refused."""
    opener = urllib.request.build_opener(_NoRedirects)

    def send(payload: dict[str, Any]) -> None:
        if template is not None:
            body = template.render(payload["fields"]).encode()
            kind = template.content_type
        else:
            body = json.dumps(
                {"text": payload["line"], "content": payload["line"], "alert": payload["alert"]}
            ).encode()
            kind = "application/json"
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": kind}, method="POST"
        )
        try:
            with opener.open(request, timeout=HTTP_TIMEOUT_S) as response:
                response.read(1024)
        except urllib.error.HTTPError as exc:
            where = f": {exc.msg}" if 300 <= exc.code < 400 else ""
            raise DeliveryError(f"HTTP {exc.code}{where}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DeliveryError(f"unreachable: {reason}") from None

    return Sink(f"--webhook {redacted(url)}", send)
