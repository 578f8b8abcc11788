"""A job replayed from its ranks' recordings as the job screen's source: nothing to read live,
no probe to send commands to (the job itself is folded by ``state.job_replay``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tdbg.tui.sources.job import JobSource, Notify, RankBatches

READ_ONLY = "a recording cannot run commands"


class RecordedJobSource(JobSource):
    def __init__(self, job: str) -> None:
        super().__init__(job)
        self.label = f"job {job} (replay)"

    def open(self, notify: Notify) -> None:
        return None  # everything is read already

    def batches(self) -> Iterator[RankBatches]:
        return iter(())

    def send(self, rank: int, command: str, **args: Any) -> int | None:
        self.send_error = f"{command} not sent: {READ_ONLY}"
        return None
