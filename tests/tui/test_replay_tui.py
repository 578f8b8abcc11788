"""`tdbg-tui replay FILE` driven by its Pilot: the cursor keys move through time and every panel
shows the state at the cursor step; deep-dive keys say a recording cannot run commands."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_recording import record_until_killed, synthetic_recording
from textual.pilot import Pilot
from waiting import wait_for

from tdbg.format import fmt_loss
from tdbg.model.timeline import Timeline
from tdbg.recording.reader import Recording
from tdbg.tui.app import screen_text
from tdbg.tui.replay_app import READ_ONLY, ReplayApp, load
from tdbg.tui.widgets.gradient_table import GradientTable

SIZE = (150, 44)


def loss_subtitle(app: ReplayApp) -> str:
    return str(app.monitor.query_one("#loss-panel").border_subtitle)


def alerts_subtitle(app: ReplayApp) -> str:
    return str(app.monitor.query_one("#alerts-panel").border_subtitle)


def expected_loss(timeline: Timeline, index: int) -> str:
    return fmt_loss(float(timeline.full.loss.values[index]))


async def press(pilot: Pilot[int], app: ReplayApp, *keys: str) -> None:
    """Press ``keys``, then wait (polling, with a deadline) until every panel shows the cursor."""
    await pilot.press(*keys)
    await wait_for(pilot, lambda: app.settled, what="the replay repainting at the cursor")


def line_with(app: ReplayApp, word: str) -> str:
    return next((line for line in screen_text(app).splitlines() if word in line), "")


async def line_shows(pilot: Pilot[int], app: ReplayApp, word: str, needle: str) -> None:
    """Wait until the screen's line with ``word`` says ``needle``: the compositor can be a
    frame behind the widgets on a busy machine, so one read of the screen may be stale."""
    await wait_for(pilot, lambda: needle in line_with(app, word), f"{needle!r} by {word!r}")


async def test_cursor_keys_show_the_state_at_the_cursor(tmp_path: Path) -> None:
    path = tmp_path / "syn.tdbgrec"
    synthetic_recording(path)
    timeline = load(str(path))
    app = ReplayApp(timeline)
    async with app.run_test(size=SIZE) as pilot:
        # Opens at the end: the NaN at 150, all three alerts, the NaN hunt's answer.
        await line_shows(pilot, app, "replay ·", "replay · step 199 / 199")
        await line_shows(pilot, app, "tdbg synthetic", "step 199")
        assert loss_subtitle(app).startswith("last NaN")
        assert alerts_subtitle(app) == "3 total"
        assert app.state.deep.nan_hunt is not None
        assert app.state.deep.nan_hunt.module_label.startswith("blocks.0.attn")

        await press(pilot, app, "home")
        await line_shows(pilot, app, "replay ·", "replay · step 0 / 199")
        await line_shows(pilot, app, "tdbg synthetic", "step 0 ")
        assert loss_subtitle(app).startswith(f"last {expected_loss(timeline, 0)} ")
        assert alerts_subtitle(app) == "0 total"
        assert app.state.deep.nan_hunt is None and app.state.grads.latest_step() == 0

        await press(pilot, app, *["shift+right"] * 4, *["right"] * 10)
        await line_shows(pilot, app, "replay ·", "replay · step 50 / 199")
        assert alerts_subtitle(app) == "1 total"  # the alert at step 50, not the later ones
        assert loss_subtitle(app).startswith(f"last {expected_loss(timeline, 50)} ")
        await press(pilot, app, "left")
        assert alerts_subtitle(app) == "0 total" and app.cursor == 49

        await press(pilot, app, "shift+right")  # 5 % of 200 steps, at least 10
        assert app.cursor == 59 and app.state.last_step == 59
        assert app.state.n_steps == 60 and app.state.grads.latest_step() == 59

        # The gradient table uses arrows when focused: the replay cursor still wins.
        app.monitor.query_one(GradientTable).focus()
        await press(pilot, app, "right")
        assert app.cursor == 60
        await press(pilot, app, "end")
        assert app.cursor == 199 and alerts_subtitle(app) == "3 total"
        await press(pilot, app, "right")  # past the end: stays
        assert app.cursor == 199


async def test_panels_follow_the_cursor_into_the_nan(tmp_path: Path) -> None:
    path = tmp_path / "syn.tdbgrec"
    synthetic_recording(path)
    timeline = load(str(path))
    app = ReplayApp(timeline)
    async with app.run_test(size=SIZE) as pilot:
        await press(pilot, app, "home", *["shift+right"] * 14, *["right"] * 9)
        assert not app.state.diverged and not app.monitor.has_class("-diverged")
        assert app.state.alert_count == 2 and app.state.nonfinite_alerts == 0
        await press(pilot, app, "right")  # step 150: the loss is NaN
        assert app.state.diverged and app.monitor.has_class("-diverged")
        assert app.state.nonfinite_alerts == 1
        await line_shows(pilot, app, "nonfinite_loss", "nonfinite_loss")
        assert app.state.deep.nan_hunt is None  # its job finished at 151
        await press(pilot, app, "right")
        assert app.state.deep.nan_hunt is not None
        probe = app.state.probe
        assert probe is not None and probe.clients == 140  # the last report before step 151
        assert math.isnan(app.state.last_loss or 0.0)


async def test_deep_dive_keys_say_a_recording_cannot_run_commands(tmp_path: Path) -> None:
    path = tmp_path / "syn.tdbgrec"
    synthetic_recording(path)
    app = ReplayApp(load(str(path)))
    async with app.run_test(size=SIZE) as pilot:
        for key in ("n", "p", "m", "a", "s", "c"):
            await press(pilot, app, key)
        # The keys move no cursor (settled all along): wait for their notices themselves.
        await wait_for(pilot, lambda: len(app.notices) >= 6, "a notice for each key")
        messages = app.notices
        assert len(messages) == 6 and all(READ_ONLY in m for m in messages), messages
        assert len(app.screen_stack) == 1  # no profile form opened
        await press(pilot, app, "question_mark")
        # The help is taller than the terminal: its end lists the replay keys.
        await pilot.press("end")
        keys = ("Replay (tdbg-tui replay FILE", "one recorded step back / forward")
        await wait_for(pilot, lambda: all(k in screen_text(app) for k in keys), "replay keys")


@pytest.mark.slow
async def test_replay_of_a_killed_recording_of_a_real_run(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """A training subprocess recording with TDBG_RECORD, SIGKILLed mid-run, then replayed."""
    path = tmp_path / "killed.tdbgrec"
    losses = [float(line[2]) for line in record_until_killed(path, runtime_dir, 60)]
    timeline = load(str(path))
    assert timeline.note is not None and not timeline.ended
    assert not timeline.recording.damaged  # killed, not damaged: every block checked out
    app = ReplayApp(timeline)
    async with app.run_test(size=SIZE) as pilot:
        await line_shows(pilot, app, "replay ·", "killed")
        assert app.state.layer_names == ["0", "2"]
        assert app.state.last_step == timeline.step_at(len(timeline) - 1)
        assert app.state.last_step is not None and app.state.last_step >= 60
        assert app.notices == [timeline.note]
        assert "killed" in line_with(app, "replay ·")
        assert "damaged" not in line_with(app, "replay ·")
        await press(pilot, app, "home")
        assert app.state.last_loss == pytest.approx(losses[0], rel=1e-6)
        await press(pilot, app, "right", "right")
        assert app.state.last_loss == pytest.approx(losses[2], rel=1e-6)


def test_a_flipped_byte_reads_as_damaged_and_a_cut_tail_as_killed(tmp_path: Path) -> None:
    path = tmp_path / "syn.tdbgrec"
    synthetic_recording(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.tdbgrec"
    cut.write_bytes(data[:-7])  # the last write cut off, as by a kill
    bad = tmp_path / "bad.tdbgrec"
    flipped = bytearray(data)
    flipped[data.index(b"grad_norms", len(data) // 2) + 20] ^= 0x5A  # inside a steps block
    bad.write_bytes(bytes(flipped))
    states = {}
    for target in (cut, bad):
        app = ReplayApp(load(str(target)))
        states[target.name] = app.file_state
    assert states == {"cut.tdbgrec": "killed", "bad.tdbgrec": "damaged"}


def test_state_at_is_independent_of_the_path_taken(tmp_path: Path) -> None:
    """Views share the whole run's arrays: moving back and forth never mixes states."""
    path = tmp_path / "syn.tdbgrec"
    synthetic_recording(path, steps=1200, batch=40)
    timeline = Timeline(Recording(path))
    late = timeline.state_at(1100)
    early = timeline.state_at(100)
    again = timeline.state_at(1100)
    assert early.last_step == 100 and late.last_step == again.last_step == 1100
    assert list(late.loss.values[:101]) == pytest.approx(list(early.loss.values), nan_ok=True)
    steps, rows = late.grads.matrix()
    assert steps[-1] == 1100 and len(steps) <= 1024 and rows.shape[1] == 6
    assert list(steps) == sorted(steps)
    assert early.alert_count == 1 and late.alert_count == 3  # alerts at 50, 120, 150


async def test_a_run_whose_steps_carry_no_loss_says_so_not_that_it_is_nan(
    tmp_path: Path,
) -> None:
    """``tdbg run`` of a loop without backward() (``torch.autograd.grad``): its steps have
    gradients but no loss. The loss panel says no loss was reported (not "no finite loss",
    which reads as a NaN), and the alert says why."""
    from test_zero_code import run_recorded

    path = tmp_path / "grad.tdbg"
    done = run_recorded(path, "train_no_single_backward.py", "grad", grad_every=False)
    assert done.returncode == 0, done.stderr
    app = ReplayApp(load(str(path)))
    async with app.run_test(size=SIZE) as pilot:
        # Found at the first update, watched from the second: 7 steps of 8 updates.
        await line_shows(pilot, app, "replay ·", "replay · step 6 / 6")
        await wait_for(
            pilot,
            lambda: "no loss reported by the steps so far" in screen_text(app),
            "the loss panel's note",
        )
        assert "no finite loss" not in screen_text(app)
        assert "probe_error: the model is" in screen_text(app)  # the alert, cut to fit
