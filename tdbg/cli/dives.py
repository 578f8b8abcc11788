"""The deep-dive subcommands (profile, snapshot, nan-hunt, anomaly, activations): send the
command, follow its job to the end, print the result."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn, TextIO

from tdbg.cli.dump import activations_event, finite_tree
from tdbg.cli.errors import CliError
from tdbg.cli.report import (
    format_anomaly,
    format_nan_hunt,
    print_activations,
    print_profile,
    print_snapshot,
    progress_line,
)
from tdbg.cli.target_args import connect_target
from tdbg.connect.client import CommandRefused, CommandTimeout, ProbeClient
from tdbg.format import fmt_every
from tdbg.protocol.framing import ProtocolError
from tdbg.protocol.messages.jobs import FINAL_STATES, Job

# Seconds a cancel waits for the probe's answer: milliseconds as a rule, seconds on a machine
# whose cores are all busy (seen: 2 s was not enough for a rank mid-profile under load).
CANCEL_TIMEOUT = 10.0


class JobFailed(Exception):
    """The job ended failed or cancelled; exit code 1 with its reason."""


class JobWatch:
    """Follows one job's ``job`` messages on a client until it ends, the run ends or time is up.

    Also keeps live ``anomaly`` alerts (their messages hold the forward traceback) and the
    first live ``activations`` message after the command was accepted.
    """

    def __init__(
        self,
        client: ProbeClient,
        command: str,
        timeout: float,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.command = command
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.progress = progress
        self.job: int | None = None
        self.ack: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self.alerts: list[dict[str, Any]] = []
        self.activations: dict[str, Any] | None = None
        self.cancel_on_abort = True  # cancel the job on a timeout or Ctrl-C
        self._synced = False
        self._shown: tuple[Any, ...] | None = None

    def start(self, **args: Any) -> dict[str, Any]:
        """Send the command and wait for its ack (CliError on a refusal or no answer)."""
        try:
            mid = self.client.send(self.command, **args)
        except OSError:  # not BrokenPipeError for run(): that one means stdout went away
            raise CliError(
                f"the run closed the connection before {self.command} was sent"
            ) from None
        try:
            self.ack = self.client.reply(mid, self.command, max(0.1, self._left()))
        except CommandRefused as exc:
            raise CliError(f"{self.command} refused: {exc}") from None
        except CommandTimeout as exc:
            if self.client.peer_closed:
                raise CliError(f"the run ended before it answered {self.command}") from None
            raise CliError(str(exc)) from None
        except KeyboardInterrupt:
            # Learn the job number if the ack is on its way, so it can be cancelled.
            try:
                self.ack = self.client.reply(mid, self.command, 2.0)
            except (CommandRefused, CommandTimeout, OSError, ProtocolError):
                raise KeyboardInterrupt from None
            self.job = int(self.ack.get("job") or 0) or None
            self._interrupted()
            raise
        self.job = int(self.ack.get("job") or 0) or None
        return self.ack

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _take(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Note one message; return it when it is this job's final ``job`` message."""
        mtype = msg.get("type")
        if mtype == "synced":
            self._synced = True
        if msg.get("history"):
            return None
        job = Job.from_wire(msg, self.command) if mtype == "job" else None
        if job is not None and self.job is not None and job.job == self.job:
            self.last = msg  # as sent: its result goes out as the command's JSON
            key = (job.state, job.done)
            if self.progress is not None and key != self._shown:
                self._shown = key
                self.progress(progress_line(msg))
            if job.final:
                return msg
        elif mtype == "alert" and msg.get("kind") == "anomaly":
            self.alerts.append(msg)
        elif mtype == "activations" and self._synced and self.activations is None:
            self.activations = msg
        elif mtype == "bye":
            self._ended(str(msg.get("reason") or "closed"))
        return None

    def _ended(self, reason: str) -> NoReturn:
        what = f"{self.command} job {self.job}"
        state = (self.last or {}).get("state", "armed")
        if state in FINAL_STATES:
            state = f"{state}: {(self.last or {}).get('message') or 'no reason given'}"
        if reason == "slow_consumer":
            raise CliError(f"the probe dropped this client as too slow while {what} was {state}")
        raise CliError(f"the run ended before {what} finished (it was {state})")

    def wait(self, until: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """Read until the job ends (return its final message), or ``until()`` holds (None).

        CliError when the time is up (the job is cancelled first) or the run ends; JobFailed
        when the job failed or was cancelled. Ctrl-C cancels the job and re-raises.
        """
        try:
            while True:
                if until is not None and until():
                    return None
                left = self._left()
                if left <= 0:
                    self._timed_out()
                for msg in self.client.messages(timeout=min(0.5, max(0.01, left))):
                    final = self._take(msg)
                    if final is not None:
                        return self._finish(final)
                    if (until is not None and until()) or self._left() <= 0:
                        break
                if self.client.peer_closed:
                    self._ended("closed")
        except KeyboardInterrupt:
            self._interrupted()
            raise

    def _interrupted(self) -> None:
        if self.cancel_on_abort and self.cancel():
            print(f"tdbg: interrupted: {self.command} job {self.job} cancelled", file=sys.stderr)

    def _finish(self, final: dict[str, Any]) -> dict[str, Any]:
        if final.get("state") == "done":
            return final
        # A run that ends cancels its jobs, then says bye at once: that is "the run ended"
        # (exit 2), not a job that failed or was cancelled on its own (exit 1).
        linger = time.monotonic() + 0.5
        while time.monotonic() < linger and not self.client.peer_closed:
            for msg in self.client.messages(timeout=max(0.01, linger - time.monotonic())):
                if msg.get("type") == "bye":
                    self._ended(str(msg.get("reason") or "closed"))
                if time.monotonic() >= linger:
                    break
        if self.client.peer_closed:
            self._ended("closed")
        reason = final.get("message") or "no reason given"
        raise JobFailed(f"{self.command} job {self.job} {final.get('state')}: {reason}")

    def _timed_out(self) -> NoReturn:
        state = (self.last or {}).get("state", "armed")
        cancelled = "; cancelled" if self.cancel_on_abort and self.cancel() else ""
        if state == "armed":
            raise CliError(
                f"the run did not reach a step boundary within {self.timeout:g} s "
                f"({self.command} job {self.job} was armed{cancelled})"
            )
        raise CliError(
            f"{self.command} job {self.job} did not finish within {self.timeout:g} s "
            f"(it was {state}{cancelled})"
        )

    def cancel(self) -> bool:
        """Ask the probe to cancel the job (best effort, waits up to CANCEL_TIMEOUT for the
        answer; it comes in milliseconds unless the machine is very busy); True when the probe
        accepted."""
        if self.job is None or self.client.peer_closed:
            return False
        if self.last is not None and self.last.get("state") in FINAL_STATES:
            return False
        try:
            self.client.command("cancel", timeout=CANCEL_TIMEOUT, job=self.job)
        except (CommandRefused, CommandTimeout, OSError, ProtocolError):
            return False
        return True


def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines on stderr: with --progress, or by default when stderr is a terminal."""
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    if not show:
        return None
    return lambda line: print(f"tdbg: {line}", file=sys.stderr, flush=True)


def _note(ack: dict[str, Any], prefix: str = "") -> None:
    if ack.get("message"):
        print(f"tdbg: {prefix}note: {ack['message']}", file=sys.stderr, flush=True)


def _write_json(out: TextIO, value: Any) -> None:
    out.write(json.dumps(finite_tree(value), separators=(",", ":")) + "\n")


def follow_job(
    watch: JobWatch,
    stop: Callable[[], bool] | None = None,
    note_prefix: str = "",
    **cmd_args: Any,
) -> dict[str, Any] | None:
    """Send the watch's command, follow its job to the end and return its result (an anomaly's
    with its ``alerts``); None when ``stop()`` came true first (the caller cancels)."""
    _note(watch.start(**cmd_args), note_prefix)
    if stop is not None and stop():
        return None
    final = watch.wait(until=stop)
    if final is None:
        return None
    result = dict(final.get("result") or {})
    if watch.command == "anomaly":
        # Each backward error is also an alert; give late ones a moment to arrive.
        errors = int(result.get("errors") or 0)
        watch.deadline = min(watch.deadline, time.monotonic() + 2.0)
        with contextlib.suppress(CliError):
            watch.wait(until=lambda: len(watch.alerts) >= errors)
        result["alerts"] = watch.alerts
    return result


def _run_job(args: argparse.Namespace) -> dict[str, Any]:
    """Attach, send the subcommand's command, follow its job to the end; return its result."""
    command, timeout, cmd_args = dive_request(args)
    client = connect_target(args.target, None, args)
    watch = JobWatch(client, command, timeout, _progress(args))
    try:
        result = follow_job(watch, **cmd_args)
        assert result is not None
        return result
    finally:
        client.close()


