"""ProfilerPanel: a profile job's progress, its top-ops table, and the trace file below it."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from tdbg.format import fmt_bytes, fmt_seconds
from tdbg.model.deep import DeepState, progress
from tdbg.protocol.messages.results import ProfileResult
from tdbg.tui.widgets.profiler_table import TITLES, ProfilerTable
from tdbg.tui.widgets.steady import SteadyStatic

HINT = (
    "Press p to profile the next steps · m memory snapshot · n NaN hunt · a anomaly mode"
    " · s activation statistics"
)
STATES = ("idle", "active", "done", "failed", "refused")


def steps_text(steps: tuple[int, int] | None) -> str:
    if steps is None:
        return "steps n/a"
    first, last = steps
    return f"step {first}" if last in (None, first) else f"steps {first}–{last}"


def summary(profile: ProfileResult) -> str:
    wall = fmt_seconds(profile.wall_seconds)
    where = "" if profile.device else " · CPU only (no device columns)"
    return f"{steps_text(profile.steps)} · {wall} wall · {len(profile.rows)} ops{where}"


def one_line(text: str) -> Text:
    """A line that is cut with an ellipsis rather than wrapped (paths are long)."""
    return Text(text, no_wrap=True, overflow="ellipsis")


class ProfilerPanel(Vertical):
    """Dumb: ``show(deep)`` sets the text, the table and one state class (``-done``, ...)."""

    def compose(self) -> ComposeResult:
        yield SteadyStatic(HINT, id="profile-status", markup=False)
        yield ProfilerTable(id="profile-table")
        yield SteadyStatic("", id="profile-trace", markup=False)

    @property
    def table(self) -> ProfilerTable:
        return self.query_one(ProfilerTable)

    def show(self, deep: DeepState) -> None:
        job = deep.latest_job("profile")
        refusal = deep.refusal("profile")
        profile = deep.profile
        if refusal is not None:
            state, status = "refused", f"profile refused — {refusal}"
        elif job is not None:
            state = {"done": "done", "failed": "failed", "cancelled": "failed"}.get(
                job.state, "active"
            )
            status = progress(job)
            if profile is not None and deep.profile_job == job.job:
                status += f" · {summary(profile)}"
        else:
            state, status = "idle", HINT
        if profile is not None and (job is None or job.job != deep.profile_job):
            status += f"  (table: profile #{deep.profile_job}, {summary(profile)})"
        for name in STATES:
            self.set_class(state == name, f"-{name}")
        self.set_class(profile is None, "-empty")
        self.query_one("#profile-status", Static).update(one_line(status))
        self.table.show(profile, deep.previous_profile)
        trace = Text("\n", no_wrap=True).join(one_line(line) for line in self._trace_lines(deep))
        self.query_one("#profile-trace", Static).update(trace)

    def _trace_lines(self, deep: DeepState) -> list[str]:
        profile = deep.profile
        if profile is None:
            return []
        table = self.table
        if profile.trace is not None:
            size = fmt_bytes(profile.trace.size)
            line = f"trace {profile.trace.path} ({size}) — open in ui.perfetto.dev"
        else:
            line = "no trace file written"
        if profile.truncated:
            line += " · top ops only (truncated)"
        previous = table.previous
        if previous is not None:
            slower = table.slower_ops()
            metric = TITLES.get(table.metric, table.metric)
            compare = (
                f"Δ/call: {metric} per call vs profile #{deep.previous_profile_job}"
                f" ({steps_text(previous.steps)}) · {len(slower)} op(s) slower"
            )
            if slower:
                compare += ": " + ", ".join(slower[:3]) + (" …" if len(slower) > 3 else "")
            return [line, compare]
        return [line]
