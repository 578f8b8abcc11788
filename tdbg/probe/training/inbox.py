"""The one hand-off from the training thread to the probe thread: bounded, never waited on."""

from __future__ import annotations

from collections import deque

from tdbg.probe.training.loss_ring import LossRing
from tdbg.probe.training.metrics import MAX_PENDING as MAX_PENDING_METRICS
from tdbg.probe.training.metrics import PendingMetrics
from tdbg.probe.training.pending import LeanHanded, PendingStep, UsualStep
from tdbg.protocol.messages.alert import Alert

STEPS_SIZE = 4096  # pending steps the training thread may run ahead of the probe thread
ALERTS_SIZE = 64


class Inbox:
    """What the training thread hands the probe thread, and all it shares with it.

    The training side only appends (a bounded deque drops its oldest when full: appending never
    blocks, whatever the probe thread is doing) and counts what it appended; the probe thread
    only pops. ``open`` is the probe thread's word that something reads what is appended: while
    it is False the training side keeps nothing (a step nobody can ever read costs nothing).
    """

    __slots__ = ("steps", "appended", "metrics", "alerts", "open", "ring")

    def __init__(self) -> None:
        self.steps: deque[PendingStep | UsualStep | LeanHanded] = deque(maxlen=STEPS_SIZE)
        self.appended = 0  # written by the training thread only
        # probe.log()'s batches, read off the training thread as steps are.
        self.metrics: deque[PendingMetrics] = deque(maxlen=MAX_PENDING_METRICS)
        self.alerts: deque[Alert] = deque(maxlen=ALERTS_SIZE)  # the training side's own alerts
        self.open = False
        # A GPU run's loss ring (loss_ring.py), which the probe thread frees where no step
        # asks for its slots (LossRing.reclaim); None on the CPU and once it is given up.
        self.ring: LossRing | None = None
