"""A GPU run's usual-step losses kept on the device and read back once a tick (loss_ring.py):
every step's loss still recorded, exactly, in order, the run's last ones too, whatever the
loop writes into the loss's memory after its step. Proven on the CPU with a ring of CPU
tensors (no CUDA here; gpu_check.py runs it on a GPU)."""

from __future__ import annotations

import collections
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop, handed_over
from test_phase_marks import on_a_fake_gpu
from waiting import TIMEOUT, wait_until

import tdbg
from tdbg.probe.serving import server as server_module
from tdbg.probe.serving.server import ProbeServer
from tdbg.probe.training import cost_model, lean, loss_ring, taps
from tdbg.probe.training import inbox as inbox_module
from tdbg.probe.training.loss_ring import LossBatch, LossRing, copied_now
from tdbg.protocol.steps import unpack_steps
from tdbg.recording.reader import Recording

CPU = torch.device("cpu")


def cpu_ring() -> LossRing:
    return LossRing(CPU, stream_of=lambda device: None, key_of=lambda device: None)


def test_a_batch_is_read_back_whole_after_its_copy_began() -> None:
    ring = cpu_ring()
    losses = [torch.tensor(float(k) / 3) for k in range(5)]
    places = [ring.add(loss) for loss in losses]
    assert all(place is not None for place in places)
    batch = places[0][0]  # type: ignore[index]
    assert all(b is batch for b, _ in places) and [i for _, i in places] == list(range(5))  # type: ignore[misc]
    assert batch.read() is None  # the first read closes the batch and starts its copy
    later = ring.add(torch.tensor(9.0))  # a closed batch takes no more
    assert later is not None and later[0] is not batch and later[1] == 0
    assert batch.read() == pytest.approx([float(t) for t in losses], rel=1e-7)
    assert batch.read() is batch.read()  # read once, kept


def kept(ring: LossRing, loss: torch.Tensor) -> tuple[LossBatch, int]:
    place = ring.add(loss)
    assert place is not None
    return place


def test_losses_of_several_shapes_and_dtypes_in_one_batch() -> None:
    ring = cpu_ring()
    with torch.inference_mode():  # (a tensor without a version counter to read)
        inferred = torch.tensor(5.5)
    losses = [
        torch.tensor(1.5),
        torch.tensor([2.5]),
        torch.tensor([[4.5]]),
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.tensor(0.1, dtype=torch.float64),
        inferred,
    ]
    batch = [kept(ring, loss) for loss in losses][0][0]
    assert batch.read() is None
    assert batch.read() == [1.5, 2.5, 4.5, 3.5, 0.1, 5.5]  # (float64 slots: each exactly)
    assert ring.spoiled is None


def test_each_step_s_loss_is_its_own_whatever_the_loop_writes_after() -> None:
    """The loss's memory written again before the tick's copy, in every way a loop does: a
    buffer rewritten and passed as a new view each step (a CUDA graph's static output), two
    such buffers in turn (two graphs), an accumulator changed in place, writes through
    ``.data`` that move no version counter (as a graph's replay or an in-place all-reduce do
    not): each step's value is the one it had at its step."""
    ring = cpu_ring()
    one, two, running = torch.zeros(()), torch.zeros(()), torch.zeros(())
    places, expected = [], []
    for step in range(12):
        value = float(step) + 0.25
        if step % 4 == 0:
            one.fill_(value)
            passed = one.detach()
        elif step % 4 == 1:
            two.data.copy_(torch.tensor(value))  # no version counter moved
            passed = two.detach()
        elif step % 4 == 2:
            passed = running.mul_(0.5).add_(value)  # the same tensor, changed in place
            value = float(running)
        else:
            one.data.fill_(value)
            passed = one.detach()
        places.append(kept(ring, passed))
        expected.append(value)
    for buffer in (one, two, running):
        buffer.data.fill_(-1.0)  # all written again before the copy
    batch = places[0][0]
    assert all(b is batch for b, _ in places)
    assert batch.read() is None
    assert batch.read() == expected
    assert ring.spoiled is None


def test_a_copy_that_fails_leaves_its_steps_without_a_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def out_of_memory(vector: torch.Tensor, timing: bool = False) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    monkeypatch.setattr(loss_ring, "host_copy", out_of_memory)
    ring = cpu_ring()
    batch = [kept(ring, torch.tensor(float(k))) for k in range(4)][0][0]
    assert batch.read() == [None, None, None, None]  # never raises into the probe thread
    assert ring.spoiled and "OutOfMemoryError" in ring.spoiled


