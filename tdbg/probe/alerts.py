"""Alert rules over resolved steps: non-finite values, missing grads, spikes, stalls, lr 0."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import sub
from typing import Any

from tdbg.protocol.messages.alert import Alert as AlertMessage
from tdbg.protocol.messages.updates import LARGE_RATIO, TINY_RATIO, UpdateRatios
from tdbg.protocol.stall import DEFAULT_STALL_RULE
from tdbg.protocol.steps import StepRecord

WINDOW = 100  # recent values a robust z-score is measured against
MIN_HISTORY = 20  # no spike verdict before this many values
SPIKE_Z = 8.0  # robust z-score (median/MAD) that counts as a spike
SPIKE_RATIO = 3.0  # and the value must also be this many times the median
LR_ZERO_STEPS = 3  # lr must stay 0 this many steps (warm-up may start at 0)
MAX_NAMED = 8  # layers named in one message
# A layer's update ratio below TINY_RATIO this many of its measurements in a row, while another
# layer's is at least LEARNING_RATIO: it has stopped learning (a learning rate of 0 for its
# group, an optimizer that skips it, weights that cannot move).
STUCK_MEASUREMENTS = 5
LEARNING_RATIO = 1e-5


def alert(
    kind: str, severity: str, step: int, message: str, layers: Sequence[str] = ()
) -> AlertMessage:
    """An ``alert`` message, typed by the protocol's definition (what clients read)."""
    return AlertMessage(kind, severity, step, time.time(), message, tuple(layers))


def _names(layers: Sequence[str]) -> str:
    shown = ", ".join(layers[:MAX_NAMED])
    return shown + (f" and {len(layers) - MAX_NAMED} more" if len(layers) > MAX_NAMED else "")


def robust_z(value: float, history: Sequence[float]) -> float:
    """How many robust standard deviations (1.4826 MAD) ``value`` lies above the median."""
    med = statistics.median(history)
    mad = statistics.median(abs(v - med) for v in history) * 1.4826
    scale = mad if mad > 0 else max(abs(med) * 1e-3, 1e-12)
    return (value - med) / scale


class RobustWindow:
    """The last WINDOW values with their median and robust scale (1.4826 MAD).

    The statistics are refreshed every REFRESH appends while the window fills, every
    REFRESH_FULL once full, not every step: a median of 100 values costs ~20 us of the probe
    thread's GIL time (2.5 us a step at every 8th: a quarter of its per-step work on short
    steps), and a window a quarter old still stands for the recent losses: spikes stand out
    either way.
    """

    REFRESH = 8
    REFRESH_FULL = WINDOW // 4

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=WINDOW)
        self.median = math.nan
        self.scale = math.nan
        self._since = 0

    def __len__(self) -> int:
        return len(self.values)

    def append(self, value: float) -> None:
        self.values.append(value)
        self._since += 1
        filled = len(self.values)
        every = self.REFRESH_FULL if filled == WINDOW else self.REFRESH
        if self._since >= every or filled <= MIN_HISTORY:
            self._since = 0
            med = statistics.median(self.values)
            # In C (map), not a generator: the probe thread's GIL time on short steps.
            mad = statistics.median(map(abs, map(sub, self.values, repeat(med)))) * 1.4826
            self.median = med
            self.scale = mad if mad > 0 else max(abs(med) * 1e-3, 1e-12)

    def z(self, value: float) -> float:
        return (value - self.median) / self.scale


