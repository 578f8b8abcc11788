"""`tdbg dump --follow / --last N / --count N` against a real run: which part of the stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Loop, OpenReader, Reader, fresh_runtime_dir
from demo_job import demo_job

import tdbg
from tdbg.cli.main import run

# A small, quick demo that runs until the test ends.
DEMO = ("--delay", "0.01", "--steps", "100000", "--width", "16", "--depth", "3")


def dump(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict]:
    assert run(["dump", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def steps_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "step"]


@pytest.fixture(scope="module")
def demo_socket() -> Iterator[Path]:
    """One single-process MLP demo (no rank in its environment) training until the module is
    done; its socket. The tests below only read it (a demo takes seconds to start)."""
    with fresh_runtime_dir() as runtime, pytest.MonkeyPatch.context() as env:
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            env.delenv(var, raising=False)
        with demo_job("mlp", *DEMO, runtime=runtime) as (_, entry):
            yield entry.socket


def test_count_is_live_steps_and_follow_has_no_history(
    demo_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reader = Reader(demo_socket)
    reader.wait(lambda r: len(r.records()) >= 30, what="30 steps")
    seen = max(rec.step for rec in reader.records())
    reader.close()

    # --count 1 is the step the run takes now, not step 0 of its history.
    events = dump(capsys, "--count", "1", str(demo_socket))
    assert events[0]["type"] == "hello" and "head" in events[0]["layers"]
    (step,) = steps_of(events)
    assert step["step"] > seen and "history" not in step
    assert not [e for e in events if e.get("history")]

    events = dump(capsys, "--follow", "--timeout", "2", str(demo_socket))
    types = [e["type"] for e in events]
    assert types[0] == "hello" and "synced" in types and types[-1] == "end"
    assert not [e for e in events if e.get("history")], "--follow printed history"
    assert all(s["step"] > seen for s in steps_of(events))


def test_last_is_the_end_of_the_history_then_live_with_count(
    demo_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reader = Reader(demo_socket)
    reader.wait(lambda r: len(r.records()) >= 30, what="30 steps")
    seen = max(rec.step for rec in reader.records())
    reader.close()

    # --last alone: a snapshot that ends at `synced`, no --timeout needed.
    events = dump(capsys, "--last", "5", str(demo_socket))
    assert events[-1]["type"] == "synced"
    numbers = [s["step"] for s in steps_of(events)]
    assert len(numbers) == 5 and numbers == list(range(numbers[0], numbers[0] + 5))
    assert numbers[-1] >= seen and all(s.get("history") for s in steps_of(events))

    events = dump(capsys, "--last", "3", "--count", "2", str(demo_socket))
    steps = steps_of(events)
    assert [bool(s.get("history")) for s in steps] == [True] * 3 + [False] * 2
    assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[0]["step"] + 5))


def test_last_cuts_alerts_and_metrics_to_its_steps_and_recordings_obey(
    runtime_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], probe_reader: OpenReader
) -> None:
    loop = Loop()
    path = tmp_path / "r.tdbg"
    probe = tdbg.watch(loop.model, loop.opt, name="rec", record=path)
    reader = probe_reader(probe)
    loop.run(2, probe)
    probe.log(early=1.0)  # before the window
    probe.step(float("nan"))  # step 2: an alert before the window
    loop.run(12, probe)
    probe.step(float("nan"))  # step 15: an alert inside the window
    loop.run(4, probe)
    probe.log(late=2.0)
    loop.run(1, probe)
    reader.wait(lambda r: len(r.records()) >= 21, what="21 steps")
    reader.close()

    events = dump(capsys, "--last", "10", str(probe.socket_path))
    assert [s["step"] for s in steps_of(events)] == list(range(11, 21))
    assert {e["name"] for e in events if e["type"] == "metric"} == {"late"}
    assert {a["step"] for a in events if a["type"] == "alert"} == {15}
    everything = dump(capsys, "--last", "100", str(probe.socket_path))
    assert {a["step"] for a in everything if a["type"] == "alert"} == {2, 15}
    probe.close()

    events = dump(capsys, "--last", "3", str(path))
    assert [s["step"] for s in steps_of(events)] == [18, 19, 20]
    assert events[0]["type"] == "hello" and events[-1]["type"] == "end"
    assert [s["step"] for s in steps_of(dump(capsys, "--count", "2", str(path)))] == [0, 1]
    assert run(["dump", "--follow", str(path)]) == 2
    assert "a recording has no new steps" in capsys.readouterr().err


def test_every_event_of_a_rank_carries_its_rank(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launcher's environment makes the demo rank 1 of a 2-rank job (no process group).
    for var, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(var, value)
    with demo_job("mlp", *DEMO, runtime=runtime_dir) as (_, entry):
        events = dump(capsys, "--count", "3", str(entry.socket))
    assert len(steps_of(events)) == 3
    assert {e.get("rank") for e in events} == {1}, "an event without the rank's number"


def test_a_single_process_run_has_no_rank_on_its_events(
    demo_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = dump(capsys, "--count", "2", str(demo_socket))
    assert steps_of(events) and not [e for e in events if "rank" in e]
