"""A bridge keeps what its last summary read (each rank's medians, state word and gradient rows):
every summary it sends is byte for byte the one read afresh — through system reports, steps, a
stall by silence and by the probe's alert, a restart, a dead rank, a non-finite loss, a diverged
rank and a new layer list — and a rank's medians are read again only when its steps change."""

from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace

import msgpack
import pytest

from tdbg.model import node_figures, run_state
from tdbg.model.health import assess, stalled
from tdbg.model.node_reduce import NodeCache, reduce_node
from tdbg.model.run_state import RunState
from tdbg.protocol.steps import pack_steps
from tdbg.tui.sources.synthetic import layer_names, step_records, system_message

RANKS, LAYERS = 8, 6


class Clock:
    """The wall clock the states read (when steps arrived) and the summaries are made at."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def rank(r: int, layers: int = LAYERS) -> RunState:
    state = RunState({"name": "t", "rank": r, "world_size": RANKS, "job": "j"})
    state.apply({"type": "layers", "names": layer_names(layers), "numel": [100] * layers})
    state.mark("live")
    return state


def steps(r: int, first: int, n: int, rng: random.Random) -> dict[str, object]:
    out = []
    for rec in step_records(first, n, LAYERS, grad_every=rng.choice([1, 2]) if r else 1, seed=r):
        data = rec.data_time + (0.03 if r == 3 and (rec.step // 40) % 2 else 0.0)
        norms = rec.grad_norms
        if r == 5 and rec.step > 150 and norms:  # rank 5 diverges in its last layer
            norms = [*norms[:-1], norms[-1] * 1.5]
        out.append(
            dataclasses.replace(
                rec,
                data_time=data,
                step_time=rec.step_time + data,
                grad_norms=norms,
                backward_time=rec.backward_time if rng.random() > 0.2 else math.nan,
                loss=math.nan if r == 6 and rec.step > 300 else rec.loss,
            )
        )
    return dict(pack_steps(out, LAYERS))


def collective(r: int, clock: Clock, step: int) -> dict[str, object]:
    return {
        "type": "alert", "kind": "stalled", "severity": "warning", "step": step,
        "headline": "no step", "time": clock.now, "where": "train.py:1", "stack": ["a", "b"],
        "collective": {"seq": 10 - (r == 4), "op": "all_reduce", "group": ["0", "pg"],
                       "sizes": [[4]]},
    }  # fmt: skip


def test_every_cached_summary_is_the_one_read_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(run_state, "_time", SimpleNamespace(time=clock.time))
    states = {r: rank(r) for r in range(RANKS)}
    rng, cache = random.Random(1), NodeCache()
    sent: dict[str, dict[int, int]] = {"fresh": {}, "cached": {}}
    names: dict[str, str | None] = {"fresh": None, "cached": None}
    step, words = 0, set()
    for tick in range(400):
        clock.now = 1000.0 + tick * 0.5
        if tick % 2 == 0 and not (60 < tick < 90 or 140 < tick < 147):  # else silent: stalls
            n = rng.choice([0, 1, 1, 2, 3, 7])
            for r, state in states.items():
                if not state.ended and n:
                    state.apply(steps(r, step, n, rng))
            step += n
        if rng.random() < 0.5:
            for state in states.values():
                state.apply(dict(system_message(gpu=tick % 3 == 0)))
        if tick == 120:
            states[2] = rank(2)  # a restart: a new state for the rank
        if tick == 200:
            states[7].mark("ended", "killed by SIGKILL")
        if tick in (250, 300):
            for r, state in states.items():
                if not state.ended:
                    state.apply(collective(r, clock, step) if tick == 250 else {
                        "type": "alert", "kind": "resumed", "severity": "info", "step": step,
                        "headline": "ok", "time": clock.now})  # fmt: skip
        if tick == 330:
            for r in states:
                states[r].apply({"type": "layers", "names": layer_names(8), "numel": [100] * 8})
        wires = {}
        for how in ("fresh", "cached"):
            summary = reduce_node("n0", "j", states, names[how], clock.now, sent[how],
                                  cache if how == "cached" else None)  # fmt: skip
            names[how] = summary.grads.layout if summary.grads is not None else names[how]
            for f in summary.ranks:
                if f.windows:
                    sent[how][f.rank] = f.windows[-1].end
            wires[how] = msgpack.packb(summary.to_wire())
            words |= {f.state for f in summary.ranks}
        assert wires["cached"] == wires["fresh"], f"summary {tick}"
    assert words == {"live", "stalled", "dead: killed by SIGKILL"}


def test_a_ranks_medians_are_read_again_only_when_its_steps_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read: list[int] = []
    real = node_figures.step_figures

    def counted(state: RunState) -> node_figures.StepFigures:
        read.append(1)
        return real(state)

    monkeypatch.setattr(node_figures, "step_figures", counted)
    states, cache, rng = {r: rank(r) for r in range(4)}, NodeCache(), random.Random(2)
    for r, state in states.items():
        state.apply(steps(r, 0, 30, rng))
    reduce_node("n0", "j", states, cache=cache)
    assert len(read) == 4
    for state in states.values():
        state.apply(dict(system_message()))  # a report: the state's revision, not its steps
    reduce_node("n0", "j", states, cache=cache)
    assert len(read) == 4
    states[1].apply(steps(1, 30, 1, rng))
    summary = reduce_node("n0", "j", states, cache=cache)
    assert len(read) == 5
    assert summary.ranks[1].step == 30 and summary.ranks[0].step == 29


def test_stalled_is_assess_saying_stalled() -> None:
    rng, seen = random.Random(3), set()
    for case in range(200):
        state = rank(0)
        now = 5.0e9
        if case % 5:
            state.apply(steps(0, 0, rng.choice([1, 5, 30]), rng))
            now = float(state.cols["time"].values[-1]) + rng.choice([0.1, 5.0, 60.0, 900.0])
        if case % 7 == 0:
            state.apply(collective(0, Clock(), 3))
        if case % 11 == 0:
            state.mark(rng.choice(["ended", "reconnecting", "live"]), "closed")
        for by_arrival in (False, True):
            expected = assess(state, now, by_arrival).word == "stalled"
            assert stalled(state, now, by_arrival) is expected
            seen.add(expected)
    assert seen == {True, False}
