"""A model watched by tdbg saves, loads, copies and compiles as one that is not: a checkpoint
loads where tdbg is not installed, and ``torch.compile(fullgraph=True)`` trains true."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop, Reader, handed_over, reader_on

import tdbg

LOAD_WITHOUT_TDBG = """
import sys
sys.modules["tdbg"] = None  # `import tdbg` now raises: the loader has no tdbg at all
import torch
saved = torch.load(sys.argv[1], weights_only=False)
model, opt, x = saved["model"], saved["opt"], saved["x"]
assert torch.equal(model(x), saved["out"])
opt.zero_grad()
model(x).sum().backward()
opt.step()  # its hooks (the probe's, copied) run and do nothing
twin = __import__("copy").deepcopy(model)
assert torch.equal(twin(x), model(x))
print("loaded", sorted(m for m in sys.modules if m.startswith("tdbg")))
"""


def run_without_tdbg(script: str, path: Path, timeout: float = 120) -> str:
    """Run ``script`` on the checkpoint ``path`` in a Python where ``import tdbg`` fails (the
    script's guard; -I: no PYTHONPATH, no user site); what it printed, once it exits 0."""
    done = subprocess.run(
        [sys.executable, "-I", "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_checkpoint_saved_while_watched_loads_without_tdbg(
    runtime_dir: Path, tmp_path: Path
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    loop.run(2, probe)
    path = tmp_path / "checkpoint.pt"
    out = loop.model(loop.x)
    torch.save({"model": loop.model, "opt": loop.opt, "x": loop.x, "out": out}, path)
    assert run_without_tdbg(LOAD_WITHOUT_TDBG, path) == "loaded ['tdbg']"  # the guard's None
    probe.close()


def _users_pre_hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
    """The script's own forward pre-hook (with keyword arguments): copies keep it."""


def _users_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    """The script's own forward hook (always called): copies keep it."""


class _OwnState(torch.nn.Module):
    """A module class whose ``__getstate__`` does not call ``nn.Module``'s (as the RNNs')."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__  # the live one: the copy must not take the model's hooks off


def _hooks_of(model: torch.nn.Module) -> list[Any]:
    return [
        hook
        for module in model.modules()
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for hook in hooks.values()
    ]


def _copies(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Whole copies of ``model``: deep, pickled, saved (a shallow copy shares its children)."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return [
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),  # noqa: S301 (our own bytes)
        torch.load(buffer, weights_only=False),
    ]


@pytest.mark.parametrize("kind", ["sequential", "lstm", "own-getstate"])
def test_copies_of_a_watched_model_carry_the_scripts_hooks_and_none_of_tdbgs(
    runtime_dir: Path, kind: str
) -> None:
    """Deep and shallow copies, pickles and ``torch.save`` of a watched module hold the
    script's own hooks (with their keyword and always-called flags) and no hook of tdbg's, not
    even an inert one, whatever class defines the module's ``__getstate__``; the live model
    keeps its hooks and the copies report nothing into the probe."""
    model: torch.nn.Module
    if kind == "sequential":
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    elif kind == "lstm":
        model = torch.nn.LSTM(4, 3, batch_first=True)
    else:
        model = _OwnState()
    pre = model.register_forward_pre_hook(_users_pre_hook, with_kwargs=True)
    post = model.register_forward_hook(_users_hook, always_call=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = tdbg.watch(model, opt, grad_every=1)
    x = torch.randn(2, 5, 4) if kind == "lstm" else torch.randn(5, 4)

    def step() -> None:
        out = model(x)
        loss = (out[0] if isinstance(out, tuple) else out).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step(loss)

    step()
    live = list(model._forward_pre_hooks.items())
    assert len(live) == 1  # the script's; the probe's forward mark is its wrapper
    wrapper = model.__dict__["forward"]
    for clone in _copies(model):
        assert "forward" not in clone.__dict__  # the class's forward, not the probe's wrapper
        assert list(clone._forward_pre_hooks) == [pre.id]
        assert list(clone._forward_hooks) == [post.id]
        assert dict(clone._forward_pre_hooks_with_kwargs) == {pre.id: True}
        assert dict(clone._forward_hooks_always_called) == {post.id: True}
        assert [getattr(h, "__name__", None) for h in _hooks_of(clone)] == [
            "_users_pre_hook",
            "_users_hook",
        ]
        before = probe._hooks.timeline.forward_start
        clone(x)
        assert probe._hooks.timeline.forward_start is before  # nothing reached the probe
    shallow = copy.copy(model)  # its own hook dicts; its children are the model's
    assert list(shallow._forward_pre_hooks) == [pre.id]
    assert list(shallow._forward_hooks) == [post.id]
    assert "forward" not in shallow.__dict__
    assert list(model._forward_pre_hooks.items()) == live
    assert model.__dict__["forward"] is wrapper
    step()
    assert probe.steps == 2 and probe.errors == 0
    probe.close()


LOAD_SCRIPT_AND_COMPILE_WITHOUT_TDBG = """
import sys
sys.modules["tdbg"] = None  # `import tdbg` now raises: the loader has no tdbg at all
import torch
saved = torch.load(sys.argv[1], weights_only=False)
for name in ("mlp", "lstm"):
    model, x = saved[name], saved[name + "_x"]
    hooks = [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks)
             for h in d.values()]
    assert hooks == [], (name, hooks)
    assert not any("forward" in m.__dict__ for m in model.modules()), name
    if name == "mlp":  # an LSTM unwatched neither scripts nor compiles fullgraph in 2.13
        expected = model(x)
        assert torch.allclose(torch.jit.script(model)(x), expected)
        assert torch.allclose(torch.compile(model, backend="eager", fullgraph=True)(x), expected)
print("scripted and compiled", sorted(m for m in sys.modules if m.startswith("tdbg")))
"""


def test_a_model_saved_whole_while_watched_scripts_and_compiles_without_tdbg(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """pytorch/examples' word_language_model saves its whole model: loaded where tdbg is not
    installed, it carries no hook of tdbg's, so ``torch.jit.script`` (which compiles every hook
    from its source) and ``torch.compile(fullgraph=True)`` (which refuses a graph break) take it
    as they take the model unwatched. An LSTM (its class pickles through its own
    ``__getstate__``) carries none either."""
    loop = Loop()
    lstm = torch.nn.LSTM(4, 3, batch_first=True)
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    lstm_probe = tdbg.watch(lstm)
    loop.run(2, probe)
    lstm_x = torch.randn(2, 5, 4)
    lstm(lstm_x)[0].sum().backward()
    lstm_probe.step()
    path = tmp_path / "whole.pt"
    saved = {"mlp": loop.model, "mlp_x": loop.x, "lstm": lstm, "lstm_x": lstm_x}
    torch.save(saved, path)
    out = run_without_tdbg(LOAD_SCRIPT_AND_COMPILE_WITHOUT_TDBG, path, timeout=300)
    assert out == "scripted and compiled ['tdbg']"
    lstm_probe.close()
    probe.close()


def test_a_copy_taken_while_a_dive_has_hooks_armed_carries_none(runtime_dir: Path) -> None:
    """A NaN hunt (which starts by itself after a non-finite alert) and activation statistics
    arm hooks on every module; a checkpoint or deep copy taken meanwhile (a best-model
    snapshot) raised ``cannot pickle '_thread.lock'`` and now holds none of them."""
    from conftest import dive_context

    from tdbg.probe.dives.activations import ActivationsDive
    from tdbg.probe.dives.nan_hunt import NanHuntDive

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    model.register_forward_hook(_users_hook)
    for dive_class, params in ((NanHuntDive, {"steps": 1}), (ActivationsDive, {"every": 1})):
        dive = dive_class(dive_context(model), 7, params, "manual")
        dive.start(0)  # armed for step 1
        assert len(_hooks_of(model)) > 1, dive_class  # armed
        for clone in _copies(model):
            assert [getattr(h, "__name__", None) for h in _hooks_of(clone)] == ["_users_hook"]
            clone(torch.randn(3, 4)).sum().backward()
        dive.cancelled(1, "off")
        dive.release()
        assert [getattr(h, "__name__", None) for h in _hooks_of(model)] == ["_users_hook"]


def test_a_parametrized_model_copies_while_a_nan_hunt_is_armed(runtime_dir: Path) -> None:
    """``torch.nn.utils.parametrize`` (spectral_norm, weight_norm, orthogonal: a GAN's
    discriminator) deep-copies a module through its ``__dict__``, around ``__getstate__``: the
    hunt's hooks are copied as they are. They hold the hunt weakly and copy as a no-op, so a
    best-model copy taken while the hunt is armed works (it raised ``cannot pickle
    '_thread.lock'``) and reports nothing into the hunt."""
    from conftest import dive_context

    from tdbg.probe.dives.nan_hunt import NanHuntDive

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 4)),
        torch.nn.ReLU(),
        torch.nn.Linear(4, 1),
    )
    x = torch.randn(3, 4)
    ctx = dive_context(model)
    dive = NanHuntDive(ctx, 7, {"steps": 1}, "manual")
    dive.start(0)
    twin = copy.deepcopy(model)
    events = len(ctx.events)
    assert torch.allclose(twin(x), model(x))
    twin(x).sum().backward()
    assert len(ctx.events) == events
    dive.cancelled(1, "off")
    dive.release()


def test_a_watched_model_compiles_with_fullgraph_and_trains_true(runtime_dir: Path) -> None:
    """fullgraph=True refuses any graph break; the probe's forward hooks are a no-op the graph
    absorbs. The run's losses and gradient norms are those of the same run unwatched."""
    from norm_oracle import reference_norms

    from tdbg.probe.training.gradients import find_layers

    def train(watch: bool) -> tuple[list[float], list[float], Reader | None]:
        loop = Loop()
        probe = tdbg.watch(loop.model, loop.opt, grad_every=1) if watch else None
        reader = reader_on(probe) if probe is not None else None
        compiled = torch.compile(loop.model, backend="eager", fullgraph=True)
        torch._dynamo.utils.counters.clear()
        losses, totals = [], []
        for _ in range(4):
            loop.optimizer.zero_grad()
            loss = ((compiled(loop.x) - loop.y) ** 2).mean()
            loss.backward()
            totals.append(reference_norms(find_layers(loop.model))[0])
            loop.optimizer.step()
            losses.append(float(loss.detach()))
            if probe is not None:
                probe.step(loss)
        # Compiled once: the hooks' checks add no guard that fails at every call.
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        if probe is not None:
            assert probe.errors == 0
            reader.wait(lambda r: len(r.records()) >= 4)  # type: ignore[union-attr]
        return losses, totals, reader

    torch._dynamo.reset()
    plain_losses, plain_totals, _ = train(watch=False)
    torch._dynamo.reset()
    losses, totals, reader = train(watch=True)
    assert reader is not None
    assert losses == plain_losses and totals == plain_totals
    records = reader.records()
    assert [r.step for r in records] == [0, 1, 2, 3]
    for record, loss, total in zip(records, losses, totals, strict=True):
        assert abs(record.loss - loss) <= 1e-6 * abs(loss)
        assert abs(record.grad_total - total) <= 1e-5 * total
    reader.close()


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_a_watched_model_exports_and_the_probe_sees_no_traced_call(
    runtime_dir: Path, strict: bool
) -> None:
    """``torch.export`` calls the module (with fake tensors when non-strict, outside dynamo):
    the probe's forward hook does nothing there (no mark, no captured batch), the program
    exports and computes what the model does, and training goes on watched."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    loop.run(1, probe)
    hooks = probe._hooks
    hooks.capture_inputs = True
    hooks.last_inputs = None
    with torch.enable_grad():
        program = torch.export.export(loop.model, (loop.x,), strict=strict)
    assert hooks.last_inputs is None and hooks.timeline.forward_start is None
    assert torch.allclose(program.module()(loop.x), loop.model(loop.x))
    hooks.timeline.forward_start = None  # the eager call just above marked one
    loop.run(2, probe)
    assert probe.errors == 0 and probe.steps == 3
    probe.close()


@pytest.mark.parametrize(
    ("fullgraph", "retrace"),
    [(True, False), (True, True), (False, True)],
    ids=["fullgraph", "fullgraph-retraced-while-sampling", "default-retraced-while-sampling"],
)
def test_the_activations_dive_on_a_compiled_model_says_it_saw_nothing(
    runtime_dir: Path, fullgraph: bool, retrace: bool
) -> None:
    """A client asks for activation statistics while a compiled model trains. Its hooks run
    no code in the compiled graph (no graph break: fullgraph=True still compiles, also when
    dynamo traces again while they are armed: a smaller batch), the losses are the unwatched
    run's, and the job fails saying the model ran compiled, with no sample of empty numbers."""

    def train(watch: bool) -> tuple[list[float], Reader | None, Any, torch.nn.Module]:
        torch._dynamo.reset()
        loop = Loop()
        probe = tdbg.watch(loop.model, loop.opt) if watch else None
        reader = reader_on(probe) if probe is not None else None
        if reader is not None:
            reader.wait(lambda r: r.of("synced"))
            mid = reader.client.send("activations", every=1, enabled=True)
            reader.wait(lambda r: any(m.get("id") == mid for m in r.messages), what="the ack")
        compiled = torch.compile(loop.model, backend="eager", fullgraph=fullgraph)
        losses = []
        for step in range(4):
            # The dive arms its hooks at step 0's boundary; a smaller batch from step 1 on
            # makes dynamo trace the forward again with them in place.
            rows = 16 if retrace and step > 0 else 32
            loop.optimizer.zero_grad()
            loss = ((compiled(loop.x[:rows]) - loop.y[:rows]) ** 2).mean()
            loss.backward()
            loop.optimizer.step()
            losses.append(float(loss.detach()))
            if probe is not None:
                probe.step(loss)
        return losses, reader, probe, loop.model

    plain, _, _, _ = train(watch=False)
    losses, reader, probe, model = train(watch=True)
    assert reader is not None and probe is not None
    assert losses == plain
    reader.wait(lambda r: any(j["state"] == "failed" for j in r.of("job")), what="the job's end")
    reader.settle()
    [job] = [j for j in reader.of("job") if j["state"] == "failed"]
    assert job["command"] == "activations" and job["step"] == 1
    assert job["message"].startswith(
        "no module output seen at step 1: the model runs compiled (torch.compile)"
    ), job["message"]
    assert reader.of("activations") == []  # no sample of numbers that were never seen
    assert probe.errors == 0
    assert all(not leaf._forward_hooks for leaf in model.children())  # the dive's hooks: released
    reader.close()


@pytest.mark.parametrize("grad_every", [1, 10**9])
def test_a_compiled_optimizer_step_still_runs_the_probe_hooks(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, grad_every: int
) -> None:
    """``torch.compile(optimizer.step)`` (the compiled-optimizer recipe): the step hooks run
    eagerly around the compiled update, so each step has its LR, its gradient pass before the
    update and its optimizer phase; no probe error. (The hooks skip dynamo's wrapper in eager
    mode and go through it only while dynamo traces them.) Without gradient passes the steps
    would be lean, the optimizer's pre-hook out of its dict: the optimizer tap hands the
    traced update to it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe = tdbg.watch(model, opt, name="compiled-step", grad_every=grad_every)
    sent = handed_over(probe, monkeypatch)
    try:
        step = torch.compile(opt.step, backend="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4 if grad_every == 1 else 8):
                opt.zero_grad()
                loss = ((model(torch.randn(16, 4)) - torch.randn(16, 1)) ** 2).mean()
                loss.backward()
                step()
                probe.step(loss)
        # dynamo never traced the probe's hooks or taps (it warned about their clock reads)
        assert not [w for w in caught if "Dynamo" in str(w.message)], caught
        assert len(sent) == (4 if grad_every == 1 else 8)
        for pending in sent:
            assert pending.lr == [0.01]
            assert (pending.grads is not None) == (grad_every == 1 or pending is sent[0])
            assert pending.timeline.optimizer_start is not None
            assert pending.timeline.optimizer_end is not None
        assert probe.errors == 0, probe.last_error
    finally:
        probe.close()


def _doubled(module: torch.nn.Module, inputs: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
    """The script's own forward pre-hook, one TorchScript compiles."""
    return (inputs[0] * 2,)


def test_a_watched_model_and_its_copies_script_with_the_scripts_own_hooks(
    runtime_dir: Path,
) -> None:
    """``torch.jit.script`` compiles every forward hook from its source: a watched model (and
    a deep copy of it, before and after close) scripts as unwatched, with the script's own hook
    and not tdbg's, and the watched model keeps its hooks, in order, and trains watched."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    loop.model.register_forward_pre_hook(_doubled)
    loop.run(1, probe)
    before = list(loop.model._forward_pre_hooks.items())
    assert len(before) == 1  # the script's; the probe's forward mark is its wrapper
    wrapper = loop.model.__dict__["forward"]
    scripted = torch.jit.script(loop.model)
    assert list(loop.model._forward_pre_hooks.items()) == before
    assert loop.model.__dict__["forward"] is wrapper  # set aside while scripted, back after
    expected = loop.model(loop.x)
    assert torch.allclose(scripted(loop.x), expected)
    assert torch.allclose(scripted(loop.x), loop.model[2](loop.model[1](loop.model[0](2 * loop.x))))
    twin = copy.deepcopy(loop.model)
    assert torch.allclose(torch.jit.script(twin)(loop.x), expected)
    loop.run(2, probe)
    assert probe.errors == 0 and probe.steps == 3
    probe.close()
    trained = loop.model(loop.x)
    assert torch.allclose(torch.jit.script(copy.deepcopy(loop.model))(loop.x), trained)


def test_hooks_come_and_go_as_ever_while_a_watched_model_is_scripted(runtime_dir: Path) -> None:
    """What other code does while TorchScript reads the model (a dive arming or releasing its
    hooks, a forward in another thread): a hook removed meanwhile stays removed, one added
    meanwhile stays, removable through its handle (and TorchScript does not see it if it is
    tdbg's, on any module), a forward meanwhile runs as the class's (the probe's forward
    wrapper set aside while TorchScript reads the module)."""
    import functools
    import sys

    from torch.jit import _recursive

    from tdbg.probe.training.hook_refs import INERT_EVENT

    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    loop.run(1, probe)
    leaving = loop.model.register_forward_hook(functools.partial(sys.audit, INERT_EVENT))
    arrived: list[Any] = []

    def stubs(module: torch.nn.Module) -> Any:
        if module is loop.model:  # the window, as another thread would use it
            leaving.remove()
            arrived.append(
                loop.model.register_forward_hook(functools.partial(sys.audit, INERT_EVENT))
            )
            # A tdbg hook armed on a layer that had none (TorchScript reads it later).
            arrived.append(
                loop.model[2].register_forward_hook(functools.partial(sys.audit, INERT_EVENT))
            )
            # The probe's forward wrapper is set aside while TorchScript reads the class's
            # forward (script_tap): a forward meanwhile runs as the class's.
            assert "forward" not in loop.model.__dict__
            assert torch.allclose(loop.model(loop.x), expected)
            # A checkpoint taken meanwhile (another thread's) is the model's, loadable as ever.
            twin = copy.deepcopy(loop.model)
            assert type(twin._forward_hooks) is type(twin._forward_pre_hooks) is OrderedDict
            buffer = io.BytesIO()
            torch.save(loop.model, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            assert type(saved._forward_hooks) is OrderedDict
        return _recursive.infer_methods_to_compile(module)

    expected = loop.model(loop.x)
    scripted = _recursive.create_script_module(loop.model, stubs)
    assert torch.allclose(scripted.forward(loop.x), loop.model(loop.x))
    hooks = list(loop.model._forward_hooks)
    assert leaving.id not in hooks and hooks == [arrived[0].id]
    assert list(loop.model[2]._forward_hooks) == [arrived[1].id]
    assert "forward" in loop.model.__dict__  # the probe's wrapper, back in place
    for handle in arrived:  # registered meanwhile, removable as ever
        handle.remove()
    assert not loop.model._forward_hooks and not loop.model[2]._forward_hooks
    probe._hooks.timeline.forward_start = None
    loop.run(2, probe)
    assert probe.errors == 0 and probe.steps == 3
    probe.close()
