"""The diagnosis behind `tdbg report`, from plain RunStates: each verdict from the judgement that
made it at the time (the probe's alerts, the one stall rule), and the evidence's figures."""

from __future__ import annotations

from tdbg.model.diagnosis import diagnose, figure_lines
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.alert import Alert
from tdbg.protocol.steps import StepRecord, pack_steps


def _run(steps: int = 40, data: float = 0.001, clip: float | None = None) -> RunState:
    state = RunState({"name": "unit", "start_time": 0.0})
    records = [
        StepRecord(
            step=i,
            time=0.1 * i,
            loss=2.0 - 0.01 * i,
            step_time=0.1,
            data_time=data,
            forward_time=0.02,
            backward_time=0.04,
            optimizer_time=0.01,
            clip_max=1.0 if clip is not None else float("nan"),
            clip_norm=clip if clip is not None else float("nan"),
        )
        for i in range(steps)
    ]
    state.apply(pack_steps(records, 0))
    return state


def _alert(kind: str, step: int, message: str, severity: str = "error") -> dict:
    return Alert(kind, severity, step, 0.1 * step, message).to_wire()


def test_a_healthy_run_has_one_ok_verdict_and_its_figures() -> None:
    d = diagnose(_run())
    assert [(v.level, v.headline) for v in d.verdicts] == [
        ("ok", "no trouble seen: no alert, no stall, finite loss throughout")
    ]
    assert (d.loss_first, d.loss_best_step, d.steps) == (2.0, 39, 40)
    assert round(d.phases["backward_time"] or 0, 3) == 0.4
    labels = [label for label, _ in figure_lines(d)]
    assert labels[:3] == ["steps", "loss", "speed"] and "time went to" in labels


def test_stalls_spikes_and_input_bound_are_named_worst_first() -> None:
    state = _run(data=0.06)
    state.apply(_alert("loss_spike", 10, "loss jumped", "warning"))
    state.apply(_alert("loss_spike", 20, "loss jumped again", "warning"))
    state.apply(_alert("stalled", 30, "no step for 40 s after step 30 — stuck at data.py:9"))
    state.apply(_alert("resumed", 31, "the loop resumed after 41 s", "info"))
    d = diagnose(state)
    levels = [v.level for v in d.verdicts]
    assert levels == sorted(levels, key=["bad", "warn", "ok"].index)
    heads = [v.headline for v in d.verdicts]
    assert heads[0] == "the loop stalled 1 time, resumed 1"
    assert "2× loss spikes at steps 10–20" in heads
    assert any(h.startswith("input-bound: 60.0%") for h in heads)


def test_clipping_and_memory_in_the_evidence() -> None:
    state = _run(clip=2.0)  # every step's norm over its max_norm: clipping always active
    state.apply(
        {
            "type": "system",
            "time": 1.0,
            "host": {"rss": 1 << 30},
            "cuda": [{"index": 0, "name": "H100", "peak": 3 << 30, "reserved": 4 << 30}],
            "gpus": [],
            "missing": [],
        }
    )
    d = diagnose(state)
    clip = next(v for v in d.verdicts if "clipping" in v.headline)
    assert clip.level == "warn" and "100.0% of 40 steps" in clip.headline
    figures = dict(figure_lines(d))
    assert figures["memory cuda:0"] == "peak 3 GiB · reserved 4 GiB"
    assert figures["host memory"] == "1 GiB resident"


def test_how_a_run_ended_reads_once_for_the_header_and_the_row() -> None:
    from tdbg.model.ending import ending

    assert (ending("exit 0").kind, ending("exit 0").row) == ("clean", "ended (exit 0)")
    assert (ending("exit 1: boom").kind, ending("exit 1: boom").row) == (
        "dead",
        "dead: exit 1: boom",
    )
    assert ending("killed by SIGKILL").kind == ending("killed").kind == "dead"
    assert (ending("connection closed").kind, ending(None).words) == ("lost", "probe closed")


def test_the_last_profile_s_top_ops_with_the_profile_s_own_share() -> None:
    from tdbg.tui.sources.synthetic import OPS, job_messages, profile_result

    state = _run()
    state.apply_many(job_messages(1, "profile", {"steps": 5}, profile_result()))
    d = diagnose(state)
    assert d.top_ops and len(d.top_ops) == min(5, len(OPS))
    profile = state.deep.profile
    assert profile is not None
    first = max(profile.rows, key=lambda r: r.self_cpu or 0.0)
    assert d.top_ops[0]["name"] == first.name and d.top_ops[0]["share"] == profile.share(first)
    assert [label for label, _ in figure_lines(d)].count("time went to") == 1
