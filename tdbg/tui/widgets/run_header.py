"""RunHeader: run name, state, step/total, epoch, steps/s, ETA, elapsed, host, pid; then what
is watched (models, optimizers)."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text

from tdbg.format import fmt, fmt_duration, fmt_percent, fmt_span
from tdbg.model.ending import how_it_ended
from tdbg.model.health import assess
from tdbg.model.run_state import RunState
from tdbg.tui.widgets.steady import SteadyStatic

VERDICT_SECONDS = 1.0  # the verdict is re-judged this often even when no data arrives


class RunHeader(SteadyStatic):
    """The top line. The connection state is also set as a CSS class (``-live``, ``-ended``...)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "run-header--name",
        "run-header--state",
        "run-header--dim",
    }
    STATES = ("connecting", "live", "ended", "reconnecting", "waiting")
    VERDICTS = ("stalled", "non-finite", "input-bound", "probe-off")

    def on_mount(self) -> None:
        # A stalled run sends nothing: without a clock of its own the header would say "live".
        self._shown: tuple[RunState, bool] | None = None
        self.set_interval(VERDICT_SECONDS, self._rejudge)

    def _rejudge(self) -> None:
        shown = getattr(self, "_shown", None)
        if shown is not None:
            self.show(*shown)

    def show(self, state: RunState, two_lines: bool = True) -> None:
        """Line 1: who, the state, progress (step/total, epoch, ETA); line 2 (``two_lines``,
        else appended to line 1): what is watched."""
        self._shown = (state, two_lines)
        run = state.run
        for name in self.STATES:
            self.set_class(state.connection == name, f"-{name}")
        health = assess(state, by_arrival=True) if state.connection == "live" else None
        verdict = health.word.replace(" ", "-") if health is not None else ""
        for name in self.VERDICTS:
            self.set_class(verdict == name, f"-{name}")
        clean = state.probe_closed or (state.end_reason or "").startswith(("shutdown", "closed"))
        self.set_class(state.ended and clean, "-clean")
        name_style = self.get_component_rich_style("run-header--name")
        dim = self.get_component_rich_style("run-header--dim")
        state_style = self.get_component_rich_style("run-header--state")
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" tdbg ", dim)
        text.append(str(run.get("name") or "(no run)"), name_style)
        label = state.connection
        ended = state.connection == "ended" or state.probe_closed
        if ended:  # how: a clean shutdown, a lost connection, dropped as a slow reader, ...
            label = f"run ended: {how_it_ended(state.end_reason)}"
        elif state.connection == "reconnecting":
            # Either a restarted run was found or a dropped connection (ssh) is being retried:
            # the notice beside the screen says which.
            label = "reconnecting"
        if health is not None and verdict in self.VERDICTS:
            # The run's health in words: stalled for 1m03s, non-finite since step N, ...
            label = f"{health.word}: {health.detail}"
        text.append("  ● ", state_style)
        text.append(label, state_style)
        total = state.planned_steps
        step = fmt(state.last_step, "d")
        if total is not None:
            progress = state.progress()
            text.append(f"  step {step}/{total} {fmt_percent(progress, '.0f')}%")
        else:
            text.append(f"  step {step}")
        epoch = state.epoch
        if epoch is not None:
            text.append(f"  epoch {epoch:g}")
        if health is not None and not ended:  # a recent window, 0 while stalled; no stale rate
            text.append(f"  {fmt(health.steps_per_sec, '.1f')} steps/s")
        eta = state.eta()
        if eta is not None and verdict != "stalled":  # a stalled run has no time left to tell
            text.append(f"  ETA {fmt_span(eta)}")
        text.append(f"  elapsed {fmt_duration(state.elapsed())}")
        where = f"  {run.get('host') or 'n/a'}  pid {run.get('pid', 'n/a')}"
        if run.get("world_size") is not None or run.get("rank"):
            where += f"  rank {run.get('rank', 0)}"
        text.append(where, dim)
        watched = watching(state)
        self.set_class(two_lines and bool(watched), "-two")
        width = self.size.width or 500  # before the first layout: no cut
        if watched and not two_lines:
            text.append(f"  {watched}", dim)
        text.truncate(width, overflow="ellipsis")
        if watched and two_lines:
            second = Text(f" {watched}", style=dim, no_wrap=True, overflow="ellipsis")
            second.truncate(width, overflow="ellipsis")
            text = Text("\n").join([text, second])
        self.update(text)


def watching(state: RunState) -> str:
    """``watching netG, netD · optimizers optG (Adam), optD (Adam)``; "" when the run does not
    say (an older probe)."""
    parts = []
    models = state.models
    if models:
        parts.append("watching " + ", ".join(models))
    optimizers = state.optimizers
    if len(optimizers) == 1 and optimizers[0][0].lower().startswith("opt"):
        name, kind, _ = optimizers[0]  # "optimizer (Adam)", not "optimizer optimizer (Adam)"
        parts.append(f"{name} ({kind})")
    elif optimizers:
        word = "optimizer" if len(optimizers) == 1 else "optimizers"
        parts.append(f"{word} " + ", ".join(f"{n} ({t})" for n, t, _ in optimizers))
    groups = state.param_groups
    if groups is not None and groups > 1:
        parts.append(f"{groups} param groups")
    return " · ".join(parts)
