"""DeepPanel: one view per deep dive (profile, memory snapshot, NaN hunt), switched by key."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ContentSwitcher

from tdbg.model.deep import DIVES, DeepState
from tdbg.tui.widgets.nan_hunt_view import NanHuntView
from tdbg.tui.widgets.profiler_panel import ProfilerPanel
from tdbg.tui.widgets.snapshot_view import SnapshotView

VIEWS = ("deep-profile", "deep-snapshot", "deep-nan")
VIEW_OF = {
    "profile": "deep-profile",
    "snapshot": "deep-snapshot",
    "nan_hunt": "deep-nan",
    "anomaly": "deep-nan",
}
TITLES = {
    "deep-profile": "Profiler top-ops",
    "deep-snapshot": "Memory snapshot",
    "deep-nan": "NaN hunt · anomaly mode",
}


class DeepPanel(Vertical):
    """Follows the newest dive: a new job or refusal switches to its view; ``d`` cycles views."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._followed: tuple[int | None, int | None] = (None, None)

    def compose(self) -> ComposeResult:
        with ContentSwitcher(initial="deep-profile", id="deep-switcher"):
            yield ProfilerPanel(id="deep-profile")
            yield SnapshotView(id="deep-snapshot")
            yield NanHuntView(id="deep-nan")

    @property
    def view(self) -> str:
        return self.query_one(ContentSwitcher).current or VIEWS[0]

    @property
    def title(self) -> str:
        return TITLES[self.view]

    @property
    def latest(self) -> tuple[int | None, int | None]:
        """The newest dive's job and the newest refusal's id: what a closed panel waits past."""
        return self._followed

    def forget(self) -> None:
        """Back to the first view, following no dive: the screen shows another run now."""
        self._followed = (None, None)
        self.switch(VIEWS[0])

    def switch(self, view: str) -> None:
        self.query_one(ContentSwitcher).current = view

    def cycle_view(self) -> str:
        view = VIEWS[(VIEWS.index(self.view) + 1) % len(VIEWS)]
        self.switch(view)
        return view

    def command(self) -> str:
        """The command whose view is shown (anomaly shares the NaN view)."""
        return {"deep-profile": "profile", "deep-snapshot": "snapshot"}.get(self.view, "nan_hunt")

    def show(self, deep: DeepState, snapshot_unavailable: str | None = None) -> None:
        self._follow(deep)
        self.query_one(ProfilerPanel).show(deep)
        self.query_one(SnapshotView).show(deep, snapshot_unavailable)
        self.query_one(NanHuntView).show(deep)

    def _follow(self, deep: DeepState) -> None:
        jobs = [j for j in deep.jobs.values() if j.command in DIVES]
        newest_job = max(jobs, key=lambda j: j.job, default=None)
        refused = [r for r in deep.requests.values() if r.refused and r.command in DIVES]
        newest_refusal = max(refused, key=lambda r: r.seq, default=None)
        key = (
            None if newest_job is None else newest_job.job,
            None if newest_refusal is None else newest_refusal.id,
        )
        if key == self._followed:
            return
        old_job, old_refusal = self._followed
        self._followed = key
        if newest_refusal is not None and newest_refusal.id != old_refusal:
            self.switch(VIEW_OF[newest_refusal.command])
        elif newest_job is not None and newest_job.job != old_job:
            self.switch(VIEW_OF[newest_job.command])
