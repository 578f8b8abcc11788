"""Deep dives in the training thread: a command's work applied at step boundaries, analysed off it.

A :class:`Dive` is one accepted command. The :class:`DiveRunner` starts it at the first step
boundary after it was accepted, calls it at every later boundary until it has its steps, then
lets it hand heavy analysis (profiler tables, snapshot files) to the probe's worker thread.
Everything a dive does is wrapped: an exception fails the job with its reason, releases what the
dive holds (profiler, hooks, anomaly mode) and is counted, never raised into the training loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from tdbg.probe.log import warn
from tdbg.protocol.messages.alert import Alert
from tdbg.protocol.messages.jobs import FINAL_STATES, Job
from tdbg.protocol.messages.results import Activations, JobResult, NoResult
from tdbg.protocol.messages.run import RunInfo

MAX_EVENTS = 2048  # job and activation messages waiting for the probe thread


@dataclass
class DiveContext:
    """What dives may use. Shared by all dives of one probe; built once at watch()."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    cuda_device: torch.device | None
    run_info: RunInfo
    artifacts: Callable[[], Path | None]  # the directory for trace and snapshot files
    submit: Callable[[Callable[[], None]], None]  # run on the probe's worker thread
    side_alerts: deque[Alert]  # alerts for the probe thread to send
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    anomaly_check_nan: bool = False  # watch(anomaly_check_nan=True): clients may ask check_nan
    step: int = 0  # the current step count, updated by the runner at each boundary
    # Count an exception raised inside a dive's hook (the hook then does nothing more).
    on_error: Callable[[BaseException], None] | None = None
    # Where the run first went non-finite (tdbg.probe.origin.Origin), set by the probe
    # thread before it starts the automatic NaN hunt: the hunt's headline then names it.
    nan_origin: Any = None


