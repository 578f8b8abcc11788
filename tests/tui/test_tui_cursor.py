"""The inspect cursor (g, the arrows, escape) reading every chart at one step, and log-y kept per
chart (l) (issue 34)."""

from __future__ import annotations

from test_tui_app import shows
from test_tui_layout import region_lines
from test_tui_loss_chart import focus_by_tab
from waiting import wait_for

from tdbg.model.cursor import lr_at, metric_at
from tdbg.tui.app import make_app, screen_text
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run
from tdbg.tui.widgets.loss_chart import LossChart
from tdbg.tui.widgets.metric_table import MetricTable


async def test_cursor_reads_every_chart_at_one_step() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=400), dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 400, "400 steps")
        await shows(pilot, app, "linear (l)")
        monitor = app.screen
        assert isinstance(monitor, MonitorScreen)
        await pilot.press("e")
        await shows(pilot, app, "▏step 399 loss", "cursor ← → · esc", "step 399 ▲")
        stride = app.query_one(LossChart).cursor_stride()  # steps per braille dot
        assert stride > 1
        for _ in range(5):
            await pilot.press("left")
        await wait_for(pilot, lambda: monitor.cursor_step == 399 - 5 * stride, "five dots back")
        state = app.state
        step = monitor.cursor_step
        assert step is not None
        loss = float(state.loss.values[list(state.steps.values).index(step)])
        await shows(pilot, app, f"▏step {step} loss {loss:.4g}", f"step {step} ▲")
        await pilot.press("shift+left")
        at = 399 - 15 * stride
        await wait_for(pilot, lambda: monitor.cursor_step == at, "ten dots more")
        # The learning rate, the metrics and the gradient norms read the cursor's step too.
        lr = lr_at(state, at)[0]
        lr_lines = "\n".join(region_lines(app, app.query_one("#lr")))
        assert f"{lr:.3e}" in lr_lines, lr_lines
        table = app.query_one(MetricTable)
        assert table.cursor == at
        point = metric_at(state.metrics["loss/netG"], at)
        assert point is not None
        await shows(pilot, app, f"{point[1]:.4g}")
        summary = "\n".join(region_lines(app, app.query_one("#grad-summary")))
        assert f"▏step {at} total" in summary and "blocks.0.attn.weight" in summary, summary
        # The step-time chart reads the same step.
        chart = app.query_one(LossChart)
        await focus_by_tab(pilot, app, chart)
        await pilot.press("v")
        await shows(pilot, app, f"▏step {at} ms")
        await pilot.press("escape")
        await wait_for(pilot, lambda: monitor.cursor_step is None, "the cursor gone")
        await wait_for(pilot, lambda: "▏step" not in screen_text(app), "no cursor on screen")
        # With the cursor off, the arrows pan the chart again.
        await pilot.press("w", "left")
        await shows(pilot, app, "steps 0–")


async def test_log_y_is_kept_per_chart() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=400), dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 400, "400 steps")
        chart = app.query_one(LossChart)
        await focus_by_tab(pilot, app, chart)
        await pilot.press("l")
        await shows(pilot, app, "log (l)", "· log")
        await pilot.press("v")  # the step time keeps its own scale: linear
        await shows(pilot, app, "step time ms", "linear (l)")
        assert chart.logs == {"loss"}
        await pilot.press("l")
        await wait_for(pilot, lambda: chart.logs == {"loss", "step time"}, "both on log")
        await pilot.press("v", "l")
        await wait_for(pilot, lambda: chart.logs == {"step time"}, "the loss back to linear")
        await shows(pilot, app, "linear (l)")
