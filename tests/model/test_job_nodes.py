"""Node summaries judged as the ranks' own streams are: a straggler with its phase, diverged ranks
with their layers and step, a hang with its collective and stacks, NaN on some ranks — the same
findings, word for word, from ``Job`` (every stream) and ``NodesJob`` (summaries over the wire),
at 2 ranks and at 64 ranks on 8 nodes. Malformed summaries read as None."""

from __future__ import annotations

import msgpack
import pytest

from tdbg.model.job import Job, JobFinding
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_nodes import NodesJob
from tdbg.model.node_reduce import reduce_node
from tdbg.model.run_state import RunState
from tdbg.protocol.messages import alert_message
from tdbg.protocol.messages.node_summary import NodeSummary
from tdbg.protocol.steps import StepRecord, pack_steps

LAYERS = ["embed", "fc1", "fc2"]


def job_of(ranks: int) -> Job:
    states = {}
    for rank in range(ranks):
        state = RunState({"name": "t", "rank": rank, "world_size": ranks, "job": "j1"})
        state.apply({"type": "layers", "names": LAYERS, "numel": [10] * len(LAYERS)})
        states[rank] = state
    return Job("j1", states)


def run(job: Job, steps: int, slow: int | None = None, off: int | None = None) -> None:
    """``steps`` steps on every rank: rank ``slow`` waits 20 ms more for its data, rank
    ``off``'s fc2 gradient differs from step 25 on."""
    for rank, state in job.ranks.items():
        records = []
        for step in range(steps):
            data = 0.001 + (0.020 if rank == slow else 0.0)
            norms = [1.0, 2.0, 3.0 + (0.5 if rank == off and step >= 25 else 0.0)]
            records.append(
                StepRecord(step, float(step), 1.0 + step * 1e-3, step_time=data + 0.015,
                           data_time=data, forward_time=0.010, backward_time=0.005,
                           optimizer_time=0.0, grad_norms=norms)
            )  # fmt: skip
        state.apply(pack_steps(records, len(LAYERS)))


def through_nodes(job: Job, per_node: int) -> NodesJob:
    """The job's ranks reduced node by node, each summary over the wire and read back."""
    nodes = NodesJob(job.job)
    ranks = sorted(job.ranks)
    for k in range(0, len(ranks), per_node):
        mine = {r: job.ranks[r] for r in ranks[k : k + per_node]}
        wire = msgpack.unpackb(msgpack.packb(reduce_node(f"n{k}", "j1", mine).to_wire()))
        summary = NodeSummary.from_wire(wire)
        assert summary is not None
        nodes.update(f"n{k}", summary)
    return nodes


def said(findings: list[JobFinding]) -> list[tuple[object, ...]]:
    return [(f.kind, f.ranks, f.message, f.layers, f.phase, f.step, f.collective, f.stacks)
            for f in findings]  # fmt: skip


@pytest.mark.parametrize(("ranks", "per_node"), [(2, 1), (2, 2), (64, 8), (1024, 8)])
def test_a_straggler_is_named_with_its_phase_as_from_the_streams(ranks: int, per_node: int) -> None:
    job = job_of(ranks)
    run(job, 40, slow=ranks - 1)
    nodes = through_nodes(job, per_node)
    expected = said(job.findings())
    assert [f[:2] for f in expected] == [("straggler", [ranks - 1])]
    assert expected[0][4] == "data_time"
    assert said(nodes.findings()) == expected


@pytest.mark.parametrize(("ranks", "per_node"), [(2, 1), (2, 2), (3, 3), (64, 8), (1024, 8)])
def test_a_diverged_rank_is_named_with_its_layer_and_step(ranks: int, per_node: int) -> None:
    job = job_of(ranks)
    run(job, 40, off=1)
    expected = said(job.findings())
    assert expected and expected[0][0] == "rank_divergence"
    assert said(through_nodes(job, per_node).findings()) == expected
    applies, rule = through_nodes(job, per_node).divergence_rule()
    assert applies and rule == job.divergence_rule()[1]


