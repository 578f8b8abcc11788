"""`tdbg status` and the health verdict behind it (and behind the TUI's header)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from conftest import Loop, OpenReader

import tdbg
from tdbg.cli.main import run
from tdbg.model.health import assess
from tdbg.model.run_state import RunState
from tdbg.protocol.steps import StepRecord, pack_steps


def _state(times: list[float], losses: list[float], data: float = 0.0) -> RunState:
    state = RunState({"name": "unit"})
    state.mark("live")
    records = [
        StepRecord(step=i, time=t, loss=value, step_time=0.1, data_time=data)
        for i, (t, value) in enumerate(zip(times, losses, strict=True))
    ]
    state.apply(pack_steps(records, 0))
    return state


def test_a_run_is_live_then_stalled_after_ten_step_times_or_five_seconds() -> None:
    state = _state([100.0 + 0.1 * i for i in range(30)], [1.0] * 30)
    last = 100.0 + 0.1 * 29
    assert assess(state, now=last + 0.5).word == "live"
    assert assess(state, now=last + 4.5).word == "live"  # never before 5 s
    stalled = assess(state, now=last + 63.2)
    assert (stalled.word, stalled.level, stalled.steps_per_sec) == ("stalled", "bad", 0.0)
    assert stalled.detail == "no step for 1m03s" and not stalled.healthy


def test_non_finite_names_the_step_it_began_and_input_bound_warns() -> None:
    losses = [1.0] * 10 + [float("nan"), float("inf"), float("nan")]
    state = _state([float(i) for i in range(13)], losses)
    health = assess(state, now=12.5)
    assert health.word == "non-finite" and health.detail == "loss non-finite since step 10"
    slow = _state([0.1 * i for i in range(20)], [1.0] * 20, data=0.08)
    assert assess(slow, now=2.0).word == "input-bound"


def test_status_prints_one_line_per_run_and_exits_by_health(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str], probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="healthy")
    reader = probe_reader(probe)
    loop.run(5, probe)
    reader.wait(lambda r: len(r.records()) >= 5)
    assert run(["status"]) == 0
    line = capsys.readouterr().out
    # live, or input-bound: five tiny steps on a busy machine can spend most of their time
    # waiting in the loader (seen in CI beside two CPU burners); either is a healthy exit 0.
    assert line.startswith("healthy") and "step       4" in line, line
    assert re.search(r" (live|input-bound) ", line), line
    # The rate as the TUI header spells it (format.fmt_rate), the alert count in words.
    assert re.search(r" (\d+\.\d|\d+|\d+(\.\d+)?[kM]) steps/s ", line), line
    assert "0 alerts" in line
    assert run(["status", "--json", str(probe.socket_path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["name"], got["step"]) == ("healthy", 4) and got["health"] in ("live", "input-bound")
    probe.step(float("nan"))
    reader.wait(lambda r: any(a["kind"] == "nonfinite_loss" for a in r.of("alert")))
    assert run(["status"]) == 1
    assert "non-finite" in capsys.readouterr().out
    reader.close()


def test_status_of_a_recording_and_without_any_run(
    runtime_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["status"]) == 2
    assert "no tdbg runs" in capsys.readouterr().err
    loop = Loop()
    path = tmp_path / "r.tdbg"
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path)
    loop.run(3, probe)
    probe.close()
    assert run(["status", str(path)]) == 0
    assert "ended" in capsys.readouterr().out


def test_the_probe_s_own_stall_alert_says_stalled_until_resumed() -> None:
    """A TUI that attaches to a run stalled for an hour learns it from the stall alert in the
    history, not after ten more seconds of its own clock."""
    state = _state([0.1 * i for i in range(20)], [1.0] * 20)
    state.apply(
        {
            "type": "alert",
            "kind": "stalled",
            "severity": "error",
            "step": 19,
            "time": 5.0,
            "message": "no step for 3600 s after step 19 — stuck at loader.py:1",
            "layers": [],
        }
    )
    health = assess(state, now=2.0, by_arrival=True)
    assert health.word == "stalled" and health.detail.startswith("no step for 3600 s")
    state.apply(
        {
            "type": "alert",
            "kind": "resumed",
            "severity": "info",
            "step": 20,
            "time": 6.0,
            "message": "the loop resumed after 3600 s",
            "layers": [],
        }
    )
    assert assess(state, now=2.0, by_arrival=True).word == "live"


def test_ls_says_how_long_ago_each_run_started(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="listed")
    assert run(["ls"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("listed") and re.search(r"started \d\d:\d\d:\d\d \(\d+s ago\)", line)
    probe.close()


def test_input_bound_is_a_warning_that_fails_only_with_strict(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str], probe_reader: OpenReader
) -> None:
    # A cron job runs `tdbg status`: a run waiting on its data loader is slow, not in trouble.
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="starved")
    reader = probe_reader(probe)
    for _ in range(40):
        time.sleep(0.02)  # the loader: most of each step
        loop.step(probe)
    reader.wait(lambda r: len(r.records()) >= 40)
    assert run(["status", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["health"], got["level"]) == ("input-bound", "warn")
    assert run(["status", "--strict"]) == 1
    assert "input-bound" in capsys.readouterr().out
    reader.close()
    probe.close()


@pytest.mark.slow
def test_a_killed_run_s_recording_is_trouble(
    runtime_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_recording import record_until_killed

    path = tmp_path / "killed.tdbg"
    record_until_killed(path, runtime_dir, 20)
    assert run(["status", "--json", str(path)]) == 1
    got = json.loads(capsys.readouterr().out)
    assert (got["health"], got["level"]) == ("ended", "bad")
    assert got["detail"].startswith("killed")
