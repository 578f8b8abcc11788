"""The alerts a logged metric raises: its first non-finite value, by name, then as counts."""

from __future__ import annotations

from tdbg.probe.alerts import alert
from tdbg.probe.training.metrics import MetricsHistory
from tdbg.protocol.messages.alert import Alert

NONFINITE_METRIC_ALERTS = 8  # metric names alerted one by one; then a count at powers of 2


def nonfinite_metric_alerts(metrics: MetricsHistory, new: list[str]) -> list[Alert]:
    """Alerts for the metrics in ``new`` that just went non-finite (``metrics.add``'s answer):
    the first NONFINITE_METRIC_ALERTS names each get one; past them a count, at 16, 32, 64, ...
    names, so that thousands of bad metrics cost a handful of alerts."""
    out: list[Alert] = []
    before = len(metrics.first_nonfinite) - len(new)
    for count, name in enumerate(new, before + 1):
        step, _, value = metrics.first_nonfinite[name]
        if count <= NONFINITE_METRIC_ALERTS:
            message = f"metric {name} is {value} at step {step} (first non-finite value)"
        elif count & (count - 1) == 0:
            message = (
                f"{count} metrics have gone non-finite (the latest: {name} is {value} "
                f"at step {step}); each one's first non-finite value is kept"
            )
        else:
            continue
        out.append(alert("nonfinite_metric", "warning", step, message))
    return out
