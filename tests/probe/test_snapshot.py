"""The memory snapshot dive: top sites from a torch-shaped snapshot, the file, the CPU refusal."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import pickle
import stat
import sysconfig
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_info

import tdbg
from tdbg.probe import artifacts
from tdbg.probe.dives.base import DiveContext, DiveRunner
from tdbg.probe.dives.snapshot import (
    BEFORE_RECORDING,
    NO_CUDA,
    NO_PYTHON,
    SnapshotDive,
    site,
    summarize,
    write_snapshot,
)

RUN = run_info(pid=4242)
MB = 1 << 20


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


TORCH = frame(os.path.join(os.path.dirname(torch.__file__), "nn/modules/linear.py"), 125, "forward")
TORCH_CALL = frame(
    os.path.join(os.path.dirname(torch.__file__), "nn/modules/module.py"), 1784, "_call_impl"
)
TDBG = frame(os.path.join(os.path.dirname(tdbg.__file__), "probe/watch.py"), 300, "step")
STDLIB = frame(contextlib.__file__, 81, "inner")
LIBRARY = frame(
    os.path.join(sysconfig.get_paths()["purelib"], "transformers/modeling.py"), 7, "forward"
)
FORWARD = frame("/home/u/train.py", 12, "forward")
MAIN = frame("/home/u/train.py", 30, "main")


def block(address: int, size: int, frames: list[dict[str, Any]], state: str = "active_allocated"):
    return {
        "address": address,
        "size": size,
        "requested_size": size,
        "state": state,
        "frames": frames,
    }


def synthetic_snapshot() -> dict[str, Any]:
    """Shaped as ``torch.cuda.memory._snapshot()`` returns it (see its docstring and
    torch/csrc/cuda/memory_snapshot.cpp): segments of blocks, every block with a ``frames``
    list (innermost frame first; empty without a recorded context), one trace per device."""
    base, second, other = 0x7F0000000000, 0x7F1000000000, 0x7F2000000000
    segment0 = {
        "device": 0,
        "address": base,
        "total_size": 8 * MB,
        "allocated_size": 0,
        "active_size": 0,
        "requested_size": 0,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": [
            block(base, 1 * MB, [TORCH, TORCH_CALL, FORWARD, MAIN]),
            block(base + 1 * MB, MB // 2, [TORCH, FORWARD, MAIN]),
            block(base + 3 * MB // 2, MB // 4, [], state="inactive"),
            block(base + 7 * MB // 4, 2 * MB, []),  # in the trace: the autograd engine's thread
            block(base + 15 * MB // 4, MB // 8, [TORCH, FORWARD], state="active_pending_free"),
            block(base + 31 * MB // 8, MB // 16, [STDLIB, TORCH, TDBG, MAIN]),
            block(base + 63 * MB // 16, MB // 32, [TORCH, LIBRARY, FORWARD]),
            block(base + 127 * MB // 32, MB // 64, [TORCH, TORCH_CALL]),  # no user frame at all
        ],
    }
    segment1 = dict(segment0, address=second, total_size=4 * MB)
    segment1["blocks"] = [block(second, 3 * MB, [])]  # never allocated in the trace
    segment_other_device = dict(segment0, device=1, address=other, total_size=16 * MB)
    segment_other_device["blocks"] = [block(other, 16 * MB, [TORCH, MAIN])]
    trace0 = [
        {"action": "segment_alloc", "addr": base, "size": 8 * MB, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": base, "size": MB, "stream": 0, "frames": [TORCH, FORWARD]},
        {"action": "alloc", "addr": base + 7 * MB // 4, "size": 2 * MB, "stream": 0, "frames": []},
    ]
    return {
        "segments": [segment0, segment1, segment_other_device],
        "device_traces": [trace0, [{"action": "alloc", "addr": other, "size": 16 * MB}]],
        "allocator_settings": {"expandable_segments": False},
    }


def test_site_names_the_first_frame_outside_torch_tdbg_and_the_stdlib() -> None:
    assert site([TORCH, TORCH_CALL, FORWARD, MAIN]) == "train.py:12 in forward"
    assert site([STDLIB, TORCH, TDBG, MAIN]) == "train.py:30 in main"
    assert site([TORCH, LIBRARY, FORWARD]) == "modeling.py:7 in forward"  # a library is a site
    generated = frame("<eval_with_key>.3", 5, "forward")  # FX code: not torch's, so a site
    assert site([generated, MAIN]) == "<eval_with_key>.3:5 in forward"
    assert site([TORCH, TORCH_CALL]) == "linear.py:125 in forward"  # all internal: innermost
    assert site([]) is None and site(None) is None


def test_summary_ranks_allocation_sites_of_the_model_device_by_bytes() -> None:
    summary = summarize(synthetic_snapshot(), device=0, max_entries=1000).to_wire()
    assert summary["top"] == [
        {"site": BEFORE_RECORDING, "bytes": 3 * MB, "count": 1},
        {"site": NO_PYTHON, "bytes": 2 * MB, "count": 1},
        {"site": "train.py:12 in forward", "bytes": MB + MB // 2, "count": 2},
        {"site": "train.py:30 in main", "bytes": MB // 16, "count": 1},
        {"site": "modeling.py:7 in forward", "bytes": MB // 32, "count": 1},
        {"site": "linear.py:125 in forward", "bytes": MB // 64, "count": 1},
    ]
    active = sum(entry["bytes"] for entry in summary["top"])
    assert summary["active_bytes"] == active  # pending-free and inactive blocks are not active
    assert summary["reserved_bytes"] == 8 * MB + 4 * MB  # device 1's segment is not ours
    # A wrapped trace (as many entries as max_entries) cannot prove "before recording".
    wrapped = summarize(synthetic_snapshot(), device=0, max_entries=3).to_wire()
    assert "(no Python frame)" in {entry["site"] for entry in wrapped["top"]}
    assert BEFORE_RECORDING not in {entry["site"] for entry in wrapped["top"]}


def test_without_block_frames_sites_come_from_the_live_trace_allocations() -> None:
    user, other = [TORCH, FORWARD], [TORCH, MAIN]
    snapshot = {
        "segments": [
            {"device": 0, "total_size": 4 * MB, "blocks": [block(1, 100, []), block(9, 30, [])]}
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": 1, "size": 100, "frames": user},
                {"action": "alloc", "addr": 5, "size": 50, "frames": other},
                {"action": "free_requested", "addr": 5, "size": 50, "frames": other},
                {"action": "free_completed", "addr": 5, "size": 50, "frames": other},
                {"action": "alloc", "addr": 9, "size": 30, "frames": user},
            ]
        ],
    }
    summary = summarize(snapshot, device=0).to_wire()
    assert summary["top"] == [{"site": "train.py:12 in forward", "bytes": 130, "count": 2}]
    assert summary["active_bytes"] == 130 and summary["reserved_bytes"] == 4 * MB


def test_the_snapshot_file_is_private_and_round_trips(tmp_path: Path) -> None:
    directory = tmp_path / "artifacts"
    directory.mkdir(mode=0o700)
    snapshot = synthetic_snapshot()
    info = write_snapshot(snapshot, directory, "unit-r0-p1-snapshot-steps1-3.pickle")
    path = Path(info.path)
    assert path == directory / "unit-r0-p1-snapshot-steps1-3.pickle"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = path.read_bytes()
    assert info.size == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    # Loading our own file back in a test is fine; the probe never unpickles anything.
    assert pickle.loads(data) == snapshot  # noqa: S301
    assert os.listdir(directory) == [path.name]


@pytest.fixture
def base(private_dir: Path) -> Path:
    return private_dir


def context(device: torch.device | None, base: Path | None) -> DiveContext:
    return DiveContext(
        model=torch.nn.Linear(2, 2),
        optimizer=None,
        cuda_device=device,
        run_info=RUN,
        artifacts=(lambda: artifacts.artifact_dir(base)) if base is not None else (lambda: None),
        submit=lambda fn: fn(),
        side_alerts=deque(),
    )


class FakeAllocator:
    """Stands in for torch.cuda.memory's history switch and snapshot on a machine without a
    GPU, recording the calls the dive makes and in which order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.snapshot = synthetic_snapshot()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.take)
        self.enabled = False  # what torch._C._cuda_isHistoryEnabled() answers
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.enabled, raising=False)

    def record(self, enabled: str | None = "all", **kwargs: Any) -> None:
        self.calls.append(("record", {"enabled": enabled, **kwargs}))

    def take(self, device: Any = None) -> dict[str, Any]:
        self.calls.append(("snapshot", {}))
        return self.snapshot


