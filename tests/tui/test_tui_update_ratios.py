"""The gradient table's update-ratio column: there once a run sends ratios, each layer's latest."""

from __future__ import annotations

from test_tui_app import painted, shows
from waiting import wait_for

from tdbg.protocol.messages import UpdateRatios
from tdbg.tui.app import make_app, screen_text
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run


async def test_the_column_comes_with_the_first_ratios() -> None:
    plain = make_app(ReplaySource(synthetic_run(steps=40, n_layers=4), dict(RUN)))
    async with plain.run_test(size=(120, 40)) as pilot:
        await painted(pilot, plain)
        assert "Δw/w" not in screen_text(plain)  # an older probe's run: the table as it was

    ratios = [
        UpdateRatios(10, (0, 1, 2), (1.5e-3, 0.0, 0.25)).to_wire(),
        UpdateRatios(30, (0,), (2.5e-3,)).to_wire(),  # layer 0 again: the latest is shown
    ]
    app = make_app(ReplaySource([*synthetic_run(steps=40, n_layers=4), *ratios], dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: len(app.state.update_ratio) == 3, "the ratios read")
        await painted(pilot, app)
        text = await shows(pilot, app, "Δw/w", "2.5e-03", "2.5e-01")
        assert "1.5e-03" not in text  # layer 0's older ratio
        rows = [line for line in text.splitlines() if "2.5e-01" in line or "2.5e-03" in line]
        assert len(rows) == 2


async def test_u_shows_the_ratios_over_the_steps_as_a_heatmap() -> None:
    ratios = [
        UpdateRatios(step, (0, 1), (1e-3 * (1 + step / 10), 0.0)).to_wire()
        for step in range(0, 40, 5)
    ]
    app = make_app(ReplaySource([*synthetic_run(steps=40, n_layers=4), *ratios], dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.update_revision == 8, "the ratios read")
        await painted(pilot, app)
        await pilot.press("u")
        await shows(pilot, app, "update ratios ‖Δw‖/‖w‖ · u: norms")
        steps, rows = app.state.update_matrix()
        assert list(steps) == list(range(0, 40, 5)) and rows.shape == (8, 4)
        assert rows[:, 1].tolist() == [0.0] * 8  # layer 1 never moved: exact zeros (░)
        assert all(v != v for v in rows[:, 2])  # layer 2 never measured: blank
        await pilot.press("u")
        await shows(pilot, app, "heatmap · u: ratios · h: table")
