"""The probe's current-stream lookup and events (a fake at torch's CUDA boundary: no GPU
here; benchmarks/gpu_check.py runs the real one), its host copies, and a step whose loss was
copied as it is."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tdbg.probe import device_copy
from tdbg.probe.training.pending import PendingStep


class FakeStream:
    made = 0

    def __init__(self, stream_id: int, device_index: int, device_type: int) -> None:
        FakeStream.made += 1
        self.key = (stream_id, device_index, device_type)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """torch's C call answering (stream id, device, type) per device, as set in the dict."""
    current = {0: 7, 1: 9}
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentStream", lambda index: (current[index], index, 1), raising=False
    )
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(device_copy, "_streams", {})
    FakeStream.made = 0
    return current


def test_the_current_stream_is_torch_s_and_made_once(fake_cuda: dict[int, int]) -> None:
    first = device_copy.current_stream(torch.device("cuda", 1))
    assert first.key == (9, 1, 1)
    assert device_copy.current_stream(torch.device("cuda", 1)) is first
    assert FakeStream.made == 1
    fake_cuda[1] = 11  # the loop entered `with torch.cuda.stream(s):`: events go on s
    assert device_copy.current_stream(torch.device("cuda", 1)).key == (11, 1, 1)
    assert device_copy.current_stream(torch.device("cuda", 0)).key == (7, 0, 1)


def test_a_new_stream_every_step_does_not_grow_the_cache(fake_cuda: dict[int, int]) -> None:
    for i in range(device_copy.MAX_STREAMS * 3):
        fake_cuda[0] = 100 + i
        assert device_copy.current_stream(torch.device("cuda", 0)).key == (100 + i, 0, 1)
        assert len(device_copy._streams) <= device_copy.MAX_STREAMS


def test_an_event_is_recorded_on_the_device_s_current_stream(
    fake_cuda: dict[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.timing = enable_timing
            self.stream: FakeStream | None = None

        def record(self, stream: FakeStream) -> None:
            self.stream = stream

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    event = device_copy.recorded_event(torch.device("cuda", 1), timing=True)
    assert event.timing and event.stream.key == (9, 1, 1)
    assert not device_copy.recorded_event(torch.device("cuda", 0)).timing


def test_a_cpu_tensor_goes_to_the_host_as_it_is() -> None:
    vector = torch.arange(3.0)
    values, ready = device_copy.host_copy(vector, timing=True)
    assert values is vector and ready is None


def test_a_loss_copied_as_it_is_resolves_to_its_value() -> None:
    """On a GPU the loss alone is copied 0-d in its own dtype (no reshape or cast launched on
    the training thread): the probe thread reads it as the loss."""
    for value in (
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.tensor([1.25], dtype=torch.float64),
    ):
        pending = PendingStep()
        pending.values, pending.device_scalars = value, ["loss"]
        resolved: Any = pending.resolve()
        assert resolved is not None
        assert resolved[0].loss == float(value)
