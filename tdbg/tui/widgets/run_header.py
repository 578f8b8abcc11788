"""RunHeader: run name, state, step/total, epoch, steps/s, ETA, elapsed, host, pid; then what
is watched (models, optimizers)."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text

from tdbg.format import fmt, fmt_duration, fmt_percent, fmt_span
from tdbg.model.ending import how_it_ended
from tdbg.model.health import assess
from tdbg.model.run_state import RunState
from tdbg.tui.widgets.fit import Part, fit_parts
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
        # Each part with its rank: a narrow terminal (80 columns over ssh) leaves out the host,
        # then the elapsed clock, ... so that the state and the step always show in full.
        parts: list[Part] = [(Text(" tdbg ", dim), 0)]
        parts.append((Text(str(run.get("name") or "(no run)"), name_style), 0))
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
        parts.append((Text(f"  ● {label}", state_style), 0))
        total = state.planned_steps
        step = fmt(state.last_step, "d")
        if total is not None:
            progress = state.progress()
            parts.append((f"  step {step}/{total}", 0))
            parts.append((f" {fmt_percent(progress, '.0f')}%", 3))
        else:
            parts.append((f"  step {step}", 0))
        epoch = state.epoch
        if epoch is not None:
            parts.append((f"  epoch {epoch:g}", 4))
        if health is not None and not ended:  # a recent window, 0 while stalled; no stale rate
            parts.append((f"  {fmt(health.steps_per_sec, '.1f')} steps/s", 2))
        eta = state.eta()
        if eta is not None and verdict != "stalled":  # a stalled run has no time left to tell
            parts.append((f"  ETA {fmt_span(eta)}", 1))
        parts.append((f"  elapsed {fmt_duration(state.elapsed())}", 5))
        where = f"  {run.get('host') or 'n/a'}  pid {run.get('pid', 'n/a')}"
        parts.append((Text(where, dim), 6))
        if run.get("world_size") is not None or run.get("rank"):
            parts.append((Text(f"  rank {run.get('rank', 0)}", dim), 2))
        watched = watching(state)
        self.set_class(two_lines and bool(watched), "-two")
        width = self.size.width or 500  # before the first layout: no cut
        if watched and not two_lines:
            parts.append((Text(f"  {watched}", dim), 7))
        text = fit_parts(parts, width)
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
