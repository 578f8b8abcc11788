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

What a reference does not survive is a loss whose memory is written again after its step: an
accumulator changed in place (passed again, or through a new view such as ``acc.detach()``),
or the static output of a CUDA graph's replay (``torch.compile(mode="reduce-overhead")``),
which the next replay overwrites. The ring sees each: a loss at the address of the one kept
before it (both alive, so the same memory), or one whose version counter moved between its
step and the copy. Such a loss is not read (its step's record says no loss: a wrong number
would be worse), and the ring is *spoiled*: the sampler copies each step's loss at its step
from then on, and says so once. The first steps of a run are copied at once (RING_FROM), so
a loop that does this from its start is seen before any of its losses is kept. A copy that
fails (the device out of memory, say) spoils it too, its batch's steps recorded without a loss.

The losses are stacked on the stream that was current when their batch began: a loop that
computes its loss on another stream than the one current at ``probe.step()`` needs the
stream's work ordered there, as any later use of that tensor would.
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

    __slots__ = ("_ring", "tensors", "versions", "stream", "values", "ready", "losses", "unread")

    def __init__(self, ring: LossRing | None, stream: Any) -> None:
        self._ring = ring
        self.tensors: list[torch.Tensor] | None = []  # None once closed (copied)
        self.versions: list[int] = []  # each tensor's version counter when it was kept
        self.stream = stream  # the training thread's stream when the batch began
        self.values: torch.Tensor | None = None  # the host copy, in flight
        self.ready: Any = None  # the event recorded after the copy
        # Read back: a float each, None where the loss could not be read (its memory
        # written again after its step, or the copy failed).
        self.losses: list[float | None] | None = None
        self.unread: set[int] = set()  # places whose memory was written again

    def read(self) -> list[float | None] | None:
        """On the probe thread: every loss of the batch as a float (None: not readable), or
        None while they are not on the host yet (the first call closes the batch and starts
        their copy). Never blocks, never raises."""
        if self.losses is not None:
            return self.losses
        if self.values is None:
            ring = self._ring
            tensors = ring.close(self) if ring is not None else []
            try:
                self._copy(tensors)
            except Exception as exc:  # the device out of memory, a graph's freed output
                if ring is not None:
                    ring.spoil(f"copying the kept losses failed ({type(exc).__name__}: {exc})")
                self.losses = [None] * len(tensors)
                return self.losses
            if self.values is None:
                return self.losses
            return None
        if self.ready is not None and not self.ready.query():
            return None
        values: list[float | None] = self.values.reshape(-1).tolist()
        for place in self.unread:
            values[place] = None
        self.losses = values
        self.values = self.ready = None
        return values

    def _copy(self, tensors: list[torch.Tensor]) -> None:
        """One copy of ``tensors`` (closed: the training thread adds to a new batch now); the
        ones whose memory was written since their step are left unread."""
        if not tensors:
            self.losses = []
            return
        with torch.cuda.stream(self.stream):  # the stream the losses were made on
            first = tensors[0]
            if all(t.shape == first.shape and t.dtype == first.dtype for t in tensors):
                vector = torch.stack(tensors).float()
            else:  # losses of several shapes or dtypes in one run: rare, one op each
                vector = torch.cat([t.reshape(1).float() for t in tensors])
            self.values, self.ready = host_copy(vector)
        # After the copy was queued: a write queued before it moved the counter by now.
        for place, (tensor, version) in enumerate(zip(tensors, self.versions, strict=True)):
            if tensor._version != version:
                self.unread.add(place)
        if self.unread and self._ring is not None:
            self._ring.spoil("a loss passed to probe.step() was changed in place after its step")


def copied_now(loss: torch.Tensor) -> tuple[LossBatch, int]:
    """``loss`` copied at its step, as a batch of its own (where the ring is not used any
    more): the same place a kept loss has, read the same way."""
    batch = LossBatch(None, None)  # (no stream: the current one, as the step's own work)
    batch.tensors = None
    batch.versions.append(loss._version)
    batch._copy([loss])
    return batch, 0


class LossRing:
    """Where a GPU run's training thread keeps its usual steps' losses (see the module)."""

    __slots__ = ("_lock", "_batch", "device", "_stream_of", "spoiled")

    def __init__(
        self, device: torch.device, stream_of: Callable[[torch.device], Any] = current_stream
    ) -> None:
        self._lock = threading.Lock()  # add() on the training thread, close() on the probe's
        self._batch: LossBatch | None = None
        self.device = device  # the losses it keeps are on this device
        self._stream_of = stream_of  # (tests keep CPU tensors: no stream)
        # Why the ring is not to be used any more (see the module), or None. Set on either
        # thread; the sampler reads it and copies each step's loss at its step from then on.
        self.spoiled: str | None = None

    def spoil(self, why: str) -> None:
        if self.spoiled is None:
            self.spoiled = why

    def add(self, loss: torch.Tensor) -> tuple[LossBatch, int]:
        """Keep ``loss`` (a scalar on this ring's device, no graph); its batch and place. A
        loss at the address of the one kept before it shares its memory (both are alive):
        that one's step is then left unread, and the ring spoiled."""
        with self._lock:
            batch = self._batch
            tensors = None if batch is None else batch.tensors
            if batch is None or tensors is None or len(tensors) >= CAPACITY:
                # The stream current now, as the losses of this batch are made on it: looked
                # up once a batch, not once a step.
                batch = self._batch = LossBatch(self, self._stream_of(self.device))
                batch.tensors = [loss]
                batch.versions.append(loss._version)
                return batch, 0
            if tensors[-1].data_ptr() == loss.data_ptr():
                batch.unread.add(len(tensors) - 1)
                self.spoil("the losses passed to probe.step() share their memory from step to step")
            tensors.append(loss)
            batch.versions.append(loss._version)
            return batch, len(tensors) - 1

    def close(self, batch: LossBatch) -> list[torch.Tensor]:
        """From the probe thread: no more losses go into ``batch``; the ones it holds."""
        with self._lock:
            if self._batch is batch:
                self._batch = None
            tensors, batch.tensors = batch.tensors, None
        return tensors or []