class Dive:
    """One command's work. Subclasses set ``kind`` and override :meth:`start`,
    :meth:`boundary` and :meth:`release`; they call :meth:`finish_steps` when their steps are
    done, and :meth:`done` / :meth:`fail` (from any thread) when the job is over."""

    kind: ClassVar[str] = ""

    def __init__(self, ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> None:
        self.ctx = ctx
        self.job = job
        self.args = args
        self.trigger = trigger  # "manual" (a client asked) or "auto" (the probe did)
        self.total: int | None = args.get("steps")
        self.count = 0  # steps run so far
        self.state = "armed"
        self.finished = False  # the job reached a final state (any thread may set it)
        self.stepping = True  # False once the training thread has nothing more to do
        self.cancel_requested = False
        self.run_ended = False  # cancelled because the run ended: what it took still goes out
        self.started_at = 0.0

    # --- override ---------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Training thread, at the boundary before the first step of the dive."""

    def boundary(self, step: int) -> None:
        """Training thread, at each later boundary: one more of the dive's steps has run."""
        self.count += 1
        self.progress(step)
        if self.total is not None and self.count >= self.total:
            self.finish_steps(step)

    def finish_steps(self, step: int) -> None:
        """Training thread: the dive's steps are over; release and (by default) finish."""
        self.stepping = False
        self.release()
        self.done(step, NoResult())

    def release(self) -> None:
        """Training thread (or close): give back everything the dive holds; idempotent, and
        must not raise."""

    def cancelled(self, step: int, reason: str) -> None:
        """A cancel request or the run ending; by default release and report cancelled."""
        self.stepping = False
        self.release()
        self.emit("cancelled", step, reason)

    # --- reporting (any thread) -------------------------------------------------------------
    def emit(
        self,
        state: str,
        step: int | None,
        message: str = "",
        result: JobResult | None = None,
    ) -> None:
        if self.finished:
            return
        self.state = state
        if state in FINAL_STATES:
            self.finished = True
        self.ctx.events.append(
            as_event(
                Job(
                    self.job,
                    self.kind,
                    state,
                    step,
                    time.time(),
                    done=self.count,
                    total=self.total,
                    message=message,
                    args=self.args,
                    trigger=self.trigger,
                    result=result,
                )
            )
        )

    def progress(self, step: int) -> None:
        self.emit("running", step, f"{self.count}/{self.total}" if self.total else "")

    def done(self, step: int | None, result: JobResult) -> None:
        self.emit("done", step, "", result)

    def fail(self, step: int | None, reason: str) -> None:
        self.emit("failed", step, reason)

    def analyse(self, step: int, work: Callable[[], JobResult]) -> None:
        """Run ``work`` on the probe's worker thread; what it returns is the job's result."""
        self.emit("analysing", step)

        def run() -> None:
            try:
                self.done(step, work())
            except Exception as exc:
                self.fail(step, f"analysis failed: {_reason(exc)}")

        self.ctx.submit(run)


def remove_handles(handles: list[Any]) -> None:
    """Remove hook handles a dive has taken out of its list; never raises (a handle that cannot
    go is gone), since it runs on failure paths and at close."""
    for handle in handles:
        try:
            handle.remove()
        except Exception:
            pass


def as_event(message: Job | Activations) -> dict[str, Any]:
    """A typed message as the events queue holds them (plain maps the probe thread packs)."""
    return message.to_wire()


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class DiveRunner:
    """Applies accepted commands in the training thread. ``busy`` is the one flag the training
    thread reads per step while nothing is armed."""

    def __init__(
        self,
        ctx: DiveContext,
        factories: Mapping[str, Callable[[DiveContext, int, dict[str, Any], str], Dive]],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.ctx = ctx
        self.factories = factories
        self.intents: deque[tuple[str, int, dict[str, Any], str]] = deque()  # bounded by intake
        self.cancels: deque[int] = deque(maxlen=64)
        self.active: list[Dive] = []
        self.busy = False
        self._on_error = on_error

    # --- any thread -------------------------------------------------------------------------
    def enqueue(self, command: str, job: int, args: dict[str, Any], trigger: str) -> None:
        self.intents.append((command, job, args, trigger))
        self.busy = True  # after the append: the training thread cannot miss it (see boundary)

    def cancel(self, job: int) -> None:
        self.cancels.append(job)
        self.busy = True

    # --- training thread --------------------------------------------------------------------
    def at_boundary(self, step: int) -> None:
        """Called from probe.step() after step ``step`` was recorded; never raises."""
        self.ctx.step = step
        for dive in list(self.active):
            if dive.finished and dive.stepping:
                # Finished from another thread (a hook failed it, a cap fired): its hooks and
                # modes are still in place, so give them back here, in the training thread.
                dive.stepping = False
                self._guard(dive, step, dive.release)
            elif dive.stepping:
                self._guard(dive, step, dive.boundary, step)
        cancelled: set[int] = set()
        while self.cancels:
            cancelled.add(self.cancels.popleft())
        for dive in self.active:
            if dive.job in cancelled and not dive.finished:
                cancelled.discard(dive.job)
                self._guard(dive, step, dive.cancelled, step, "cancelled by a client")
        while self.intents:
            command, job, args, trigger = self.intents.popleft()
            if job in cancelled:
                self.ctx.events.append(
                    as_event(
                        Job(
                            job,
                            command,
                            "cancelled",
                            step,
                            time.time(),
                            message="cancelled before it started",
                        )
                    )
                )
                continue
            self._start(command, job, args, trigger, step)
        self.active = [d for d in self.active if d.stepping and not d.finished]
        self.busy = False
        if self.intents or self.cancels or self.active:
            self.busy = True  # re-checked after clearing: an intent queued meanwhile is kept

    def _start(self, command: str, job: int, args: dict[str, Any], trigger: str, step: int) -> None:
        factory = self.factories.get(command)
        if factory is None:
            return
        try:
            dive = factory(self.ctx, job, args, trigger)
        except Exception as exc:
            self._on_error(exc)
            return
        if command == "activations":
            # A second activations command replaces the first (a new interval, or off).
            for other in self.active:
                if other.kind == "activations" and not other.finished:
                    self._guard(other, step, other.cancelled, step, "replaced")
        dive.started_at = time.monotonic()
        self.active.append(dive)
        self._guard(dive, step, dive.start, step)
        if not dive.finished and dive.stepping:
            dive.progress(step)

    def _guard(self, dive: Dive, step: int, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except Exception as exc:
            dive.stepping = False
            try:
                dive.release()
            except Exception as release_exc:  # release must not raise; count it if it does
                self._on_error(release_exc)
            dive.fail(step, _reason(exc))
            warn(f"tdbg: {dive.kind} failed (training continues): {_reason(exc)}")

    def close(self, reason: str = "the run ended") -> None:
        """Release every dive (profiler stopped, hooks removed, anomaly off); from close()."""
        self.intents.clear()
        for dive in self.active:
            if not dive.finished or dive.stepping:
                dive.run_ended = True
                try:
                    dive.cancelled(self.ctx.step, reason)
                except Exception:
                    try:
                        dive.release()
                    except Exception:
                        pass
        self.active = []
        self.busy = False

    def forget(self) -> None:
        """In a forked child: drop everything without touching torch state."""
        self.intents.clear()
        self.active = []
        self.busy = False
