"""``i``: the model summary over the monitor, at any size, and back with Escape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Loop
from test_tui_app import painted, shows
from waiting import wait_for

import tdbg
from tdbg.protocol.messages import alert_message
from tdbg.tui.app import make_app, screen_text
from tdbg.tui.replay_app import ReplayApp, load
from tdbg.tui.screens.model_info import ModelInfoScreen
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, START_TIME, synthetic_run


def _run_with_summary() -> list[dict[str, Any]]:
    """The synthetic run, its layers message carrying the model summary's columns as a probe
    sends them, and a no_grad alert for one layer."""
    messages = synthetic_run(steps=60, n_layers=4)
    layers = next(m for m in messages if m.get("type") == "layers")
    names = layers["names"]
    layers.update(
        types=["Embedding", "Linear", "Linear", "LayerNorm"],
        dtypes=["float32", "bfloat16", "bfloat16", "float32"],
        devices=["cuda:0"] * 4,
        bytes=[4000, 2000, 2000, 4000],
        trainable=[0, 1000, 1000, 1000],
        optimizer=[-1, 0, 0, -1],
    )
    no_grad = alert_message("no_grad", "warning", 40, "no gradient", [names[2]], START_TIME)
    return [*messages, no_grad]


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_model_key_shows_the_summary_and_escape_returns(size: tuple[int, int]) -> None:
    run = dict(RUN, optimizers=[{"name": "adamw", "type": "AdamW", "groups": 2}])
    app = make_app(ReplaySource(_run_with_summary(), run))
    async with app.run_test(size=size) as pilot:
        await painted(pilot, app)
        await wait_for(pilot, lambda: app.state.alert_count >= 1, "the no_grad alert")
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelInfoScreen), "the model")
        text = await shows(pilot, app, "4000 parameters in 4 layers", "optimizers: adamw")
        assert "by dtype: float32 2000, bfloat16 2000" in text
        names = app.state.layer_names
        # The last lines scroll into view: the layers to look at.
        await pilot.press("end")
        await shows(pilot, app, f"{names[0]}: frozen", f"{names[3]}: no optimizer")
        await shows(pilot, app, f"{names[2]}: no gradient")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "the monitor")
        assert "parameters in 4 layers" not in screen_text(app)


async def test_a_replayed_recording_shows_its_model(tmp_path: Path) -> None:
    # A real run recorded: its frozen first layer and the summary's columns survive the file.
    loop = Loop()
    for param in loop.model[0].parameters():
        param.requires_grad_(False)
    path = tmp_path / "frozen.tdbg"
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path)
    loop.run(5, probe)
    probe.close()
    app = ReplayApp(load(str(path)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: bool(app.state.layer_facts), "the layers read")
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelInfoScreen), "the model")
        await shows(pilot, app, "0: frozen", "float32", "Linear", "SGD")
