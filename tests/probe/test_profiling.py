"""The profile dive and artifact files: a real CPU training loop under a real torch.profiler."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop, Reader, wait_until

import tdbg
from tdbg.connect.runtime import RuntimeDirError
from tdbg.probe import artifacts
from tdbg.probe.dives import profiling
from tdbg.probe.dives.base import DiveContext, DiveRunner
from tdbg.probe.dives.profiling import ANOTHER_PROFILER, ProfileDive, profiler_active

RUN = {"name": "unit", "pid": 4242, "rank": 0}


@pytest.fixture(autouse=True)
def _no_profiler_left() -> Iterator[None]:
    """Every test must leave the process without a running profiler (guarantees: commands)."""
    assert not profiler_active()
    yield
    assert not profiler_active(), "a profiler was left running"


@pytest.fixture
def base(private_dir: Path) -> Path:
    return private_dir


def context(
    model: torch.nn.Module,
    base: Path | None,
    submit: Callable[[Callable[[], None]], None] | None = None,
) -> DiveContext:
    """A DiveContext whose worker runs the analysis at once, in the calling thread."""
    return DiveContext(
        model=model,
        optimizer=None,
        cuda_device=None,
        run_info=dict(RUN),
        artifacts=(lambda: artifacts.artifact_dir(base)) if base is not None else (lambda: None),
        submit=submit or (lambda fn: fn()),
        side_alerts=deque(),
    )


def drive(loop: Loop, dive: ProfileDive, start: int, steps: int) -> int:
    """Start ``dive`` at the boundary after step ``start``, then train ``steps`` steps, calling
    its boundary after each while it still wants steps; returns the last step run."""
    dive.start(start)
    step = start
    for _ in range(steps):
        loop.step()
        step += 1
        if dive.stepping and not dive.finished:
            dive.boundary(step)
    return step


def states(ctx: DiveContext) -> list[str]:
    return [event["state"] for event in ctx.events]


def final(ctx: DiveContext) -> dict[str, Any]:
    return ctx.events[-1]


def test_profile_of_an_mlp_gives_sorted_top_ops_and_a_private_trace(base: Path) -> None:
    loop = Loop()
    ctx = context(loop.model, base)
    dive = ProfileDive(ctx, 1, {"steps": 3}, "manual")
    assert dive.args["max_seconds"] == 30.0 and dive.args["with_stack"] is False  # defaults
    drive(loop, dive, start=10, steps=6)

    assert states(ctx) == ["running"] * 3 + ["analysing", "done"]
    assert not profiler_active()
    event = final(ctx)
    result = event["result"]
    assert event["message"] == "" and event["step"] == 13
    assert result["steps"] == [11, 13]
    assert result["device"] is False and result["sort"] == "cpu_total"
    assert result["truncated"] is False and 0 < len(result["rows"]) <= 100
    assert result["wall_seconds"] > 0
    rows = result["rows"]
    names = {row["name"] for row in rows}
    assert "aten::addmm" in names or {"aten::linear", "aten::mm"} & names
    totals = [row["cpu_total"] for row in rows]
    assert totals == sorted(totals, reverse=True)
    assert set(rows[0]) == {
        "name",
        "calls",
        "self_cpu",
        "cpu_total",
        "self_device",
        "device_total",
        "cpu_memory",
        "device_memory",
    }
    addmm = next(row for row in rows if row["name"] == "aten::addmm")
    assert addmm["calls"] == 2 * 3  # two Linear layers, three steps
    assert result["total_self_cpu"] >= sum(row["self_cpu"] for row in rows) - 1e-3
    assert result["total_self_device"] == 0.0

    trace = result["trace"]
    path = Path(trace["path"])
    assert path.parent == base / "artifacts"
    assert path.name == "unit-r0-p4242-profile-steps11-13.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((base / "artifacts").stat().st_mode) == 0o700
    data = path.read_bytes()
    assert trace["size"] == len(data)
    assert trace["sha256"] == hashlib.sha256(data).hexdigest()
    assert json.loads(data)["traceEvents"]
    assert os.listdir(base / "artifacts") == [path.name]  # no temp file left behind


def test_the_wall_clock_cap_stops_early(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(profiling, "clock", lambda: now[0])
    loop = Loop()
    ctx = context(loop.model, base)
    dive = ProfileDive(ctx, 1, {"steps": 200, "max_seconds": 5}, "manual")
    dive.start(0)
    for step in range(1, 10):
        loop.step()
        now[0] += 2.0  # each step takes 2 s of wall clock
        if dive.stepping:
            dive.boundary(step)
    assert not profiler_active()
    event = final(ctx)
    assert event["state"] == "done"
    assert event["message"] == "stopped at the 5 s cap after 3 steps"
    assert event["result"]["steps"] == [1, 3]
    assert event["result"]["wall_seconds"] == 6.0
    assert event["result"]["rows"]


def test_cancel_mid_profile_still_gives_a_table_and_stops_the_profiler(base: Path) -> None:
    loop = Loop()
    ctx = context(loop.model, base)
    runner = DiveRunner(ctx, {"profile": ProfileDive}, lambda exc: None)
    runner.enqueue("profile", 7, {"steps": 10}, "manual")
    for step in range(5):
        loop.step()
        runner.at_boundary(step)  # starts at 0: steps 1.. are profiled
        if step == 2:
            runner.cancel(7)
    assert not profiler_active()
    assert not runner.active and not runner.busy
    event = final(ctx)
    assert event["state"] == "done"
    assert event["message"] == "cancelled by a client after 3 of 10 steps"
    assert event["result"]["steps"] == [1, 3]
    assert "aten::addmm" in {row["name"] for row in event["result"]["rows"]}
    assert Path(event["result"]["trace"]["path"]).name.endswith("-profile-steps1-3.json")


def test_cancel_before_any_step_ends_cancelled(base: Path) -> None:
    loop = Loop()
    ctx = context(loop.model, base)
    dive = ProfileDive(ctx, 1, {}, "manual")
    dive.start(4)
    assert profiler_active()
    dive.cancelled(4, "cancelled by a client")
    assert not profiler_active()
    assert final(ctx)["state"] == "cancelled"
    assert final(ctx)["message"] == "cancelled by a client before any step was profiled"
    assert not (base / "artifacts").exists()


def test_close_mid_profile_stops_the_profiler(base: Path) -> None:
    loop = Loop()
    queued: list[Callable[[], None]] = []
    ctx = context(loop.model, base, submit=queued.append)  # a worker that never runs
    runner = DiveRunner(ctx, {"profile": ProfileDive}, lambda exc: None)
    runner.enqueue("profile", 1, {"steps": 50}, "manual")
    for step in range(3):
        loop.step()
        runner.at_boundary(step)
    assert profiler_active()
    runner.close()  # what probe.close() does
    assert not profiler_active()
    assert final(ctx)["state"] == "analysing"  # the recorded steps are still analysed...
    queued.pop()()
    assert final(ctx)["state"] == "done"  # ...when the worker gets to them
    assert "the run ended after 2 of 50 steps" == final(ctx)["message"]


def test_release_is_idempotent_and_only_the_starting_thread_stops(base: Path) -> None:
    loop = Loop()
    ctx = context(loop.model, base)
    dive = ProfileDive(ctx, 1, {}, "manual")
    dive.start(0)
    # From another thread a stop cannot reach the training thread's profiler state: it is
    # left alone rather than half-stopped (which would leak torch's callbacks).
    other = threading.Thread(target=dive.release)
    other.start()
    other.join()
    assert profiler_active()
    loop.step()
    dive.release()
    assert not profiler_active()
    dive.release()  # again: nothing to do, no error
    assert not profiler_active()


def test_a_running_user_profiler_is_refused_and_left_alone(base: Path) -> None:
    loop = Loop()
    ctx = context(loop.model, base)
    runner = DiveRunner(ctx, {"profile": ProfileDive}, lambda exc: None)
    user = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    user.start()
    try:
        runner.enqueue("profile", 3, {"steps": 2}, "manual")
        loop.step()
        runner.at_boundary(0)
        assert final(ctx)["state"] == "failed"
        assert final(ctx)["message"] == ANOTHER_PROFILER
        assert not runner.active
        assert profiler_active()  # the user's profiler is still on...
        loop.step()
    finally:
        user.stop()
    # ...and recorded both steps, ours untouched by the refusal.
    ops = {event.key: event.count for event in user.key_averages()}
    assert ops["aten::addmm"] == 2 * 2


def test_without_an_artifacts_directory_the_table_still_comes_back() -> None:
    loop = Loop()
    ctx = context(loop.model, None)
    dive = ProfileDive(ctx, 1, {"steps": 1}, "manual")
    drive(loop, dive, start=0, steps=1)
    event = final(ctx)
    assert event["state"] == "done"
    assert event["result"]["trace"] is None and event["result"]["rows"]
    assert event["message"] == "trace not written: this probe has no artifacts directory"


def test_bad_arguments_are_refused_when_the_dive_is_made(base: Path) -> None:
    from tdbg.protocol.framing import ProtocolError

    with pytest.raises(ProtocolError, match="profile.steps"):
        ProfileDive(context(Loop().model, base), 1, {"steps": 0}, "manual")


# --- artifact files -----------------------------------------------------------------------


def test_artifact_dir_is_private_and_refuses_a_symlink(base: Path) -> None:
    made = artifacts.artifact_dir(base)
    assert made == base / "artifacts"
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert artifacts.artifact_dir(base) == made  # again: already there, still checked
    os.rmdir(made)
    elsewhere = Path(tempfile.mkdtemp(prefix="tdbg-elsewhere-"))
    try:
        os.symlink(elsewhere, made)
        with pytest.raises(RuntimeDirError, match="not a real directory"):
            artifacts.artifact_dir(base)
        os.unlink(made)
        os.mkdir(made, 0o700)
        os.chmod(made, 0o755)
        with pytest.raises(RuntimeDirError, match="0700"):
            artifacts.artifact_dir(base)
    finally:
        os.rmdir(elsewhere)


def test_artifact_names_are_built_by_the_probe_and_sanitised() -> None:
    name = artifacts.artifact_name(
        {"name": "../../etc/my run", "pid": 12, "rank": 3}, "profile", 5, 9, ".json"
    )
    assert "/" not in name and not name.startswith(".")
    assert name.endswith("-r3-p12-profile-steps5-9.json")
    assert artifacts.artifact_name({}, "snapshot", 1, 1, ".pickle").startswith("run-r0-p")


def test_finalize_hashes_sets_0600_and_never_replaces_an_older_file(base: Path) -> None:
    directory = artifacts.artifact_dir(base)
    final_path = directory / "x-steps1-2.json"
    infos = []
    for payload in (b'{"a": 1}', b'{"b": 22}'):
        tmp = artifacts.private_temp(directory, final_path.name)
        assert stat.S_IMODE(tmp.stat().st_mode) == 0o600
        tmp.write_bytes(payload)
        os.chmod(tmp, 0o644)  # as a writer with a lax umask might leave it
        infos.append(artifacts.finalize(tmp, final_path))
    assert [Path(info.path).name for info in infos] == ["x-steps1-2.json", "x-steps1-2-2.json"]
    for info, payload in zip(infos, (b'{"a": 1}', b'{"b": 22}'), strict=True):
        path = Path(info.path)
        assert path.read_bytes() == payload
        assert info.size == len(payload)
        assert info.sha256 == hashlib.sha256(payload).hexdigest()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(os.listdir(directory)) == ["x-steps1-2-2.json", "x-steps1-2.json"]


# --- through the real probe ---------------------------------------------------------------


def _job_events(reader: Reader, job: int) -> list[dict[str, Any]]:
    return [m for m in reader.of("job") if m["job"] == job]


def _ack(reader: Reader, mid: int) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((m for m in reader.of("ack") if m["id"] == mid), None)

    wait_until(found, what=f"the ack of command {mid}")
    answer = found()
    assert answer is not None
    return answer


def test_profile_through_the_probe_and_its_socket(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="unit")
    reader = Reader(probe.socket_path)  # type: ignore[arg-type]
    try:
        reader.wait(lambda r: r.of("synced"))
        loop.run(2, probe)  # steps 0, 1
        job = _ack(reader, reader.client.send("profile", steps=3))["job"]
        for _ in range(50):
            if any(e["state"] == "done" for e in _job_events(reader, job)):
                break
            loop.step(probe)
        reader.wait(lambda r: any(e["state"] == "done" for e in _job_events(r, job)))
        assert not profiler_active()
        states = [e["state"] for e in _job_events(reader, job)]
        assert states[0] in ("armed", "running") and states[-2:] == ["analysing", "done"]
        result = _job_events(reader, job)[-1]["result"]
        first, last = result["steps"]
        assert last - first == 2
        assert "aten::addmm" in {row["name"] for row in result["rows"]}
        path = Path(result["trace"]["path"])
        assert path.parent == runtime_dir / "artifacts"
        assert path.name.startswith("unit-r0-p") and path.name.endswith(
            f"-profile-steps{first}-{last}.json"
        )
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert json.loads(path.read_bytes())["traceEvents"]
    finally:
        reader.close()
        probe.close()


def test_closing_the_probe_mid_profile_stops_the_profiler(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="unit")
    reader = Reader(probe.socket_path)  # type: ignore[arg-type]
    try:
        reader.wait(lambda r: r.of("synced"))
        job = _ack(reader, reader.client.send("profile", steps=100))["job"]
        for _ in range(50):
            loop.step(probe)
            if profiler_active() and any(
                e["state"] == "running" and e["done"] >= 2 for e in _job_events(reader, job)
            ):
                break
        assert profiler_active()
    finally:
        reader.close()
        probe.close()
    assert not profiler_active()


def test_the_artifacts_directory_keeps_within_its_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Oldest first; never the file just written, never a write in progress."""
    from tdbg.probe import artifacts

    monkeypatch.setattr(artifacts, "ARTIFACTS_MAX_FILES", 3)
    monkeypatch.setattr(artifacts, "ARTIFACTS_MAX_BYTES", 9_150)
    directory = tmp_path / "artifacts"
    directory.mkdir(mode=0o700)
    for i in range(4):
        path = directory / f"old{i}.json"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
    (directory / ".in-progress.tmp").write_bytes(b"x")
    tmp = artifacts.private_temp(directory, "new.json")
    tmp.write_bytes(b"y" * 9_000)
    result = artifacts.finalize(tmp, directory / "new.json")
    left = sorted(p.name for p in directory.iterdir())
    assert left == [".in-progress.tmp", "new.json", "old3.json"]  # files bound, then bytes
    assert result.size == 9_000