def test_a_loss_the_buffer_cannot_take_gives_the_ring_up() -> None:
    ring = cpu_ring()
    assert ring.add(torch.tensor(1.0)) is not None
    assert ring.add(torch.empty((), device="meta")) is None  # (no data to copy)
    assert ring.spoiled and "could not be kept" in ring.spoiled


def test_a_ring_first_written_in_inference_mode_is_written_outside_it_too() -> None:
    """The buffer is made at the first step's write: made under ``torch.inference_mode()`` (an
    evaluation's loss passed), it would be an inference tensor, which no later step outside
    that mode could write (the ring given up for the run)."""
    ring = cpu_ring()
    with torch.inference_mode():
        first = kept(ring, torch.tensor(1.5))
    second = kept(ring, torch.tensor(2.5))
    assert ring.spoiled is None
    assert first[0] is second[0] and first[0].read() is None
    assert first[0].read() == [1.5, 2.5]


def test_a_loss_copied_at_its_step_reads_as_a_kept_one() -> None:
    """Where the ring is not used for a step, its loss is copied at once, as a batch of its
    own read the same way (bfloat16 and a shape [1] loss too)."""
    for loss in (torch.tensor(2.5), torch.tensor([1.5]), torch.tensor(0.75, dtype=torch.bfloat16)):
        batch, place = copied_now(loss)
        losses = batch.read()
        assert losses is not None and losses[place] == float(loss)


def test_a_slot_is_written_again_only_once_its_batch_is_read_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ring of 4 slots: a probe thread that falls a whole ring behind has the steps copy
    their own losses (add: None) until it reads a batch back; a batch never runs past the
    buffer's end, and values written after the wrap are the later steps'."""
    monkeypatch.setattr(loss_ring, "CAPACITY", 4)
    ring = cpu_ring()
    first = [kept(ring, torch.tensor(float(k))) for k in range(3)][0][0]
    assert first.read() is None and first.read() == [0.0, 1.0, 2.0]  # slots 0-2 free again
    second = kept(ring, torch.tensor(3.0))  # slot 3: a new batch (the first was closed)
    third = [kept(ring, torch.tensor(float(k))) for k in (4, 5, 6)]  # slots 0-2: another
    assert second[0] is not first and third[0][0] is not second[0]
    assert [place for _, place in third] == [0, 1, 2]
    assert ring.add(torch.tensor(7.0)) is None  # slot 3 is the second batch's, not back yet
    assert ring.spoiled is None
    assert second[0].read() is None  # (queues the third batch too)
    assert second[0].read() == [3.0]
    fourth = kept(ring, torch.tensor(7.0))  # slot 3 again, in a batch of its own
    assert fourth[1] == 0 and fourth[0] is not third[0][0]
    assert third[0][0].read() == [4.0, 5.0, 6.0]
    assert fourth[0].read() is None and fourth[0].read() == [7.0]
    assert kept(ring, torch.tensor(8.0))[1] == 0  # past the end: a new batch at slot 0


class LateCopy:
    """A copy to the host that lands when its event is first asked after the first time (a
    DMA that takes a while): what it reads is the slots as they are then."""

    def __init__(self, vector: torch.Tensor) -> None:
        self.vector, self.asked = vector, 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked > 1


def late_copy(vector: torch.Tensor, timing: bool = False) -> tuple[torch.Tensor, LateCopy]:
    return vector, LateCopy(vector)  # (the buffer's own memory: read when it lands)


def test_a_slot_is_not_written_again_before_its_copy_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy queued is not a copy done: a slot's next write (on any stream) waits for its
    batch to be back on the host, or the copy would read the later step's value."""
    monkeypatch.setattr(loss_ring, "CAPACITY", 4)
    monkeypatch.setattr(loss_ring, "host_copy", late_copy)
    ring = cpu_ring()
    first = [kept(ring, torch.tensor(float(k))) for k in range(4)]
    batch = first[0][0]
    assert batch.read() is None  # queued
    assert batch.read() is None  # not landed yet
    assert ring.add(torch.tensor(9.0)) is None  # slot 0 not free: copied at its step instead
    assert batch.read() == [0.0, 1.0, 2.0, 3.0]  # landed, every value its step's
    assert kept(ring, torch.tensor(4.0))[1] == 0  # now slot 0 is free


