"""The profile dive: torch.profiler over the next N steps, a top-ops table and a Perfetto trace."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from tdbg.probe import artifacts
from tdbg.probe.dives.base import Dive, DiveContext
from tdbg.probe.log import warn
from tdbg.protocol.messages.commands import command_args
from tdbg.protocol.messages.results import FileInfo, JobResult, ProfileResult, ProfileRow

MAX_NAME = 500  # CUDA kernel names can run to thousands of characters of C++ templates
ANOTHER_PROFILER = "another torch profiler is already running in this process"
clock = time.monotonic  # the wall-clock cap's clock (tests replace it)


def profiler_active() -> bool:
    """True when some torch profiler is on: torch's process-wide flag (set by any
    ``torch.profiler.profile``/``torch.autograd.profiler.profile``, in any thread) or this
    thread's profiler state (``emit_nvtx`` and friends). Kineto allows one session at a time."""
    return bool(torch.autograd.profiler._is_profiler_enabled) or bool(
        torch._C._autograd._profiler_enabled()
    )


def _us(value: float) -> float:
    return round(float(value), 3)  # nanosecond resolution; drops float-summation noise


def _row(event: Any) -> ProfileRow:
    """One ``FunctionEventAvg`` as a wire row: times in microseconds, memory in bytes."""
    name = str(event.key)
    if len(name) > MAX_NAME:
        name = name[: MAX_NAME - 1] + "…"
    return ProfileRow(
        name=name,
        calls=int(event.count),
        self_cpu=_us(event.self_cpu_time_total),
        cpu_total=_us(event.cpu_time_total),
        self_device=_us(event.self_device_time_total),
        device_total=_us(event.device_time_total),
        cpu_memory=int(event.self_cpu_memory_usage),
        device_memory=int(event.self_device_memory_usage),
    )


