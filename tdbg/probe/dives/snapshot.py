"""The memory snapshot dive: CUDA allocator history over N steps, a memory_viz file, top sites."""

from __future__ import annotations

import functools
import os
import pickle  # WRITING only: pytorch.org/memory_viz opens pickles; nothing here ever loads one
import sysconfig
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import tdbg
from tdbg.probe import artifacts
from tdbg.probe.dives.base import Dive, DiveContext
from tdbg.probe.log import warn
from tdbg.probe.training import oom
from tdbg.protocol.messages.commands import command_args
from tdbg.protocol.messages.results import AllocationSite, FileInfo, SnapshotResult

MAX_SITES = 50
NO_CUDA = "memory snapshots need CUDA: this run is on cpu"
BEFORE_RECORDING = "(allocated before recording)"
NO_PYTHON = "(no Python frame: autograd engine or C++)"
UNKNOWN = "(no Python frame)"


def _dir(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


_PATHS = sysconfig.get_paths()
_PACKAGES = tuple(_dir(os.path.dirname(module.__file__ or "")) for module in (torch, tdbg))
_STDLIB = tuple({_dir(_PATHS["stdlib"]), _dir(_PATHS["platstdlib"])})
# In conda and plain CPython layouts site-packages lies inside the stdlib directory: a frame
# there is a library the user chose (transformers, ...), and a fine site to name.
_SITE = tuple({_dir(_PATHS["purelib"]), _dir(_PATHS["platlib"])})


@functools.lru_cache(maxsize=4096)
def _internal(filename: str) -> bool:
    """A frame in torch, tdbg or the standard library (``contextlib`` wrappers, ``copy``):
    skipped, so a site names the user's line that led there. Cached: a snapshot repeats the
    same few hundred files across its (up to 100 000) stacks."""
    if not os.path.isabs(filename):
        return False  # "<eval_with_key>.3" (FX), "<string>", "??": generated or unknown code
    real = os.path.realpath(filename)
    if real.startswith(_PACKAGES):
        return True
    is_site = real.startswith(_SITE) or "-packages/" in real
    return real.startswith(_STDLIB) and not is_site


def _frame_text(frame: dict[str, Any]) -> str:
    filename = str(frame.get("filename", "?"))
    where = os.path.basename(filename) or filename
    return f"{where}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def site(frames: list[dict[str, Any]] | None) -> str | None:
    """``file.py:line in func`` of the innermost frame outside torch/tdbg/the stdlib (frames
    come innermost first, as the allocator records them); the innermost frame when all are
    internal; None without frames."""
    if not frames:
        return None
    for frame in frames:
        if not _internal(str(frame.get("filename", ""))):
            return _frame_text(frame)
    return _frame_text(frames[0])


def _live_allocations(trace: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Replay a device trace: the ``alloc`` entries not freed by its end, by address."""
    live: dict[int, dict[str, Any]] = {}
    for entry in trace:
        action = entry.get("action")
        addr = entry.get("addr")
        if not isinstance(addr, int):
            continue
        if action == "alloc":
            live[addr] = entry
        elif action in ("free_requested", "free_completed"):
            live.pop(addr, None)
    return live


def summarize(
    snapshot: dict[str, Any], device: int, max_entries: int | None = None
) -> SnapshotResult:
    """``top`` allocation sites by bytes, ``active_bytes`` and ``reserved_bytes`` of one
    device from a ``torch.cuda.memory._snapshot()`` dict.

    Sites come from the active blocks' ``frames``; when no block carries any, from the
    ``alloc`` entries of the device trace still live at its end. A block without frames is
    "allocated before recording" when the trace (complete: not wrapped at ``max_entries``)
    never saw it allocated, else an allocation with no Python frame (the autograd engine's
    threads have none).
    """
    segments = [
        seg for seg in snapshot.get("segments") or [] if seg.get("device", device) == device
    ]
    reserved = sum(int(seg.get("total_size", 0)) for seg in segments)
    blocks = [
        block
        for seg in segments
        for block in seg.get("blocks") or []
        if block.get("state") == "active_allocated"
    ]
    active = sum(int(block.get("size", 0)) for block in blocks)
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if 0 <= device < len(traces) else []
    complete = max_entries is None or len(trace) < max_entries
    allocated_in_trace = {e.get("addr") for e in trace if e.get("action") == "alloc"}

    sites: dict[str, list[int]] = {}

    def add(where: str, size: int) -> None:
        entry = sites.setdefault(where, [0, 0])
        entry[0] += size
        entry[1] += 1

    if any(block.get("frames") for block in blocks) or not trace:
        for block in blocks:
            where = site(block.get("frames"))
            if where is None:
                if block.get("address") in allocated_in_trace:
                    where = NO_PYTHON
                elif complete and trace:
                    where = BEFORE_RECORDING
                else:
                    where = UNKNOWN
            add(where, int(block.get("size", 0)))
    else:
        for entry in _live_allocations(trace).values():
            add(site(entry.get("frames")) or NO_PYTHON, int(entry.get("size", 0)))
    top = sorted(sites.items(), key=lambda item: (-item[1][0], item[0]))[:MAX_SITES]
    return SnapshotResult(
        top=tuple(AllocationSite(where, size, count) for where, (size, count) in top),
        active_bytes=active,
        reserved_bytes=reserved,
    )


def write_snapshot(snapshot: dict[str, Any], directory: Path, name: str) -> FileInfo:
    """Pickle ``snapshot`` as ``torch.cuda.memory._dump_snapshot`` does (the format
    pytorch.org/memory_viz reads) to an 0600 temp file, then rename it; ``{path, size,
    sha256}``. Pickling holds the GIL (about a second per few hundred MB of snapshot)."""
    tmp: Path | None = None
    try:
        tmp = artifacts.private_temp(directory, name)
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(snapshot, f)
        return artifacts.finalize(tmp, directory / name)
    except BaseException:
        artifacts.discard(tmp)
        raise


def history_enabled() -> bool:
    """Whether the CUDA allocator is recording history already (torch's own check; absent from
    CPU builds and old releases, where nothing can be recording)."""
    check = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(check()) if check is not None else False


class SnapshotDive(Dive):
    """``torch.cuda.memory._record_memory_history`` for ``steps`` steps, then a snapshot.

    History is switched on and the snapshot taken in the training thread at step boundaries
    (the snapshot is then consistent with a step's end); the file and the summary are made
    on the worker thread. Recording costs ~2 µs of Python stack capture per CUDA allocation
    while on; ``_snapshot()`` itself converts up to ``max_entries`` entries to Python once,
    on the training thread (tens to hundreds of ms).
    """

    kind = "snapshot"

    def __init__(self, ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> None:
        args = command_args("snapshot", args)
        super().__init__(ctx, job, args, trigger)
        self._recording = False
        self._device = 0
        self._directory: Path | None = None
        self._first = 0
        self._borrowed = False  # history was already on (the script's): never touched

    # --- training thread --------------------------------------------------------------------
    def start(self, step: int) -> None:
        device = self.ctx.cuda_device
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            self.stepping = False
            self.fail(step, NO_CUDA)
            return
        try:
            directory = self.ctx.artifacts()
        except Exception as exc:
            directory = None
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = "this probe has no artifacts directory"
        if directory is None:
            self.stepping = False
            self.fail(step, f"no place for the snapshot file: {why}")
            return
        self._directory = directory
        self._device = device.index if device.index is not None else torch.cuda.current_device()
        self._first = step + 1
        if history_enabled() and not oom.stacks_recording():
            # The script records allocator history itself (its own OOM post-mortem, say):
            # switching it on again would clear its ring buffer and switching it off at the end
            # would stop its recording. Leave it exactly as it is and take the snapshot from it.
            # (The probe's own oom_stacks record keeps no events: the dive records them, then
            # gives the stacks record back in release().)
            self._borrowed = True
            return
        # clear_history: the file then holds this dive's steps only, not an earlier
        # snapshot's entries left in the allocator's ring buffer.
        torch.cuda.memory._record_memory_history(
            enabled="all",
            context="all",
            stacks="python",
            max_entries=int(self.args["max_entries"]),
            clear_history=True,
        )
        self._recording = True

    def finish_steps(self, step: int) -> None:
        self.stepping = False
        try:
            snap = torch.cuda.memory._snapshot()
        finally:
            self.release()
        first, directory = self._first, self._directory
        if directory is None:  # start() always sets it before any step runs
            self.fail(step, "no place for the snapshot file")
            return
        self.analyse(step, lambda: self._analyse(snap, first, step, directory))

    def release(self) -> None:
        if not self._recording:
            return
        self._recording = False
        if oom.stacks_recording():
            oom.record_stacks()  # back to the live allocations' stacks the probe keeps
            return
        try:
            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception as exc:  # never raises: it runs on failure paths and at close
            warn(f"tdbg: turning CUDA memory history off failed: {type(exc).__name__}: {exc}")

    # --- worker thread ----------------------------------------------------------------------
    def _analyse(
        self, snap: dict[str, Any], first: int, last: int, directory: Path
    ) -> SnapshotResult:
        summary = summarize(snap, self._device, int(self.args["max_entries"]))
        name = artifacts.artifact_name(self.ctx.run_info, self.kind, first, last, ".pickle")
        info = write_snapshot(snap, directory, name)
        owner = "script" if self._borrowed else "tdbg"
        return replace(summary, file=info, steps=(first, last), history_owner=owner)
