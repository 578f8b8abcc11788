"""One profile sent to every rank of a job at once: which ranks are still at it, each rank's
result or why it has none, read from the ranks' own deep-dive states as their answers fold in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tdbg.model.deep import progress
from tdbg.model.job import Job
from tdbg.model.rank_profiles import ProfileComparison, compare_profiles
from tdbg.protocol.messages.jobs import FINAL_STATES


@dataclass
class RankAnswer:
    """Where one rank's profile stands: running (``progress``), a result, or an error."""

    rank: int
    progress: str = ""
    result: Any = None
    error: str | None = None

    @property
    def settled(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class JobProfile:
    """The command's id on each rank it was sent to, and the ranks it could not be sent to."""

    args: dict[str, Any]
    sent: dict[int, int] = field(default_factory=dict)  # rank -> message id
    unsent: dict[int, str] = field(default_factory=dict)  # rank -> why not sent

    def answers(self, job: Job) -> list[RankAnswer]:
        """Every rank's answer so far, by rank."""
        out = [RankAnswer(rank, error=why) for rank, why in self.unsent.items()]
        out += [self._answer(job, rank, mid) for rank, mid in self.sent.items()]
        return sorted(out, key=lambda a: a.rank)

    def _answer(self, job: Job, rank: int, mid: int) -> RankAnswer:
        answer = RankAnswer(rank, progress="sent, waiting for its answer")
        state = job.ranks.get(rank)
        request = None if state is None else state.deep.requests.get(mid)
        if state is None or request is None:  # the rank restarted: a new state, a new probe
            answer.error = "restarted before it answered"
            return answer
        if request.refused is not None:
            answer.error = f"refused: {request.refused}"
            return answer
        dive = None if request.job is None else state.deep.jobs.get(request.job)
        if dive is not None:
            answer.progress = progress(dive)
            if dive.state == "done" and dive.result is not None:
                answer.result = dive.result
            elif dive.state in FINAL_STATES:
                answer.error = progress(dive)
        if not answer.settled and state.ended:
            answer.error = f"ended before its profile finished ({state.end_reason or 'closed'})"
        return answer

    def progress(self, answers: list[RankAnswer]) -> str:
        """``profiling 4 ranks: 2 done`` (done: a result or an error)."""
        done = sum(a.settled for a in answers)
        return f"profiling {len(answers)} rank{'s' if len(answers) != 1 else ''}: {done} done"

    @staticmethod
    def finished(answers: list[RankAnswer]) -> bool:
        return all(a.settled for a in answers)

    @staticmethod
    def comparison(answers: list[RankAnswer]) -> ProfileComparison | None:
        """The answered ranks compared (None: no rank answered)."""
        return compare_profiles({a.rank: a.result for a in answers if a.result is not None})
