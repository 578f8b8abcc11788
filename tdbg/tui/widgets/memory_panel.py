"""MemoryPanel: GPU gauges, the CUDA allocator, process and host memory, and what is missing."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text

from tdbg.format import fmt, fmt_bytes
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.reports import GpuStats, System
from tdbg.tui.widgets.fit import Part, fit_parts
from tdbg.tui.widgets.glyphs import gauge
from tdbg.tui.widgets.steady import SteadyStatic

GAUGE = 8


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float) and b > 0:
        return float(a) / float(b)
    return None


def _index(index: int | None) -> str:
    return "?" if index is None else str(index)


def cpu_run(state: RunState) -> bool:
    """No GPU reported and the run's device is not CUDA: GPU figures are not expected."""
    system = state.system
    device = str(state.run.get("device") or "")
    reported = system is not None and (system.gpus or system.cuda)
    return not reported and not device.startswith("cuda")


class MemoryPanel(SteadyStatic):
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "memory-panel--gauge",
        "memory-panel--hot",
        "memory-panel--missing",
        "memory-panel--dim",
    }

    def show(self, state: RunState, compact: bool = False) -> None:
        """The full panel, or (``compact``, a short terminal) one line of the main figures."""
        system = state.system
        if system is None:
            self.update(Text("n/a (no system report yet)", style=self._dim))
            return
        if compact:
            self.update(self._one_line(state, system))
            return
        lines: list[Text] = []
        for gpu in system.gpus:
            lines.append(self._gpu(gpu))
        for dev in system.cuda:
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(f"cuda:{_index(dev.index)} ")
            line.append(
                f"alloc {fmt_bytes(dev.allocated)}"
                f"  reserved {fmt_bytes(dev.reserved)}"
                f"  peak {fmt_bytes(dev.peak)}"
                f"\n        retries {fmt(dev.retries, 'd')}"
                f"  ooms {fmt(dev.ooms, 'd')}"
            )
            lines.append(line)
        host = system.host
        line = Text(no_wrap=True, overflow="ellipsis")
        ram = _ratio(host.ram_used, host.ram_total)
        line.append("host  RAM ")
        line.append(gauge(ram, GAUGE), self._gauge_style(ram))
        line.append(f" {fmt_bytes(host.ram_used)}/{fmt_bytes(host.ram_total)}")
        line.append(f"  CPU {fmt(host.cpu_percent, '.0f', '%')}")
        line.append(f"\n      RSS {fmt_bytes(host.rss)}")
        lines.append(line)
        if cpu_run(state):
            # On a CPU run "no NVML" and "CUDA not in use" are expected, not warnings: one line.
            lines.append(Text("CPU run · no GPU", style=self._dim))
        else:
            missing_style = self.get_component_rich_style("memory-panel--missing")
            for reason in system.missing:
                lines.append(Text(f"n/a: {reason}", style=missing_style))
        self.update(Text("\n", no_wrap=True).join(lines))

    @property
    def _dim(self) -> Any:
        return self.get_component_rich_style("memory-panel--dim")

    def _one_line(self, state: RunState, system: System) -> Text:
        """``Memory  GPU0 97% 30 GiB/80 GiB · cuda:0 peak 25 GiB · RAM 30 GiB/128 GiB ...``"""
        # Fitted to the width by leaving out whole figures (the least telling first), never
        # cutting one mid-number (an 80-column screen read "RAM 1.83").
        dim = self._dim
        figures: list[tuple[str, Any, int]] = []  # text, style, rank
        for gpu in system.gpus:
            mem = _ratio(gpu.mem_used, gpu.mem_total)
            used = f"{fmt_bytes(gpu.mem_used)}/{fmt_bytes(gpu.mem_total)}"
            style = self._gauge_style(mem) if mem is not None and mem > 0.9 else ""
            figures.append((f"GPU{_index(gpu.index)} {fmt(gpu.util, '.0f', '%')} {used}", style, 0))
        for dev in system.cuda:
            figures.append((f"cuda:{_index(dev.index)} peak {fmt_bytes(dev.peak)}", "", 1))
        host = system.host
        ram = _ratio(host.ram_used, host.ram_total)
        style = self._gauge_style(ram) if ram is not None and ram > 0.9 else ""
        figures.append((f"RAM {fmt_bytes(host.ram_used)}/{fmt_bytes(host.ram_total)}", style, 1))
        figures.append((f"RSS {fmt_bytes(host.rss)}", "", 3))
        figures.append((f"CPU {fmt(host.cpu_percent, '.0f', '%')}", "", 2))
        parts: list[Part] = [(Text("Memory", dim), 0)]
        if cpu_run(state):
            parts.append((Text(" (CPU run, no GPU)", dim), 2))
        for k, (figure, style, rank) in enumerate(figures):
            parts.append((Text.assemble((" " if k == 0 else " · ", dim), (figure, style)), rank))
        return fit_parts(parts, max(1, self.size.width or 500))

    def _gauge_style(self, fraction: float | None) -> Any:
        hot = fraction is not None and fraction > 0.9
        return self.get_component_rich_style("memory-panel--hot" if hot else "memory-panel--gauge")

    def _gpu(self, gpu: GpuStats) -> Text:
        util = gpu.util
        util_f = util / 100 if util is not None else None
        mem = _ratio(gpu.mem_used, gpu.mem_total)
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"GPU{_index(gpu.index)} {str(gpu.name or '')[:24]}\n")
        line.append("  util ")
        line.append(gauge(util_f, GAUGE), self._gauge_style(util_f))
        line.append(f" {fmt(util, '.0f', '%'):>4}  mem ")
        line.append(gauge(mem, GAUGE), self._gauge_style(mem))
        line.append(f" {fmt_bytes(gpu.mem_used)} / {fmt_bytes(gpu.mem_total)}")
        line.append(
            f"\n  {fmt(gpu.temp, '.0f', '°C')}  {fmt(gpu.power, '.0f')}"
            f"/{fmt(gpu.power_limit, '.0f', ' W')}"
            f"  {fmt(gpu.sm_clock, '.0f', ' MHz')}"
        )
        return line
