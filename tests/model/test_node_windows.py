"""Which rank was the slowest over time, judged from node summaries as the bridges send them (each
rank's windows, the new ones only after the first summary): the same record, word for word, as
from the ranks' own steps — a straggler that comes and goes at 64 ranks on 8 nodes, one that stays,
a rank that died, a restarted rank; the windows kept stay bounded."""

from __future__ import annotations

from collections.abc import Mapping

import msgpack
from straggler_streams import apply_steps, intermittent, job_of, noise, record

from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_nodes import NodesJob
from tdbg.model.node_reduce import rank_windows, reduce_node
from tdbg.model.node_windows import KEPT, WAIT_WHOLE
from tdbg.model.run_state import RunState
from tdbg.model.straggler_history import WINDOW, StragglerHistory
from tdbg.protocol.messages.node_summary import NodeSummary
from tdbg.protocol.steps import pack_steps


class Bridges:
    """The job's ranks split over nodes of ``per_node``, each summarised as its bridge does:
    over the wire, with the windows it sent before remembered."""

    def __init__(self, job: Job, per_node: int) -> None:
        self.job = job
        ranks = sorted(job.ranks)
        self.nodes = {f"n{k}": ranks[k : k + per_node] for k in range(0, len(ranks), per_node)}
        self.sent: dict[str, dict[int, int]] = {node: {} for node in self.nodes}
        self.viewer = NodesJob(job.job)

    def summarise(self, late: frozenset[str] = frozenset(), now: float | None = None) -> None:
        """Every node's summary (made at ``now``), but the ``late`` nodes' (their bridges not
        started yet)."""
        for node, ranks in self.nodes.items():
            if node in late:
                continue
            states: Mapping[int, RunState] = {r: self.job.ranks[r] for r in ranks}
            summary = reduce_node(node, self.job.job, states, now=now, windows_sent=self.sent[node])
            wire = msgpack.unpackb(msgpack.packb(summary.to_wire()))
            read = NodeSummary.from_wire(wire)
            assert read is not None
            for figures in read.ranks:
                if figures.windows:
                    self.sent[node][figures.rank] = figures.windows[-1].end
            self.viewer.update(node, read)


def feed(job: Job, bridges: Bridges, both: tuple[StragglerHistory, StragglerHistory],
         steps: range, data: object, batch: int = 5) -> None:  # fmt: skip
    """The ranks' steps in batches; after each, a summary from every node, and both records
    fed: one from the ranks' steps, one from the summaries."""
    assert callable(data)
    for first in range(steps.start, steps.stop, batch):
        apply_steps(job, range(first, min(first + batch, steps.stop)), data)
        bridges.summarise()
        both[0].update(job)
        both[1].update(bridges.viewer.windowed())


def test_a_straggler_that_comes_and_goes_at_64_ranks_is_named_as_from_the_streams() -> None:
    job = job_of(64)
    bridges = Bridges(job, 8)
    streams, summaries = StragglerHistory(), StragglerHistory()
    feed(job, bridges, (streams, summaries), range(700), intermittent(37, 150, 60))
    [named] = summaries.named()
    assert (named.rank, named.kind) == (37, "intermittent")
    assert named.spells >= 3 and named.phase_words() == "input wait"
    assert summaries.line() == streams.line()
    assert summaries.to_json() == streams.to_json()
    assert summaries.line().startswith("rank 37 (intermittent): the slowest in ")


def test_a_node_whose_first_summary_comes_late_is_judged_from_the_start() -> None:
    """128 bridges start seconds apart: the record waits for the job's ranks, so the windows
    before a late node's first summary are judged with its ranks, not without them."""
    job = job_of(16)
    bridges = Bridges(job, 4)
    streams, summaries = StragglerHistory(), StragglerHistory()
    base = noise(6)
    slow = lambda r, s: base(r, s) + (0.030 if r == 13 else 0.0)  # noqa: E731
    for first in range(0, 300, 5):
        apply_steps(job, range(first, first + 5), slow)
        bridges.summarise(late=frozenset({"n12"}) if first < 60 else frozenset())
        streams.update(job)
        summaries.update(bridges.viewer.windowed())
    [named] = summaries.named()
    assert (named.rank, named.kind) == (13, "persistent")
    assert summaries.line() == streams.line()
    assert "the slowest in 100 %" in summaries.line()


