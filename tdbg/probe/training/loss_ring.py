"""A GPU run's step losses kept on the device and read back in one copy a tick, not one a step.

On a GPU every CUDA call the probe makes costs the training thread host time: on an H200 (a
VM, as cloud GPUs are) a device-to-host copy of the loss with its event took ~90-110 us and
each further event ~20-30 us, against 1-8 ms launch-bound steps (benchmarks/gpu_parts.py). So a
usual step's loss is not copied where it is handed over: the training thread only keeps a
reference to it in the current :class:`LossBatch` (no CUDA call, no allocation on the device).
The probe thread, when it comes to resolve the first step of a batch (once a tick, every
~100 ms), closes the batch and copies all of its losses at once: one ``stack``, one
non-blocking copy into pinned memory and one event, on the stream the losses were made on
(CUDA streams are not tied to a thread). The records follow a tick later, every loss in
them as it was: the TUI is at most a tick or two behind, as it already was.

What a reference does not survive is a loss changed in place after its step (an accumulator
the loop passes every step): such a loop passes the same tensor again, which the sampler sees
(``StepSampler._keep_loss``), and its losses are copied at their step from then on. The first
steps of a run are copied at once (RING_FROM) so that it is seen before any is kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from tdbg.probe.device_copy import current_stream, host_copy

# The losses one batch holds at most (a batch is normally one probe tick's steps): past it a
# new batch starts, so a probe thread that falls behind never holds an unbounded list.
CAPACITY = 1024
# The steps of a run copied at their step before any is kept (see the module's docstring).
RING_FROM = 4


class LossBatch:
    """Consecutive steps' losses on one device, copied to the host together."""

    __slots__ = ("_ring", "tensors", "stream", "values", "ready", "losses")

    def __init__(self, ring: LossRing, stream: Any) -> None:
        self._ring = ring
        self.tensors: list[torch.Tensor] | None = []  # None once closed (copied)
        self.stream = stream  # the training thread's stream when the batch began
        self.values: torch.Tensor | None = None  # the host copy, in flight
        self.ready: Any = None  # the event recorded after the copy
        self.losses: list[float] | None = None  # read back

    def read(self) -> list[float] | None:
        """On the probe thread: every loss of the batch as a float, or None while they are not
        on the host yet (the first call closes the batch and starts their copy). Never
        blocks."""
        if self.losses is not None:
            return self.losses
        if self.values is None:
            self._copy(self._ring.close(self))
            return None
        if self.ready is not None and not self.ready.query():
            return None
        self.losses = self.values.reshape(-1).tolist()
        self.values = self.ready = None
        return self.losses

    def _copy(self, tensors: list[torch.Tensor]) -> None:
        """One copy of ``tensors`` (closed: the training thread adds to a new batch now)."""
        with torch.cuda.stream(self.stream):  # the stream the losses were made on
            first = tensors[0]
            if all(t.shape == first.shape and t.dtype == first.dtype for t in tensors):
                vector = torch.stack(tensors).float()
            else:  # losses of several shapes or dtypes in one run: rare, one op each
                vector = torch.cat([t.reshape(1).float() for t in tensors])
            self.values, self.ready = host_copy(vector)


class LossRing:
    """Where a GPU run's training thread keeps its usual steps' losses (see the module)."""

    __slots__ = ("_lock", "_batch", "device", "_stream_of")

    def __init__(
        self, device: torch.device, stream_of: Callable[[torch.device], Any] = current_stream
    ) -> None:
        self._lock = threading.Lock()  # add() on the training thread, close() on the probe's
        self._batch: LossBatch | None = None
        self.device = device  # the losses it keeps are on this device
        self._stream_of = stream_of  # (tests keep CPU tensors: no stream)

    def add(self, loss: torch.Tensor) -> tuple[LossBatch, int]:
        """Keep ``loss`` (a scalar on this ring's device, no graph); its batch and place."""
        with self._lock:
            batch = self._batch
            tensors = None if batch is None else batch.tensors
            if batch is None or tensors is None or len(tensors) >= CAPACITY:
                # The stream current now, as the losses of this batch are made on it: looked
                # up once a batch, not once a step.
                batch = self._batch = LossBatch(self, self._stream_of(self.device))
                tensors = batch.tensors = [loss]
                return batch, 0
            tensors.append(loss)
            return batch, len(tensors) - 1

    def close(self, batch: LossBatch) -> list[torch.Tensor]:
        """From the probe thread: no more losses go into ``batch``; the ones it holds."""
        with self._lock:
            if self._batch is batch:
                self._batch = None
            tensors, batch.tensors = batch.tensors, None
        return tensors or []
