"""AnatomyBar: where a step's time goes (data, no-grad, forward, backward, optimizer)."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text

from tdbg.format import fmt
from tdbg.model.run_state import RunState
from tdbg.protocol.steps import PHASE_LABELS, PHASE_SHORT_LABELS
from tdbg.protocol.steps import PHASES as ANATOMY
from tdbg.tui.widgets.steady import SteadyStatic

LABELS = PHASE_LABELS
SHORT_LABELS = PHASE_SHORT_LABELS


class AnatomyBar(SteadyStatic):
    """A proportional coloured bar plus percentages; ``-input-bound`` when data dominates."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "anatomy-bar--data_time",
        "anatomy-bar--no_grad_time",
        "anatomy-bar--forward_time",
        "anatomy-bar--backward_time",
        "anatomy-bar--optimizer_time",
        "anatomy-bar--other",
        "anatomy-bar--warning",
    }

    def show(self, state: RunState, compact: bool = False) -> None:
        """The bar over the legend; ``compact`` (a short terminal): the legend alone."""
        shares = state.anatomy()
        self.set_class(state.input_bound, "-input-bound")
        width = max(10, self.size.width - 2)
        bar = Text(no_wrap=True, overflow="crop")
        used = 0
        if all(v is None for v in shares.values()):
            bar.append("step anatomy: n/a (phase timings not measured)")
        else:
            for name in ANATOMY:
                share = shares[name] or 0.0
                cells = int(round(share * width))
                cells = min(cells, width - used)
                style = self.get_component_rich_style(f"anatomy-bar--{name}")
                # A label only where it fits whole with a gap: cut ones ran into each other
                # ("daforwabackward"); the legend below names every phase anyway.
                label = LABELS[name] if cells > len(LABELS[name]) else ""
                bar.append(label.ljust(cells), style)
                used += cells
            if used < width:
                bar.append(
                    " " * (width - used), self.get_component_rich_style("anatomy-bar--other")
                )
        # A narrow terminal: short names, then single spaces, so the last phase is not the one
        # cut off (the INPUT-BOUND warning goes in front).
        room = width - (len("INPUT-BOUND  ") if state.input_bound else 0)
        for labels, gap, word in (
            (LABELS, "  ", "step "),
            (SHORT_LABELS, "  ", "step "),
            (SHORT_LABELS, " ", "step "),
            (SHORT_LABELS, " ", ""),
        ):
            legend = self._legend(state, shares, labels, gap, word)
            if legend.cell_len <= room:
                break
        # Throughput only where the run reports it: "n/a tokens/s" on a non-LM run is noise.
        for unit in ("samples", "tokens"):
            rate = state.throughput(unit)
            if rate is not None:
                legend.append(f"  {fmt(rate, '.4g')} {unit}/s")
        if state.input_bound:
            # First, so a narrow terminal cuts the explanation, not the warning.
            warning = Text("INPUT-BOUND", self.get_component_rich_style("anatomy-bar--warning"))
            wide = self.size.width >= len(legend) + 40
            legend = Text.assemble(
                warning, " data loader is the bottleneck  " if wide else "  ", legend
            )
            legend.no_wrap, legend.overflow = True, "ellipsis"
        self.update(legend if compact else Text("\n").join([bar, legend]))

    def _legend(
        self,
        state: RunState,
        shares: dict[str, float | None],
        labels: dict[str, str],
        gap: str,
        word: str,
    ) -> Text:
        legend = Text(no_wrap=True, overflow="ellipsis")
        step_time = state.mean_recent("step_time")
        legend.append(f"{word}{fmt(None if step_time is None else step_time * 1e3, '.1f', ' ms')}")
        for name in ANATOMY:
            part = shares[name]
            if name == "no_grad_time" and not (part is not None and part >= 0.005):
                continue  # named only while forwards without grad take a share of the steps
            legend.append(gap)
            legend.append("■", self.get_component_rich_style(f"anatomy-bar--{name}"))
            legend.append(
                f" {labels[name]} {fmt(None if part is None else part * 100, '.0f', '%')}"
            )
        return legend