def test_a_job_hung_before_its_last_node_came_is_judged_when_it_comes() -> None:
    """The bridges attach to a job already hung (no step will come): the straggler on the node
    whose first summary came last is named, and the record over its history, once it comes."""
    job = job_of(16)
    bridges = Bridges(job, 4)
    alerts = JobAlerts()
    apply_steps(job, range(40, 240), lambda r, s: 0.002 + (0.030 if r == 13 else 0.0))
    bridges.summarise(late=frozenset({"n12"}))
    alerts.update(bridges.viewer, now=1.0)
    assert not alerts.active and alerts.history.judged == 0
    bridges.summarise()
    raised = alerts.update(bridges.viewer, now=2.0)
    assert [(a.kind, a.ranks) for a in raised] == [("straggler", [13])]
    [named] = alerts.history.named()
    assert (named.rank, named.kind) == (13, "persistent")
    assert "the slowest in 100 %" in alerts.history.line()


def test_a_node_that_never_reports_holds_the_record_back_two_minutes_at_most() -> None:
    job = job_of(16)
    bridges = Bridges(job, 4)
    summaries = StragglerHistory()
    slow = lambda r, s: 0.002 + (0.030 if r == 5 else 0.0)  # noqa: E731
    for k, first in enumerate(range(0, 300, 5)):
        apply_steps(job, range(first, first + 5), slow)
        bridges.summarise(late=frozenset({"n12"}), now=1000.0 + 2.5 * k)  # 2 steps/s
        summaries.update(bridges.viewer.windowed())
        if 2.5 * k < WAIT_WHOLE:
            assert summaries.judged == 0, k
    [named] = summaries.named()
    assert (named.rank, named.kind) == (5, "persistent")


def test_a_rank_slow_all_along_is_persistent_and_noise_names_none() -> None:
    job = job_of(16)
    bridges = Bridges(job, 4)
    streams, summaries = StragglerHistory(), StragglerHistory()
    base = noise(5)
    feed(job, bridges, (streams, summaries), range(300),
         lambda r, s: base(r, s) + (0.030 if r == 9 else 0.0))  # fmt: skip
    assert [(r.rank, r.kind) for r in summaries.named()] == [(9, "persistent")]
    assert summaries.to_json() == streams.to_json()

    quiet = job_of(16)
    bridges = Bridges(quiet, 4)
    streams, summaries = StragglerHistory(), StragglerHistory()
    feed(quiet, bridges, (streams, summaries), range(300), noise(6))
    assert summaries.named() == [] and summaries.judged > 0
    assert summaries.line() == streams.line()


def test_a_rank_that_died_no_longer_holds_the_record_back() -> None:
    job = job_of(8)
    bridges = Bridges(job, 4)
    streams, summaries = StragglerHistory(), StragglerHistory()
    pattern = intermittent(2, 1000, 1000)  # rank 2 slow for as long as it lives
    feed(job, bridges, (streams, summaries), range(200), pattern)
    job.ranks[2].mark("ended", "killed by signal 9")
    feed(job, bridges, (streams, summaries), range(200, 400), pattern)
    assert summaries.judged == streams.judged and summaries.recent[-1].end == 400  # not held
    [named] = summaries.named()
    assert (named.rank, named.kind) == (2, "earlier")
    assert summaries.to_json() == streams.to_json()


def test_job_alerts_keep_the_record_from_summaries() -> None:
    job = job_of(16)
    bridges = Bridges(job, 8)
    alerts = JobAlerts()
    pattern = intermittent(5, 150, 60)
    for first in range(0, 600, 10):
        for state in job.ranks.values():
            recs = [record(s, pattern(state.run["rank"], s)) for s in range(first, first + 10)]
            state.apply(pack_steps(recs, 0))
        bridges.summarise()
        alerts.update(bridges.viewer, now=float(first))
    [named] = alerts.history.named()
    assert (named.rank, named.kind) == (5, "intermittent")


