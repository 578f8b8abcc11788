"""tdbg-tui shows issue 10's numbers, asserted on the screen as a user reads it: progress, epoch
and ETA; micro-batches; clipping beside the pre-clip norms; what is watched; user metrics (table,
NaN highlighted, charted on enter, bounded); a run that ended cleanly; an older probe; 80x24."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.pilot import Pilot
from waiting import wait_for

from tdbg.protocol.framing import pack
from tdbg.protocol.messages import metrics_message
from tdbg.protocol.steps import pack_steps
from tdbg.tui.app import TdbgApp, make_app, screen_text
from tdbg.tui.replay_app import ReplayApp, load
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, layer_names, metric_points, step_records, synthetic_run
from tdbg.tui.widgets.metric_table import MetricTable

SIZE = (120, 40)


async def shows(pilot: Pilot[Any], app: TdbgApp | ReplayApp, *needles: str) -> str:
    """Wait until every needle is on screen; return the screen text."""
    await wait_for(pilot, lambda: all(n in screen_text(app) for n in needles), f"{needles}")
    return screen_text(app)


def live(**kwargs: Any) -> TdbgApp:
    return make_app(ReplaySource(synthetic_run(**kwargs), dict(RUN), end=False))


async def test_the_main_screen_shows_the_true_numbers() -> None:
    app = live(steps=400, n_layers=12, skipped_steps=3)
    async with app.run_test(size=SIZE) as pilot:
        text = await shows(
            pilot,
            app,
            "step 399/1000 40%",
            "val/acc",
            "4 micro-batches",
            "clip 1.0 · active",
            "netD blocks.2.proj.weight",
            "optD      1.000e-04",
            # and one of each other panel's, which may repaint a frame after these
            "watching netG, netD",
            "━ loss/netG",
            "Gradient norms per layer (pre-clip)",
            "% of steps",
            "optG      1.000e-03",
            "5 names",
            "skipped 3 non-finite updates",
        )
        lines = text.split("\n")
        header, watched = lines[0], lines[1]
        assert "● live" in header and "epoch 3" in header and "20.0 steps/s" in header
        assert "ETA 30s" in header  # 600 steps left at 20 steps/s
        assert "testhost" in header and "pid 4242" in header
        assert "watching netG, netD · optimizers optG (Adam), optD (Adam)" in watched
        assert "4 micro-batches" in text  # beside the loss
        assert "━ loss" in text and "━ val_loss" in text and "━ loss/netG" in text  # legend
        assert "Gradient norms per layer (pre-clip)" in text
        assert "clip 1.0 · active" in text and "% of steps" in text
        assert "netG blocks.0.attn.weight" in text and "netD blocks.2.proj.weight" in text
        assert "optG      1.000e-03" in text and "optD      1.000e-04" in text  # LR labels
        for name in ("loss/netG", "loss/netD", "grad_scale", "val_loss", "val/acc"):
            assert name in text
        assert "metric" in text and "min" in text and "max" in text and "5 names" in text
        assert "skipped 3 non-finite updates" in text


async def test_a_run_that_closed_cleanly_reads_run_ended() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=200, closed=True), dict(RUN)))
    async with app.run_test(size=SIZE) as pilot:
        text = await shows(pilot, app, "● run ended", "run ended · probe closed")
        assert "(shutdown)" not in text and "ETA" not in text and "PROBE OFF" not in text
        assert app.query_one("#header").has_class("-clean")


async def test_the_error_breaker_is_not_an_ended_run() -> None:
    messages = synthetic_run(steps=50)
    probe = next(m for m in messages if m["type"] == "probe")
    probe.update(disabled=True, errors=100, last_error="RuntimeError: boom")
    app = make_app(ReplaySource(messages, dict(RUN), end=False))
    async with app.run_test(size=SIZE) as pilot:
        text = await shows(pilot, app, "PROBE OFF: error breaker after 100 errors")
        assert "run ended" not in text


async def test_a_probe_over_its_budget_says_so_and_one_within_does_not() -> None:
    """Where the probe's fixed per-step work alone passes its budget (a very short step, a
    busy host) its reported cost is over it: the status line says so, in the warning colour,
    rather than showing a bare figure a user must compare with a setting they may not know."""
    messages = synthetic_run(steps=50)
    probe = next(m for m in messages if m["type"] == "probe")
    probe.update(cost_fraction=0.0166, overhead_budget=0.01)
    app = make_app(ReplaySource(messages, dict(RUN), end=False))
    async with app.run_test(size=SIZE) as pilot:
        await shows(pilot, app, "probe 1.7% > 1% budget")
        assert app.screen.query_one("ProbeStatus").has_class("-over-budget")
    within = live(steps=50)  # 0.6 % of a 2 % budget
    async with within.run_test(size=SIZE) as pilot:
        text = await shows(pilot, within, "probe 0.6%")
        assert "budget" not in text.split("probe 0.6%")[1].split("·")[0]
        assert not within.screen.query_one("ProbeStatus").has_class("-over-budget")


async def test_a_nan_metric_is_visible_and_flagged() -> None:
    app = live(steps=300, nan_at=250)
    async with app.run_test(size=SIZE) as pilot:
        text = await shows(pilot, app, "val_loss !", "1 non-finite")
        row = next(line for line in text.split("\n") if "val_loss !" in line)
        assert "NaN" in row and "300" not in row.split("NaN")[0]  # latest value NaN, step 250
        assert "250" in row


async def test_enter_charts_a_metric_and_again_goes_back() -> None:
    app = live(steps=300)
    async with app.run_test(size=SIZE) as pilot:
        await shows(pilot, app, "val/acc")
        table = app.query_one(MetricTable)
        table.focus()
        await pilot.pause()
        table.move_cursor(row=table.get_row_index("val/acc"))
        await pilot.pause()
        await pilot.press("enter")
        await shows(pilot, app, "Metric val/acc", "━ val/acc")
        await pilot.press("enter")
        await shows(pilot, app, "━ smoothed")
        monitor = app.screen
        assert isinstance(monitor, MonitorScreen) and monitor.chart_metric is None


async def test_many_metrics_stay_in_a_bounded_scrolling_table() -> None:
    app = live(steps=100, extra_metrics=40)
    async with app.run_test(size=SIZE) as pilot:
        await shows(pilot, app, "45 names")
        panel = app.query_one("#metrics-panel")
        assert panel.size.height <= 10  # the table scrolls; the charts keep their room
        assert "extra/metric_039" not in screen_text(app)
        table = app.query_one(MetricTable)
        table.focus()
        await pilot.pause()
        table.move_cursor(row=table.row_count - 1)  # the cursor scrolls the table
        await shows(pilot, app, "extra/metric_039")


async def test_an_older_probe_shows_none_of_it() -> None:
    run = {k: v for k, v in RUN.items() if k not in ("models", "optimizers", "param_groups")}
    messages = synthetic_run(
        steps=200, models=(), total_steps=None, metrics=False, true_numbers=False
    )
    app = make_app(ReplaySource(messages, run, end=False))
    async with app.run_test(size=SIZE) as pilot:
        text = await shows(pilot, app, "step 199", "blocks.0.attn.weight", "group 0", "total ")
        for absent in ("micro-batches", "clip", "epoch", "ETA", "watching", "Metrics", "/1000"):
            assert absent not in text, absent
        assert "group 0" in text and "total " in text
        assert app.query_one("#header").size.height == 1


async def test_lr_columns_beyond_the_cap_say_so() -> None:
    run = dict(RUN, param_groups=120)
    app = make_app(ReplaySource(synthetic_run(steps=20), run, end=False))
    async with app.run_test(size=SIZE) as pilot:
        await shows(pilot, app, "showing 2 of 120", "120 param groups")


async def test_80x24_keeps_the_essentials() -> None:
    app = live(steps=400)
    async with app.run_test(size=(80, 24)) as pilot:
        text = await shows(
            pilot,
            app,
            "step 399/1000 40%",
            "Metrics",
            "clip 1.0",
            "4 micro-batches",
            "1.69e-02",
            "p Profile",  # the footer keeps the main keys, not a focused panel's own
            "netG blocks.0",
        )
        assert app.query_one("#header").size.height == 1  # one line on a short screen
        # On a narrow, short screen the LR panel gives its room to the alerts.
        assert "4 micro-batches" in text and "netG blocks.0" in text
        assert app.query_one("#loss-chart").size.height >= 10  # >= 8 plot rows
        assert app.query_one("#grad-table").size.height >= 6  # a heading and >= 5 layers
        assert "Press p to profile" not in text  # the footer has the keys


async def test_200x60_has_room_for_everything() -> None:
    app = live(steps=400, extra_metrics=3)
    async with app.run_test(size=(200, 60)) as pilot:
        await shows(
            pilot,
            app,
            "step 399/1000 40%",
            "extra/metric_002",
            "watching netG, netD",
            "Press p to profile",
        )
        assert app.query_one("#loss-chart").size.height >= 15


async def test_a_replay_shows_metrics_as_they_stood_at_the_cursor(tmp_path: Path) -> None:
    from tdbg.probe.serving.recorder import Recorder  # the real writer: what a run records

    path = tmp_path / "run.tdbg"
    rec = Recorder(path, RUN, layer_names(4), [100] * 4)
    assert rec.open()
    for start in range(0, 200, 50):
        msg = pack_steps(step_records(start, 50, 4), 4)
        rec.add_steps(msg, pack(msg))
        rec.add(pack(dict(metrics_message(metric_points(start, 50, nan_at=150)))))
        rec.flush()
    rec.close()
    timeline = load(str(path))
    at_60 = timeline.state_at(timeline.index_of(60))
    assert at_60.metrics["val_loss"].last_step == 50 and at_60.micro_batches == 4
    app = ReplayApp(timeline)
    async with app.run_test(size=SIZE) as pilot:
        text = await shows(pilot, app, "val_loss !", "4 micro-batches", "clip 1.0 · active")
        assert "NaN" in next(line for line in text.split("\n") if "val_loss !" in line)
        for _ in range(3):
            await pilot.press("home")
        await wait_for(pilot, lambda: app.cursor == 0, "the cursor at the first step")

        def unflagged() -> str | None:
            text = screen_text(app)
            return text if "val_loss" in text and "val_loss !" not in text else None

        # The panels repaint at the cursor a moment after it moved (PAINT_DELAY): until then
        # the end's "val_loss !" is on screen, and "val_loss" with it.
        await wait_for(pilot, unflagged, "val_loss unflagged at step 0: the NaN came later")


async def test_a_layer_that_left_or_came_reads_no_norm_not_nan(runtime_dir: Path) -> None:
    # A real run's messages: the head replaced after 3 steps. The old head has no norm from
    # then on, the new one none before: blank, "gone" and last, not a NaN that would head the
    # table as the most urgent row, nor a heatmap full of NaN marks.
    from changed_runs import replaced_head_run

    from tdbg.tui.widgets.gradient_heatmap import ABSENT, NONFINITE, GradientHeatmap
    from tdbg.tui.widgets.gradient_table import GradientTable

    messages = [m for m in replaced_head_run(runtime_dir) if m["type"] != "welcome"]
    app = make_app(ReplaySource(messages, dict(RUN), end=False))
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count == 4, "the four layers")
        await wait_for(pilot, lambda: str(table.get_cell("1", "norm")).strip() == "gone", "gone")
        assert "nan" not in str(table.get_cell("1", "norm"))
        assert "!" not in str(table.get_cell("1", "trend"))  # blank once it left, not NaN marks
        for new in ("2", "3"):
            trend = str(table.get_cell(new, "trend"))
            assert "!" not in trend and trend.startswith(" ")  # blank before it came
        table.sort_mode = "norm"  # the largest first, a NaN before them; no norm last
        table.apply_sort()
        order = [int(str(row.key.value)) for row in table.ordered_rows]
        assert order[-1] == 1
        await pilot.press("h")
        heatmap = app.query_one(GradientHeatmap)
        await wait_for(pilot, lambda: heatmap._levels.shape[1] == 6, "six sampled steps")
        levels = heatmap._levels  # layers x steps 0..5
        assert not (levels == NONFINITE).any()
        assert (levels[1, 3:] == ABSENT).all() and (levels[1, :3] >= 0).all()
        assert (levels[2:, :3] == ABSENT).all() and (levels[2:, 3:] >= 0).all()