def test_one_read_queues_every_batch_written_so_far() -> None:
    """A loop that changes the current stream every step makes a batch a step: the first read
    of any queues them all, so a tick later all are back (not one batch a tick)."""
    streams = iter(["a", "b"] * 10)
    ring = LossRing(CPU, stream_of=lambda device: None, key_of=lambda device: next(streams))
    places = [kept(ring, torch.tensor(float(k))) for k in range(10)]
    assert len({id(b) for b, _ in places}) == 10
    assert places[0][0].read() is None  # queues all ten
    assert [b.read() for b, _ in places[1:]] == [[float(k)] for k in range(1, 10)]
    assert places[0][0].read() == [0.0]


def test_reading_an_older_batch_frees_only_its_own_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches on two streams: the older one read back frees its slots, not the newer's."""
    monkeypatch.setattr(loss_ring, "CAPACITY", 4)
    keys = iter(["a", "b", "b", "b", "b", "b", "b"])
    ring = LossRing(CPU, stream_of=lambda device: None, key_of=lambda device: next(keys))
    older = kept(ring, torch.tensor(0.0))  # slot 0, stream a
    newer = kept(ring, torch.tensor(1.0))  # slot 1, stream b: a batch of its own
    kept(ring, torch.tensor(2.0))  # slot 2
    assert older[0].read() is None  # (queues both batches)
    assert older[0].read() == [0.0]  # back: slot 0 free, not 1-2
    assert kept(ring, torch.tensor(3.0))[1] == 0  # slot 3, a new batch (the last was closed)
    assert kept(ring, torch.tensor(4.0))[1] == 0  # slot 0 again, past the end: another
    assert ring.add(torch.tensor(5.0)) is None  # slot 1 is the newer batch's, not back yet
    assert newer[0].read() == [1.0, 2.0]


def test_a_new_stream_starts_a_new_batch() -> None:
    """The losses of one batch are copied out on one stream, after their writes: a loop that
    makes another stream current between steps starts another batch there."""
    streams = iter(["a", "a", "b", "b", "a"])
    current: list[str] = []

    def key_of(device: torch.device) -> str:
        current.append(next(streams))
        return current[-1]

    ring = LossRing(CPU, stream_of=lambda device: None, key_of=key_of)
    batches = [kept(ring, torch.tensor(float(k)))[0] for k in range(5)]
    assert [len({id(b) for b in batches[i:j]}) for i, j in ((0, 2), (2, 4))] == [1, 1]
    assert len({id(b) for b in batches}) == 3


