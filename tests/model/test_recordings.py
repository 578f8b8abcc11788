"""The model from Python, as in a notebook: a recording loaded into a RunState, a job's recordings
judged, the verdicts asked for — no TUI, no CLI, no socket."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import Loop, linear_at

import tdbg
from tdbg.model.health import assess
from tdbg.model.recordings import load_job, load_run
from tdbg.recording.reader import RecordingError


def test_a_recording_loads_into_the_model_with_its_verdicts(tmp_path: Path) -> None:
    loop = Loop()
    path = tmp_path / "nan.tdbg"
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path)
    loop.run(6, probe)
    with loop.torch.no_grad():
        linear_at(loop.model, 0).weight.fill_(math.nan)  # the loss is NaN from step 6 on
    loop.run(4, probe)
    probe.close()

    run = load_run(path)
    assert run.n_steps == 10 and run.last_step == 9
    assert run.nonfinite_since == 6 and run.diverged
    assert [a.kind for a in run.alerts if a.nonfinite]  # the probe's own alert, kept
    health = assess(run)
    assert (health.word, health.detail) == ("ended", "clean shutdown at step 9")
    assert run.layer_names == ["0", "2"]


def test_not_a_recording_is_one_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.tdbg"
    bad.write_bytes(b"not a recording")
    with pytest.raises(RecordingError):
        load_run(bad)
    with pytest.raises(RecordingError, match="no tdbg recordings"):
        load_job(_empty(tmp_path))


def _empty(tmp_path: Path) -> Path:
    empty = tmp_path / "empty"
    empty.mkdir()
    return empty


@pytest.mark.slow
def test_a_job_s_recordings_load_judged_as_its_screen_would(straggler_job: list[Path]) -> None:
    job, alerts = load_job(straggler_job[0].parent)
    assert sorted(job.ranks) == [0, 1, 2]
    raised = {(a.kind, tuple(a.ranks)) for a in alerts.events if not a.cleared}
    assert raised == {("straggler", (1,)), ("rank_divergence", (2,))}
    assert [assess(state).word for state in job.ranks.values()] == ["ended"] * 3
