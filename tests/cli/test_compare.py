"""`tdbg compare`: real recordings side by side — which run is ahead, where they part, which
layers differ, how they were started — and runs that share no steps compared by time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Loop

import tdbg
from tdbg.cli.main import run
from tdbg.model.comparison import compare
from tdbg.model.run_state import RunState
from tdbg.protocol.steps import StepRecord, pack_steps


def _record(path: Path, lr: float, steps: int = 150, name: str = "run") -> None:
    loop = Loop()
    for group in loop.optimizer.param_groups:
        group["lr"] = lr
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path, grad_every=1, name=name)
    loop.run(steps, probe)
    probe.close()


def test_the_run_that_learns_is_ahead_and_they_part_early(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    learns, stuck = tmp_path / "learns.tdbg", tmp_path / "stuck.tdbg"
    _record(learns, 0.05)
    _record(stuck, 0.0005)
    assert run(["compare", str(stuck), str(learns)]) == 0
    text = capsys.readouterr().out
    assert "B is ahead by" in text and "(smoothed loss at step 149)" in text
    parted = next(line for line in text.splitlines() if " part at step " in line)
    assert int(parted.split(" part at step ")[1].split()[0]) < 60, parted
    assert "first_lr" in text and "[0.0005]" in text and "[0.05]" in text  # how they differ

    assert run(["compare", "--json", str(stuck), str(learns)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["axis"] == "step" and got["ahead"] == 1 and got["common"] == [0, 149]
    assert got["runs"][1]["loss_final"] < got["runs"][0]["loss_final"]
    assert got["started"]["first_lr"] == [[0.0005], [0.05]]
    assert {name for name, _ in got["layers"]} <= {"0", "2"}


def test_the_same_run_twice_stays_within_its_noise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.tdbg", tmp_path / "b.tdbg"
    _record(a, 0.05)
    _record(b, 0.05)
    assert run(["compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "stay within their noise" in text and "started differently" not in text


def _timed(start: float, first_step: int, steps: int, slope: float) -> RunState:
    state = RunState({"name": "t", "start_time": start})
    records = [
        StepRecord(step=first_step + i, time=start + i, loss=10.0 - slope * i, step_time=1.0)
        for i in range(steps)
    ]
    state.apply(pack_steps(records, 0))
    return state


def test_runs_that_share_no_steps_are_compared_by_time() -> None:
    # A resumed run numbers its steps from 1000: no shared step, but the same hours.
    a, b = _timed(100.0, 0, 50, 0.01), _timed(500.0, 1000, 50, 0.1)
    result = compare([a, b], ["a", "b"])
    assert result.axis == "time" and result.ahead == 1
    assert result.notes == ["the runs share no steps: compared by time since each started"]


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = tmp_path / "a.tdbg"
    _record(a, 0.05, steps=5)
    junk = tmp_path / "junk.tdbg"
    junk.write_bytes(b"junk")
    for args in ([str(a)], [str(a), str(junk)], [str(a), str(tmp_path / "none.tdbg")]):
        assert run(["compare", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tdbg: error:") and len(err.strip().splitlines()) == 1, err


def test_a_run_without_a_finite_loss_is_named_as_such() -> None:
    a, b = _timed(100.0, 0, 50, 0.01), RunState({"name": "nan"})
    b.apply(pack_steps([StepRecord(step=i, time=1.0 + i, loss=float("nan")) for i in range(50)], 0))
    result = compare([a, b], ["a", "b"])
    assert result.notes == ["no finite loss to compare in run B"] and result.ahead is None


def _record_metrics(path: Path, lr: float, names: tuple[str, ...]) -> None:
    """A run that logs ``names`` (``acc`` every step, ``val_loss`` every 10): real metrics."""
    loop = Loop()
    for group in loop.optimizer.param_groups:
        group["lr"] = lr
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path, grad_every=1, name="m")
    for step in range(120):
        loss = loop.step(probe)
        if "acc" in names:
            probe.log(acc=1.0 / (1.0 + loss))
        if "val_loss" in names and step % 10 == 0:
            probe.log(val_loss=loss * 1.1)
        if "extra" in names:
            probe.log(extra=float(step))
    probe.close()


def test_every_metric_is_overlaid_and_one_run_s_own_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.tdbg", tmp_path / "b.tdbg"
    _record_metrics(a, 0.05, ("acc", "val_loss"))
    _record_metrics(b, 0.005, ("acc", "extra"))
    assert run(["compare", "--json", str(a), str(b)]) == 0
    got = json.loads(capsys.readouterr().out)
    charts = {o["name"]: o for o in got["overlays"]}
    # The run's own series first, then each metric both runs logged.
    assert list(charts) == ["lr", "step_time", "grad_norm", "acc"]
    assert got["only_in"] == {"val_loss": [0], "extra": [1]}
    acc = charts["acc"]
    assert acc["span"] == [0, 119] and len(acc["x"]) == 60
    assert acc["last"][0] == got["runs"][0]["metrics_final"]["acc"]
    assert all(len(s) == 60 for s in acc["series"])
    assert acc["series"][0][-1] > acc["series"][1][-1]  # the faster learner is more accurate
    assert charts["lr"]["series"] == [[0.05] * 60, [0.005] * 60]

    assert run(["compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    for label in ("lr", "step time (s)", "gradient norm (total)", "acc"):
        head = next(i for i, line in enumerate(lines) if line.startswith(f"  {label} · steps "))
        below = lines[head + 1 : head + 3]
        assert below[0].startswith("  A ") and below[1].startswith("  B "), below
    assert f"  {got['overlays'][3]['last'][0]:.4g}" in lines[head + 1]  # acc's last value
    assert "  only in A: val_loss" in text and "  only in B: extra" in text


def test_by_time_overlays_by_the_seconds_since_each_started(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.tdbg", tmp_path / "b.tdbg"
    _record_metrics(a, 0.05, ("acc",))
    _record_metrics(b, 0.05, ("acc",))
    assert run(["compare", "--by", "time", "--json", str(a), str(b)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["axis"] == "time" and "acc" in {o["name"] for o in got["overlays"]}
    assert run(["compare", "--by", "time", str(a), str(b)]) == 0
    assert "runs by time" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        run(["compare", "--by", "steps", str(a), str(b)])
    assert exited.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_by_step_says_why_runs_without_shared_steps_are_not_compared() -> None:
    a, b = _timed(100.0, 0, 50, 0.01), _timed(500.0, 1000, 50, 0.1)
    result = compare([a, b], ["a", "b"], by="step")
    assert result.axis == "step" and result.ahead is None and result.common is None
    assert result.notes == ["the runs share no steps with losses (--by time compares them by time)"]
    result = compare([a, b], ["a", "b"], by="time")
    assert result.axis == "time" and result.ahead == 1 and not result.notes
    assert {o.name for o in result.overlays} == {"step_time"}
