"""The probe end to end: a real training loop in this process, a real client on a real socket."""

from __future__ import annotations

import io
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import Loop, OpenReader, Reader, inject_fault, wait_until
from torch import nn

import tdbg
from tdbg.probe import watch as watch_module
from tdbg.probe.training.gradients import GradientStats


def consumed(probe: tdbg.Probe, n: int) -> None:
    """Wait until the probe thread has turned ``n`` steps into records (and history)."""
    wait_until(lambda: probe._server.consumed >= n, what=f"{n} steps consumed")


def alerts_of(reader: Reader, kind: str) -> list[dict]:
    return [a for a in reader.of("alert") if a["kind"] == kind]


def test_tensor_loss_and_gradient_norms_reach_the_client(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1, name="unit")
    reader = probe_reader(probe)
    reader.wait(lambda r: r.of("synced"))
    assert reader.client.run["name"] == "unit"
    assert reader.of("layers")[0]["names"] == ["0", "2"]
    loop.run(12, probe, reference=True)
    reader.wait(lambda r: len(r.records()) >= 12)
    recs = reader.records()
    assert [r.step for r in recs] == list(range(12))
    assert [r.loss for r in recs] == loop.losses  # exact: the same float32 value
    for r, (ref_total, ref_layers) in zip(recs, loop.norms, strict=True):
        assert r.grad_total == pytest.approx(ref_total, rel=1e-5)
        assert r.grad_norms == pytest.approx(ref_layers, rel=1e-5)
        assert r.lr == [0.05]
    assert all(math.isfinite(r.forward_time) and r.forward_time >= 0 for r in recs)
    assert all(math.isfinite(r.step_time) for r in recs[1:])
    reader.close()


