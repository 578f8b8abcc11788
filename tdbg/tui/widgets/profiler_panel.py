"""ProfilerPanel: the place for on-demand profiler top-ops; says honestly it is not here yet."""

from __future__ import annotations

from textual.widgets import Static

PLACEHOLDER = (
    "Press p to profile the next steps — on-demand profiling comes with the deep-dive commands."
)


class ProfilerPanel(Static):
    def on_mount(self) -> None:
        self.update(PLACEHOLDER)
