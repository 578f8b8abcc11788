"""Another run under this one's loss (`tdbg-tui RUN --compare OLD.tdbg`, `tdbg-tui A.tdbg B.tdbg`):
drawn up to this run's step in a colour of its own, named in the legend, inside the y-range."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_tui_deep import FeedSource
from waiting import wait_for

from tdbg.model.run_state import RunState
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.app import make_app, screen_text
from tdbg.tui.widgets.loss_chart import LossChart


def _steps(first: int, n: int, loss: float) -> dict:
    return pack_steps([StepRecord(step=i, time=1.0 + i, loss=loss) for i in range(first, n)], 0)


async def test_yesterday_s_run_is_drawn_up_to_today_s_step() -> None:
    yesterday = RunState({"name": "yesterday"})
    yesterday.apply(_steps(0, 200, 0.25))  # far below today's: the y-range must take it in
    source = FeedSource()
    app = make_app(source)
    app.compare_with([("yesterday.tdbg", yesterday)])
    async with app.run_test(size=(120, 40)) as pilot:
        source.feed(_steps(0, 50, 2.0), {"type": "synced"})
        chart = app.query_one(LossChart)

        def drawn() -> bool:
            data = chart._data
            return data is not None and len(data.steps) == 50

        await wait_for(pilot, drawn, "today's 50 steps drawn")
        data = chart._data
        assert data is not None and len(data.fitted) == 1
        steps, values, _ = data.fitted[0]
        assert int(steps[-1]) == 49 and len(values) == 50  # up to today's step, not beyond
        text = screen_text(app)
        assert "━ yesterday.tdbg" in text
        assert "0.5┤" in text  # the y-range reaches down to yesterday's 0.25


def test_two_recordings_replay_the_first_with_the_second_under_it(tmp_path: Path) -> None:
    # A second recording that is not one is one line and exit 2, before any screen starts.
    bad = tmp_path / "b.tdbg"
    bad.write_bytes(b"junk")
    out = subprocess.run(
        [sys.executable, "-m", "tdbg.cli", "tui", "--compare", str(bad), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
