"""RunHeader: run name, host, pid, step, steps/s, elapsed and the connection state."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.widgets import Static

from tdbg.format import fmt, fmt_duration
from tdbg.tui.state.run_state import RunState


class RunHeader(Static):
    """The top line. The connection state is also set as a CSS class (``-live``, ``-ended``...)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "run-header--name",
        "run-header--state",
        "run-header--dim",
    }
    STATES = ("connecting", "live", "ended", "reconnecting", "waiting")

    def show(self, state: RunState) -> None:
        run = state.run
        for name in self.STATES:
            self.set_class(state.connection == name, f"-{name}")
        name_style = self.get_component_rich_style("run-header--name")
        dim = self.get_component_rich_style("run-header--dim")
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" tdbg ", dim)
        text.append(str(run.get("name") or "(no run)"), name_style)
        text.append(
            f"  {run.get('host') or 'n/a'}  pid {run.get('pid', 'n/a')}  rank {run.get('rank', 0)}",
            dim,
        )
        text.append(f"  step {fmt(state.last_step, 'd')}")
        text.append(f"  {fmt(state.steps_per_sec(), '.1f')} steps/s")
        text.append(f"  elapsed {fmt_duration(state.elapsed())}")
        label = state.connection
        if state.connection == "ended":
            label = f"run ended ({state.end_reason or 'closed'})"
        elif state.connection == "reconnecting":
            # Either a restarted run was found or a dropped connection (ssh) is being retried:
            # the notice beside the screen says which.
            label = "reconnecting"
        text.append("  ● ", self.get_component_rich_style("run-header--state"))
        text.append(label, self.get_component_rich_style("run-header--state"))
        self.update(text)