def test_a_healthy_node_sends_one_gradient_row_a_step() -> None:
    job = job_of(8)
    run(job, 30)
    summary = reduce_node("n", "j1", job.ranks)
    assert summary.grads is not None and len(summary.grads.rows) <= len(summary.grads.steps)
    assert through_nodes(job, 8).findings() == []


def stall(seq: int, where: str) -> dict[str, object]:
    message = dict(alert_message("stalled", "warning", 5, f"no step — stuck at {where}", [], 1.0))
    message["stack"] = ["train.py:10 in main: step()", where]
    message["collective"] = {"seq": seq, "op": "gloo:all_reduce", "sizes": [[8]],
                             "group": ["0", "default_pg"]}  # fmt: skip
    return message


@pytest.mark.parametrize(("ranks", "per_node"), [(2, 1), (64, 8), (1024, 8)])
def test_a_hung_rank_is_named_with_the_collective_and_stacks(ranks: int, per_node: int) -> None:
    job = job_of(ranks)
    run(job, 30)
    for rank, state in job.ranks.items():
        state.apply(stall(6 if rank == 5 % ranks else 7, f"train.py:{rank} in somewhere"))
    expected = said(job.findings())
    assert expected[0][:2] == ("hang", [5 % ranks])
    assert said(through_nodes(job, per_node).findings()) == expected


@pytest.mark.parametrize(("ranks", "per_node"), [(2, 1), (64, 8), (1024, 8)])
def test_nan_on_some_ranks_and_a_dead_rank(ranks: int, per_node: int) -> None:
    job = job_of(ranks)
    run(job, 30)
    bad = ranks - 1
    job.ranks[bad].apply(pack_steps([StepRecord(30, 30.0, float("nan"))], 0))
    job.ranks[0].mark("ended", "connection lost: [Errno 104] Connection reset by peer")
    expected = said(job.findings())
    assert [f[:2] for f in expected] == [("nonfinite_ranks", [bad])]
    nodes = through_nodes(job, per_node)
    assert said(nodes.findings()) == expected
    assert list(nodes.gone()) == [0] and nodes.gone()[0] == nodes.figures[0].state != "live"


def test_the_alerts_follow_a_summarised_job_as_a_streamed_one() -> None:
    job = job_of(16)
    alerts, by_nodes = JobAlerts(), JobAlerts()
    for first in range(0, 60, 5):
        for rank, state in job.ranks.items():
            data = 0.001 + (0.02 if rank == 3 and first >= 20 else 0.0)
            records = [
                StepRecord(s, float(s), 1.0, step_time=data + 0.015, data_time=data,
                           forward_time=0.01, backward_time=0.005)
                for s in range(first, first + 5)
            ]  # fmt: skip
            state.apply(pack_steps(records, 0))
        streamed = alerts.update(job, now=float(first))
        summarised = by_nodes.update(through_nodes(job, 4), now=float(first))
        assert [(a.kind, a.ranks, a.message) for a in summarised] == [
            (a.kind, a.ranks, a.message) for a in streamed
        ]
    assert [(a.kind, a.ranks) for a in by_nodes.active.values()] == [("straggler", [3])]


@pytest.mark.parametrize(
    "wire",
    [
        None,
        {"type": "summary"},
        {"type": "summary", "v": 99, "ranks": {"rank": [0]}},
        {"type": "summary", "v": 1, "ranks": {"rank": []}},
        {"type": "summary", "v": 1, "ranks": "x"},
        {"type": "summary", "v": 1, "ranks": {"rank": [0]}, "grads": {"steps": [1], "rows": b"x"}},
        {
            "type": "summary",
            "v": 1,
            "ranks": {"rank": [0]},
            "grads": {"steps": [1], "rows": b"\0" * 8, "which": [[0, [3]]]},
        },  # fmt: skip
    ],
)
def test_malformed_summaries_read_as_none_or_without_the_bad_part(wire: object) -> None:
    summary = NodeSummary.from_wire(wire)
    assert summary is None or summary.grads is None
