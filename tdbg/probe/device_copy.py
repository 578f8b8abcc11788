"""Device-to-host copies and CUDA events on a device's current stream, without torch's
Python cost of finding that stream."""

from __future__ import annotations

from typing import Any

import torch

# A loop that makes a new stream every step must not grow the cache without end.
MAX_STREAMS = 64

_streams: dict[tuple[int, int, int], Any] = {}


def stream_key(device: torch.device) -> Any:
    """What identifies ``device``'s current stream (its ids, from torch's C side: one call, no
    Python object made)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentStream(index)


def current_stream(device: torch.device) -> Any:
    """``torch.cuda.current_stream(device)``: the same stream, looked up by the ids torch's C
    side returns instead of built anew. torch's own call costs ~9 us of Python (measured on an
    H200), and the probe records about five events a step."""
    # (stream_key written out: this runs on every CUDA event the probe records.)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = torch._C._cuda_getCurrentStream(index)
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= MAX_STREAMS:
            _streams.clear()
        stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        _streams[key] = stream
    return stream


# torch.cuda.Event's C base: the same event, without the Python layer torch.cuda.Event puts
# over its constructor, record(), query() and elapsed_time() (a Python frame each, on every
# one of the ~5 events a step, and on the probe thread at each query). A CPU-only
# build has it as an empty stub, or not at all; no event is made there.
_EventBase: Any = getattr(torch._C, "_CudaEventBase", None)
if _EventBase is not None and not hasattr(_EventBase, "record"):
    _EventBase = None


def recorded_event(device: torch.device, timing: bool = False) -> Any:
    """A CUDA event recorded now on ``device``'s current stream: an asynchronous enqueue, no
    host-device sync. ``timing``: one that can start or end a timed span. It has the C
    methods ``query()``, ``elapsed_time(end)`` and ``synchronize()`` of torch.cuda.Event."""
    if _EventBase is None:
        event = torch.cuda.Event(enable_timing=timing)
    else:
        event = _EventBase(enable_timing=timing)
    event.record(current_stream(device))
    return event


def host_copy(vector: torch.Tensor, timing: bool = False) -> tuple[torch.Tensor, Any]:
    """``vector`` on its way to the host, and the event that says the copy is done (None where
    there is nothing to wait for). On CUDA an asynchronous copy into pinned memory, the event
    recorded after it on the same stream; a CPU tensor as it is; elsewhere (mps, xpu, ...: no
    CUDA event to wait on) a plain copy."""
    if vector.device.type == "cuda":
        return vector.to("cpu", non_blocking=True), recorded_event(vector.device, timing)
    return vector.to("cpu"), None


def device_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, device=device)`` (int64) without a host-device sync: on CUDA a
    copy from pageable memory waits for the device's queue to drain (sync debug mode calls
    it synchronizing), so the values go through pinned memory and are copied asynchronously
    (torch's pinned allocator keeps the buffer until the copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    pinned = torch.tensor(values, dtype=torch.int64).pin_memory()
    return pinned.to(device, non_blocking=True)