def as_on_a_gpu(probe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``probe`` as on a GPU run: its marks CUDA ones on the steps it times (a fake event:
    test_phase_marks.on_a_fake_gpu), a loss ring (of CPU tensors, which the taps keep unread,
    as a device's), the backward's scalar kept unread on lean steps."""
    monkeypatch.setattr(taps, "READ_ON_HOST", False)
    on_a_fake_gpu(probe)
    probe._sampler._loss_ring = probe._server.handoff.ring = cpu_ring()
    probe._sampler.lean.device_loss = CPU


def watched_as_on_a_gpu(loop: Loop, path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A probe recording to ``path``, as on a GPU run, and the list of steps it hands its
    thread."""
    probe = tdbg.watch(loop.model, loop.opt, name="ring", serve=False, record=path)
    as_on_a_gpu(probe, monkeypatch)
    return probe, handed_over(probe, monkeypatch)


def train(
    loop: Loop,
    probe: Any,
    steps: int,
    passed: Callable[[torch.Tensor], Any] = torch.Tensor.detach,
    samples: Callable[[int], Any] = lambda step: None,
) -> None:
    """``steps`` steps of ``loop``, each passing probe.step() ``passed(loss)`` (by default
    ``loss.detach()``, a GPU loop's usual call) and ``samples(step)``; each loss noted."""
    for step in range(steps):
        loop.model.zero_grad(set_to_none=True)
        loss = loop.loss()
        loss.backward()
        loop.optimizer.step()
        probe.step(passed(loss), samples=samples(step))
        loop.losses.append(loss.item())


def run(
    loop: Loop, probe: Any, steps: int, monkeypatch: pytest.MonkeyPatch, passed: bool = True
) -> None:
    """``steps`` steps of ``loop``, each passing probe.step() a scalar of its own (not the one
    backpropagated; ``passed`` False: nothing, the scalar backpropagated taken, as ``tdbg
    run`` does), the whole way: lean steps off (the tests of lean steps are below)."""
    monkeypatch.setattr(lean, "ENABLED", False)
    train(loop, probe, steps, (lambda loss: loss.detach().clone()) if passed else lambda _: None)


def each_step_recorded(path: Path, losses: list[float]) -> None:
    """The recording at ``path`` has every step, in order, each with its own loss."""
    recorded = recorded_losses(path)
    assert [step for step, _ in recorded] == list(range(len(losses)))
    for (_, value), expected in zip(recorded, losses, strict=True):
        assert value == pytest.approx(expected, rel=1e-6)


def recorded_losses(path: Path) -> list[tuple[int, float | None]]:
    steps = [r for m in Recording(path).messages() if m["type"] == "steps" for r in unpack_steps(m)]
    return [(r.step, r.loss) for r in steps]


def in_the_ring(steps: list[Any]) -> None:
    """``steps``' losses went into the loss ring (not each copied to the host at its step):
    batches of the ring's, each shared by several steps."""
    assert all(p.loss_batch._ring is not None for p in steps)
    assert len({id(p.loss_batch) for p in steps}) < len(steps) / 2


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "backpropagated"])
def test_every_step_loss_is_recorded_from_the_ring_the_last_ones_too(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, passed: bool
) -> None:
    loop = Loop(seed=5)
    path = tmp_path / "ring.tdbg"
    probe, sent = watched_as_on_a_gpu(loop, path, monkeypatch)
    run(loop, probe, 120, monkeypatch, passed)
    probe.close()  # right after the last step: its batch is read back at close
    kept = [p for p in sent if p.loss_batch is not None]
    assert len(kept) > 100  # the usual steps (not the sampled ones: their values are copied)
    assert all(p.grads is None for p in kept)
    in_the_ring(kept)
    # Read back a tick's steps at a time, each batch a run of consecutive steps.
    batches: dict[int, list[int]] = {}
    for p in kept:
        batches.setdefault(id(p.loss_batch), []).append(p.loss_index)
    assert len(batches) < len(kept)
    assert all(places == list(range(len(places))) for places in batches.values())
    each_step_recorded(path, loop.losses)
    assert probe.errors == 0


