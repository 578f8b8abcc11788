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
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

QUEUE_SIZE = 256  # notices waiting for a sink; past it the newest are dropped (and said once)
TRIES = 4  # one delivery, then three retries
BACKOFF_S = (1.0, 2.0, 4.0)  # waits between tries
EXEC_TIMEOUT_S = 30.0  # a command that runs longer is killed (and said once)
HTTP_TIMEOUT_S = 10.0
DRAIN_S = 15.0  # at the end of the stream, how long the sinks may take to finish


class DeliveryError(Exception):
    """One try failed; the message says why in a few words."""


class Sink:
    """A delivery target with its own thread: ``put`` never blocks; ``close`` waits (bounded)
    for what is queued."""

    def __init__(self, name: str, send: Callable[[dict[str, Any]], None]) -> None:
        self.name = name
        self._send = send
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(QUEUE_SIZE)
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

    def close(self, timeout: float = DRAIN_S) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            tries = 1 if self.failing else TRIES
            for attempt in range(tries):
                try:
                    self._send(payload)
                    self.sent += 1
                    self.failing = False
                    break
                except DeliveryError as exc:
                    if attempt == tries - 1:
                        self.failed += 1
                        self.failing = True
                        self._say("gave up", f"{self.name}: {exc}; gave up on this alert")
                        break
                    self._say("retrying", f"{self.name}: {exc}; retrying with backoff")
                    time.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])

    def _say(self, what: str, line: str) -> None:
        """Each kind of trouble once: a dead webhook is one line, not one per alert."""
        if what not in self._said:
            self._said.add(what)
            print(f"tdbg: {line} (said once)", file=sys.stderr, flush=True)


def exec_sink(command: str, timeout: float = EXEC_TIMEOUT_S) -> Sink:
    """``--exec CMD``: CMD run by the shell with the alert as JSON on its standard input."""

    def send(payload: dict[str, Any]) -> None:
        try:
            # A session of its own: on a timeout the whole group goes, the shell's children too
            # (one holding the pipes open would keep communicate() waiting for good).
            proc = subprocess.Popen(
                ["/bin/sh", "-c", command],  # the user's own command line, as they typed it
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            raise DeliveryError(str(exc)) from None
        try:
            _, err = proc.communicate(json.dumps(payload["alert"]) + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise DeliveryError(f"still running after {timeout:g} s: killed") from None
        if proc.returncode != 0:
            tail = (err or "").strip().splitlines()[-1:] or [""]
            raise DeliveryError(f"exit {proc.returncode}" + (f": {tail[0]}" if tail[0] else ""))

    return Sink(f"--exec {command!r}", send)


def webhook_sink(url: str) -> Sink:
    """``--webhook URL``: a JSON POST that Slack (``text``) and Discord (``content``) both show,
    with the alert itself under ``alert`` for anything else."""

    def send(payload: dict[str, Any]) -> None:
        body = json.dumps(
            {"text": payload["line"], "content": payload["line"], "alert": payload["alert"]}
        ).encode()
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                response.read(1024)
        except urllib.error.HTTPError as exc:
            raise DeliveryError(f"HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DeliveryError(f"unreachable: {reason}") from None

    return Sink(f"--webhook {url}", send)