def dive_request(args: argparse.Namespace) -> tuple[str, float, dict[str, Any]]:
    """The protocol command, timeout and arguments a deep-dive subcommand sends (to one run,
    or to each rank of a job). Not for activations, whose modes are its own."""
    name = args.command.replace("-", "_")
    if name == "profile":
        cmd_args = dict(
            steps=args.steps,
            max_seconds=args.max_seconds,
            record_shapes=args.record_shapes,
            profile_memory=args.profile_memory,
            with_stack=args.with_stack,
        )
        return name, args.timeout or args.max_seconds + 60.0, cmd_args
    if name == "snapshot":
        return name, args.timeout or 120.0, dict(steps=args.steps, max_entries=args.max_entries)
    if name == "anomaly":
        return name, args.timeout or 120.0, dict(steps=args.steps, check_nan=args.check_nan)
    return name, args.timeout or 120.0, dict(steps=args.steps)


def cmd_profile(args: argparse.Namespace, out: TextIO) -> int:
    result = _run_job(args)
    if args.json:
        _write_json(out, result)
    else:
        print_profile(result, out, args.sort, args.rows)
    return 0


def cmd_snapshot(args: argparse.Namespace, out: TextIO) -> int:
    result = _run_job(args)
    if args.json:
        _write_json(out, result)
    else:
        print_snapshot(result, out, args.rows)
    return 0