class AlertRules:
    """Turns each resolved step into zero or more alerts; a condition alerts on onset only."""

    def __init__(
        self,
        layer_names: Sequence[str],
        frozen: Sequence[int] = (),
        lr_groups: Sequence[Any] = (),
    ) -> None:
        self.layer_names = list(layer_names)
        self.frozen = set(frozen)  # layers with no trainable parameter: a zero norm is expected
        # Per layer, the lr column of the param group updating it (layer_facts' ``lr_group``):
        # names the layers a learning rate of zero stops.
        self.lr_groups = list(lr_groups)
        # Layers whose parameters left the model -> the first step without them: no norm (NaN).
        self.gone: dict[int, int] = {}
        self._losses = RobustWindow()
        self._grad_logs = RobustWindow()  # log10 of the total gradient norm
        self._step_times: deque[float] = deque(maxlen=WINDOW)
        self._active: dict[str, Any] = {}
        self._lr_zero_run = 0
        self.stalled_since: float | None = None
        # Per layer: its latest update ratio, and how many of its measurements in a row were
        # tiny.
        self._ratio: dict[int, float] = {}
        self._tiny_run: dict[int, int] = {}

    def relayout(
        self,
        layer_names: Sequence[str],
        gone: Mapping[int, int],
        frozen: Sequence[int] = (),
        lr_groups: Sequence[Any] = (),
    ) -> None:
        """The watched layers changed mid-run. The total norm's spike baseline is kept: a new
        head whose gradients explode must still alert (it does, measured: a head replaced with
        too high a learning rate), at the price of a warning when a fresh head's norm is just
        larger than the old model's."""
        self.layer_names = list(layer_names)
        self.lr_groups = list(lr_groups)
        self.gone = dict(gone)  # a layer that left the model: no norm from its step on
        # As the gradient passes were rebuilt at the same moment: they read no parameter that
        # did not require grad then, so its layer's zero norm is expected.
        self.frozen = set(frozen)

    def _onset(self, key: str, value: Any) -> bool:
        """True when condition ``key`` starts or changes value; False while it persists."""
        changed = self._active.get(key) != value
        self._active[key] = value
        return changed and value is not None

    def check_step(self, rec: StepRecord, missing_layers: Sequence[int] = ()) -> list[AlertMessage]:
        out: list[AlertMessage] = []
        step = rec.step
        if rec.loss is not None:
            if not math.isfinite(rec.loss):
                if self._onset("loss", "nonfinite"):
                    out.append(
                        alert("nonfinite_loss", "error", step, f"loss is {rec.loss} at step {step}")
                    )
            else:
                self._active["loss"] = None
                losses = self._losses
                if rec.loss > 0 and len(losses.values) >= MIN_HISTORY:
                    med = losses.median
                    z = (rec.loss - med) / losses.scale  # RobustWindow.z, written out
                    if z > SPIKE_Z and rec.loss > SPIKE_RATIO * max(med, 1e-12):
                        out.append(
                            alert(
                                "loss_spike",
                                "warning",
                                step,
                                f"loss spiked to {rec.loss:.4g} (median {med:.4g}, z={z:.0f})",
                            )
                        )
                losses.append(rec.loss)
        if rec.grad_norms is not None:
            out.extend(self._check_grads(rec, missing_layers))
        if rec.lr:
            # (A containment test first, in C: on almost every step no LR is 0.)
            zero = [i for i, lr in enumerate(rec.lr) if lr == 0.0] if 0.0 in rec.lr else []
            self._lr_zero_run = self._lr_zero_run + 1 if zero else 0
            key = tuple(zero) if self._lr_zero_run >= LR_ZERO_STEPS else None
            if key is None and not zero:
                self._active["lr"] = None
            elif key is not None and self._onset("lr", key):
                out.append(self._lr_zero_alert(step, zero, len(rec.lr)))
        if math.isfinite(rec.step_time) and rec.step_time > 0:
            self._step_times.append(rec.step_time)
        return out

    def _lr_zero_alert(self, step: int, zero: list[int], columns: int) -> AlertMessage:
        """The ``lr_zero`` alert, naming the layers those param groups update (where the
        layout says which: layer_facts' ``lr_group``)."""
        groups = ", ".join(str(i) for i in zero)
        held = set(zero)
        names = self.layer_names
        stopped = [
            names[i]
            for i, column in enumerate(self.lr_groups[: len(names)])
            if column in held and i not in self.gone and i not in self.frozen
        ]
        if len(zero) >= columns:
            said = "nothing is learning"
        elif len(stopped) == 1:
            said = f"layer {stopped[0]} learns nothing"
        elif stopped:
            said = f"layers {_names(stopped)} learn nothing"
        else:
            said = "the layers in them learn nothing"
        return alert(
            "lr_zero",
            "warning",
            step,
            f"learning rate is 0 in param group(s) {groups}: {said}",
            stopped,
        )

    def _check_grads(self, rec: StepRecord, missing_layers: Sequence[int]) -> list[AlertMessage]:
        out: list[AlertMessage] = []
        step, norms, names = rec.step, rec.grad_norms or (), self.layer_names
        gone = self.gone
        bad = [
            names[i]
            for i, v in enumerate(norms)
            if not math.isfinite(v) and not (i in gone and step >= gone[i])
        ]
        if bad:
            if self._onset("grad_nonfinite", tuple(bad)):
                out.append(
                    alert(
                        "nonfinite_grad",
                        "error",
                        step,
                        f"non-finite gradient in {_names(bad)}",
                        bad,
                    )
                )
        else:
            self._active["grad_nonfinite"] = None
        missing = [names[i] for i in missing_layers]
        if self._onset("no_grad", tuple(missing) or None) and missing:
            out.append(
                alert(
                    "no_grad",
                    "warning",
                    step,
                    f"no gradient reached {_names(missing)} (frozen by mistake? detached?)",
                    missing,
                )
            )
        missing_set = set(missing_layers)
        skip = missing_set | self.frozen
        zero = [names[i] for i, v in enumerate(norms) if v == 0.0 and i not in skip]
        if self._onset("zero_grad", tuple(zero) or None) and zero:
            out.append(
                alert(
                    "zero_grad",
                    "warning",
                    step,
                    f"all-zero gradient in {_names(zero)} (dead units? detached branch?)",
                    zero,
                )
            )
        total = rec.grad_total
        if total is not None and math.isfinite(total) and total > 0:
            log_total = math.log10(total)
            if len(self._grad_logs) >= MIN_HISTORY:
                z = self._grad_logs.z(log_total)
                med = 10**self._grad_logs.median
                if z > SPIKE_Z and total > SPIKE_RATIO * med:
                    # The largest finite norms (a gone layer's NaN is no norm at all).
                    finite = [i for i in range(len(norms)) if math.isfinite(norms[i])]
                    top = sorted(finite, key=lambda i: -norms[i])[:3]
                    worst = [names[i] for i in top]
                    out.append(
                        alert(
                            "exploding_grad",
                            "warning",
                            step,
                            f"gradient norm jumped to {total:.3g} "
                            f"(median {med:.3g}); largest in {_names(worst)}",
                            worst,
                        )
                    )
            self._grad_logs.append(log_total)
        return out

    def check_stall(self, last_step: int, seconds_since_step: float) -> list[AlertMessage]:
        """Called periodically by the probe thread: a loop with no step for far too long, by the
        rule the probe announces in its hello (so every reader calls the same gap a stall)."""
        if len(self._step_times) < 3:  # no median worth the name yet: never a stall
            return []
        median = statistics.median(self._step_times)
        limit = DEFAULT_STALL_RULE.limit(median)
        if seconds_since_step > limit and self.stalled_since is None:
            self.stalled_since = time.time() - seconds_since_step
            return [
                alert(
                    "stalled",
                    "error",
                    last_step,
                    f"no step for {seconds_since_step:.0f} s after step {last_step} "
                    f"(a step usually takes {median:.3g} s): "
                    "hung dataloader, collective or deadlock?",
                )
            ]
        return []

    def check_updates(self, measured: UpdateRatios) -> list[AlertMessage]:
        """Alerts from a sampled step's update ratios: layers that stopped learning while
        others learn (tiny ratios, ``update_stalled``), and updates too large for their weights
        (``update_large``). Each on onset, as the gradient alerts are."""
        names = self.layer_names
        for layer, ratio in zip(measured.layers, measured.ratios, strict=True):
            if layer >= len(names) or ratio != ratio:  # not a layer now; no ratio (zero weights)
                continue
            self._ratio[layer] = ratio
            self._tiny_run[layer] = self._tiny_run.get(layer, 0) + 1 if ratio < TINY_RATIO else 0
        out: list[AlertMessage] = []
        stuck = [i for i, run in self._tiny_run.items() if run >= STUCK_MEASUREMENTS]
        learning = [r for i, r in self._ratio.items() if r >= LEARNING_RATIO and i not in stuck]
        stuck_names = tuple(names[i] for i in sorted(stuck) if i not in self.gone)
        if not learning:
            stuck_names = ()  # nothing learns at all: the learning-rate alerts say that
        if self._onset("update_stalled", stuck_names or None) and stuck_names:
            typical = statistics.median(learning)
            worst = max(self._ratio[i] for i in stuck)
            out.append(
                alert(
                    "update_stalled",
                    "warning",
                    measured.step,
                    f"{_names(list(stuck_names))} stopped learning: update ratio ‖Δw‖/‖w‖ at "
                    f"most {worst:.1g} for {STUCK_MEASUREMENTS}+ sampled steps while other "
                    f"layers move {typical:.1g} (a learning rate of 0 for its group? left out "
                    "of the optimizer's update?)",
                    list(stuck_names),
                )
            )
        large = tuple(
            names[i] for i in sorted(self._ratio) if self._ratio[i] > LARGE_RATIO and i < len(names)
        )
        if self._onset("update_large", large or None) and large:
            biggest = max(r for r in self._ratio.values() if r == r)
            out.append(
                alert(
                    "update_large",
                    "warning",
                    measured.step,
                    f"updates too large in {_names(list(large))}: ‖Δw‖/‖w‖ up to {biggest:.2g} "
                    f"in one step (about 1e-3 is typical): learning rate too high?",
                    list(large),
                )
            )
        return out

    def check_resumed(self, step: int) -> list[AlertMessage]:
        if self.stalled_since is None:
            return []
        stalled_for = time.time() - self.stalled_since
        self.stalled_since = None
        return [alert("resumed", "info", step, f"the loop resumed after {stalled_for:.0f} s")]
