"""AnomalyBanner: a one-line warning while autograd anomaly mode is on in the training process."""

from __future__ import annotations

from tdbg.model.deep import DeepState
from tdbg.tui.widgets.steady import SteadyStatic


class AnomalyBanner(SteadyStatic):
    """Shown only while the screen has ``-anomaly`` (see tdbg.tcss); the text says for how long."""

    def show(self, deep: DeepState) -> None:
        job = deep.active_job("anomaly")
        if job is None:
            self.update("")
            return
        done = "?" if job.done is None else job.done
        total = "?" if job.total is None else job.total
        self.update(
            f"⚠ autograd anomaly mode ON (#{job.job}, {job.state} {done}/{total} steps) — global"
            " and slow: every op records a traceback · switches itself off · c cancels"
        )
