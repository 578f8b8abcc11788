"""AlertDigest: the alerts in the order a reader needs them: root cause first, repeats folded."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from tdbg.model.run_state import Alert

MAX_VARIANTS = 500  # folded rows below the pinned ones; the oldest go first


@dataclass(slots=True)
class AlertRow:
    """One line of the alerts panel: ``alert`` stands for ``count`` alerts of its kind (pinned)
    or of its kind and message, first raised at ``first_step`` and last at ``last_step``."""

    key: str
    alert: Alert
    count: int
    first_step: int | None
    last_step: int | None
    pinned: bool


class AlertDigest:
    """Folds alerts, oldest first, into rows: the first alert of each kind, pinned in the order
    the kinds first appeared (the first kind is usually the cause, the rest its consequences),
    each with how often its kind came and when last; then the later alerts whose message differs
    from their kind's first, newest first, identical ones folded into one row.

    ``update`` takes RunState's ``alerts`` (newest first, bounded) and ``alert_count`` and folds
    only what is new, so the first alerts stay pinned after the bounded list has dropped them.
    """

    def __init__(self) -> None:
        self._reset()
        self.revision = 0

    def _reset(self) -> None:
        self._pinned: dict[str, AlertRow] = {}  # by kind, in order of first appearance
        self._variants: OrderedDict[tuple[str, str], AlertRow] = OrderedDict()  # oldest first
        self._source: object = None
        self._seen = 0
        self.missed = 0  # alerts counted but gone from the bounded list before they were read
        self._keys = 0  # each row's key: the panel keeps its cursor on a row across updates

    def update(self, alerts: deque[Alert] | Sequence[Alert], count: int) -> bool:
        """Fold the alerts that arrived since the last call; True when the rows changed. A new
        list (a replay cursor moved, another run) or a smaller count starts over."""
        changed = False
        if alerts is not self._source or count < self._seen:
            self._reset()
            self._source = alerts
            changed = True
        new = count - self._seen
        if new > 0:
            fresh = list(islice(alerts, min(new, len(alerts))))
            self.missed += new - len(fresh)
            for alert in reversed(fresh):
                self.add(alert)
            self._seen = count
            changed = True
        if changed:
            self.revision += 1
        return changed

    def add(self, alert: Alert) -> None:
        """Fold one alert, the next in the order they were raised."""
        first = self._pinned.get(alert.kind)
        if first is None:
            key = f"first:{alert.kind}"
            self._pinned[alert.kind] = AlertRow(key, alert, 1, alert.step, alert.step, True)
            return
        first.count += 1
        first.last_step = alert.step
        if alert.message == first.alert.message:
            return  # the pinned row says it all: same kind, same words
        variant = (alert.kind, alert.message)
        row = self._variants.pop(variant, None)
        if row is None:
            self._keys += 1
            row = AlertRow(f"later:{self._keys}", alert, 0, alert.step, None, False)
            if len(self._variants) >= MAX_VARIANTS:
                self._variants.popitem(last=False)
        row.alert = alert  # the newest of its fold: its stack or collective is the current one
        row.count += 1
        row.last_step = alert.step
        self._variants[variant] = row  # moved to the newest end

    @property
    def pinned(self) -> list[AlertRow]:
        return list(self._pinned.values())

    @property
    def later(self) -> list[AlertRow]:
        """The folded later alerts, newest first."""
        return list(reversed(self._variants.values()))

    def rows(self) -> list[AlertRow]:
        return [*self.pinned, *self.later]
