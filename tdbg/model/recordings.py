"""A recording as the model: one run's state, or a job's ranks judged, from Python or a notebook.

from tdbg.model.recordings import load_run, load_job
from tdbg.model.health import assess

run = load_run("train.tdbg")            # RunState: loss, lr, gradients, alerts, anatomy ...
assess(run).word, run.nonfinite_since   # "ended", the step a trailing NaN run began
job, alerts = load_job("runs/")         # every rank's recording in a directory, judged
[(a.kind, a.ranks, a.message) for a in alerts.events]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_replay import replay_job
from tdbg.model.run_state import RunState
from tdbg.recording.reader import Recording, RecordingError, is_recording


def load_run(path: str | os.PathLike[str]) -> RunState:
    """The whole of one recording folded into a RunState, ended as the file says: ``shutdown``
    (the run closed it), else ``killed`` (cut short); a damaged file up to its damage, with
    where it stopped among ``errors``. A RecordingError when it is no recording."""
    recording = Recording(path)
    state = RunState(dict(recording.run))
    state.apply_many(recording.messages())
    if recording.stopped is not None:
        state.errors.append(recording.stopped)
    state.mark("ended", state.end_reason or ("shutdown" if recording.ended else "killed"))
    return state


def load_job(
    where: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> tuple[Job, JobAlerts]:
    """A job's ranks from their recordings — a directory of them, or the files — folded in
    step with each other and judged as a live job screen would have judged them."""
    if not isinstance(where, str | os.PathLike):
        paths = [Path(p) for p in where]
    elif Path(where).is_dir():
        paths = sorted(p for p in Path(where).iterdir() if p.is_file() and is_recording(p))
    else:
        paths = [Path(where)]
    if not paths:
        raise RecordingError(f"{where}: no tdbg recordings there")
    return replay_job(paths)
