"""A GPU run's step losses copied into a buffer on the device and read back in one copy a tick.

On a GPU every CUDA call the probe makes costs the training thread host time: on an H200 (a
VM, as cloud GPUs are) a device-to-host copy of the loss with its event took ~90-110 us and
each further event ~20-30 us, against 1-8 ms launch-bound steps (benchmarks/gpu_parts.py). So a
usual step's loss is not copied to the host where it is handed over: the training thread
copies it into the next slot of the ring's own buffer on the device (one ``copy_``, queued on
the current stream: no sync, no allocation), and the step goes on. The probe thread, when it
comes to resolve the first step of a batch (once a tick, every ~100 ms), closes the batch and
copies its slots to the host at once: one non-blocking copy into pinned memory and one event,
on the stream the slots were written on. The records follow a tick later, every loss in them
as it was at its step: the TUI is at most a tick or two behind, as it already was.

The copy at the step is what makes the value the step's: the loss's own memory may be written
again before the tick (an accumulator changed in place, a buffer passed as a new view each
step, a CUDA graph's static output that the next replay overwrites, an in-place all-reduce
after ``probe.step()``), and some of those writes move no version counter, so a reference
kept until the tick could read a later step's value without any way to tell.

A slot is written again only once the batch it last held is back on the host (the ring counts
slots written and slots read back), so a slot's next write, on whatever stream, never races
its copy; a probe thread a whole ring behind makes the step copy its loss to the host itself
(``add`` returns None). A batch is the slots written on one stream: a loop that changes the
current stream between steps starts a new one, so that each batch's copy is queued after its
slots' writes, on theirs; the first read of any batch queues the copies of every batch
written so far, so a loop that changes streams each step is read back a tick later too. A
copy that fails (the device out of memory, say) gives the ring up, its batch's steps recorded
without a loss. (A loss made on another stream than the one current at ``probe.step()``
needs that stream's work ordered there, as any other use of the tensor on it would.)
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch

from tdbg.probe.device_copy import current_stream, host_copy, stream_key

# Slots in the ring (a tick's steps are normally far fewer: a probe thread this far behind
# makes the steps copy their own losses until it frees slots again, LossRing.reclaim).
# 8 bytes each, on the device.
CAPACITY = 4096


class LossBatch:
    """Consecutive steps' losses in consecutive slots of one ring, copied to the host together."""

    __slots__ = (
        "_ring", "first", "count", "key", "stream", "closed", "failed", "values", "ready", "losses"
    )  # fmt: skip

    def __init__(self, ring: LossRing | None, first: int, key: Any, stream: Any) -> None:
        self._ring = ring
        self.first = first  # the ring's count of slots written when this batch began
        self.count = 0  # its slots (its steps' places are 0 .. count - 1)
        self.key = key  # the stream its slots are written on (device_copy.stream_key)
        self.stream = stream  # that stream, where their copy to the host is queued
        self.closed = False  # no more steps go into it (its copy queued, or about to be)
        self.failed = False  # its copy could not be queued: its steps have no loss
        self.values: torch.Tensor | None = None  # the host copy, in flight
        self.ready: Any = None  # the event recorded after the copy
        # Read back: a float each, None where the copy failed.
        self.losses: list[float | None] | None = None

    def read(self) -> list[float | None] | None:
        """On the probe thread: every loss of the batch as a float (None: not readable), or
        None while they are not on the host yet (the first call closes the batch and starts
        their copy). Never blocks, never raises."""
        if self.losses is not None:
            return self.losses
        ring = self._ring
        if not self.closed:
            if ring is None:  # (copied_now's batch is closed at birth)
                self.losses = []
                return self.losses
            ring.copy_out()  # this batch's copy and every other one written so far
            if self.count and not self.failed:
                return None  # just queued: not there yet (a CPU ring's too, as a GPU's)
        if self.failed:
            self.losses = [None] * self.count
            return self.losses
        if self.ready is not None and not self.ready.query():
            return None
        values = self.values
        self.losses = [] if values is None else values.tolist()
        self.values = self.ready = None
        if ring is not None:
            ring.read_back(self)
        return self.losses


def copied_now(loss: torch.Tensor) -> tuple[LossBatch, int]:
    """``loss`` copied to the host at its step, as a batch of its own (where the ring is not
    used: given up, or a whole ring behind): the same place a kept loss has, read the same way."""
    batch = LossBatch(None, 0, None, None)
    batch.closed = True
    batch.count = 1
    vector = loss.detach().reshape(1).to(torch.float64)
    batch.values, batch.ready = host_copy(vector)
    if batch.ready is None:  # on the host already (a CPU tensor: the loss's own memory)
        batch.losses = batch.values.tolist()
        batch.values = None
    return batch, 0


