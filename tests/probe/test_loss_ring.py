"""A GPU run's usual-step losses kept on the device and read back once a tick (loss_ring.py):
every step's loss still recorded, exactly, in order, the run's last ones too; a loop that
passes the same tensor every step (an accumulator) copied at each step instead. Proven on the
CPU with the ring keeping CPU tensors (no CUDA here; gpu_check.py runs it on a GPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop, handed_over
from test_phase_marks import on_a_fake_gpu

import tdbg
from tdbg.probe.training import lean, loss_ring, taps
from tdbg.probe.training.loss_ring import RING_FROM, LossRing, copied_now
from tdbg.protocol.steps import unpack_steps
from tdbg.recording.reader import Recording

CPU = torch.device("cpu")


def cpu_ring() -> LossRing:
    return LossRing(CPU, stream_of=lambda device: None)


def test_a_batch_is_read_back_whole_after_its_copy_began() -> None:
    ring = cpu_ring()
    losses = [torch.tensor(float(k) / 3) for k in range(5)]
    places = [ring.add(loss) for loss in losses]
    batch = places[0][0]
    assert all(b is batch for b, _ in places) and [i for _, i in places] == list(range(5))
    assert batch.read() is None  # the first read closes the batch and starts its copy
    later, index = ring.add(torch.tensor(9.0))  # a closed batch takes no more
    assert later is not batch and index == 0
    assert batch.read() == pytest.approx([float(t) for t in losses], rel=1e-7)
    assert batch.read() is batch.read()  # read once, kept


def test_losses_of_several_shapes_and_dtypes_in_one_batch() -> None:
    ring = cpu_ring()
    losses = [torch.tensor(1.5), torch.tensor([2.5]), torch.tensor(3.5, dtype=torch.bfloat16)]
    batch = [ring.add(loss) for loss in losses][0][0]
    assert batch.read() is None
    assert batch.read() == [1.5, 2.5, 3.5]


def test_a_loss_sharing_the_memory_of_the_one_before_is_not_read() -> None:
    """Two losses kept at one address (a buffer rewritten in place, passed as a new view each
    step): the earlier one's memory holds the later value by the copy, so it is left unread
    (None, not a wrong number) and the ring is spoiled; the later one is read."""
    ring = cpu_ring()
    buffer = torch.zeros(())
    first = ring.add(torch.tensor(1.0))
    buffer.fill_(2.0)
    ring.add(buffer.detach())
    buffer.fill_(3.0)
    ring.add(buffer.detach())
    batch = first[0]
    assert ring.spoiled and "share their memory" in ring.spoiled
    assert batch.read() is None
    assert batch.read() == [1.0, None, 3.0]


def test_a_loss_changed_in_place_after_its_step_is_not_read() -> None:
    ring = cpu_ring()
    kept = [torch.tensor(float(k)) for k in range(3)]
    batch = [ring.add(t) for t in kept][0][0]
    kept[1].add_(10.0)  # after its step, before the copy: its version counter moves
    assert batch.read() is None
    assert batch.read() == [0.0, None, 2.0]
    assert ring.spoiled and "changed in place" in ring.spoiled


def test_a_copy_that_fails_leaves_its_steps_without_a_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def out_of_memory(vector: torch.Tensor, timing: bool = False) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    monkeypatch.setattr(loss_ring, "host_copy", out_of_memory)
    ring = cpu_ring()
    batch = [ring.add(torch.tensor(float(k))) for k in range(4)][0][0]
    assert batch.read() == [None, None, None, None]  # never raises into the probe thread
    assert ring.spoiled and "OutOfMemoryError" in ring.spoiled


def test_a_loss_copied_at_its_step_reads_as_a_kept_one() -> None:
    """Where the ring was given up during a lean step, its loss is copied at once, as a batch
    of its own read the same way (bfloat16 and a shape [1] loss too)."""
    for loss in (torch.tensor(2.5), torch.tensor([1.5]), torch.tensor(0.75, dtype=torch.bfloat16)):
        batch, place = copied_now(loss)
        losses = batch.read()
        assert losses is not None and losses[place] == float(loss)


def test_a_full_batch_starts_another(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_ring, "CAPACITY", 3)
    ring = cpu_ring()
    batches = [ring.add(torch.tensor(float(k)))[0] for k in range(7)]
    assert [len({id(b) for b in batches[i : i + 3]}) for i in (0, 3)] == [1, 1]
    assert len({id(b) for b in batches}) == 3


def as_on_a_gpu(probe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``probe`` as on a GPU run: its marks CUDA ones on the steps it times (a fake event:
    test_phase_marks.on_a_fake_gpu), a loss ring (of CPU tensors, which the taps keep unread,
    as a device's), the backward's scalar kept unread on lean steps."""
    monkeypatch.setattr(taps, "READ_ON_HOST", False)
    on_a_fake_gpu(probe)
    probe._sampler._loss_ring = cpu_ring()
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


