"""RunState: numpy histories of one run, bounded gradient history, alerts and derived figures."""

from __future__ import annotations

import math
import time as _time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from tdbg.model.columns import GrowArray, StepBatch, thin_mask
from tdbg.model.console_log import ConsoleLog
from tdbg.model.deep import DeepState
from tdbg.model.distributions import LayerDistributions
from tdbg.model.grad_history import GradHistory
from tdbg.model.metrics import MetricStore
from tdbg.model.step_summaries import Clipping, StepSummaries
from tdbg.protocol.framing import ProtocolError
from tdbg.protocol.messages import LayerPresence, read_layer_presence, read_metrics
from tdbg.protocol.messages.alert import Alert
from tdbg.protocol.messages.console import ConsoleLines
from tdbg.protocol.messages.histograms import Histograms
from tdbg.protocol.messages.reports import ProbeHealth, System
from tdbg.protocol.messages.run import read_layer_facts
from tdbg.protocol.messages.updates import UpdateRatios
from tdbg.protocol.steps import (
    F64_COLUMNS,
    MAX_LR_COLUMNS,
    MAX_PHASE_GAP,
    PHASES,
)


class MessageFeed(Protocol):
    """What a glance reads from (``tdbg.connect.client.ProbeClient`` is one): the model knows
    no sockets, only a run's hello, its messages and whether the peer hung up."""

    run: dict[str, Any]
    peer_closed: bool

    def messages(self, timeout: float | None = None) -> Iterator[dict[str, Any]]: ...


# no_grad_time: a watched model's forwards without grad before the step's own (an evaluation);
# NaN from probes and recordings older than the column, and then left out of the bar.
ANATOMY = PHASES  # the step phases, owned by protocol/steps.py

MAX_ALERTS = 500
# Per-step scalars kept; past this the older half is thinned to every other step (again and
# again), so a run of any length costs at most ~25 MiB of history while recent steps stay exact.
MAX_SCALAR_ROWS = 1 << 18
EMA_ALPHA = 0.05  # smoothed loss: about a 20-step memory
RATE_WINDOW = 5.0  # seconds of recent steps that steps/s is measured over
ANATOMY_WINDOW = 32  # steps averaged for the step-anatomy bar
INPUT_BOUND_SHARE = 0.30  # data loading above this share of a step means the GPU waits on input


