"""NanHuntView: the NaN hunt's answer (first non-finite module) and anomaly mode's progress."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text

from tdbg.format import fmt, fmt_stat
from tdbg.model.deep import DeepState, progress
from tdbg.protocol.messages.results import NanHuntResult
from tdbg.tui.widgets.steady import SteadyStatic

NONE_YET = (
    "No NaN hunt yet. Press n: for the next step the probe watches every module's output and"
    " gradient and names the first one that is NaN/Inf. Press a for autograd anomaly mode."
)


def hunt_lines(hunt: NanHuntResult, job: int | None) -> list[str]:
    """The NaN hunt's answer in a few lines, as the user reads it."""
    checked = fmt(hunt.steps_checked, "d")
    trigger = f" · {hunt.trigger}" if hunt.trigger else ""
    if not hunt.found:
        return [f"NaN hunt #{job}: no non-finite value in {checked} step(s) checked{trigger}"]
    where = f"{hunt.phase or 'n/a'}"
    at = f" at step {hunt.step}" if hunt.step is not None else ""
    # What was measured only (anomaly mode names the module, not its figures): a row of
    # "n/a" beside "inputs finite" would claim what nobody looked at.
    figures = []
    if hunt.numel is not None:
        figures.append(f"{fmt(hunt.nonfinite, 'd')} of {fmt(hunt.numel, 'd')} elements non-finite")
    if hunt.input_nonfinite:
        figures.append("inputs already non-finite")
    elif hunt.input_min is not None or hunt.input_max is not None:
        figures.append(
            f"input min {fmt_stat(hunt.input_min)} max {fmt_stat(hunt.input_max)} · inputs finite"
        )
    lines = [
        f"NaN hunt #{job}: first non-finite {'gradient' if where == 'backward' else 'output'}"
        f" in {hunt.module_label} ({hunt.module_type or 'n/a'}) · {where}{at}",
    ]
    if figures:
        lines.append("  " + " · ".join(figures))
    params = (
        params_line(hunt.params_nonfinite) + " · " if hunt.params_nonfinite is not None else "  "
    )
    lines.append(f"{params}{checked} step(s) checked{trigger}")
    return lines


def params_line(params_nonfinite: int | None) -> str:
    """The module's own weights: when they already hold NaN/Inf, the hunt has found where the
    damage is now, not where it began — an earlier optimizer step spread it, and the first
    non-finite gradient alert names the layer it started in."""
    if not params_nonfinite:
        return f"  parameters non-finite {fmt(params_nonfinite, 'd')}"
    return (
        f"  its weights are already non-finite ({fmt(params_nonfinite, 'd')} elements): an earlier"
        " update spread it — the first nonfinite_grad alert shows where it began"
    )


class NanHuntView(SteadyStatic):
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "nan-hunt-view--found",
        "nan-hunt-view--status",
        "nan-hunt-view--dim",
        "nan-hunt-view--warning",
    }

    def show(self, deep: DeepState) -> None:
        status = self.get_component_rich_style("nan-hunt-view--status")
        dim = self.get_component_rich_style("nan-hunt-view--dim")
        text = Text(no_wrap=True, overflow="ellipsis")
        job = deep.latest_job("nan_hunt")
        refusal = deep.refusal("nan_hunt")
        hunt = deep.nan_hunt
        if refusal is not None:
            text.append(f"NaN hunt refused — {refusal}\n", status)
        elif job is not None and (hunt is None or deep.nan_hunt_job != job.job):
            text.append(progress(job) + "\n", status)
        if hunt is not None:
            style = self.get_component_rich_style("nan-hunt-view--found") if hunt.found else ""
            for i, line in enumerate(hunt_lines(hunt, deep.nan_hunt_job)):
                text.append(line + "\n", style if i == 0 else "")
        self._anomaly(deep, text)
        if not text.plain.strip():
            text.append(NONE_YET, dim)
            text.no_wrap = False
        text.rstrip()
        self.set_class(hunt is not None and hunt.found, "-found")
        self.update(text)

    def _anomaly(self, deep: DeepState, text: Text) -> None:
        job = deep.latest_job("anomaly")
        refusal = deep.refusal("anomaly")
        if refusal is not None:
            text.append(
                f"anomaly mode refused — {refusal}\n",
                self.get_component_rich_style("nan-hunt-view--status"),
            )
        elif job is not None and job.active:
            warning = self.get_component_rich_style("nan-hunt-view--warning")
            text.append(progress(job) + " — global and slow while on\n", warning)
        elif job is not None:
            errors = fmt(deep.anomaly.errors, "d") if deep.anomaly else "n/a"
            text.append(f"{progress(job)} · backward errors seen: {errors}\n")
