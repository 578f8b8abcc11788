"""`tdbg dump --job` prints which ranks were repeatedly the slowest, as the job screen's panel says
it: a `slowest_over_time` event when the ranks named change, and once at the end. The ranks'
streams are synthetic step batches folded as the dump's reader threads fold them."""

from __future__ import annotations

from typing import Any

from straggler_streams import Pattern, intermittent, noise, record

from tdbg.cli.job_targets import _JobJudge
from tdbg.protocol.steps import pack_steps

RANKS = 4


def judged(pattern: Pattern, steps: int) -> list[dict[str, Any]]:
    judge = _JobJudge("j1", history=True)
    folds = [judge.tap({"name": "t", "rank": r, "world_size": RANKS, "job": "j1"})
             for r in range(RANKS)]  # fmt: skip
    out: list[dict[str, Any]] = []
    for first in range(0, steps, 50):
        for rank, fold in enumerate(folds):
            records = [record(s, pattern(rank, s)) for s in range(first, first + 50)]
            fold(pack_steps(records, 0))
        out.extend(judge.judge(final=False))
        judge.judged_at = 0.0  # judged after every batch, as a slow reader would see it
    out.extend(judge.judge(final=True))
    return [e for e in out if e["type"] == "slowest_over_time"]


def test_a_rank_that_comes_and_goes_is_printed_intermittent() -> None:
    events = judged(intermittent(3, 150, 60), 700)
    last = events[-1]
    assert last["job"] == "j1" and last["window"] == 10
    ranks = last["ranks"]
    assert ranks[0]["rank"] == 3
    assert ranks[0]["kind"] == "intermittent" and "intermittent" in str(last["line"])
    # Printed when the named ranks change and once at the end, not after every judgement.
    assert len(events) < 700 // 50


def test_noise_names_nobody_in_the_dump() -> None:
    events = judged(noise(5), 300)
    assert events and all(not r["kind"] for e in events for r in e["ranks"])
    assert "no rank repeatedly the slowest" in str(events[-1]["line"])
