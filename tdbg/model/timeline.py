"""Timeline: a recording loaded once, and the RunState at any step of it in O(window); no textual.

Loading folds the recording's steps into one RunState (the whole run) and files every other
message under its *position*: the step it belongs to (an alert's or a job's own ``step``) or
else the latest step recorded before it (``system`` / ``probe`` reports). The state at a cursor
step S is then assembled without re-reading anything:

* scalar histories (loss, smoothed loss, lr, timings) are views of the first n rows of the whole
  run's arrays — O(1), no copy;
* per-layer gradient rows up to S are rebuilt into a :class:`GradHistory` of the usual bounded
  size — O((512 + 512) x layers);
* alerts with position <= S; the latest ``system`` and ``probe`` report at or before S;
* deep-dive state (jobs, results, activation statistics) folded from a checkpoint taken every
  :data:`DEEP_CHECKPOINT` messages — at most that many messages folded per move.

So a cursor move costs about the same on a 100-step and a 1,000,000-step recording.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import math
from collections import deque
from typing import Any

import numpy as np

from tdbg.model.columns import StepBatch
from tdbg.model.console_log import KEEP_LINES, ConsoleLog
from tdbg.model.deep import DeepState
from tdbg.model.distributions import LayerDistributions
from tdbg.model.grad_history import GradHistory
from tdbg.model.run_state import MAX_ALERTS, Alert, RunState, ratio_rows
from tdbg.protocol.framing import ProtocolError
from tdbg.protocol.messages.console import ConsoleLines
from tdbg.protocol.messages.histograms import Histograms
from tdbg.protocol.messages.reports import ProbeHealth, System
from tdbg.protocol.messages.results import Activations
from tdbg.protocol.messages.updates import UpdateRatios
from tdbg.recording.reader import Recording

DEEP_CHECKPOINT = 128  # deep-dive messages between DeepState checkpoints
DEEP_TYPES = frozenset({"job", "activations", "probe"})


class ReplayState(RunState):
    """A RunState seen at a replay cursor: ``connection`` is ``replay`` and the elapsed time is
    the cursor step's, not the wall clock's."""

    def __init__(self, run: dict[str, Any] | None = None) -> None:
        super().__init__(run)
        self.connection = "replay"
        self.cursor_index = 0
        self.total_steps = 0

    def elapsed(self, now: float | None = None) -> float | None:
        start = self.run.get("start_time")
        if not isinstance(start, int | float) or not self.steps.n:
            return None
        return max(0.0, float(self.cols["time"].values[-1]) - float(start))


class Timeline:
    """Every message of a recording, indexed by step, ready to be viewed at any cursor."""

    def __init__(self, recording: Recording, messages: Any = None) -> None:
        self.recording = recording
        self.run = dict(recording.run)
        self.created = recording.created
        self.full = RunState(self.run)
        position = -1  # the latest step recorded so far
        self._alerts: list[tuple[int, Alert]] = []
        self._reports: dict[str, tuple[list[int], list[dict[str, Any]]]] = {
            "system": ([], []),
            "probe": ([], []),
        }
        deep: list[tuple[int, int, dict[str, Any]]] = []
        self._updates: list[UpdateRatios] = []  # in the order recorded (their steps ascend)
        self._histograms: list[Histograms] = []  # likewise
        self._outputs: list[Activations] = []  # activation samples with histograms, likewise
        self._console: list[ConsoleLines] = []  # likewise (lines before the first step: -1)
        console_steps: list[int] = []
        grad_steps: list[np.ndarray] = []
        grad_rows: list[np.ndarray] = []
        for msg in recording.messages() if messages is None else messages:
            mtype = msg.get("type")
            if mtype == "steps":
                before = self.full.n_steps
                self.full.apply(msg)
                if self.full.n_steps > before:
                    position = max(position, int(self.full.steps.values[-1]))
                    self._collect_grads(msg, grad_steps, grad_rows)
            elif mtype == "layers":
                names = [str(n) for n in msg.get("names") or []]
                if names != self.full.layer_names:
                    grad_steps.clear()  # rows of another width cannot be stacked with these
                    grad_rows.clear()
                self.full.apply(msg)
            elif mtype == "metrics":
                self.full.apply(msg)
            elif mtype == "updates" and (measured := UpdateRatios.from_wire(msg)) is not None:
                self._updates.append(measured)
            elif mtype == "histograms" and (counted := Histograms.from_wire(msg)) is not None:
                self._histograms.append(counted)
            elif mtype == "console" and (lines := ConsoleLines.from_wire(msg)) is not None:
                self._console.append(lines)
                console_steps.append(-1 if lines.step is None else lines.step)
            elif mtype == "alert" and (alert := Alert.from_wire(msg)) is not None:
                self._alerts.append((self._own_step(msg, position), alert))
            elif mtype in ("system", "probe"):
                steps, reports = self._reports[mtype]
                steps.append(position)
                reports.append(msg)
            if mtype == "activations" and (sample := Activations.from_wire(msg)) is not None:
                if sample.hist and sample.step is not None:
                    self._outputs.append(sample)
            if mtype in DEEP_TYPES:
                deep.append((self._own_step(msg, position), len(deep), msg))
        n_layers = len(self.full.layer_names)
        if grad_steps:
            self.grad_steps = np.concatenate(grad_steps)
            self.grad_rows = np.concatenate(grad_rows)
        else:
            self.grad_steps = np.zeros(0, np.int64)
            self.grad_rows = np.zeros((0, n_layers), np.float32)
        self._alert_pos = np.array([p for p, _ in self._alerts], dtype=np.int64)
        self._alert_nonfinite = np.array([a.nonfinite for _, a in self._alerts], dtype=bool)
        deep.sort(key=lambda item: (item[0], item[1]))  # stable: recording order within a step
        self._deep_pos = [p for p, _, _ in deep]
        self._deep = [m for _, _, m in deep]
        self._deep_checkpoints: list[DeepState] = []
        state = DeepState()
        for i, msg in enumerate(self._deep):
            if i % DEEP_CHECKPOINT == 0:
                self._deep_checkpoints.append(copy.deepcopy(state))
            self._apply_deep(state, msg)
        self.full.distributions = LayerDistributions.of(self._histograms, self._outputs)
        self._histogram_steps = [h.step for h in self._histograms]
        self._output_steps = [a.step or 0 for a in self._outputs]
        self.full.console = ConsoleLog.of(self._console)
        # Sent at the step the probe had reached: ascending, as the ticks that sent them.
        self._console_steps = list(itertools.accumulate(console_steps, max))
        self.ended = recording.ended
        self.note = recording.end_note

    @staticmethod
    def _own_step(msg: dict[str, Any], position: int) -> int:
        step = msg.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step <= position:
            return step
        return position

    def _collect_grads(
        self, msg: dict[str, Any], steps_out: list[np.ndarray], rows_out: list[np.ndarray]
    ) -> None:
        try:
            batch = StepBatch.decode(msg)
        except ProtocolError:
            return  # the live model says so when it folds the same batch
        n_layers = batch.n_layers
        if n_layers != len(self.full.layer_names) or not n_layers or not batch.has_grads.any():
            return
        steps_out.append(batch.grad_steps.astype(np.int64))
        rows_out.append(batch.grad_rows.astype(np.float32))

    @staticmethod
    def _apply_deep(state: DeepState, msg: dict[str, Any]) -> None:
        try:
            state.apply(msg)
        except (TypeError, ValueError, AttributeError):
            pass  # a malformed message: the live view would report it; a replay skips it
        state.notices.clear()  # replay shows states, it does not announce what happened

    # --- cursor ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.full.n_steps

    def step_at(self, index: int) -> int | None:
        if not len(self):
            return None
        return int(self.full.steps.values[self.clamp(index)])

    def clamp(self, index: int) -> int:
        return max(0, min(len(self) - 1, index))

    def index_of(self, step: int) -> int:
        """The index of the last recorded step <= ``step`` (0 when it is before them all)."""
        i = int(np.searchsorted(self.full.steps.values, step, side="right")) - 1
        return self.clamp(i)

    def state_at(self, index: int) -> ReplayState:
        """The run as the TUI showed it when step ``index`` (0-based, of the recorded steps)
        was the latest."""
        full = self.full
        state = ReplayState(self.run)
        state.layer_names = list(full.layer_names)
        state.layer_numel = list(full.layer_numel)
        state.layer_model = list(full.layer_model)
        state.layer_models = full.layer_models
        state.presence = full.presence
        state.layer_facts = full.layer_facts
        state.synced = True
        state.total_steps = len(self)
        state.end_reason = "replay"
        if not len(self):
            state.grads = GradHistory(len(full.layer_names))
            state.deep = self._deep_at(-1)
            state.console = self._console_at(-1)
            state.system, state.probe = self._reports_at(-1)
            self._put_alerts(state, -1)
            return state
        index = self.clamp(index)
        state.cursor_index = index
        step = int(full.steps.values[index])
        state.share_head(full, index + 1)
        state.metrics = full.metrics.until(step)
        g = int(np.searchsorted(self.grad_steps, step, side="right"))
        state.grads = GradHistory.from_rows(
            len(full.layer_names), self.grad_steps[:g], self.grad_rows[:g]
        )
        self._put_alerts(state, step)
        shown = []  # the measurements up to the cursor: each layer's latest, and their history
        for measured in self._updates:
            if measured.step > step:
                break
            shown.append(measured)
            state.update_ratio.update(
                (layer, (measured.step, ratio))
                for layer, ratio in zip(measured.layers, measured.ratios, strict=True)
            )
        if shown:
            n_layers = len(full.layer_names)
            state.update_history = GradHistory.from_rows(n_layers, *ratio_rows(shown, n_layers))
        state.update_revision = len(shown)
        shown_until = bisect.bisect_right(self._histogram_steps, step)
        outputs_until = bisect.bisect_right(self._output_steps, step)
        state.distributions = LayerDistributions.of(
            self._histograms[:shown_until], self._outputs[:outputs_until]
        )
        state.console = self._console_at(step)
        state.system, state.probe = self._reports_at(step)
        state.deep = self._deep_at(step)
        return state

    def _console_at(self, step: int) -> ConsoleLog:
        """The console as it stood at ``step``: built from the newest messages that fill it, not
        from every one (the cursor moves often; a long run sent thousands)."""
        until = bisect.bisect_right(self._console_steps, step)
        start, held = until, 0
        while start > 0 and held < KEEP_LINES:
            start -= 1
            held += len(self._console[start].texts)
        return ConsoleLog.of(self._console[start:until])

    def _put_alerts(self, state: RunState, step: int) -> None:
        shown = np.flatnonzero(self._alert_pos <= step)
        state.alert_count = int(shown.size)
        state.nonfinite_alerts = int(self._alert_nonfinite[shown].sum())
        newest_first = [self._alerts[i][1] for i in shown[-MAX_ALERTS:][::-1]]
        state.alerts = deque(newest_first, maxlen=MAX_ALERTS)

    def _reports_at(self, step: int) -> tuple[System | None, ProbeHealth | None]:
        """The latest ``system`` and ``probe`` reports at or before ``step``, decoded."""
        system, probe = self._report_at("system", step), self._report_at("probe", step)
        return (
            None if system is None else System.from_wire(system),
            None if probe is None else ProbeHealth.from_wire(probe),
        )

    def _report_at(self, kind: str, step: int) -> dict[str, Any] | None:
        steps, reports = self._reports[kind]
        i = bisect.bisect_right(steps, step) - 1
        return reports[i] if i >= 0 else None

    def _deep_at(self, step: int) -> DeepState:
        j = bisect.bisect_right(self._deep_pos, step)
        if not self._deep_checkpoints:
            return DeepState()
        c = min(j // DEEP_CHECKPOINT, len(self._deep_checkpoints) - 1)
        state = copy.deepcopy(self._deep_checkpoints[c])
        for msg in self._deep[c * DEEP_CHECKPOINT : j]:
            self._apply_deep(state, msg)
        return state

    # --- labels -----------------------------------------------------------------------------

    def time_at(self, index: int) -> float | None:
        if not len(self):
            return None
        value = float(self.full.cols["time"].values[self.clamp(index)])
        return value if math.isfinite(value) else None
