"""Command intake on the probe's server thread: refusals, job numbers, the audit log, job history.

The server thread never touches torch state: an accepted command becomes an intent in the
:class:`~tdbg.probe.dives.base.DiveRunner`'s queue, applied by the training thread at the next step
boundary. Refusals are decided here, before anything is queued: unknown commands and bad
arguments (by the protocol's schemas), read-only mode, a command this run cannot serve
(a memory snapshot without CUDA), a second job of a kind already in flight, a full queue.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from tdbg.probe.dives.base import DiveRunner, as_event
from tdbg.probe.log import warn
from tdbg.protocol.framing import ErrorCode
from tdbg.protocol.messages.commands import MUTATING
from tdbg.protocol.messages.jobs import FINAL_STATES, Ack, Job

MAX_INTENTS = 16  # guarantees: commands
KEPT_JOBS = 32  # finished jobs replayed to late clients
ANOMALY_WARNING = (
    "anomaly mode is global and slow: every op records a traceback while it is on "
    "(it turns itself off after {steps} steps)"
)


class Refused(Exception):
    """A command the probe will not run; ``code`` is an ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


AUDIT_MAX_BYTES = 1 << 20  # the audit log rotates past this size (one older file is kept)
AUDIT_REFUSALS_PER_MINUTE = 20  # refusals logged per peer per minute; the rest are counted


