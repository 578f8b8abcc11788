"""Anomaly mode on demand: autograd anomaly detection for N steps, its backward errors as alerts."""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from tdbg.probe.alerts import alert
from tdbg.probe.dives.base import Dive, DiveContext
from tdbg.protocol.messages.results import AnomalyResult

# torch warns with this text (python_anomaly_mode.cpp) just before backward raises: the traceback
# of the forward call that made the failing node.
_FORWARD_TRACE = "Traceback of forward call that caused the error"
_NODE = re.compile(r"Error detected in (\S+?)\.")
MAX_ALERT_CHARS = 3500  # the alert travels in one message; a deep traceback is cut at the top


class AnomalyDive(Dive):
    """``torch.autograd.set_detect_anomaly(True, check_nan=...)`` for ``steps`` steps, then off.

    By default ``check_nan=False``: a NaN never becomes an exception in the user's loop, while an
    error raised by backward (an in-place modification, a broken graph) still names the forward
    op that caused it. The probe catches torch's warning that carries that traceback and sends
    it as an ``anomaly`` alert; the error itself goes on to the user's loop as it would anyway.
    """

    kind = "anomaly"

    def __init__(self, ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> None:
        super().__init__(ctx, job, args, trigger)
        self.errors = 0
        self._was_enabled: bool | None = None
        self._was_check_nan = True
        self._showwarning: Any = None
        self._filter: tuple[Any, ...] | None = None

    def start(self, step: int) -> None:
        self._was_enabled = torch.is_anomaly_enabled()
        self._was_check_nan = torch.is_anomaly_check_nan_enabled()
        # Seen every time, not once per code location as the default filter would.
        warnings.filterwarnings("always", message=r"Error detected in", category=UserWarning)
        self._filter = warnings.filters[0]
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._on_warning
        torch.autograd.set_detect_anomaly(True, check_nan=bool(self.args.get("check_nan")))

    def _on_warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        try:
            text = str(message)
            if _FORWARD_TRACE in text:
                self.errors += 1
                node = _NODE.search(text)
                trace = text.split(_FORWARD_TRACE, 1)[1].lstrip(":\n")
                trace = trace.split("(Triggered internally", 1)[0].rstrip()
                head = f"backward error in {node.group(1) if node else 'autograd'}; forward call:"
                body = trace[-MAX_ALERT_CHARS:]
                self.ctx.side_alerts.append(
                    alert("anomaly", "error", self.ctx.step, f"{head}\n{body}")
                )
        finally:
            # The user still sees the warning exactly as without the probe.
            if self._showwarning is not None:
                self._showwarning(message, category, filename, lineno, file, line)

    def finish_steps(self, step: int) -> None:
        self.stepping = False
        self.release()
        self.done(
            step,
            AnomalyResult(self.count, bool(self.args.get("check_nan")), self.errors),
        )

    def release(self) -> None:
        if self._was_enabled is None:
            return
        was_enabled, self._was_enabled = self._was_enabled, None
        try:
            torch.autograd.set_detect_anomaly(was_enabled, check_nan=self._was_check_nan)
        finally:
            if warnings.showwarning == self._on_warning:
                warnings.showwarning = self._showwarning
            if self._filter is not None and self._filter in warnings.filters:
                warnings.filters.remove(self._filter)  # type: ignore[attr-defined]
                warnings._filters_mutated()  # type: ignore[attr-defined]
            self._filter = None