def cmd_nan_hunt(args: argparse.Namespace, out: TextIO) -> int:
    result = _run_job(args)
    if args.json:
        _write_json(out, result)
    else:
        out.write(format_nan_hunt(result))
    return 0


def cmd_anomaly(args: argparse.Namespace, out: TextIO) -> int:
    result = _run_job(args)
    if args.json:
        _write_json(out, result)
    else:
        out.write(format_anomaly(result, result["alerts"]))
    return 0


def follow_activations(
    watch: JobWatch,
    args: argparse.Namespace,
    stop: Callable[[], bool] | None = None,
    note_prefix: str = "",
) -> dict[str, Any] | None:
    """Turn activation statistics off or on; with ``--show``, the next sampled step (an
    ``activations`` event). None when ``stop()`` came true first."""
    # Statistics stay on after this command returns: giving up waiting must not turn them off.
    watch.cancel_on_abort = False
    if args.off:
        ack = watch.start(enabled=False)
        _note(ack, note_prefix)
        return {"enabled": False, "job": ack.get("job")}
    ack = watch.start(every=args.every, enabled=True)
    _note(ack, note_prefix)
    if not args.show:
        return {"enabled": True, "every": args.every, "job": ack.get("job")}
    try:
        watch.wait(until=lambda: watch.activations is not None or (stop is not None and stop()))
    except JobFailed as exc:
        raise CliError(str(exc)) from None
    except CliError:
        if watch.activations is None and watch._left() <= 0:
            raise CliError(f"no sampled step within {watch.timeout:g} s") from None
        raise
    if watch.activations is None:
        return None
    return activations_event(watch.activations)


def print_activations_outcome(outcome: dict[str, Any], out: TextIO) -> None:
    """What ``follow_activations`` returned, as text."""
    if outcome.get("type") == "activations":
        print_activations(outcome, out)
    elif outcome.get("enabled"):
        out.write(
            f"activation statistics {fmt_every(outcome.get('every'))} (job {outcome.get('job')}); "
            "see them with tdbg dump or tdbg-tui, stop with tdbg activations --off\n"
        )
    else:
        out.write("activation statistics off\n")


def cmd_activations(args: argparse.Namespace, out: TextIO) -> int:
    client = connect_target(args.target, None, args)
    watch = JobWatch(client, "activations", args.timeout or 60.0, _progress(args))
    try:
        outcome = follow_activations(watch, args)
        assert outcome is not None
        if args.json:
            _write_json(out, outcome)
        else:
            print_activations_outcome(outcome, out)
        return 0
    finally:
        client.close()
