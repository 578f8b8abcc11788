"""tdbg's actions in the command palette (ctrl+p) of the real app attached to a real probe."""

from __future__ import annotations

from pathlib import Path

from conftest import Loop
from textual.command import CommandPalette
from waiting import wait_for

import tdbg
from tdbg.tui.app import make_app, screen_text
from tdbg.tui.screens.help import HelpScreen
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.screens.profile_form import ProfileFormScreen
from tdbg.tui.sources.base import SocketSource


async def test_palette_lists_tdbg_actions_and_runs_them(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="palette")
    loop.run(5, probe)
    app = make_app(SocketSource(path=str(probe.socket_path)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps >= 5, what="the run's steps")
        titles = {command.title for command in app.get_system_commands(app.screen)}
        for title in ("Profile", "NaN hunt", "Heatmap", "Log scale", "Switch run", "Help"):
            assert title in titles, titles
        assert [t for t in titles if t == "Quit"] == ["Quit"]  # ours, not Textual's as well

        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), "the palette")
        await pilot.press(*"profile")
        await wait_for(pilot, lambda: "key p" in screen_text(app), what="Profile, key p")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfileFormScreen), "profile form")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "the monitor")

        # A toggle runs on the monitor as its key does.
        monitor = app.screen
        assert isinstance(monitor, MonitorScreen) and not monitor.log_scale
        await pilot.press("ctrl+p", *"log scale")
        await wait_for(pilot, lambda: "key l" in screen_text(app), what="Log scale, key l")
        await pilot.press("enter")
        await wait_for(pilot, lambda: monitor.log_scale, what="log scale on")

        await pilot.press("ctrl+p", *"help")
        await wait_for(pilot, lambda: "key ?" in screen_text(app), what="Help, key ?")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
    probe.close()