class LossRing:
    """Where a GPU run's training thread keeps its usual steps' losses (see the module)."""

    __slots__ = (
        "_lock",
        "_batch",
        "_unqueued",
        "device",
        "_stream_of",
        "_key_of",
        "spoiled",
        "_buffer",
        "_slots",
        "_written",
        "_done",
        "_queued",
    )

    def __init__(
        self,
        device: torch.device,
        stream_of: Callable[[torch.device], Any] = current_stream,
        key_of: Callable[[torch.device], Any] = stream_key,
    ) -> None:
        self._lock = threading.Lock()  # add() on the training thread, copy_out() on the probe's
        self._batch: LossBatch | None = None  # the batch steps go into now
        self._unqueued: list[LossBatch] = []  # batches written, their copy not queued yet
        self.device = device  # the losses it keeps are on this device
        self._stream_of = stream_of  # (tests keep CPU tensors: no stream)
        self._key_of = key_of
        # Why the ring is not to be used any more (see the module), or None. Set on either
        # thread; the sampler reads it and copies each step's loss at its step from then on.
        self.spoiled: str | None = None
        self._buffer: torch.Tensor | None = None  # made at the first add, on the device
        # Its elements as one-element views, made as the first lap of the ring reaches them
        # (one slice a step then, none after: all 4096 at once took ~7 ms on a CPU).
        self._slots: list[torch.Tensor] = []
        self._written = 0  # slots written since the start (slot: this modulo CAPACITY)
        self._done = 0  # ... of which the batch is back on the host (the slot free again)
        # Batches whose copy is queued and whose slots are not free yet, oldest first (the
        # probe thread's own: copy_out, read_back and reclaim run there).
        self._queued: collections.deque[LossBatch] = collections.deque()

    def spoil(self, why: str) -> None:
        if self.spoiled is None:
            self.spoiled = why

    def add(self, loss: torch.Tensor) -> tuple[LossBatch, int] | None:
        """Copy ``loss`` (a one-element tensor without a graph, on this ring's device) into the
        next slot, on the current stream; its batch and place. None where it is not kept: the
        probe thread is a whole ring behind (or the write failed: the ring is given up then),
        and the caller copies it to the host at its step."""
        key = self._key_of(self.device)
        with self._lock:
            written = self._written
            if written - self._done >= CAPACITY:
                return None  # its slot's last batch is not back on the host yet
            slot = written % CAPACITY
            batch = self._batch
            try:
                if batch is None or batch.closed or slot == 0 or batch.key != key:
                    # A batch is a run of slots on one stream, never past the buffer's end.
                    batch = self._new_batch(written, key)
                if slot == len(self._slots):  # the first lap: this slot's view made now
                    if self._buffer is None:
                        # Not an inference tensor, whatever mode the first step runs in (one
                        # could not be written outside inference mode: the ring given up).
                        with torch.inference_mode(False):
                            self._buffer = torch.empty(
                                CAPACITY, dtype=torch.float64, device=self.device
                            )
                    self._slots.append(self._buffer[slot : slot + 1])
                if loss.requires_grad:  # (the callers pass none: a graph on the buffer)
                    loss = loss.detach()
                self._slots[slot].copy_(loss if loss.dim() <= 1 else loss.reshape(1))
            except Exception as exc:  # a loss the buffer cannot take: copied at each step
                self.spoil(f"a loss could not be kept on the device ({type(exc).__name__}: {exc})")
                return None
            self._written = written + 1
            place = batch.count
            batch.count = place + 1
            return batch, place

    def _new_batch(self, written: int, key: Any) -> LossBatch:
        """(Under the lock.) The batch the next steps go into, from slot ``written``."""
        stream = self._stream_of(self.device)
        buffer = self._buffer
        if stream is not None and buffer is not None:
            # The buffer used on this stream too: not handed out again by the allocator while
            # a write or copy queued here is pending, should the ring be freed meanwhile.
            buffer.record_stream(stream)
        batch = self._batch = LossBatch(self, written, key, stream)
        self._unqueued.append(batch)
        return batch

    def copy_out(self) -> None:
        """From the probe thread: close every batch written so far (no more losses go into
        them) and queue each one's copy to the host, on the stream its slots were written on.
        The lock is held only to take them: their slots are not written again before they
        are read back (:meth:`read_back`), so the copies are queued without it."""
        with self._lock:
            batches, self._unqueued, self._batch = self._unqueued, [], None
            for batch in batches:
                batch.closed = True
            buffer = self._buffer
        for batch in batches:
            if not batch.count or buffer is None:
                continue
            self._queued.append(batch)
            try:
                start = batch.first % CAPACITY
                vector = buffer[start : start + batch.count]
                with torch.cuda.stream(batch.stream):  # (None: a no-op)
                    values, ready = host_copy(vector)
                if ready is None:  # on the host already: the buffer's own memory (a CPU ring)
                    values = values.clone()
                batch.values, batch.ready = values, ready
            except Exception as exc:  # the device out of memory, say
                self.spoil(f"copying the kept losses failed ({type(exc).__name__}: {exc})")
                batch.failed = True

    def read_back(self, batch: LossBatch) -> None:
        """From the probe thread: ``batch`` is back on the host; its slots may be written
        again. (Batches are read back in order, steps resolving in order; one dropped unread,
        its steps lost in a full hand-off, is passed by the next.)"""
        with self._lock:
            done = self._done = max(self._done, batch.first + batch.count)
        queued = self._queued
        while queued and queued[0].first + queued[0].count <= done:
            queued.popleft()  # read back, or passed by a later one (its steps dropped)

    def reclaim(self) -> None:
        """From the probe thread, once a tick: where the ring is full, its batches read back,
        oldest first, as far as their copies have landed, whether or not a step still asks
        for them. A probe thread that fell a whole ring behind may have seen their steps
        dropped from the full hand-off; nothing else would read them, and every later step
        would copy its own loss for the rest of the run."""
        if self._written - self._done < CAPACITY:
            return
        self.copy_out()
        for batch in list(self._queued):
            if batch.read() is None:
                return  # its copy still in flight: the next tick
