"""Several ranks' recordings as one job: folded step by step, in step with each other, and
judged as they go, so the job alerts are the ones a live job screen would have raised."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.run_state import RunState
from tdbg.protocol.framing import ProtocolError
from tdbg.protocol.steps import step_columns
from tdbg.recording.reader import Recording, RecordingError

MAX_JUDGEMENTS = 2000  # the job is judged at most this often over a replay (every step if fewer)


def replay_job(paths: Sequence[Path]) -> tuple[Job, JobAlerts]:
    """The ranks' recordings folded into one job, with the alerts raised and cleared on the way
    (judged at every step up to MAX_JUDGEMENTS steps, else that many times, evenly). A
    RecordingError when a file is no recording or two files are the same rank."""
    recordings = [Recording(p) for p in paths]
    job = Job(str(recordings[0].run.get("job") or recordings[0].path.stem), {})
    streams: dict[int, list[tuple[int | None, dict[str, Any]]]] = {}
    for recording in recordings:
        rank = int(recording.run.get("rank") or 0)
        if rank in job.ranks:
            raise RecordingError(f"{recording.path}: rank {rank} is in two of these recordings")
        job.ranks[rank] = RunState(dict(recording.run))
        streams[rank] = list(_by_step(recording))
    job.ranks = dict(sorted(job.ranks.items()))
    last = max((f for s in streams.values() for f, _ in s if f is not None), default=0)
    stride = max(1, last // MAX_JUDGEMENTS)
    alerts = JobAlerts()
    at = dict.fromkeys(streams, 0)  # rank -> its next message
    target = -1
    while any(at[r] < len(streams[r]) for r in streams):
        target += stride
        for rank, stream in streams.items():
            while at[rank] < len(stream):
                first, message = stream[at[rank]]
                if first is not None and first > target:
                    break  # a later step: folded on a later round
                job.ranks[rank].apply(message)
                at[rank] += 1
        alerts.update(job, now=_latest_time(job))
    for state in job.ranks.values():  # its goodbye's reason, when the recording has one
        state.mark("ended", state.end_reason or "recording ends")
    return job, alerts


def _by_step(recording: Recording) -> Iterator[tuple[int | None, dict[str, Any]]]:
    """The recording's messages, each with the first step of a step batch (None otherwise)."""
    for message in recording.messages():
        first = None
        if message.get("type") == "steps":
            try:
                steps = step_columns(message).step
                first = int(steps[0]) if len(steps) else None
            except ProtocolError:
                first = None  # RunState.apply reports it
        yield first, message


def _latest_time(job: Job) -> float | None:
    times = [s.cols["time"].values[-1] for s in job.ranks.values() if s.n_steps]
    return float(max(times)) if times else None