def run(loop: Loop, probe: Any, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``steps`` steps of ``loop``, each passing probe.step() a scalar of its own (not the one
    backpropagated), the whole way: lean steps off (the tests of lean steps are below)."""
    monkeypatch.setattr(lean, "ENABLED", False)
    train(loop, probe, steps, lambda loss: loss.detach().clone())


def recorded_losses(path: Path) -> list[tuple[int, float | None]]:
    steps = [r for m in Recording(path).messages() if m["type"] == "steps" for r in unpack_steps(m)]
    return [(r.step, r.loss) for r in steps]


def test_every_step_loss_is_recorded_from_the_ring_the_last_ones_too(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = Loop(seed=5)
    path = tmp_path / "ring.tdbg"
    probe, sent = watched_as_on_a_gpu(loop, path, monkeypatch)
    run(loop, probe, 120, monkeypatch)
    probe.close()  # right after the last step: its batch is read back at close
    kept = [p for p in sent if p.loss_batch is not None]
    assert [p.step for p in sent if p.loss_batch is None][:RING_FROM] == list(range(RING_FROM))
    assert len(kept) > 100  # the usual steps (not the sampled ones: their values are copied)
    # Read back a tick's steps at a time, each batch a run of consecutive steps.
    batches: dict[int, list[int]] = {}
    for p in kept:
        batches.setdefault(id(p.loss_batch), []).append(p.loss_index)
    assert len(batches) < len(kept)
    assert all(places == list(range(len(places))) for places in batches.values())
    recorded = recorded_losses(path)
    assert [step for step, _ in recorded] == list(range(120))
    for (_, loss), expected in zip(recorded, loop.losses, strict=True):
        assert loss == pytest.approx(expected, rel=1e-6)
    assert probe.errors == 0


@pytest.mark.parametrize("lean_steps", [True, False], ids=["lean", "whole way"])
def test_a_loop_passing_one_tensor_every_step_is_copied_at_each_step(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lean_steps: bool
) -> None:
    """An accumulator the loop changes in place and passes again: a reference kept until the
    tick would read a later value, so the ring is dropped for the run at the second pass,
    before any step of the tensor was kept in it (the first RING_FROM steps never are)."""
    loop = Loop(seed=6)
    probe, sent = watched_as_on_a_gpu(loop, tmp_path / "acc.tdbg", monkeypatch)
    probe._sampler.grad_every = 10**9
    running = torch.zeros(())
    monkeypatch.setattr(lean, "ENABLED", lean_steps)

    def accumulated(loss: torch.Tensor) -> torch.Tensor:
        return running.mul_(0.9).add_(loss.detach(), alpha=0.1)  # changed in place, passed again

    train(loop, probe, 30, accumulated)
    assert probe._sampler._loss_ring is None
    assert all(p.loss_batch is None for p in sent)
    assert not probe._sampler.lean.on  # no lean step on a GPU run without its ring
    probe.close()
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
    recorded = recorded_losses(path)
    assert [step for step, _ in recorded] == list(range(100))
    for (_, value), expected in zip(recorded, loop.losses, strict=True):
        assert value == pytest.approx(expected, rel=1e-6)
    assert probe.errors == 0


def test_lean_gpu_steps_keep_their_loss_in_the_ring_and_their_phases_unmarked(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``probe.step(loss)`` with the scalar just backpropagated, as a GPU loop calls it: the
    steps between the timed ones are lean (lean.py), their loss kept unread in the ring and
    their phases NaN (an untimed GPU step's); the timed ones go the whole way with all four
    phases; every step's loss recorded, exactly."""
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
    recorded = recorded_losses(path)
    assert [step for step, _ in recorded] == list(range(200))
    for (_, loss), expected in zip(recorded, loop.losses, strict=True):
        assert loss == pytest.approx(expected, rel=1e-6)
    steps = {
        r.step: r
        for m in Recording(path).messages()
        if m["type"] == "steps"
        for r in unpack_steps(m)
    }
    timed = [s for s, r in steps.items() if r.forward_time == r.forward_time]
    assert 200 / 32 < len(timed) < 200 / 4  # one in a few, as on a GPU
    for p in lean_steps:
        record = steps[p.step]
        assert all(
            getattr(record, name) != getattr(record, name)
            for name in ("data_time", "forward_time", "backward_time", "optimizer_time")
        )
        assert record.step_time > 0 and record.probe_time > 0
    assert probe.errors == 0


def test_a_loop_passing_views_of_one_buffer_is_copied_at_each_step(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``buffer.copy_(loss); probe.step(buffer.detach())``: a new tensor each step at one
    address (a CUDA graph's static output is the same). Seen in the first steps, before the
    ring keeps any: it is given up, said once, no lean GPU step."""
    loop = Loop(seed=10)
    path = tmp_path / "views.tdbg"
    probe, sent = watched_as_on_a_gpu(loop, path, monkeypatch)
    probe._sampler.grad_every = 10**9
    buffer = torch.zeros(())
    train(loop, probe, 30, lambda loss: buffer.copy_(loss.detach()).detach())
    assert probe._sampler._loss_ring is None
    assert all(p.loss_batch is None for p in sent)
    probe.close()
    alerts = [m for m in Recording(path).messages() if m.get("type") == "alert"]
    told = [a["message"] for a in alerts if "share their memory" in a["message"]]
    assert len(told) == 1 and "copied to the host at its step" in told[0]
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
    probe._sampler._loss_ring = LossRing(torch.device("meta"), stream_of=lambda device: None)
    probe._sampler.grad_every = 10**9
    train(loop, probe, 40)
    ring = probe._sampler._loss_ring
    assert ring is not None and ring.spoiled is None
    assert all(p.loss_batch is None for p in sent)
    probe.close()
    assert probe.errors == 0
