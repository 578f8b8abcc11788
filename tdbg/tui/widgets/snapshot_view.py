"""SnapshotView: a memory snapshot job's progress, its file, and the top allocation sites."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text

from tdbg.format import fmt, fmt_bytes
from tdbg.model.deep import DeepState, progress
from tdbg.tui.widgets.profiler_panel import steps_text
from tdbg.tui.widgets.steady import SteadyStatic

TOP_SITES = 10

NONE_YET = (
    "No memory snapshot yet. Press m on a CUDA run: the probe records allocator history for the"
    " next steps and writes a file for PyTorch's memory visualizer (pytorch.org/memory_viz)."
)


class SnapshotView(SteadyStatic):
    COMPONENT_CLASSES: ClassVar[set[str]] = {"snapshot-view--dim", "snapshot-view--status"}

    def show(self, deep: DeepState, unavailable: str | None = None) -> None:
        job = deep.latest_job("snapshot")
        refusal = deep.refusal("snapshot")
        result = deep.snapshot
        self.set_class(
            refusal is not None or (job is not None and job.state == "failed"), "-failed"
        )
        status_style = self.get_component_rich_style("snapshot-view--status")
        dim = self.get_component_rich_style("snapshot-view--dim")
        text = Text(no_wrap=True, overflow="ellipsis")
        if refusal is not None:
            text.append(f"memory snapshot refused — {refusal}\n", status_style)
        elif job is not None:
            text.append(progress(job) + "\n", status_style)
        elif unavailable:
            text.append(f"memory snapshot unavailable: {unavailable}\n", status_style)
        if result is None:
            if job is None and refusal is None:
                text.append(NONE_YET, dim)
                text.no_wrap = False
            self.update(text)
            return
        text.append(
            f"snapshot #{deep.snapshot_job} · {steps_text(result.steps)}"
            f" · active {fmt_bytes(result.active_bytes)}"
            f" · reserved {fmt_bytes(result.reserved_bytes)}\n"
        )
        if result.file is not None:
            text.append(f"file {result.file.path} ({fmt_bytes(result.file.size)})")
            text.append(" — open in pytorch.org/memory_viz\n", dim)
        text.append("top allocation sites by size:\n", dim)
        for top in result.top[:TOP_SITES]:
            text.append(f"  {fmt_bytes(top.bytes):>10}  ×{fmt(top.count, 'd'):<6} {top.site}\n")
        if not result.top:
            text.append("  n/a (no allocation recorded)\n", dim)
        text.rstrip()
        self.update(text)