def test_python_float_none_samples_and_tokens(runtime_dir: Path, probe_reader: OpenReader) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    reader = probe_reader(probe)
    probe.step(1.25, samples=32, tokens=1024)
    probe.step(None)
    probe.step(3)  # an int is a number too
    reader.wait(lambda r: len(r.records()) >= 3)
    a, b, c = reader.records()
    assert (a.loss, a.samples, a.tokens) == (1.25, 32.0, 1024.0)
    assert b.loss is None and math.isnan(b.samples)
    assert c.loss == 3.0
    assert probe.errors == 0
    reader.close()


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensor", "float"])
def test_nan_loss_alert_arrives_over_the_socket(
    runtime_dir: Path, as_tensor: bool, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    reader = probe_reader(probe)
    loop.run(3, probe)
    nan = torch.tensor(float("nan")) if as_tensor else float("nan")
    probe.step(nan)
    probe.step(nan)
    reader.wait(lambda r: alerts_of(r, "nonfinite_loss"))
    reader.wait(lambda r: len(r.records()) >= 5)
    (alert,) = alerts_of(reader, "nonfinite_loss")  # onset only
    assert alert["step"] == 3 and alert["severity"] == "error"
    assert math.isnan(reader.records()[3].loss)
    reader.close()


def test_multi_element_loss_is_a_clear_alert_not_an_exception(
    runtime_dir: Path, probe_log: io.StringIO, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    reader = probe_reader(probe)
    probe.step(torch.ones(4, 2))  # must not raise
    probe.step(torch.ones(3))
    probe.step(torch.tensor([2.5]))  # one element is a scalar loss
    reader.wait(lambda r: len(r.records()) >= 3 and alerts_of(r, "probe_error"))
    (alert,) = alerts_of(reader, "probe_error")  # reported once
    assert "(4, 2)" in alert["message"] and "scalar" in alert["message"]
    recs = reader.records()
    assert recs[0].loss is None and recs[1].loss is None
    assert recs[2].loss == 2.5
    assert "(4, 2)" in probe_log.getvalue()
    assert probe.errors == 0
    reader.close()


def test_unreadable_loss_is_reported_not_raised(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    reader = probe_reader(probe)
    probe.step("not a number")
    probe.step(object())
    reader.wait(lambda r: len(r.records()) >= 2 and alerts_of(r, "probe_error"))
    assert [r.loss for r in reader.records()] == [None, None]
    assert "str" in alerts_of(reader, "probe_error")[0]["message"]
    reader.close()


def test_without_an_optimizer_grads_are_taken_at_step(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop(optimizer=False)
    probe = tdbg.watch(loop.model, grad_every=1)
    reader = probe_reader(probe)
    loop.run(5, probe, reference=True)
    reader.wait(lambda r: len(r.records()) >= 5)
    for r, (ref_total, ref_layers) in zip(reader.records(), loop.norms, strict=True):
        assert r.grad_norms == pytest.approx(ref_layers, rel=1e-5)
        assert r.grad_total == pytest.approx(ref_total, rel=1e-5)
        assert r.lr == []
    reader.close()


def test_grad_every_samples_every_kth_step(runtime_dir: Path, probe_reader: OpenReader) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=3)
    reader = probe_reader(probe)
    loop.run(9, probe)
    reader.wait(lambda r: len(r.records()) >= 9)
    assert [r.step for r in reader.records() if r.grad_norms is not None] == [0, 3, 6]
    reader.close()


def test_model_without_parameters(
    runtime_dir: Path, probe_log: io.StringIO, probe_reader: OpenReader
) -> None:
    model = nn.Sequential(nn.ReLU())
    probe = tdbg.watch(model)
    assert "no parameters" in probe_log.getvalue()
    reader = probe_reader(probe)
    for i in range(3):
        model(torch.randn(2, 2))
        probe.step(float(i))
    reader.wait(lambda r: len(r.records()) >= 3)
    assert reader.of("layers")[0]["names"] == []
    assert [r.loss for r in reader.records()] == [0.0, 1.0, 2.0]
    assert probe.errors == 0
    reader.close()


def test_watch_rejects_what_is_not_a_module() -> None:
    with pytest.raises(
        TypeError, match=r"torch\.nn\.Module \(or a list or dict of them\), not str"
    ):
        tdbg.watch([nn.Linear(1, 1), "head"])  # type: ignore[list-item]  # what it refuses
    with pytest.raises(TypeError, match="no model"):
        tdbg.watch([])
    with pytest.raises(TypeError, match=r"names must be strings"):
        tdbg.watch({1: nn.Linear(1, 1)})  # type: ignore[dict-item]  # what it refuses
    with pytest.raises(TypeError, match="Optimizer"):
        tdbg.watch(nn.Linear(1, 1), optimizer="sgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grad_every"):
        tdbg.watch(nn.Linear(1, 1), grad_every=0, serve=False)
    with pytest.raises(ValueError, match="overhead_budget"):
        tdbg.watch(nn.Linear(1, 1), overhead_budget=0, serve=False)
    with pytest.raises(ValueError, match="activations_every"):
        tdbg.watch(nn.Linear(1, 1), activations_every=0, serve=False)
    with pytest.raises(TypeError, match=r"tdbg\.watch: unexpected keyword argument 'grad_evry'"):
        tdbg.watch(nn.Linear(1, 1), grad_evry=5, serve=False)


def test_watch_and_probe_show_every_option_as_a_keyword() -> None:
    # The options are written down once (ProbeOptions); help() and IDEs still see each one.
    import dataclasses
    import inspect

    names = [f.name for f in dataclasses.fields(watch_module.ProbeOptions)]
    for fn in (tdbg.watch, tdbg.Probe):
        params = inspect.signature(fn).parameters
        assert list(params)[:2] == ["model", "optimizer"]
        assert list(params)[2:] == names
        assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names)
    assert inspect.signature(tdbg.watch).parameters["overhead_budget"].default == 0.01
    probe = tdbg.watch(nn.Linear(1, 1), grad_every=3, serve=False, name="opts")
    assert probe.options == watch_module.ProbeOptions(grad_every=3, serve=False, name="opts")
    assert probe.grad_interval == 3 and probe.name == "opts"
    probe.close()


def hook_counts(model: nn.Module, opt: torch.optim.Optimizer | None) -> tuple[int, ...]:
    """Forward hooks; the forward's start (pre-hooks, and the probe's wrapper of the instance's
    forward, which stands for its pre-hook: forward_tap); the optimizer's step hooks."""
    starts = len(model._forward_pre_hooks) + ("forward" in model.__dict__)
    counts = [len(model._forward_hooks), starts]
    if opt is not None:
        counts += [len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)]
    return tuple(counts)


def test_hooks_socket_and_metadata_are_gone_after_close(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    assert probe.socket_path is not None
    sock = Path(probe.socket_path)
    # One forward wrapper, no hook (the forward's end is the backward tap's), the step
    # pre/post hooks.
    assert hook_counts(loop.model, loop.opt) == (0, 1, 1, 1)
    assert not loop.model._forward_pre_hooks
    assert sock.exists() and sock.with_suffix(".json").exists()
    loop.run(3, probe)
    probe.close()
    assert hook_counts(loop.model, loop.opt) == (0, 0, 0, 0)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in loop.model.modules())
    assert "forward" not in loop.model.__dict__  # the class's forward again
    assert sorted(os.listdir(runtime_dir)) == []
    assert probe.socket_path is None
    loop.run(2, probe)  # stepping a closed probe is harmless
    assert probe.steps == 3
    probe.close()  # twice is fine


def test_a_closed_probe_and_its_model_are_freed_once_dropped(runtime_dir: Path) -> None:
    """Nothing of tdbg keeps a watched model alive after close(): the map from modules to their
    probe (for "already watched") held the probe strongly, and the probe its model, so every
    model a process ever watched (a sweep's every trial) stayed in memory."""
    import gc
    import weakref

    def trial() -> tuple[weakref.ref[nn.Module], weakref.ref[tdbg.Probe]]:
        # In a function of its own: watch() reads its caller's variable names (f_locals,
        # a snapshot on Python < 3.13 that lives as long as the frame).
        net = nn.Linear(4, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        probe = tdbg.watch(net, opt)
        for _ in range(2):
            loss = net(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.step(loss)
        probe.close()
        return weakref.ref(net), weakref.ref(probe)

    model, closed = trial()

    def freed() -> bool:
        gc.collect()
        return model() is None and closed() is None

    wait_until(freed, what="the model and its closed probe freed")


def test_context_manager_closes(runtime_dir: Path) -> None:
    loop = Loop()
    with tdbg.watch(loop.model, loop.opt) as probe:
        assert probe.socket_path is not None
        loop.run(2, probe)
        assert "serving at" in repr(probe)
    assert probe.closed and "closed" in repr(probe)
    assert hook_counts(loop.model, loop.opt) == (0, 0, 0, 0)
    assert os.listdir(runtime_dir) == []


def test_watching_the_same_model_twice_closes_the_first(
    runtime_dir: Path, probe_log: io.StringIO, probe_reader: OpenReader
) -> None:
    loop = Loop()
    first = tdbg.watch(loop.model, loop.opt)
    first_path = first.socket_path
    second = tdbg.watch(loop.model, loop.opt)
    assert first.closed and not second.closed
    assert "already watched" in probe_log.getvalue()
    assert hook_counts(loop.model, loop.opt) == (0, 1, 1, 1)
    assert second.socket_path is not None and os.path.exists(second.socket_path)
    assert first_path is not None
    reader = probe_reader(second)
    loop.run(2, second)
    reader.wait(lambda r: len(r.records()) >= 2)
    reader.close()


def test_directory_argument_as_str_and_path(tmp_path: Path) -> None:
    for kind in (str, Path):
        d = Path("/tmp") / f"tdbg-dir-{os.getpid()}-{kind.__name__}"
        os.mkdir(d, 0o700)
        try:
            probe = tdbg.watch(nn.Linear(1, 1), directory=kind(d))
            assert probe.socket_path is not None
            assert Path(probe.socket_path).parent == d
            probe.close()
            assert os.listdir(d) == []
        finally:
            os.rmdir(d)


def test_probe_errors_are_counted_and_never_raised(
    runtime_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    probe_log: io.StringIO,
    probe_reader: OpenReader,
) -> None:
    def broken(self: GradientStats, weights: bool = False) -> None:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(GradientStats, "compute", broken)
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    loop.run(5, probe)  # must not raise
    assert probe.errors >= 5
    assert probe.last_error is not None and "injected failure" in probe.last_error
    assert "internal error (training continues)" in probe_log.getvalue()
    reader.wait(lambda r: len(r.records()) >= 5 and alerts_of(r, "probe_error"))
    assert [r.loss for r in reader.records()] == loop.losses  # the rest still works
    assert all(r.grad_norms is None for r in reader.records())
    reader.wait(lambda r: any(m.get("errors", 0) >= 5 for m in r.of("probe")))
    reader.close()


def test_circuit_breaker_switches_the_probe_off(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_log: io.StringIO
) -> None:
    """after 100 internal errors the probe disables itself; training goes on."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    sock = probe.socket_path
    assert sock is not None

    def broken(loss: object) -> None:
        raise RuntimeError("loss bookkeeping exploded")

    inject_fault(monkeypatch, probe, "step_losses", broken)
    loop.run(150, probe)
    assert probe.errors == watch_module.MAX_ERRORS
    assert probe._disabled
    assert hook_counts(loop.model, loop.opt) == (0, 0, 0, 0)
    assert probe_log.getvalue().count("switches itself off") == 1
    wait_until(lambda: not os.path.exists(sock), what="server stopped")
    wait_until(lambda: not any(t.is_alive() for t in probe._server._threads), what="threads ended")
    assert len(loop.losses) == 150


def test_the_breaker_gives_the_console_back(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_log: io.StringIO
) -> None:
    """A probe switched off by the breaker stops keeping the console: the streams are the real
    ones again at its next step (nobody would take the lines)."""
    real = sys.stdout
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, console=True)
    assert sys.stdout is not real and type(sys.stdout).__name__ == "TeeStream"

    def broken(loss: object) -> None:
        raise RuntimeError("loss bookkeeping exploded")

    inject_fault(monkeypatch, probe, "step_losses", broken)
    loop.run(150, probe)
    assert probe._disabled and sys.stdout is real
    probe.close()
    assert sys.stdout is real


def test_late_client_gets_the_whole_history_then_live_steps(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    # more than history's merge threshold of batches, so both merged and recent chunks replay
    for _ in range(10):
        loop.run(25, probe)
        n = len(loop.losses)
        consumed(probe, n)
    loop.run(3, probe, reference=True)
    consumed(probe, len(loop.losses))
    probe.step(float("nan"))
    loop.losses.append(math.nan)
    consumed(probe, len(loop.losses))
    wait_until(lambda: probe._server.history.alerts, what="alert in history")
    reader = probe_reader(probe)
    reader.wait(lambda r: r.of("synced"))
    history = reader.records(history=True)
    assert [r.step for r in history] == list(range(len(loop.losses)))
    assert [r.loss for r in history[:-1]] == loop.losses[:-1]
    assert math.isnan(history[-1].loss)
    for r, (_, ref_layers) in zip(history[-4:-1], loop.norms, strict=True):
        assert r.grad_norms == pytest.approx(ref_layers, rel=1e-5)
    # Where it began comes first (here: a NaN loss from finite weights), then the NaN itself.
    assert [a["kind"] for a in reader.of("alert")] == ["nonfinite_origin", "nonfinite_loss"]
    assert reader.of("alert")[0]["history"] is True
    # then live steps, marked as such, after synced
    synced_at = next(i for i, m in enumerate(reader.messages) if m["type"] == "synced")
    loop.run(4, probe)
    reader.wait(lambda r: len(r.records(history=False)) >= 4)
    live = reader.records(history=False)
    assert [r.step for r in live] == list(range(len(history), len(history) + 4))
    assert [r.loss for r in live] == loop.losses[-4:]
    first_live = next(
        i for i, m in enumerate(reader.messages) if m["type"] == "steps" and not m["history"]
    )
    assert first_live > synced_at
    reader.close()


def test_probe_health_message(runtime_dir: Path, probe_reader: OpenReader) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=2)
    reader = probe_reader(probe)
    loop.run(6, probe)
    reader.wait(lambda r: any(m["steps_seen"] == 6 for m in r.of("probe")))
    msg = [m for m in reader.of("probe") if m["steps_seen"] == 6][-1]
    assert msg["clients"] == 1 and msg["errors"] == 0 and msg["grad_interval"] == 2
    assert msg["dropped"] == 0
    reader.close()


def test_serve_false_binds_nothing(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False)
    loop.run(3, probe)
    assert probe.socket_path is None
    assert os.listdir(runtime_dir) == []
    assert probe.steps == 3


def test_the_gradient_interval_follows_the_measured_cost(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_reader: OpenReader
) -> None:
    # The costs the sampler measured are replaced through its seam, so the machine's speed
    # decides nothing: a 0.8 ms gradient pass in a 10 ms step under a 1 % budget (aimed at
    # 0.8 %) is every 10th step; once the pass costs 50 µs, every step.
    ms = 1e-3
    costs = (10 * ms, 0.8 * ms, 0.0, float("nan"))
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, overhead_budget=0.01)
    inject_fault(monkeypatch, probe, "measured_costs", lambda: costs)
    reader = probe_reader(probe)
    loop.run(40, probe)
    assert probe.grad_interval == 10
    costs = (10 * ms, 0.05 * ms, 0.0, float("nan"))
    loop.run(20, probe)
    assert probe.grad_interval == 1
    reader.wait(lambda r: len(r.records()) == 60)
    sampled = [r.step for r in reader.records() if r.grad_norms is not None]
    assert sampled == [0, 10, 20, 30, *range(40, 60)]
    probe.close()
    reader.close()