@pytest.mark.parametrize("on_gpu", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("lean_steps", [True, False], ids=["lean", "whole way"])
@pytest.mark.parametrize("passing", ["accumulator", "views", "two buffers"])
def test_a_loop_rewriting_what_it_passed_gets_each_step_s_own_loss(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lean_steps: bool,
    passing: str, on_gpu: bool,
) -> None:  # fmt: skip
    """A loop that passes the same memory every step and writes it again after the step: an
    accumulator changed in place, a buffer passed as a new view each step (a CUDA graph's
    static output), two buffers in turn written through ``.data`` (two graphs; no version
    counter moves). Each step's loss is copied into the ring at its step (a CPU run's read
    at its step), so the record is each step's own value; on a GPU the ring is kept, the
    steps lean between the timed ones."""
    loop = Loop(seed=6)
    path = tmp_path / "rewritten.tdbg"
    if on_gpu:
        probe, sent = watched_as_on_a_gpu(loop, path, monkeypatch)
    else:
        probe = tdbg.watch(loop.model, loop.opt, name="rewritten", serve=False, record=path)
        sent = handed_over(probe, monkeypatch)
    probe._sampler.grad_every = 10**9
    monkeypatch.setattr(lean, "ENABLED", lean_steps)
    running, buffers = torch.zeros(()), [torch.zeros(()), torch.zeros(())]
    passed_values: list[float] = []

    def rewritten(loss: torch.Tensor) -> torch.Tensor:
        if passing == "accumulator":
            tensor = running.mul_(0.9).add_(loss.detach(), alpha=0.1)
        else:
            buffer = buffers[0] if passing == "views" else buffers[len(passed_values) % 2]
            buffer.data.copy_(loss.detach())
            tensor = buffer.detach()
        passed_values.append(float(tensor))
        return tensor

    def write_again(*_: Any) -> None:  # the next step's forward begins: the memory rewritten
        for tensor in (running, *buffers):
            tensor.data.fill_(-1.0)

    loop.model.register_forward_pre_hook(write_again)
    train(loop, probe, 40, rewritten)
    if on_gpu:
        ring = probe._sampler._loss_ring
        assert ring is not None and ring.spoiled is None
        assert sum(p.loss_batch is not None for p in sent) > 20
    probe.close()
    each_step_recorded(path, passed_values)
    assert probe.errors == 0


def test_a_detached_loss_passed_is_kept_on_lean_steps(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``probe.step(loss.detach())`` (the demos' way, a device scalar of its own on a GPU):
    the steps between the timed ones are lean, that scalar kept in the ring."""
    loop = Loop(seed=9)
    path = tmp_path / "detached.tdbg"
    probe, sent = watched_as_on_a_gpu(loop, path, monkeypatch)
    probe._sampler.grad_every = 10**9
    train(loop, probe, 100)
    probe.close()
    lean_steps = [p for p in sent if p.loss_batch is not None and p.timeline.forward_start is None]
    assert len(lean_steps) > 50
    in_the_ring(lean_steps)
    each_step_recorded(path, loop.losses)
    assert probe.errors == 0


def test_lean_gpu_steps_keep_their_loss_in_the_ring_and_their_phases_unmarked(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``probe.step(loss)`` with the scalar just backpropagated, as a GPU loop calls it: the
    steps between the timed ones are lean (lean.py), their loss kept unread in the ring and
    their phases NaN (an untimed GPU step's); the timed ones go the whole way with all four
    phases; every step's loss recorded, exactly."""
    # One step in MAX_MEAN_GAP timed whatever the steps' length (on a loaded machine the
    # CPU's steps grow long enough for one in a few: 51 of 200 were, beside two burners).
    monkeypatch.setattr(cost_model, "MARK_EVERY_STEP_FROM", 1e9)
    loop = Loop(seed=8)
    path = tmp_path / "lean-gpu.tdbg"
    probe, sent = watched_as_on_a_gpu(loop, path, monkeypatch)
    probe._sampler.grad_every = 10**9  # no gradient pass after the first: lean in between
    loop.run(200, probe)
    probe.close()
    lean_steps = [
        p
        for p in sent
        if p.loss_batch is not None and p.unmarked and p.timeline.forward_start is None
    ]
    assert len(lean_steps) > 100
    in_the_ring(lean_steps)
    each_step_recorded(path, loop.losses)
    steps = {
        r.step: r
        for m in Recording(path).messages()
        if m["type"] == "steps"
        for r in unpack_steps(m)
    }
    timed = [s for s, r in steps.items() if r.forward_time == r.forward_time]
    assert 200 / 32 < len(timed) < 200 / 4  # one in MAX_MEAN_GAP, and the first few
    for p in lean_steps:
        record = steps[p.step]
        assert all(
            getattr(record, name) != getattr(record, name)
            for name in ("data_time", "forward_time", "backward_time", "optimizer_time")
        )
        assert record.step_time > 0 and record.probe_time > 0
    assert probe.errors == 0


def test_a_count_the_lean_step_cannot_take_does_not_give_the_ring_up(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose ``samples=`` is not a plain number settles; the loss it passed was not
    noted by the lean check (it comes last), so the whole way does not take it for one passed
    twice."""
    numpy = pytest.importorskip("numpy")
    loop = Loop(seed=11)
    probe, sent = watched_as_on_a_gpu(loop, tmp_path / "counts.tdbg", monkeypatch)
    probe._sampler.grad_every = 10**9
    train(loop, probe, 60, samples=lambda step: numpy.int64(32) if step % 7 == 3 else 32)
    assert probe._sampler._loss_ring is not None
    assert sum(p.loss_batch is not None for p in sent) > 30
    probe.close()
    assert probe.errors == 0


def test_a_scalar_the_ring_cannot_take_does_not_give_it_up(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lean step given a scalar on another device than the ring's (a CPU one on a GPU run,
    here a ring on the meta device) settles and goes the whole way, which reads it as a CPU
    scalar: the scalar is looked at twice, and must not be taken for one passed twice."""
    loop = Loop(seed=12)
    probe, sent = watched_as_on_a_gpu(loop, tmp_path / "elsewhere.tdbg", monkeypatch)
    probe._sampler._loss_ring = LossRing(
        torch.device("meta"), stream_of=lambda device: None, key_of=lambda device: None
    )
    probe._sampler.grad_every = 10**9
    train(loop, probe, 40)
    ring = probe._sampler._loss_ring
    assert ring is not None and ring.spoiled is None
    assert all(p.loss_batch is None for p in sent)
    probe.close()
    assert probe.errors == 0


def test_a_lean_gpu_step_s_ring_copy_is_counted_in_its_probe_time(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss's copy into the ring is a CUDA call on the training thread: part of what the
    probe costs the step (its probe time, hence cost_fraction), not of the loop's own time."""
    loop = Loop(seed=13)
    probe, sent = watched_as_on_a_gpu(loop, tmp_path / "counted.tdbg", monkeypatch)
    probe._sampler.grad_every = 10**9
    add = LossRing.add

    def slow_add(self: LossRing, loss: torch.Tensor) -> Any:
        deadline = time.perf_counter() + 0.002  # a launch that takes 2 ms
        while time.perf_counter() < deadline:
            pass
        return add(self, loss)

    monkeypatch.setattr(LossRing, "add", slow_add)
    train(loop, probe, 60)
    probe.close()
    lean_steps = [p for p in sent if p.loss_batch is not None and p.timeline.forward_start is None]
    assert len(lean_steps) > 20
    for p in lean_steps:
        record, _ = p.resolve()
        assert record.probe_time >= 0.002, (p.step, record.probe_time)
    assert probe.errors == 0


class NeverBack:
    """A copy to the host that never lands (a GPU-bound run's queue longer than the stop)."""

    def query(self) -> bool:
        return False


def test_steps_whose_losses_are_not_back_at_close_are_counted_dropped(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At close the probe waits a moment for the last copies (within the stop's second); the
    steps still waiting then are not recorded, and the probe's last word counts them dropped."""
    loop = Loop(seed=14)
    path = tmp_path / "never.tdbg"
    probe, _ = watched_as_on_a_gpu(loop, path, monkeypatch)
    probe._sampler.grad_every = 10**9
    monkeypatch.setattr(loss_ring, "host_copy", lambda vector, timing=False: (vector, NeverBack()))
    train(loop, probe, 30)
    probe.close()
    messages = list(Recording(path).messages())
    recorded = [r.step for m in messages if m["type"] == "steps" for r in unpack_steps(m)]
    last_word = [m for m in messages if m["type"] == "probe"][-1]
    assert len(recorded) < 30  # (the first step, a gradient pass, is copied at its step)
    assert last_word["dropped"] == 30 - len(recorded)
    assert probe.errors == 0


def test_a_ring_whose_steps_were_all_dropped_is_freed_and_used_again(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe thread held up long enough (a recording's writes blocked, say) that the ring
    fills and then its steps are all pushed out of the full hand-off by the steps that copied
    their own: once it runs again it frees the ring's slots though no step asks for them
    (LossRing.reclaim), and the steps after go into the ring again, not each copied to the
    host for the rest of the run."""
    monkeypatch.setattr(loss_ring, "CAPACITY", 8)
    monkeypatch.setattr(inbox_module, "STEPS_SIZE", 8)  # the hand-off as deep as the ring
    held = threading.Event()
    drain = ProbeServer._drain_inbox

    def drain_unless_held(server: ProbeServer) -> Any:
        return [] if held.is_set() else drain(server)

    monkeypatch.setattr(ProbeServer, "_drain_inbox", drain_unless_held)
    held.set()
    loop = Loop(seed=21)
    path = tmp_path / "held.tdbg"
    probe, sent = watched_as_on_a_gpu(loop, path, monkeypatch)
    probe._sampler.grad_every = 10**9
    train(loop, probe, 30)  # 8 fill the ring, 22 copy their own; the hand-off keeps 8 of them
    ring = probe._sampler._loss_ring
    assert ring._written == 8 and ring._done == 0
    copied = [p.loss_batch for p in sent[-8:] if p.loss_batch is not None]  # (not sampled ones)
    assert copied and all(batch._ring is None for batch in copied)
    held.clear()
    wait_until(lambda: ring._done == 8 and not probe._server.inbox, what="the ring freed")
    before = len(sent)
    train(loop, probe, 40)
    probe.close()
    # The ring's 8 slots taken again at least once (the steps come faster than its ticks:
    # each time it is full they copy their own until the next tick frees it).
    in_ring = [p for p in sent[before:] if p.loss_batch is not None and p.loss_batch._ring]
    assert len(in_ring) >= 8 and ring.spoiled is None
    # Each later step recorded (the hand-off of 8 drops some) with its own loss.
    later = [(step, value) for step, value in recorded_losses(path) if step >= 30]
    assert len(later) >= 8
    for step, value in later:
        assert value == pytest.approx(loop.losses[step], rel=1e-6)


def test_the_last_steps_are_recorded_when_the_stop_s_other_work_is_slow(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe thread's stop waits up to a second for the sampler thread's last work, then
    reads the last steps: their losses' copies from the device are queued before that wait,
    so they are back for the last tick (queued after it, they were not, and the run's last
    steps were dropped)."""
    loop = Loop(seed=31)
    path = tmp_path / "slow-stop.tdbg"
    probe, _ = watched_as_on_a_gpu(loop, path, monkeypatch)
    probe._sampler.grad_every = 10**9
    train(loop, probe, 30)
    started = threading.Event()

    def slow_statistics() -> None:  # a sample's statistics, a profiler's table: over 1 s
        started.set()
        time.sleep(1.2)

    probe._server.submit_work(slow_statistics, at_stop=True)
    assert started.wait(TIMEOUT)
    probe.close()
    each_step_recorded(path, loop.losses)


class Sharded(torch.Tensor):
    """A tensor subclass whose ``copy_`` into a plain tensor raises, as a DTensor's does
    (tensor parallel's loss, FSDP2's outputs)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_:
            raise AssertionError("a sharded tensor copied into a plain one")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_loss_of_a_tensor_subclass_does_not_give_the_ring_up(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subclass's loss passed goes the whole way's own copy; the ring stays for the steps
    after (given up, every later step of the run would copy its loss at its step)."""
    loop = Loop(seed=41)
    path = tmp_path / "sharded.tdbg"
    probe, sent = watched_as_on_a_gpu(loop, path, monkeypatch)
    probe._sampler.grad_every = 10**9
    monkeypatch.setattr(lean, "ENABLED", False)  # the whole way: a subclass is never lean
    train(loop, probe, 5, lambda loss: loss.detach().clone().as_subclass(Sharded))
    train(loop, probe, 20)
    probe.close()
    ring = probe._sampler._loss_ring
    assert ring is not None and ring.spoiled is None and probe.errors == 0
    in_the_ring([p for p in sent[5:] if p.loss_batch is not None])
    each_step_recorded(path, loop.losses)


def test_a_step_pushed_out_of_the_full_hand_off_while_read_is_not_recorded(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training thread appending to the full hand-off while the probe thread reads its
    oldest step drops that step: it is the one dropped (not recorded), and the step after it
    is recorded (it was the one taken instead, lost unsaid)."""
    monkeypatch.setattr(inbox_module, "STEPS_SIZE", 5)
    loop = Loop(seed=51)
    probe = tdbg.watch(loop.model, loop.opt, name="race", serve=False)
    probe._server.handoff.open = True  # (no probe thread: the steps stay in the hand-off)
    train(loop, probe, 25)
    steps = [handed for handed in probe._server.inbox if isinstance(handed, tuple)]
    probe.close()
    assert len(steps) == 5  # usual steps, as handed over
    inbox = collections.deque(steps[:4], maxlen=4)
    appended: list[Any] = []
    ready = server_module.usual_ready

    def the_training_thread_appends(handed: Any) -> bool:
        if not appended:  # while the probe thread reads the oldest step
            appended.append(steps[4])
            inbox.append(steps[4])  # full: the oldest dropped
        return ready(handed)

    monkeypatch.setattr(server_module, "usual_ready", the_training_thread_appends)
    reader = types.SimpleNamespace(
        inbox=inbox,
        consumed=0,
        handoff=types.SimpleNamespace(ring=None),
        _step_points=[],
        _on_grad_device_time=None,
        _on_error=pytest.fail,
    )
    resolved = ProbeServer._drain_inbox(reader)  # type: ignore[arg-type]
    first = steps[0][0]
    assert [record.step for record, _ in resolved] == [first + k for k in range(1, 5)]
    assert reader.consumed == 4 and not inbox