def test_the_real_history_switch_accepts_the_dive_arguments() -> None:
    signature = inspect.signature(torch.cuda.memory._record_memory_history)
    signature.bind(
        enabled="all", context="all", stacks="python", max_entries=1000, clear_history=True
    )
    signature.bind(enabled=None)


def test_snapshot_dive_records_n_steps_then_writes_the_file(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeAllocator(monkeypatch)
    ctx = context(torch.device("cuda", 0), base)
    runner = DiveRunner(ctx, {"snapshot": SnapshotDive}, lambda exc: None)
    runner.enqueue("snapshot", 2, {"steps": 2, "max_entries": 1000}, "manual")
    for step in range(5):
        runner.at_boundary(step)
    assert fake.calls == [
        (
            "record",
            {
                "enabled": "all",
                "context": "all",
                "stacks": "python",
                "max_entries": 1000,
                "clear_history": True,
            },
        ),
        ("snapshot", {}),  # taken while history is still on, then switched off
        ("record", {"enabled": None}),
    ]
    assert [e["state"] for e in ctx.events] == ["running"] * 3 + ["analysing", "done"]
    result = ctx.events[-1]["result"]
    assert set(result) == {
        "file",
        "steps",
        "history_owner",
        "top",
        "active_bytes",
        "reserved_bytes",
    }
    assert result["history_owner"] == "tdbg"
    assert result["steps"] == [1, 2]
    path = Path(result["file"]["path"])
    assert path == base / "artifacts" / "unit-r0-p4242-snapshot-steps1-2.pickle"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert pickle.loads(path.read_bytes()) == fake.snapshot  # noqa: S301
    expected = summarize(fake.snapshot, 0, 1000).to_wire()
    assert result["top"] == expected["top"] and result["top"][0]["site"] == BEFORE_RECORDING
    assert result["active_bytes"] == expected["active_bytes"]
    assert not runner.active and not runner.busy


def test_history_the_script_records_itself_is_left_alone(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A script that keeps allocator history for its own post-mortem must not find it cleared
    # or switched off: the snapshot is taken from it as it is.
    fake = FakeAllocator(monkeypatch)
    fake.enabled = True
    ctx = context(torch.device("cuda", 0), base)
    runner = DiveRunner(ctx, {"snapshot": SnapshotDive}, lambda exc: None)
    runner.enqueue("snapshot", 3, {"steps": 1}, "manual")
    for step in range(3):
        runner.at_boundary(step)
    runner.close()
    assert fake.calls == [("snapshot", {})]
    result = ctx.events[-1]["result"]
    assert ctx.events[-1]["state"] == "done" and result["history_owner"] == "script"
    assert Path(result["file"]["path"]).exists()


def test_cancel_switches_history_off_and_writes_nothing(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeAllocator(monkeypatch)
    ctx = context(torch.device("cuda", 0), base)
    runner = DiveRunner(ctx, {"snapshot": SnapshotDive}, lambda exc: None)
    runner.enqueue("snapshot", 2, {"steps": 10}, "manual")
    runner.at_boundary(0)
    runner.at_boundary(1)
    runner.cancel(2)
    runner.at_boundary(2)
    assert [call[0] for call in fake.calls] == ["record", "record"]
    assert fake.calls[-1] == ("record", {"enabled": None})
    assert ctx.events[-1]["state"] == "cancelled"
    assert not (base / "artifacts").exists() or not os.listdir(base / "artifacts")
    runner.close()  # release again at close: nothing more to switch off
    assert len(fake.calls) == 2


def test_on_a_cpu_run_the_dive_fails_cleanly(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("memory history must not be touched on a CPU run")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", never)
    ctx = context(None, base)
    errors: list[BaseException] = []
    runner = DiveRunner(ctx, {"snapshot": SnapshotDive}, errors.append)
    runner.enqueue("snapshot", 4, {}, "manual")
    runner.at_boundary(0)
    runner.at_boundary(1)
    assert [e["state"] for e in ctx.events] == ["failed"]
    assert ctx.events[-1]["message"] == NO_CUDA
    assert not errors and not runner.active and not runner.busy
    runner.close()


def test_without_an_artifacts_directory_history_is_never_switched_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeAllocator(monkeypatch)
    ctx = context(torch.device("cuda", 0), None)
    dive = SnapshotDive(ctx, 1, {}, "manual")
    dive.start(0)
    assert fake.calls == []
    assert ctx.events[-1]["state"] == "failed"
    assert ctx.events[-1]["message"].startswith("no place for the snapshot file")


def test_with_oom_stacks_on_the_dive_records_events_then_gives_the_stacks_back(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """watch(oom_stacks=True) keeps only live allocations' stacks (no events): the dive
    switches to its full history, and at its end back to the probe's stacks, never off."""
    from tdbg.probe.training import oom

    fake = FakeAllocator(monkeypatch)
    assert oom.record_stacks()  # through the fake: what watch(oom_stacks=True) did
    fake.enabled = True
    ctx = context(torch.device("cuda", 0), base)
    runner = DiveRunner(ctx, {"snapshot": SnapshotDive}, lambda exc: None)
    runner.enqueue("snapshot", 4, {"steps": 1, "max_entries": 1000}, "manual")
    for step in range(3):
        runner.at_boundary(step)
    runner.close()
    state = {"enabled": "state", "context": "alloc", "stacks": "python", "max_entries": 100_000}
    assert [call[1] for call in fake.calls] == [
        state,
        {
            "enabled": "all",
            "context": "all",
            "stacks": "python",
            "max_entries": 1000,
            "clear_history": True,
        },
        {},  # the snapshot
        state,
    ]
    assert ctx.events[-1]["result"]["history_owner"] == "tdbg"
    oom.stop_stacks()
    assert not oom.stacks_recording() and fake.calls[-1] == ("record", {"enabled": None})
