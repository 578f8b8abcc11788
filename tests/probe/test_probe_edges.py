"""Edge cases found in review: breaker inside a hook, frozen layers, sparse/fp16 grads, skipped
optimizer steps, flooding clients, slow loops under `tdbg dump --timeout`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop, OpenReader, handed_over, inject_fault
from demo_job import demo_job
from norm_oracle import reference_norms
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tdbg
from tdbg.probe import faults
from tdbg.probe import watch as watch_module
from tdbg.probe.alerts import AlertRules
from tdbg.probe.training import hooks as hooks_module
from tdbg.probe.training.gradients import GradientStats, find_layers
from tdbg.protocol import framing, messages
from tdbg.protocol.steps import StepRecord


def counted_ops(call: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    """``call`` with the torch ops it dispatches recorded in ``calls``."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        with CountOps(calls):
            return call(*args, **kwargs)

    return counted


class CountOps(TorchDispatchMode):
    """Records the name of every torch op dispatched while it is active."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def test_breaker_tripping_inside_the_optimizer_hook_never_raises_into_step(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """the 100th error comes from inside optimizer.step(); torch is iterating over
    its hooks then, so the probe must not remove them there."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    seen: list[int] = []
    loop.optimizer.register_step_pre_hook(lambda *a: seen.append(1))  # a user's own hook after ours

    def broken() -> None:
        raise RuntimeError("gradient pass failed")

    inject_fault(monkeypatch, probe, "optimizer_step", broken)
    loop.run(watch_module.MAX_ERRORS + 20, probe)  # raises if the breaker breaks opt.step()
    assert probe._disabled
    assert len(seen) == watch_module.MAX_ERRORS + 20
    assert not probe._hooks.handles, "hooks are removed at the next step boundary"


def test_frozen_layer_is_not_an_all_zero_gradient_alert() -> None:
    rules = AlertRules(["embed", "head"], frozen=[0])
    rec = StepRecord(step=0, time=0.0, loss=1.0, grad_total=1.0, grad_norms=[0.0, 1.0])
    assert [a.kind for a in rules.check_step(rec)] == []
    live = AlertRules(["embed", "head"])
    assert [a.kind for a in live.check_step(rec)] == ["zero_grad"]


def test_frozen_layer_end_to_end_no_alert(runtime_dir: Path, probe_reader: OpenReader) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    probe = tdbg.watch(model, opt, grad_every=1)
    assert probe.socket_path
    reader = probe_reader(probe)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(5):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 5)
    reader.settle()  # a step's alerts are sent in the same tick as the step, before the pong
    kinds = {a["kind"] for a in reader.of("alert")}
    assert not kinds & {"zero_grad", "no_grad"}, reader.of("alert")
    reader.close()


def test_sparse_and_dense_grads_in_one_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 1))
    model(torch.randint(0, 50, (20,))).sum().backward()
    layers = find_layers(model)
    sample = GradientStats(layers).compute()
    ref_total, ref_layers = reference_norms(layers)
    assert list(sample.layer_norms()[0]) == pytest.approx(ref_layers, rel=1e-5)


def test_fp16_norms_do_not_overflow() -> None:
    """An fp16 gradient whose norm is above 65504 must not read as inf (a false NaN alert)."""
    layer = nn.Linear(100, 100).half()
    layer.weight.grad = torch.full_like(layer.weight, 10.0)  # norm 1000
    layer.bias.grad = torch.full_like(layer.bias, 7000.0)  # norm 70000 > fp16 max
    layers = find_layers(layer)
    norms = list(GradientStats(layers).compute().layer_norms()[0])
    expected = ((10.0**2) * 10_000 + (7000.0**2) * 100) ** 0.5
    assert norms == pytest.approx([expected], rel=1e-3)


