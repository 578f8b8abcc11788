"""The header's verdict is never stale (issue 11): a stall shows within 10 s of the last step
(the threshold judged on a fake clock, then the real app on a run whose steps stop), and an
ended run says how it ended and shows no step rate."""

from __future__ import annotations

from waiting import wait_for

from tdbg.model.ending import how_it_ended
from tdbg.model.health import assess
from tdbg.model.run_state import RunState
from tdbg.protocol.stall import DEFAULT_STALL_RULE, StallRule
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.app import TdbgApp, make_app, screen_text
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run
from tdbg.tui.widgets.run_header import VERDICT_SECONDS


def live_run(
    step_seconds: float, steps: int = 30, start: float = 1000.0, stall: object = None
) -> RunState:
    state = RunState({"name": "unit"} if stall is None else {"name": "unit", "stall": stall})
    state.mark("live")
    records = [
        StepRecord(step=i, time=start + step_seconds * i, loss=1.0, step_time=step_seconds)
        for i in range(steps)
    ]
    state.apply(pack_steps(records, 0))
    return state


def test_the_stall_threshold_is_twenty_step_times_within_5_to_9_s_for_fast_runs() -> None:
    rule = DEFAULT_STALL_RULE
    assert rule.limit(0.05) == 5.0  # 20 steps/s: 5 s, not 1 s
    assert rule.limit(0.3) == 6.0  # twenty step times
    assert rule.limit(0.99) == 9.0  # a fast run: never later than 9 s
    assert rule.limit(None) == 9.0  # one step so far: not known yet
    assert rule.limit(3.0) == 60.0  # a slow run: twenty of its own steps
    # Re-judged every VERDICT_SECONDS, the header says so within 10 s of a fast run's last step.
    assert rule.fast_cap_s + VERDICT_SECONDS <= 10.0


def test_the_header_judges_by_the_rule_its_probe_announced() -> None:
    # A probe that announced a stricter rule in its hello: the header calls a stall by it.
    strict = live_run(3.0, stall=StallRule(factor=2.0, min_s=1.0).to_wire())
    last = float(strict.cols["time"].values[-1])
    assert assess(strict, now=last + 5.0).word == "live"
    assert assess(strict, now=last + 7.0).word == "stalled"
    # A malformed announcement (a bad peer) takes the defaults, never "every gap is a stall".
    for bad in ({"factor": 0, "min_s": -1}, {"factor": "x"}, [1, 2], {"min_s": float("nan")}):
        odd = live_run(3.0, stall=bad)
        assert StallRule.from_wire(bad) == DEFAULT_STALL_RULE
        assert assess(odd, now=float(odd.cols["time"].values[-1]) + 59.0).word == "live"


def test_a_fast_run_is_stalled_after_5_s_on_a_fake_clock_a_slow_one_after_twenty_steps() -> None:
    fast = live_run(0.05)
    last = float(fast.cols["time"].values[-1])
    assert assess(fast, now=last + 4.9).word == "live"
    stalled = assess(fast, now=last + 5.1)
    assert (stalled.word, stalled.steps_per_sec) == ("stalled", 0.0)
    slow = live_run(3.0)
    last = float(slow.cols["time"].values[-1])
    assert assess(slow, now=last + 59.0).word == "live"  # a 3 s step is not a stall at 9 s
    assert assess(slow, now=last + 61.0).word == "stalled"


def test_how_a_run_ended_in_words() -> None:
    assert how_it_ended("shutdown") == "clean shutdown"
    assert how_it_ended("slow_consumer") == "dropped: this viewer read too slowly"
    assert how_it_ended("connection closed").startswith("connection lost with no goodbye")
    assert how_it_ended("shutdown; watching for a restart") == (
        "clean shutdown · watching for a restart"
    )
    assert how_it_ended("exit 1") == "exit 1"  # what the reader was told, as it was told
    assert how_it_ended(None) == "probe closed"


async def test_the_header_says_stalled_once_the_steps_stop() -> None:
    """The synthetic run's steps stop (the source stays connected, as a hung run's probe
    does): the header turns from live to stalled by its own clock, with 0.0 steps/s."""
    source = ReplaySource(synthetic_run(steps=50), dict(RUN), end=False)
    app = make_app(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 50, "50 steps")
        header = app.query_one("RunHeader")
        await wait_for(pilot, lambda: header.has_class("-stalled"), "the header says stalled")
        said = ("stalled: no step for", "0.0 steps/s")  # the frame after the class came
        text = await wait_for(pilot, lambda: _showing(app, said), "the stall on screen")
        assert "● live" not in text


async def test_an_ended_run_says_how_and_shows_no_stale_rate() -> None:
    source = ReplaySource(synthetic_run(steps=120), dict(RUN), end_reason="slow_consumer")
    app = make_app(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.connection == "ended", "the run's end")
        await wait_for(
            pilot,
            lambda: "run ended: dropped: this viewer read too slowly" in screen_text(app),
            "how it ended",
        )
        header = screen_text(app).split("\n", 1)[0]
        assert "steps/s" not in header and "ETA" not in header
        assert "step 119" in header


async def test_a_stalled_run_shows_no_eta() -> None:
    stall = {
        "type": "alert",
        "kind": "stalled",
        "severity": "error",
        "step": 399,
        "time": 0.0,
        "message": "no step for 63 s after step 399",
        "layers": [],
    }
    app = make_app(ReplaySource([*synthetic_run(steps=400), stall], dict(RUN), end=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: "stalled: no step for 63 s" in screen_text(app), "stalled")
        assert "ETA" not in screen_text(app).split("\n", 1)[0]


def _showing(app: TdbgApp, needles: tuple[str, ...]) -> str:
    """The screen's text once it shows every needle, else ''."""
    text = screen_text(app)
    return text if all(n in text for n in needles) else ""