def test_the_bridge_sends_each_window_once_and_a_restart_afresh() -> None:
    state = job_of(1).ranks[0]
    state.apply(pack_steps([record(s, 0.002) for s in range(95)], 0))
    first = rank_windows(state)
    assert [w.end for w in first] == list(range(10, 91, WINDOW))
    assert rank_windows(state, first[-1].end) == ()
    state.apply(pack_steps([record(s, 0.002) for s in range(95, 121)], 0))
    assert [w.end for w in rank_windows(state, 90)] == [100, 110, 120]
    restarted = job_of(1).ranks[0]
    restarted.apply(pack_steps([record(s, 0.002) for s in range(25)], 0))
    assert [w.end for w in rank_windows(restarted, 120)] == [10, 20]


def test_the_windows_kept_stay_bounded() -> None:
    job = job_of(4)
    bridges = Bridges(job, 2)
    streams, summaries = StragglerHistory(), StragglerHistory()
    feed(job, bridges, (streams, summaries), range(3000), intermittent(1, 200, 50), batch=50)
    kept = bridges.viewer.windows.by_rank
    assert set(kept) == {0, 1, 2, 3} and all(len(w) <= KEPT for w in kept.values())
    assert summaries.to_json() == streams.to_json()


def test_each_windows_medians_are_the_scalar_rules_at_its_end() -> None:
    """The windows' medians, taken for all windows at once, equal busy_median and
    recent_median at each window's end, with gaps in what was measured."""
    from tdbg.model.job import busy_median, recent_median
    from tdbg.protocol.steps import StepRecord

    state = job_of(1).ranks[0]
    recs = []
    for s in range(600):
        r = record(s, 0.001 + 0.0001 * (s % 7))
        if s % 3:  # most steps time no backward (a GPU run times one in a few)
            r = StepRecord(s, float(s), 1.0, step_time=r.step_time, data_time=r.data_time)
        recs.append(r)
    state.apply(pack_steps(recs, 0))
    windows = rank_windows(state)
    assert len(windows) == 50
    for w in windows:
        row = int(state.steps.values.searchsorted(w.end))
        assert w.whole == busy_median(state, False, row)
        assert w.own == busy_median(state, True, row)
        assert w.phases == {p: recent_median(state, p, row) for p in w.phases}
    assert windows[-1].own is not None and windows[-1].phases["forward_time"] is not None


def test_a_summary_replaced_before_it_was_read_hands_its_windows_on() -> None:
    """The link keeps a node's newest summary only (a slow viewer takes one of several); the
    windows each summary sends once are carried into the one that replaces it, so the record
    misses none (at 1,024 ranks the viewer lost the first summaries' backlog this way)."""
    from tdbg.protocol.messages.node_summary import with_windows_of

    job = job_of(4)
    pattern = intermittent(2, 1000, 1000)
    sent: dict[int, int] = {}
    summaries = []
    for first in range(0, 200, 50):
        for rank, state in job.ranks.items():
            recs = [record(s, pattern(rank, s)) for s in range(first, first + 50)]
            state.apply(pack_steps(recs, 0))
        summary = reduce_node("n0", "j1", job.ranks, windows_sent=sent)
        for figures in summary.ranks:
            sent[figures.rank] = figures.windows[-1].end
        summaries.append(summary)
    kept = summaries[0]
    for newer in summaries[1:]:  # none read until the last
        kept = with_windows_of(kept, newer)
    assert [w.end for w in kept.ranks[0].windows] == list(range(10, 201, WINDOW))
    viewer = NodesJob("j1")
    viewer.update("n0", kept)
    streams, from_nodes = StragglerHistory(), StragglerHistory()
    streams.update(job)
    from_nodes.update(viewer.windowed())
    assert from_nodes.to_json() == streams.to_json() and from_nodes.judged == 20
