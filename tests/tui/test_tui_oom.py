"""tdbg-tui after a run that ran out of CUDA memory: its recording's post-mortem, with the
allocation stacks recorded, names the code behind the largest block on the alert's screen."""

from __future__ import annotations

from pathlib import Path

from test_oom import oom_recording
from test_tui_app import shows
from test_tui_loss_chart import focus_by_tab
from waiting import wait_for

from tdbg.tui.replay_app import ReplayApp, load
from tdbg.tui.screens.alert_detail import AlertDetailScreen
from tdbg.tui.widgets.alert_list import AlertList


async def test_the_post_mortem_names_the_allocating_frames_after_the_crash(tmp_path: Path) -> None:
    path = oom_recording(tmp_path / "oom.tdbg")
    app = ReplayApp(load(str(path)))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.settled, "the replay painted at its cursor")
        await wait_for(pilot, lambda: app.state.alert_count == 1, "the oom alert")
        await shows(pilot, app, "oom: CUDA out of memory")
        alerts = app.query_one(AlertList)
        await focus_by_tab(pilot, app, alerts)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, AlertDetailScreen), "the detail")
        await shows(
            pilot,
            app,
            "CUDA out of memory at step 3 (in the forward)",
            "allocate_activations",
            "run_out",
        )