class CommandDesk:
    """Takes commands from clients (server thread) and keeps every job's latest state."""

    def __init__(
        self,
        runner: DiveRunner,
        unavailable: dict[str, str],
        audit_path: Path | None,
        readonly: bool | None = None,
    ) -> None:
        self.runner = runner
        self.unavailable = unavailable  # command -> why this run cannot serve it
        self.audit_path = audit_path
        self.readonly = (
            os.environ.get("TDBG_READONLY", "") not in ("", "0") if readonly is None else readonly
        )
        self._next_job = 1
        self._lock = threading.Lock()  # job numbers and busy kinds: server and probe threads
        self._in_flight: dict[int, str] = {}  # job -> command, until a final state
        self.jobs: OrderedDict[int, dict[str, Any]] = OrderedDict()  # latest event per job
        self.latest_activations: dict[str, Any] | None = None
        self.activations_every: int | None = None
        self.auto_nan_hunt_done = False
        self._refusals: dict[int, deque[float]] = {}  # peer pid -> refusals logged this minute
        self._suppressed: dict[int, int] = {}  # peer pid -> refusals not logged since

    @staticmethod
    def _rotate_if_full(path: Path) -> None:
        """Past AUDIT_MAX_BYTES the log becomes ``audit.jsonl.1`` (replacing the older one):
        at most twice that on disk, whatever the clients do."""
        try:
            if os.lstat(path).st_size < AUDIT_MAX_BYTES:
                return
            os.replace(path, path.with_name(path.name + ".1"))
        except FileNotFoundError:
            return

    # --- server thread ----------------------------------------------------------------------
    def submit(
        self, command: str, args: dict[str, Any], peer: tuple[int, int] | None, trigger: str
    ) -> Ack:
        """Accept ``command`` (already schema-checked) and return its ack (id 0: the server
        sets it), or raise Refused. Every mutating command is audit-logged with its outcome
        (guarantees: commands)."""
        try:
            ack = self._accept(command, args, trigger)
        except Refused as exc:
            self._audit(peer, command, args, f"refused {exc.code}: {exc}", trigger)
            raise
        self._audit(peer, command, args, f"accepted as job {ack.job}", trigger)
        return ack

    def _accept(self, command: str, args: dict[str, Any], trigger: str) -> Ack:
        if self.readonly and command in MUTATING:
            raise Refused(ErrorCode.READ_ONLY, "this probe is read-only (TDBG_READONLY=1)")
        if command in self.unavailable:
            raise Refused(ErrorCode.UNAVAILABLE, self.unavailable[command])
        if command == "anomaly" and args.get("check_nan") and not self.runner.ctx.anomaly_check_nan:
            raise Refused(
                ErrorCode.UNAVAILABLE,
                "anomaly check_nan would raise inside the training loop on the first NaN; "
                "the script must allow it with tdbg.watch(..., anomaly_check_nan=True)",
            )
        with self._lock:
            if command == "cancel":
                job = int(args["job"])
                if job not in self._in_flight:
                    raise Refused(ErrorCode.BAD_MESSAGE, f"no job {job} in flight")
                self.runner.cancel(job)
                return Ack(0, command, job, f"cancelling job {job}")
            if command != "activations" and command in self._in_flight.values():
                busy = next(j for j, c in self._in_flight.items() if c == command)
                raise Refused(ErrorCode.BUSY, f"a {command} is already in flight (job {busy})")
            if len(self.runner.intents) >= MAX_INTENTS:
                raise Refused(ErrorCode.BUSY, f"{MAX_INTENTS} commands are already queued")
            job = self._next_job
            self._next_job += 1
            self._in_flight[job] = command
        message = ""
        if command == "anomaly":
            message = ANOMALY_WARNING.format(steps=args["steps"])
        elif command == "activations":
            self.activations_every = int(args["every"]) if args["enabled"] else None
        armed = Job(
            job,
            command,
            "armed",
            None,
            time.time(),
            total=args.get("steps"),
            message=message,
            args=args,
            trigger=trigger,
        )
        self.runner.ctx.events.append(as_event(armed))
        self.runner.enqueue(command, job, args, trigger)
        return Ack(0, command, job, message)

    def auto_nan_hunt(self) -> None:
        """After the run's first non-finite alert (probe thread): hunt, once, if nobody is."""
        if self.auto_nan_hunt_done:
            return
        self.auto_nan_hunt_done = True
        with contextlib.suppress(Refused):
            self.submit("nan_hunt", {"steps": 1}, None, "auto")

    def note(self, event: dict[str, Any]) -> None:
        """Probe thread: an event leaves for the clients; keep what late clients must see."""
        if event.get("type") == "activations":
            self.latest_activations = event
            return
        if event.get("type") != "job":
            return
        job = int(event["job"])
        self.jobs[job] = event
        self.jobs.move_to_end(job)
        while len(self.jobs) > KEPT_JOBS:
            self.jobs.popitem(last=False)
        if event.get("state") in FINAL_STATES:
            with self._lock:
                command = self._in_flight.pop(job, None)
            if command == "activations" and not any(
                c == "activations" for c in self._in_flight.values()
            ):
                self.activations_every = None

    def replay(self) -> list[dict[str, Any]]:
        """Finished jobs and the latest activation statistics, for a late client."""
        out = [dict(e, history=True) for e in self.jobs.values() if e.get("state") in FINAL_STATES]
        if self.latest_activations is not None:
            out.append(dict(self.latest_activations, history=True))
        return out

    def in_flight(self) -> list[int]:
        with self._lock:
            return sorted(self._in_flight)

    def _audit(
        self,
        peer: tuple[int, int] | None,
        command: str,
        args: dict[str, Any],
        result: str,
        trigger: str,
    ) -> None:
        if self.audit_path is None or command not in MUTATING | {"cancel"}:
            return
        suppressed = 0
        if result.startswith("refused"):
            # A flood of refusals (a client reconnecting to retry) is folded: at most
            # AUDIT_REFUSALS_PER_MINUTE entries a peer, then one line with the count.
            key = peer[0] if peer else -1
            times = self._refusals.setdefault(key, deque())
            now = time.monotonic()
            while times and now - times[0] > 60.0:
                times.popleft()
            if len(times) >= AUDIT_REFUSALS_PER_MINUTE:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            times.append(now)
            suppressed = self._suppressed.pop(key, 0)
            if len(self._refusals) > 256:
                self._refusals.pop(next(iter(self._refusals)))
        entry = {
            "time": time.time(),
            "peer_pid": peer[0] if peer else None,
            "peer_uid": peer[1] if peer else None,
            "trigger": trigger,
            "command": command,
            "args": args,
            "result": result,
        }
        if suppressed:
            entry["suppressed_before"] = suppressed  # refusals from this peer not written
        try:
            self._rotate_if_full(self.audit_path)
            fd = os.open(
                self.audit_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600
            )
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as exc:
            warn(f"tdbg: cannot write the audit log {self.audit_path}: {exc.strerror or exc}")