def test_the_probe_holds_no_loss_beyond_its_step(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tap keeps the scalar it saw backpropagated until ``probe.step()`` (passed back, its
    value read before the backward is the step's loss): a loop that drops its loss (and the
    graph with it: ``retain_graph=True`` keeps activations there) before the step gets it
    freed by the step's end, accumulating or not, and by a failed step's or ``close()``."""
    import weakref

    for accumulate in (1, 3):
        loop = Loop(width=8)
        probe = tdbg.watch(loop.model, loop.opt, name="held", grad_every=10**9)
        sent = handed_over(probe, monkeypatch)
        try:
            refs = []
            for _ in range(accumulate):
                loss = loop.loss() / accumulate
                loss.backward(retain_graph=True)
                refs.append(weakref.ref(loss))
            loop.optimizer.step()
            del loss
            assert refs[-1]() is not None  # the last one: held by the probe until its step
            assert all(r() is None for r in refs[:-1])
            probe.step()
            assert [r() for r in refs] == [None] * accumulate
            # passed back, the very tensor: its value as read before its backward
            loss = loop.loss()
            loss.backward()
            expected = loss.item()
            loop.optimizer.step()
            probe.step(loss)
            assert sent[-1].loss == expected and sent[-1].host_scalars is None
        finally:
            probe.close()
    # Nor after a probe.step() that failed, nor once the probe is closed.
    loop = Loop(width=8)
    probe = tdbg.watch(loop.model, loop.opt, name="held-failed", grad_every=10**9)

    def broken(*_: object) -> None:
        raise RuntimeError("the step's bookkeeping failed")

    inject_fault(monkeypatch, probe, "step_losses", broken)
    try:
        for end in ("failed step", "close"):
            loss = loop.loss()
            loss.backward(retain_graph=True)
            loop.optimizer.step()
            ref = weakref.ref(loss)
            del loss
            if end == "close":
                probe.close()
            else:
                probe.step()
                assert probe.errors == 1
            assert ref() is None, end
    finally:
        probe.close()


def test_the_last_update_s_own_loss_passed_back_after_another_accumulated(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GAN whose discriminator accumulates three micro-batches, then the generator's one
    backward and update: ``probe.step(g_loss)`` shows the generator's loss as passed (the
    very tensor last backpropagated, alone in its update), not the discriminator's sum (a
    loss passed back after several micro-batches is replaced by the update's)."""
    torch.manual_seed(0)
    disc, gen = nn.Linear(4, 1), nn.Linear(4, 4)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    probe = tdbg.watch([disc, gen], [opt_d, opt_g], name="gan-acc", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    x = torch.randn(8, 4)
    try:
        for _ in range(3):
            opt_d.zero_grad()
            for _ in range(3):
                (disc(x).mean() / 3).backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = disc(gen(x)).pow(2).mean()
            g_loss.backward()
            opt_g.step()
            probe.step(g_loss)
            assert sent[-1].loss == pytest.approx(g_loss.item(), rel=1e-6)
        assert "loss-last-micro-batch" not in probe._sampler._reported
    finally:
        probe.close()


def test_skipped_optimizer_step_is_not_a_no_gradient_alert(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    """GradScaler skips optimizer.step() on inf; the loop has zeroed grads before probe.step."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    assert probe.socket_path
    reader = probe_reader(probe)
    for i in range(6):
        loop.model.zero_grad(set_to_none=True)
        loss = ((loop.model(loop.x) - loop.y) ** 2).mean()
        loss.backward()
        if i != 2:  # step 2: the optimizer step is skipped
            loop.optimizer.step()
        loop.model.zero_grad(set_to_none=True)
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 6)
    reader.settle()
    assert not [a for a in reader.of("alert") if a["kind"] == "no_grad"], reader.of("alert")
    records = reader.records()
    assert records[2].grad_norms is None and records[3].grad_norms is not None
    reader.close()


def test_flooding_client_is_closed_and_training_unaffected(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    """a burst of pings beyond any real client's is refused and the client dropped."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    assert probe.socket_path
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(probe.socket_path)
    sock.sendall(messages.hello("flood"))
    ping = framing.pack(messages.client_message("ping", 1), framing.MAX_INBOUND_FRAME)
    sock.sendall(ping * 2000)
    sock.settimeout(5)
    data = b""
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    assert b"RATE_LIMITED" in data
    sock.close()
    loop.run(5, probe)
    reader = probe_reader(probe)  # the probe still serves a well-behaved client
    reader.wait(lambda r: len(r.records()) >= 5)
    reader.close()


def test_dump_timeout_survives_a_slow_loop(runtime_dir: Path) -> None:
    """Steps 1.5 s apart: `tdbg dump --timeout 4` must run its 4 s, not stop at the first lull."""
    with demo_job("cnn", "--delay", "1.5", runtime=runtime_dir):
        env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir))
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "tdbg.cli", "dump", "--timeout", "4"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert elapsed >= 3.5
    assert '"type":"end","reason":"disconnected"' not in out.stdout


BUSY_AT_EXIT = """
import threading, time, torch, tdbg
from torch import nn
probe = tdbg.watch(nn.Linear(4, 4))
started = threading.Event()
def analysis():  # as a dive's analysis or a tick reading tensors: torch work on a probe thread
    started.set()
    a = torch.randn(200, 200)
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        torch.mm(a, a)
probe._server.submit_work(analysis)
assert started.wait(120)
print("exiting", flush=True)
"""


def test_a_probe_thread_inside_torch_at_exit_does_not_abort_the_process(
    runtime_dir: Path,
) -> None:
    """The script ends while a probe thread is inside torch calls: the exit waits for it. Left
    running, it would re-take the GIL during finalization, be unwound through torch's noexcept
    frames and abort the process ("terminate called without an active exception", exit 134),
    as a gloo rank did at its end on a loaded machine."""
    done = subprocess.run(
        [sys.executable, "-c", BUSY_AT_EXIT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting" in done.stdout and "terminate called" not in done.stderr


def test_a_backward_costs_the_probe_no_torch_call_until_the_update(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after a backward the loop's caches are cold (on a CPU run the gradients just went
    through them) and each torch call there costs several times its usual: the backward tap
    detaches and reads the scalar before the backward, and what the probe's listener does
    with it after dispatches nothing (under gradient accumulation the later micro-batches are
    summed as they come). The loss and the micro-batch count still come out right (two
    micro-batches: their sum)."""
    from tdbg.probe.training import taps

    calls: list[str] = []

    def counted(function):
        def run(*args, **kwargs):
            with CountOps(calls):
                return function(*args, **kwargs)

        return run

    loop = Loop(width=8)
    model, opt = loop.model, loop.optimizer
    probe = tdbg.watch(model, opt, name="cold", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    try:
        monkeypatch.setattr(taps, "_scalar", counted(taps._scalar))
        monkeypatch.setattr(probe._sampler, "on_backward", counted(probe._sampler.on_backward))
        losses: list[float] = []
        for _ in range(2):
            loss = loop.loss()
            loss.backward()
            if not losses:
                assert calls == []  # the usual step: one backward, nothing dispatched
            losses.append(loss.item())
        opt.step()
        probe.step()
        (step,) = sent
        assert step.micro_batches == 2
        resolved = step.resolve()
        assert resolved is not None
        assert resolved[0].loss == pytest.approx(sum(losses))
    finally:
        probe.close()


def test_a_cpu_loss_is_read_before_its_backward_not_at_the_update(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a NaN began needs, on a step whose gradients go unsampled, whether the loss was
    finite. A CPU loss is read before its backward, still in the caches its forward left it in;
    at the optimizer's pre-hook, right after the backward streamed the gradients through them,
    the same read cost ~15 us: on such a step nothing is dispatched there, nor at the
    post-hook (the tap's detached view is kept as it is). A NaN loss is still caught at its
    own step (its pass forced)."""
    calls: list[str] = []

    loop = Loop(width=8)
    model, opt = loop.model, loop.optimizer
    probe = tdbg.watch(model, opt, name="warm-read", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    # The probe's step pre-hook and post-hook (the sampler's work is written into them).
    for hook_class in (hooks_module._StepStart, hooks_module._StepEnd):
        monkeypatch.setattr(hook_class, "__call__", counted_ops(hook_class.__call__, calls))
    per_step: list[list[str]] = []
    try:
        for step in range(3):
            opt.zero_grad()
            loss = loop.loss()
            if step == 2:
                loss = loss * float("nan")
            loss.backward()
            calls.clear()
            opt.step()
            per_step.append(list(calls))
            probe.step()
        assert per_step[1] == []  # not due: nothing read at the update
        assert [s.step for s in sent] == [0, 1, 2]
        assert sent[0].grads is not None  # the first step is sampled
        assert sent[1].grads is None
        assert sent[2].grads is not None  # forced: its loss was NaN
    finally:
        probe.close()


def test_a_backward_that_raises_is_not_counted(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backward tap counts a scalar before its backward runs (where the probe's work is
    cheaper); a backward that raises is taken back: a loop that catches it (a batch skipped
    after running out of memory) still gets its update's loss and micro-batch count right,
    under gradient accumulation too."""
    loop = Loop(width=8)
    model, opt = loop.model, loop.optimizer
    probe = tdbg.watch(model, opt, name="failed-backward", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)

    def failing_backward() -> None:
        with pytest.raises(RuntimeError):
            torch.tensor(3.0).backward()  # nothing requires grad: the backward refuses it
        with pytest.raises(RuntimeError):  # an Inf loss, not a scalar: taken back exactly
            torch.full((2,), float("inf")).backward()

    try:
        for micro_batches in (1, 2):
            opt.zero_grad()
            losses = []
            failing_backward()
            for _ in range(micro_batches):
                loss = loop.loss()
                loss.backward()
                losses.append(loss.item())
                failing_backward()
            opt.step()
            probe.step()
            step = sent[-1]
            assert step.micro_batches == micro_batches
            resolved = step.resolve()
            assert resolved is not None
            assert resolved[0].loss == pytest.approx(sum(losses), rel=1e-6)
    finally:
        probe.close()


def test_the_usual_step_reads_its_cpu_loss_once(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU loss is read once, before its backward; ``probe.step(loss)`` given that very
    tensor back uses the value (no detach, nothing dispatched), and the step's loss is it."""
    calls: list[str] = []

    loop = Loop(width=8)
    model, opt = loop.model, loop.optimizer
    probe = tdbg.watch(model, opt, name="read-once", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    try:
        for step in range(3):
            opt.zero_grad()
            loss = loop.loss()
            loss.backward()
            opt.step()
            calls.clear()
            with CountOps(calls):
                probe.step(loss)
            if step > 0:  # not sampled
                assert calls == []
            resolved = sent[-1].resolve()
            assert resolved is not None and resolved[0].loss == pytest.approx(loss.item())
    finally:
        probe.close()


def test_the_optimizer_tap_tells_the_probe_of_each_optimizer_once(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process-wide optimizer tap (a new optimizer may update the watched model) runs
    right after the backward on every step: for an optimizer the probe has heard of it returns
    after one dict lookup. A new one is still heard of at its first step, and followed."""
    loop = Loop(width=8)
    model, opt = loop.model, loop.optimizer
    probe = tdbg.watch(model, opt, name="told-once", grad_every=10**9)
    heard: list[object] = []
    hear = probe._sampler.on_any_optimizer_step

    def heard_of(optimizer: object) -> None:
        heard.append(optimizer)
        hear(optimizer)

    monkeypatch.setattr(probe._sampler, "on_any_optimizer_step", heard_of)

    def train(optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        loop.loss().backward()
        optimizer.step()
        probe.step()

    try:
        for _ in range(3):
            train(opt)
        assert heard == [opt]  # at its first step only
        replacement = torch.optim.Adam(model.parameters(), lr=0.003)
        for _ in range(3):
            train(replacement)
        assert heard == [opt, replacement]
        assert any(slot.optimizer is replacement for slot in probe._sampler._slots)
    finally:
        probe.close()


def test_the_forward_ends_where_its_backward_starts(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No hook runs after the model's forward (a Python call right after the forward's kernels
    costs microseconds): the step's forward is timed up to its backward, loss included, and
    the backward from there to the update."""
    loop = Loop(width=8)
    model, opt = loop.model, loop.optimizer
    probe = tdbg.watch(model, opt, name="phases", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    try:
        for _ in range(2):
            opt.zero_grad()
            out = model(loop.x)
            time.sleep(0.2)  # the loss's own work, say
            ((out - loop.y) ** 2).mean().backward()
            opt.step()
            probe.step()
        resolved = sent[-1].resolve()
        assert resolved is not None
        record = resolved[0]
        assert record.forward_time >= 0.2
        assert 0 <= record.backward_time < record.forward_time
    finally:
        probe.close()


def test_a_backward_after_the_update_does_not_move_the_forward_end(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward's end is marked where its backward starts, but only before the update: a
    backward after it (another model's, trained after the watched one's step) is not this
    step's forward ending, and the backward phase never comes out negative."""
    loop = Loop(width=8)
    model, opt = loop.model, loop.optimizer
    other = nn.Linear(4, 1)
    probe = tdbg.watch(model, opt, name="after-update", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    try:
        for _ in range(2):
            opt.zero_grad()
            loop.loss().backward()
            opt.step()
            other(torch.randn(16, 4)).pow(2).mean().backward()  # not watched, after the update
            probe.step()
        resolved = sent[-1].resolve()
        assert resolved is not None
        assert resolved[0].backward_time >= 0 and resolved[0].forward_time >= 0
    finally:
        probe.close()


WAYS = (
    "tensor",
    "none",
    "float",
    "detached",
    "accumulated",
    "accumulated-none",
    "counts",
    "a-copy",
    "bad-counts",
    "not-a-scalar",
    "accumulated-copy",
    "accumulated-float",
    "closure-raised",
    "tensor-count",
    "huge-count",
)


def _what_each_step_hands_over(
    grad_every: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[Any, ...]], list[tuple[int, str]], list[float]]:
    """A loop whose steps vary as real loops do (the loss passed back or not, as the tensor,
    a float or a detached copy; accumulated micro-batches, passed back the same ways; a retry
    whose ``step(closure)`` raised after its backward; a schedule; samples and tokens, a
    tensor the loop reuses among them) and what should not be passed (counts that are not, a
    loss that is not a scalar): what the probe hands its thread for each step (loss, LR,
    micro-batches, counts), what it told the user at which step, and each step's last
    micro-batch's loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    probe = tdbg.watch(model, opt, name=f"ways-{grad_every}", grad_every=grad_every)
    sent = handed_over(probe, monkeypatch)
    sampler = probe._sampler
    told: list[tuple[int, str]] = []
    tell = faults.original(probe, "sampler_tell")

    def told_at_step(message: str) -> None:
        told.append((sampler.step_count, message))
        tell(message)

    inject_fault(monkeypatch, probe, "sampler_tell", told_at_step)

    def failed_retry() -> torch.Tensor:
        ((model(x) - y) ** 2).mean().backward()
        raise RuntimeError("the retry failed")

    last_micro: list[float] = []
    try:
        for step in range(2 * len(WAYS)):
            way = WAYS[step % len(WAYS)]
            opt.zero_grad()
            micro = 3 if way.startswith("accumulated") else 1
            for _ in range(micro):
                loss = ((model(x) - y) ** 2).mean() / micro
                loss.backward()
            last_micro.append(loss.item())
            opt.step()
            schedule.step()
            if way == "closure-raised":
                with pytest.raises(RuntimeError):
                    opt.step(failed_retry)
            if way in ("tensor", "accumulated", "closure-raised"):
                probe.step(loss)
            elif way in ("float", "accumulated-float"):
                probe.step(loss.item())
            elif way == "detached":
                probe.step(loss.detach() * 2)
            elif way == "counts":
                probe.step(loss, samples=16, tokens=64.0)
            elif way in ("a-copy", "accumulated-copy"):
                probe.step(loss.detach())
            elif way == "bad-counts":
                probe.step(loss, samples=-3, tokens="many")
            elif way == "not-a-scalar":
                probe.step(loss.detach().repeat(2))
            elif way == "huge-count":
                probe.step(loss, samples=10**400)  # an int no float can hold
            elif way == "tensor-count":
                seen = torch.tensor(16)
                probe.step(loss, samples=seen)
                seen.zero_()  # the loop reuses its counter: the step's count is what it was
            else:
                probe.step()
    finally:
        probe.close()

    def loss_of(pending: Any) -> float | None:
        if pending.loss is not None:
            return round(float(pending.loss), 6)
        if pending.host_scalars is None:
            return None
        return round(float(pending.host_scalars["loss"]), 6)

    def plain(value: float) -> float | str:
        return "nan" if value != value else value  # NaN compares unequal to itself

    rows = [
        (
            p.step,
            loss_of(p),
            list(p.lr),
            plain(p.micro_batches),
            plain(p.samples),
            plain(p.tokens),
            plain(p.clip_max),
            plain(p.epoch),
            p.amp_skipped,
        )
        for p in sent
    ]
    return rows, told, last_micro


def test_the_usual_step_s_short_way_hands_over_what_the_whole_way_does(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """probe.step() takes a short way on the usual step (no gradient pass due, nothing rare);
    a gradient pass at every step takes the whole way every time: what each hands the probe
    thread of every step (loss, LR, micro-batches, counts) and tells the user is the same,
    whichever way the loop passes its loss."""
    whole, whole_told, last_micro = _what_each_step_hands_over(1, monkeypatch)
    short, short_told, _ = _what_each_step_hands_over(10**9, monkeypatch)
    assert len(whole) == len(short) == 2 * len(WAYS)
    assert short == whole
    # What the loop passed wrong is said once, at the step it came with, whichever way.
    assert short_told == whole_told
    # (Step 14's huge count is of the kind said at step 8: not said again.)
    assert [(step, message.split(":")[0]) for step, message in whole_told] == [
        (4, "probe.step(loss)"),  # the last of 3 micro-batches (said once, not at step 10)
        (8, "probe.step(samples=-3)"),
        (8, "probe.step(tokens='many')"),
        (9, "probe.step(loss)"),  # not a scalar
    ]
    # ... and the loop's own: the LR each update used, its micro-batches, the counts passed,
    # the update's loss (not its last micro-batch's, however passed back as a tensor)
    way = {name: whole[i] for i, name in enumerate(WAYS)}
    assert [row[2] for row in whole[:7]] == [[0.1]] * 3 + [[0.05]] * 3 + [[0.025]]
    micro = [way[w][3] for w in ("tensor", "accumulated", "accumulated-copy", "closure-raised")]
    assert micro == [1.0, 3.0, 3.0, 1.0]
    copy = WAYS.index("accumulated-copy")
    assert way["accumulated-copy"][1] == pytest.approx(3 * last_micro[copy], rel=1e-5)
    assert way["counts"][4:6] == (16.0, 64.0) and way["tensor-count"][4] == 16.0
    assert way["bad-counts"][4:6] == ("nan", "nan") and way["not-a-scalar"][1] is None
    assert way["huge-count"][4] == "nan"


def test_a_step_the_probe_thread_cannot_build_costs_only_itself(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_reader: OpenReader
) -> None:
    """A step whose record fails to build on the probe thread is dropped and counted as an
    error; the steps drained with it in the same tick are still published."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="one-bad", grad_every=10**9)
    build = faults.original(probe, "build_step")

    def fails_at_step_5(raw: Any) -> Any:
        if raw[0] == 5:
            raise RuntimeError("this step cannot be built")
        return build(raw)

    inject_fault(monkeypatch, probe, "build_step", fails_at_step_5)
    assert probe.socket_path
    reader = probe_reader(probe)
    try:
        loop.run(20, probe)
        reader.wait(lambda r: len(r.records()) == 19)
        assert [r.step for r in reader.records()] == [s for s in range(20) if s != 5]
        assert probe.errors == 1
    finally:
        probe.close()
        reader.close()


def test_a_step_that_fails_on_the_training_thread_keeps_its_number(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_reader: OpenReader
) -> None:
    """probe.step() failing inside (an internal error, counted) loses that step only: the
    later steps keep the loop's count, not one less for each failure."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="one-failed", grad_every=10**9)
    sampler = probe._sampler
    failed_at: list[float] = []

    def failing_at_step_5(way: Callable[..., Any]) -> Callable[..., Any]:
        def fails_at_step_5(self: Any, *args: Any) -> Any:
            if self.step_count == 5:
                failed_at.append(args[-1])  # its probe.step()'s start
                raise RuntimeError("this step fails in the probe")
            return way(self, *args)

        return fails_at_step_5

    # Either way a step is handed over: the whole way's, or a lean step's straight one.
    for way in ("step", "hand_lean_cpu_step"):
        monkeypatch.setattr(type(sampler), way, failing_at_step_5(getattr(type(sampler), way)))
    assert probe.socket_path
    reader = probe_reader(probe)
    try:
        loop.run(6, probe)
        # The next step's time starts at the failed step's start, not the one before it.
        assert failed_at and sampler._last_host == failed_at[0]
        loop.run(14, probe)
        reader.wait(lambda r: len(r.records()) == 19)
        assert [r.step for r in reader.records()] == [s for s in range(20) if s != 5]
        assert probe.errors == 1 and probe.steps == 20
    finally:
        probe.close()
        reader.close()


def test_a_lean_step_whose_hand_over_fails_is_still_a_dive_s_step_boundary(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command armed or a dive running sees every step's boundary, the one whose hand-over
    raised too (counted; the step keeps its number)."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="boundary", grad_every=10**9)
    try:
        loop.run(20, probe)
        assert probe._lean.on  # the steady state: the straight way from probe.step()

        def fails(*_: Any) -> bool:
            raise RuntimeError("this hand-over fails")

        boundaries: list[int] = []
        monkeypatch.setattr(type(probe._sampler), "hand_lean_cpu_step", fails)
        monkeypatch.setattr(probe._dives, "busy", True)
        monkeypatch.setattr(probe._dives, "at_boundary", boundaries.append)
        loop.run(1, probe)
        assert probe.errors == 1 and probe.steps == 21
        assert boundaries == [20]
    finally:
        probe.close()


def test_every_declared_fault_point_names_a_live_part(runtime_dir: Path) -> None:
    """The fault points the tests inject through (tdbg.probe.faults) resolve on a real probe,
    and an injection is undone to the very callable it replaced."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    for point in faults.POINTS:
        before = [getattr(owner, name) for owner, name in faults.targets(probe, point)]
        undo = faults.inject(probe, point, print)
        assert all(getattr(o, n) is print for o, n in faults.targets(probe, point)), point
        undo()
        after = [getattr(owner, name) for owner, name in faults.targets(probe, point)]
        assert after == before, point
    with pytest.raises(KeyError, match="no fault point"):
        faults.targets(probe, "nowhere")
    probe.close()