class ProfileDive(Dive):
    """``torch.profiler`` (CPU, plus CUDA on CUDA runs) over the next ``steps`` steps.

    The profiler is started and stopped in the training thread (its state is thread-local: a
    stop from another thread cannot reach it). It stops after ``steps`` steps, at the first
    boundary past ``max_seconds``, or on cancel; whatever was recorded is then analysed on the
    probe's worker thread: ``key_averages()`` (torch parses the kineto events lazily, there)
    and the Chrome/Perfetto trace file.
    """

    kind = "profile"

    def __init__(self, ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> None:
        args = command_args("profile", args)
        super().__init__(ctx, job, args, trigger)
        self._prof: torch.profiler.profile | None = None
        self._running = False  # the profiler is on (started, not yet stopped)
        self._thread: int | None = None  # the thread that started it: only it can stop it
        self._t0 = 0.0
        self._first = 0
        self._last = 0
        self._note = ""  # the done message: why it stopped early, what was not written

    # --- training thread --------------------------------------------------------------------
    def start(self, step: int) -> None:
        if profiler_active():
            self.stepping = False
            self.fail(step, ANOTHER_PROFILER)
            return
        activities = [ProfilerActivity.CPU]
        if self.ctx.cuda_device is not None:
            activities.append(ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            record_shapes=bool(self.args["record_shapes"]),
            profile_memory=bool(self.args["profile_memory"]),
            with_stack=bool(self.args["with_stack"]),
        )
        self._thread = threading.get_ident()
        try:
            prof.start()
        except Exception:
            # Half-started (the flag set, kineto refused): undo so a later profile can run.
            if torch.autograd.profiler._is_profiler_enabled:
                try:
                    prof.stop()
                except Exception:
                    pass
            raise
        self._prof = prof
        self._running = True
        self._t0 = clock()
        self._first = step + 1  # the next step is the first one recorded
        self._last = step

    def boundary(self, step: int) -> None:
        self.count += 1
        self._last = step
        self.progress(step)
        elapsed = clock() - self._t0
        if self.total is not None and self.count >= self.total:
            self._stop_and_analyse(step, "")
        elif elapsed >= float(self.args["max_seconds"]):
            cap = float(self.args["max_seconds"])
            self._stop_and_analyse(step, f"stopped at the {cap:g} s cap after {self.count} steps")

    def cancelled(self, step: int, reason: str) -> None:
        """A cancel still analyses the steps recorded so far; with none, the job is cancelled."""
        if not self.stepping:  # already stopped and analysing: let the analysis finish
            self.release()
            return
        if self.count == 0:
            self.stepping = False
            self.release()
            self.emit("cancelled", step, f"{reason} before any step was profiled")
            return
        self._stop_and_analyse(step, f"{reason} after {self.count} of {self.total} steps")

    def release(self) -> None:
        try:
            self._stop()
        except Exception:  # never raises: it runs on failure paths and at close
            pass

    def _stop(self) -> bool:
        """Stop the profiler if it is on; True when it is off afterwards. On CUDA runs
        ``stop()`` synchronises the device once (torch does, to collect the kernels)."""
        if not self._running or self._prof is None:
            return True
        if threading.get_ident() != self._thread:
            # The profiler's callbacks live in the training thread's thread-local state; a stop
            # from here would only clear torch's flag and leak them (and corrupt the session).
            warn("tdbg: the profiler can only be stopped from the thread that started it")
            return False
        self._running = False
        try:
            self._prof.stop()
        except Exception as exc:
            warn(f"tdbg: stopping the profiler failed: {type(exc).__name__}: {exc}")
            self._prof = None
            return False
        return True

    def _stop_and_analyse(self, step: int, note: str) -> None:
        self.stepping = False
        wall = clock() - self._t0
        prof = self._prof
        if not self._stop() or prof is None:
            self.emit("cancelled", step, f"{note or 'stopped'}; the profiler could not be read")
            return
        self._note = note
        first, last = self._first, self._last
        self.analyse(step, lambda: self._analyse(prof, first, last, wall))

    # --- worker thread ----------------------------------------------------------------------
    def _analyse(
        self, prof: torch.profiler.profile, first: int, last: int, wall: float
    ) -> ProfileResult:
        """``key_averages()`` parses every recorded event in Python (seconds for a large
        model over many steps; it holds the GIL, so the training thread slows meanwhile),
        then the trace file is written and hashed."""
        try:
            rows = [_row(event) for event in prof.key_averages()]
            trace, why = self._write_trace(prof, first, last)
            result = ProfileResult.of_ops(
                rows,
                self.ctx.cuda_device is not None,
                steps=(first, last),
                wall_seconds=round(wall, 6),
                trace=trace,
            )
            if why:
                self._note = f"{self._note}; {why}" if self._note else why
            return result
        finally:
            self._prof = None  # the kineto results can be large; keep nothing once analysed

    def _write_trace(
        self, prof: torch.profiler.profile, first: int, last: int
    ) -> tuple[FileInfo | None, str]:
        """The trace as ``<run>-profile-steps<first>-<last>.json`` in the artifacts directory:
        written to an 0600 temp name, then renamed. Without a directory, or if writing fails,
        the table still comes back; the message says why there is no trace."""
        try:
            directory = self.ctx.artifacts()
        except Exception as exc:
            return None, f"trace not written: {type(exc).__name__}: {exc}"
        if directory is None:
            return None, "trace not written: this probe has no artifacts directory"
        name = artifacts.artifact_name(self.ctx.run_info, self.kind, first, last, ".json")
        tmp: Path | None = None
        try:
            tmp = artifacts.private_temp(directory, name)
            prof.export_chrome_trace(str(tmp))
            return artifacts.finalize(tmp, directory / name), ""
        except Exception as exc:
            artifacts.discard(tmp)
            return None, f"trace not written: {type(exc).__name__}: {exc}"

    # --- reporting --------------------------------------------------------------------------
    def done(self, step: int | None, result: JobResult) -> None:
        self.emit("done", step, self._note, result)