class RunState:
    """Everything the TUI knows about one run; updated in O(batch) from protocol messages.

    Views read it on the repaint timer. ``revision`` changes whenever anything visible changed, so
    the view repaints only when there is something new.
    """

    # The histories with one row per step (besides the ``cols`` timings): thinned together,
    # shared together by a replay cursor.
    PER_STEP = ("steps", "has_loss", "loss", "loss_ema", "lr", "lr_n")

    def __init__(self, run: dict[str, Any] | None = None) -> None:
        self.run: dict[str, Any] = dict(run or {})
        self.connection = "connecting"  # connecting | live | ended | reconnecting | waiting
        self.end_reason: str | None = None
        self.synced = False
        self.revision = 0
        self.layer_names: list[str] = []
        self.layer_numel: list[int] = []
        self.layer_model: list[int] = []  # per layer, its model's index in ``models``
        self.layer_models: list[str] | None = None  # the ``layers`` message's models, if sent
        # The model summary's columns the ``layers`` message carried (model_summary.py).
        self.layer_facts: dict[str, list[Any]] = {}
        # Each layer's latest update ratio ‖Δw‖/‖w‖ and the step it was measured at (``updates``
        # messages: sampled steps, the layers in turns on a large model).
        self.update_ratio: dict[int, tuple[int, float]] = {}
        self.update_revision = 0  # changes with each ``updates`` message applied
        # Every measurement as a row (NaN for the layers not measured that time), bounded as
        # the norms are: the heatmap's update-ratio view.
        self.update_history = GradHistory(0)
        # Each layer's weight and gradient histograms over the steps that counted them.
        self.distributions = LayerDistributions()
        self.console = ConsoleLog()  # the run's stdout/stderr lines
        self.metrics = MetricStore()
        self.steps = GrowArray(np.int64)
        self.has_loss = GrowArray(np.bool_)
        self.loss = GrowArray(np.float64)
        self.loss_ema = GrowArray(np.float64)
        self.cols: dict[str, GrowArray] = {name: GrowArray(np.float64) for name in F64_COLUMNS}
        self.lr = GrowArray(np.float64, width=1)
        # Each step's real learning rates (the first lr_n of its row): a NaN past them is
        # padding (a step with fewer param groups), a NaN within them an unreadable lr.
        self.lr_n = GrowArray(np.uint8)
        self.lr_groups = 0
        self.grad_steps = GrowArray(np.int64)  # steps that carried per-layer norms
        self.grad_total = GrowArray(np.float64)
        self.grads = GradHistory(0)
        # Which norms are no norm at all (the ``layers`` message's ``since``, ``gone`` and
        # ``gone_at``): a layer added mid-run before its first step, and one that left the
        # model from then on, read NaN in the rows; shown as absent, not as non-finite.
        self.presence = LayerPresence()
        self.alerts: deque[Alert] = deque(maxlen=MAX_ALERTS)
        self.alert_count = 0
        self.thinned_steps = 0  # times the older half of the scalar history was thinned
        self.nonfinite_alerts = 0
        self.system: System | None = None  # the latest ``system`` report
        self.probe: ProbeHealth | None = None  # the latest ``probe`` report
        self.errors: list[str] = []  # ``error`` messages from the probe, and bad frames
        self.deep = DeepState()  # deep-dive commands: requests, jobs, results, activations
        self._ema: float | None = None
        # Changes whenever the per-step histories do (a batch, a thinning, a replay cursor):
        # views and the caches below key on it instead of rescanning the history.
        self.steps_revision = 0
        self._summaries = StepSummaries()
        self._anatomy: tuple[int, dict[str, float | None]] | None = None
        self.received_at: float | None = None  # wall clock of the last message
        self.steps_arrived: float | None = None  # wall clock here when steps last arrived

    # --- updates --------------------------------------------------------------------------

    def read_history(self, client: MessageFeed, deadline: float) -> None:
        """Fold what an attached ``client`` sends until its history replay is complete or
        ``deadline`` (``time.monotonic()``) passes: a glance at a run, not a follow. The run is
        ended when the probe hung up before its replay was done."""
        self.run = dict(client.run) or self.run
        self.mark("live")
        for message in client.messages(timeout=max(0.05, deadline - _time.monotonic())):
            self.apply(message)
            if self.synced or _time.monotonic() > deadline:
                break
        if client.peer_closed and not self.synced:
            self.mark("ended", self.end_reason or "closed")

    def apply_many(self, messages: Iterable[dict[str, Any]]) -> None:
        for message in messages:
            self.apply(message)

    def apply(self, message: dict[str, Any]) -> None:
        """Fold one protocol message into the state."""
        mtype = message.get("type")
        self.received_at = _time.time()
        if mtype == "steps":
            self._apply_steps(message)
        elif mtype == "layers":
            self._apply_layers(message)
        elif mtype == "updates":
            measured = UpdateRatios.from_wire(message)
            if measured is None:
                return
            for layer, ratio in zip(measured.layers, measured.ratios, strict=True):
                seen = self.update_ratio.get(layer)
                if seen is None or seen[0] <= measured.step:
                    self.update_ratio[layer] = (measured.step, ratio)
            self.update_history.widen(len(self.layer_names))
            self.update_history.extend(*ratio_rows([measured], self.update_history.n_layers))
            self.update_revision += 1
        elif mtype == "histograms":
            counted = Histograms.from_wire(message)
            if counted is None:
                return
            self.distributions.add(counted)
        elif mtype == "console":
            lines = ConsoleLines.from_wire(message)
            if lines is not None:
                self.console.add(lines)
        elif mtype == "alert":
            self._apply_alert(message)
        elif mtype == "system":
            self.system = System.from_wire(message)
        elif mtype == "probe":
            self.probe = ProbeHealth.from_wire(message)
            self.deep.apply_probe(self.probe)
        elif mtype in ("job", "ack", "activations"):
            try:
                self.deep.apply(message)
            except (TypeError, ValueError, AttributeError) as exc:  # a bad message, not a crash
                self.errors.append(f"malformed {mtype} message: {exc}")
            if mtype == "activations" and self.deep.activations is not None:
                # decoded once, by the deep state (a stale one is skipped: its step was seen)
                self.distributions.add_activations(self.deep.activations)
        elif mtype == "metrics":
            self.metrics.add(read_metrics(message))
        elif mtype == "synced":
            self.synced = True
        elif mtype == "bye":
            self.end_reason = str(message.get("reason") or "closed")
        elif mtype == "error":
            # An error with a command's id is a refusal of that command, not a protocol fault.
            if not self.deep.apply_refusal(message):
                self.errors.append(f"{message.get('code')}: {message.get('message')}")
        else:
            return  # pong, welcome and unknown types change nothing visible
        self.revision += 1

    def _apply_layers(self, message: dict[str, Any]) -> None:
        names = [str(n) for n in message.get("names") or []]
        numel = [int(n) for n in message.get("numel") or []]
        self.presence = read_layer_presence(message, len(names))
        self.layer_facts = read_layer_facts(message, len(names))
        models = message.get("models")
        if isinstance(models, list) and models:
            self.layer_models = [str(m) for m in models]
        owners = message.get("model")
        if isinstance(owners, list):
            self.layer_model = [
                int(m) if isinstance(m, int) and not isinstance(m, bool) else -1 for m in owners
            ]
        old = self.layer_names
        if old and names[: len(old)] == old:
            # The run's layers changed mid-run (a layer replaced, a model added): the list only
            # grows and every earlier layer keeps its index, so the history stays.
            self.layer_names, self.layer_numel = names, numel
            self.grads.widen(len(names))
            self.update_history.widen(len(names))
            return
        if names != self.layer_names:
            self.layer_names = names
            self.layer_numel = numel
            self.grads = GradHistory(len(names))
            self.update_history = GradHistory(len(names))
            self.update_ratio = {}
            self.distributions = LayerDistributions()
            self.grad_steps = GrowArray(np.int64)
            self.grad_total = GrowArray(np.float64)

    def _apply_steps(self, msg: dict[str, Any]) -> None:
        try:
            batch = StepBatch.decode(msg)
        except ProtocolError as exc:
            self.errors.append(str(exc))
            return
        n, n_layers, groups = batch.n, batch.n_layers, batch.lr_groups
        if n == 0:
            return
        self.steps_arrived = _time.time()
        self.steps.extend(batch.steps)
        self.has_loss.extend(batch.has_loss)
        self.loss.extend(batch.loss)
        self.loss_ema.extend(self._ema_block(batch.loss))
        for name, col in batch.timings.items():
            self.cols[name].extend(col)
        if groups > self.lr.width:
            self.lr.widen(groups)
        self.lr_groups = max(self.lr_groups, groups)
        if groups:
            self.lr.extend(batch.lr)
        else:
            self.lr.extend(np.full((n, self.lr.width), np.nan))
        self.lr_n.extend(batch.lr_n)
        self._summaries.fold(batch.steps, batch.has_loss, batch.loss, batch.timings)
        self.steps_revision += 1
        if batch.has_grads.any():
            rows = batch.grad_rows
            if 0 < n_layers < self.grads.n_layers:
                # A batch from before layers were added: NaN for the layers it did not know.
                rows = np.pad(
                    rows, ((0, 0), (0, self.grads.n_layers - n_layers)), constant_values=np.nan
                )
                n_layers = self.grads.n_layers
            if n_layers != self.grads.n_layers:
                # Steps arrived before (or without) a matching ``layers`` message: name them.
                self._apply_layers(
                    {"names": [f"layer {i}" for i in range(n_layers)], "numel": [0] * n_layers}
                )
            gsteps = batch.grad_steps
            self.grad_steps.extend(gsteps)
            self.grad_total.extend(batch.grad_total)
            if n_layers:
                self.grads.extend(gsteps, rows)
        self._bound_history()

    def _bound_history(self) -> None:
        if len(self.steps) > MAX_SCALAR_ROWS:
            keep = thin_mask(len(self.steps))
            for arr in self._per_step():
                arr.compress(keep)
            self.thinned_steps += 1
            self.steps_revision += 1
        if len(self.grad_steps) > MAX_SCALAR_ROWS:
            keep = thin_mask(len(self.grad_steps))
            self.grad_steps.compress(keep)
            self.grad_total.compress(keep)

    def _per_step(self) -> list[GrowArray]:
        return [*(getattr(self, name) for name in self.PER_STEP), *self.cols.values()]

    def share_head(self, source: RunState, n: int) -> None:
        """Show ``source``'s first ``n`` steps (a replay cursor): every per-step history becomes
        a view of source's first n rows, nothing copied; the gradient totals and the smoothed
        loss are those up to that step. The gradient history, alerts and reports are the
        caller's (they are not per-step arrays)."""
        for name in self.PER_STEP:
            setattr(self, name, getattr(source, name).head(n))
        self.cols = {name: col.head(n) for name, col in source.cols.items()}
        self.lr_groups = source.lr_groups
        step = int(self.steps.values[-1]) if self.steps.n else -1
        k = int(np.searchsorted(source.grad_steps.values, step, side="right"))
        self.grad_steps = source.grad_steps.head(k)
        self.grad_total = source.grad_total.head(k)
        ema = self.loss_ema.values
        finite = np.flatnonzero(np.isfinite(ema))
        self._ema = float(ema[finite[-1]]) if finite.size else None
        # Once per cursor move, so that every repaint at this cursor reads them in O(1).
        self._summaries = StepSummaries()
        self._summaries.fold(
            self.steps.values,
            self.has_loss.values,
            self.loss.values,
            {name: col.values for name, col in self.cols.items()},
        )
        self.steps_revision += 1

    def _ema_block(self, loss: np.ndarray) -> np.ndarray:
        # A sequential recurrence, so one float op per step in Python; non-finite losses are
        # skipped so one NaN does not poison the smoothed curve for the rest of the run, and
        # the curve has a gap there rather than a flat line hiding a diverged run.
        out = np.empty(len(loss))
        ema = self._ema
        a = EMA_ALPHA
        for i, v in enumerate(loss.tolist()):
            if math.isfinite(v):
                ema = v if ema is None else ema + a * (v - ema)
            out[i] = ema if ema is not None and math.isfinite(v) else math.nan
        self._ema = ema
        return out

    def _apply_alert(self, message: dict[str, Any]) -> None:
        alert = Alert.from_wire(message)
        if alert is None:
            return
        self.alerts.appendleft(alert)  # newest first
        self.alert_count += 1
        if alert.nonfinite:
            self.nonfinite_alerts += 1

    def sent(self, mid: int, command: str, args: dict[str, Any]) -> None:
        """The app sent a command with id ``mid``; its ack or refusal will name that id."""
        self.deep.sent(mid, command, args)
        self.revision += 1

    def mark(self, connection: str, reason: str | None = None) -> None:
        """Set the connection state (``live``, ``ended``, ...)."""
        self.connection = connection
        if reason is not None:
            self.end_reason = reason
        self.revision += 1

    # --- derived --------------------------------------------------------------------------

    @property
    def n_steps(self) -> int:
        return self.steps.n

    @property
    def last_step(self) -> int | None:
        return int(self.steps.values[-1]) if self.steps.n else None

    @property
    def last_loss(self) -> float | None:
        """The latest reported loss (may be NaN or inf), or None when none was reported."""
        return self._summaries.last_loss

    @property
    def nonfinite_since(self) -> int | None:
        """The first step of the trailing run of non-finite losses; None while the latest
        reported loss is finite (or none was reported)."""
        return self._summaries.nonfinite_since

    @property
    def smoothed_loss(self) -> float | None:
        return self._ema

    @property
    def diverged(self) -> bool:
        """The latest loss is NaN or infinite."""
        last = self.last_loss
        return last is not None and not math.isfinite(last)

    @property
    def ended(self) -> bool:
        return self.connection == "ended"

    def steps_per_sec(self) -> float | None:
        """Steps per second over the last few seconds of step timestamps."""
        if self.steps.n < 2:
            return None
        t = self.cols["time"].values
        s = self.steps.values
        t_end = t[-1]
        j = int(np.searchsorted(t, t_end - RATE_WINDOW, side="left"))
        j = min(j, self.steps.n - 2)
        dt = t_end - t[j]
        if not dt > 0:
            return None
        return float((s[-1] - s[j]) / dt)

    def elapsed(self, now: float | None = None) -> float | None:
        """Seconds since the run started; frozen at the last step once the run ended."""
        start = self.run.get("start_time")
        if not isinstance(start, int | float):
            return None
        if self.connection in ("ended", "reconnecting"):
            end = self.cols["time"].values[-1] if self.steps.n else start
        else:
            end = _time.time() if now is None else now
        return max(0.0, float(end) - float(start))

    def anatomy(self) -> dict[str, float | None]:
        """Mean share of the recent step time spent in each phase; None when not measured.

        Read several times a frame (the bar, the header, the verdict): computed once per change
        of the step history."""
        cached = self._anatomy
        if cached is None or cached[0] != self.steps_revision:
            cached = self._anatomy = (self.steps_revision, self._compute_anatomy())
        return dict(cached[1])

    def _compute_anatomy(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {name: None for name in ANATOMY}
        if not self.steps.n:
            return out
        # The recent steps whose phases were timed: on a GPU run with short steps one in a
        # few (MAX_PHASE_GAP), each share taken against those steps' own time.
        lookback = ANATOMY_WINDOW * MAX_PHASE_GAP
        parts = {name: self.cols[name].values[-lookback:] for name in ANATOMY}
        timed = np.zeros(len(next(iter(parts.values()))), dtype=bool)
        for part in parts.values():
            timed |= np.isfinite(part)
        rows = np.flatnonzero(timed)[-ANATOMY_WINDOW:]
        if not rows.size:
            return out
        total = self.cols["step_time"].values[-lookback:][rows]
        total_mean = float(np.nanmean(total)) if np.isfinite(total).any() else math.nan
        for name, part in parts.items():
            part = part[rows]
            if not np.isfinite(part).any() or not total_mean > 0:
                continue
            out[name] = min(1.0, max(0.0, float(np.nanmean(part)) / total_mean))
        return out

    @property
    def input_bound(self) -> bool:
        """Data loading takes more than INPUT_BOUND_SHARE of recent steps."""
        share = self.anatomy()["data_time"]
        return share is not None and share > INPUT_BOUND_SHARE

    def mean_recent(self, name: str, window: int = ANATOMY_WINDOW) -> float | None:
        """The mean of the last ``window`` measured values of column ``name`` (a phase is
        measured on one GPU step in at most MAX_PHASE_GAP: looked for that far back)."""
        finite = self.recent_measured(name, window)
        return float(finite.mean()) if finite.size else None

    def recent_measured(self, name: str, window: int) -> np.ndarray:
        """The last ``window`` finite values of column ``name`` among its last ``window *
        MAX_PHASE_GAP`` steps (oldest first)."""
        if not self.steps.n:
            return np.empty(0)
        col = self.cols[name].values[-window * MAX_PHASE_GAP :]
        return col[np.isfinite(col)][-window:]

    def throughput(self, column: str) -> float | None:
        """Samples (or tokens) per second over recent steps: sum of counts / sum of step times."""
        if not self.steps.n:
            return None
        counts = self.cols[column].values[-ANATOMY_WINDOW:]
        times = self.cols["step_time"].values[-ANATOMY_WINDOW:]
        ok = np.isfinite(counts) & np.isfinite(times)
        if not ok.any() or not times[ok].sum() > 0:
            return None
        return float(counts[ok].sum() / times[ok].sum())

    def latest_lr(self) -> list[float | None]:
        if not self.steps.n or not self.lr_groups:
            return []
        row = self.lr.values[-1, : int(self.lr_n.values[-1])]
        return [float(v) if math.isfinite(v) else None for v in row]

    def absent(self, steps: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` (per-layer norms of ``steps``, rows x layers) are no norm at all:
        NaN in a gone layer's column, or in a layer's column before its first step. A NaN
        anywhere else is a non-finite gradient."""
        n_layers = rows.shape[1] if rows.ndim == 2 else 0
        presence = self.presence
        if not n_layers or not presence:
            return np.zeros(rows.shape, dtype=bool)
        at = np.asarray(steps, dtype=np.int64)[:, None]
        first, until = (np.asarray(b, dtype=np.int64)[None, :] for b in presence.window(n_layers))
        return np.isnan(rows) & ((at < first) | (at >= until))

    def update_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, rows x layers) of the update ratios measured, oldest first (as
        ``grads.matrix()``): NaN where a layer was not measured at that step."""
        if self.update_history.n_layers < len(self.layer_names):
            self.update_history.widen(len(self.layer_names))
        return self.update_history.matrix()

    @property
    def grads_revision(self) -> tuple[int, int]:
        """Changes whenever the gradient panel's figures do: a row of norms, or ratios."""
        return (self.grads.total_rows, self.update_revision)

    def update_ratios(self) -> np.ndarray | None:
        """Per layer its latest update ratio (NaN: not measured yet); None when the run sent
        none (an older probe, or no sampled step yet)."""
        if not self.update_ratio:
            return None
        out = np.full(len(self.layer_names), np.nan)
        for layer, (_, ratio) in self.update_ratio.items():
            if layer < len(out):
                out[layer] = ratio
        return out

    def layer_trends(self, n: int = 16) -> np.ndarray:
        """Per-layer trend of the last ``n`` sampled rows: log10(newest / mean of the older half).

        Positive = growing. NaN when there is too little history or a value is not positive.
        """
        rows = self.grads.recent(n).astype(np.float64)
        if rows.shape[0] < 2:
            return np.full(self.grads.n_layers, np.nan)
        older = rows[: rows.shape[0] // 2]
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN layers are expected
            base = np.nanmean(np.where(np.isfinite(older), older, np.nan), axis=0)
            trend = np.log10(rows[-1] / base)
        return np.where(np.isfinite(trend), trend, np.nan)

    # --- what is watched, progress, clipping (issue 10: the true numbers) ---------------------

    @property
    def models(self) -> list[str]:
        """The watched models' names (the latest ``layers`` message's, else the welcome's)."""
        if self.layer_models:
            return list(self.layer_models)
        models = self.run.get("models")
        return [str(m) for m in models] if isinstance(models, list) else []

    @property
    def optimizers(self) -> list[tuple[str, str, int]]:
        """``(name, type, groups)`` per watched optimizer, in lr column order."""
        out: list[tuple[str, str, int]] = []
        for entry in self.run.get("optimizers") or []:
            if not isinstance(entry, dict):
                continue
            groups = entry.get("groups")
            n = groups if isinstance(groups, int) and not isinstance(groups, bool) else 1
            out.append((str(entry.get("name") or "?"), str(entry.get("type") or "?"), max(0, n)))
        return out

    @property
    def param_groups(self) -> int | None:
        """All optimizers' param groups (the probe sends at most MAX_LR_COLUMNS lr columns)."""
        value = self.run.get("param_groups")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        opts = self.optimizers
        return sum(g for _, _, g in opts) if opts else None

    @property
    def lr_columns_capped(self) -> bool:
        groups = self.param_groups
        return groups is not None and groups > MAX_LR_COLUMNS

    def lr_labels(self, n: int) -> list[str]:
        """A label for each of ``n`` lr columns: its optimizer's name (``optD``, or ``optD.1``
        for its second group), ``group k`` where the run does not say."""
        labels: list[str] = []
        for name, _, groups in self.optimizers:
            if groups == 1:
                labels.append(name)
            else:
                labels.extend(f"{name}.{g}" for g in range(groups))
        labels = labels[:n]
        labels.extend(f"group {g}" for g in range(len(labels), n))
        return labels

    def layer_owner(self, index: int) -> str | None:
        """The model a layer belongs to, when several are watched (else None)."""
        models = self.models
        if len(models) < 2 or index >= len(self.layer_model):
            return None
        m = self.layer_model[index]
        return models[m] if 0 <= m < len(models) else None

    def latest_col(self, name: str) -> float | None:
        """The latest known (finite) value of a per-step column, e.g. ``epoch``."""
        if name not in self.cols:
            raise KeyError(name)
        return self._summaries.latest.get(name)

    @property
    def micro_batches(self) -> float | None:
        """Gradient-accumulation micro-batches of the latest step that says."""
        return self.latest_col("micro_batches")

    @property
    def epoch(self) -> float | None:
        return self.latest_col("epoch")

    def clipping(self) -> Clipping | None:
        """How ``clip_grad_norm_`` behaved over the run's steps that report it; None when the
        script does not clip (or the probe is older)."""
        return self._summaries.clipping

    @property
    def planned_steps(self) -> int | None:
        """The optimizer steps the run will take, where the probe knows (the ETA's basis)."""
        return self.probe.total_steps if self.probe is not None else None

    @property
    def skipped_steps(self) -> int:
        return self.probe.skipped_steps if self.probe is not None else 0

    @property
    def probe_closed(self) -> bool:
        """The run ended and its probe closed cleanly (not an error)."""
        return self.probe is not None and self.probe.closed

    @property
    def probe_disabled(self) -> bool:
        """The probe switched itself off after too many errors (the error breaker)."""
        return self.probe is not None and self.probe.disabled

    def progress(self) -> float | None:
        """The share of ``planned_steps`` done (the last step's number + 1 over the total)."""
        total, last = self.planned_steps, self.last_step
        if total is None or last is None:
            return None
        return min(1.0, (last + 1) / total)

    def eta(self) -> float | None:
        """Seconds left at the recent steps/s, when the total is known and the run is live."""
        total, last = self.planned_steps, self.last_step
        if total is None or last is None or self.ended or self.probe_closed:
            return None
        rate = self.steps_per_sec()
        if not rate or rate <= 0:
            return None
        return max(0.0, (total - last - 1) / rate)


def ratio_rows(measured: Iterable[UpdateRatios], n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """``updates`` messages as (steps, rows x layers) for a GradHistory: one row each, NaN for
    the layers it did not measure; layers past ``n_layers`` (not announced yet) left out."""
    batch = list(measured)
    steps = np.array([m.step for m in batch], dtype=np.int64)
    rows = np.full((len(batch), n_layers), np.nan, dtype=np.float32)
    for r, m in enumerate(batch):
        for layer, ratio in zip(m.layers, m.ratios, strict=True):
            if layer < n_layers:
                rows[r, layer] = ratio
    return steps, rows
