"""The probe marks a watched model's forward by wrapping the instance's ``forward``, not by a
hook (torch's hook path costs every forward microseconds), and nothing else can tell: copies,
pickles, TorchScript, torch.compile, signature inspection and unwatching see the model's own."""

from __future__ import annotations

import copy
import functools
import inspect
import io
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import tdbg


class Net(nn.Module):
    """A model with a keyword parameter (what Hugging Face's Trainer inspects)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * scale


class CopiesItself(Net):
    """A class whose deep copy does not go through ``__getstate__``."""

    def __deepcopy__(self, memo: dict[int, Any]) -> CopiesItself:
        twin = CopiesItself()
        twin.load_state_dict(self.state_dict())
        return twin


def _train(model: nn.Module, opt: torch.optim.Optimizer, probe: tdbg.Probe, steps: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        loss = model(x, scale=0.5).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step(loss)


def _watched() -> tuple[Net, torch.optim.Optimizer, tdbg.Probe]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, tdbg.watch(model, opt, serve=False)


def test_the_wrapper_marks_the_forward_without_a_hook_and_shows_the_real_signature() -> None:
    model, opt, probe = _watched()
    assert not model._forward_pre_hooks and not model._forward_hooks
    wrapper = model.__dict__["forward"]
    # What Hugging Face's Trainer reads to drop a batch's unused columns: the real parameters.
    assert list(inspect.signature(model.forward).parameters) == ["x", "scale"]
    assert model.forward.__name__ == "forward" and model.forward.__doc__ == Net.forward.__doc__
    assert inspect.unwrap(model.forward) is Net.forward
    assert model.forward.__self__ is model  # type: ignore[attr-defined]  # a bound method
    # Each watched model's wrapper has a code object of its own (dynamo's compiled frames, and
    # their recompile limit, are kept per code object).
    other = Net()
    other_probe = tdbg.watch(other, serve=False)
    assert other.forward.__code__ is not model.forward.__code__
    other_probe.close()
    _train(model, opt, probe, 3)
    assert probe.steps == 3 and probe.errors == 0, probe.last_error
    # The forward's inputs, kept for a non-finite step's re-run (a CPU run), keywords too.
    captured = probe._hooks.last_inputs
    assert captured is not None and captured[0] is model and captured[2] == {"scale": 0.5}
    assert model.__dict__["forward"] is wrapper
    probe.close()
    assert "forward" not in model.__dict__
    assert model.forward.__func__ is Net.forward  # type: ignore[attr-defined]
    assert list(inspect.signature(model.forward).parameters) == ["x", "scale"]


def test_copies_pickles_and_checkpoints_carry_the_class_s_forward() -> None:
    model, opt, probe = _watched()
    _train(model, opt, probe, 1)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    x = torch.randn(3, 4)
    copies = [
        copy.deepcopy(model),
        copy.copy(model),
        pickle.loads(pickle.dumps(model)),  # noqa: S301 (our own bytes)
        torch.load(buffer, weights_only=False),
    ]
    probe._hooks.last_inputs = None
    for clone in copies:
        assert "forward" not in clone.__dict__
        assert torch.allclose(clone(x), model.b(torch.tanh(model.a(x))))
    assert probe._hooks.last_inputs is None  # no copy reported into the probe
    assert set(model.state_dict()) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    _train(model, opt, probe, 1)
    assert probe.steps == 2 and probe.errors == 0
    probe.close()


def test_a_watched_model_scripts_and_compiles_as_its_class() -> None:
    model, opt, probe = _watched()
    _train(model, opt, probe, 1)
    wrapper = model.__dict__["forward"]
    x = torch.randn(3, 4)
    expected = model(x)
    scripted = torch.jit.script(model)
    assert torch.allclose(scripted(x), expected)
    assert model.__dict__["forward"] is wrapper  # set aside while scripted, back after
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # no graph break
    assert torch.allclose(compiled(x), expected)
    loss = compiled(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    probe.step(loss)
    assert probe.steps == 2 and probe.errors == 0, probe.last_error
    probe.close()
    assert torch.allclose(torch.jit.script(model)(x), model(x))


def test_a_data_parallel_replica_runs_itself_through_its_own_wrapper() -> None:
    """DataParallel's replicas copy their module's ``__dict__``: the original's wrapper would
    run the original module; each replica gets one that runs the replica."""
    model, opt, probe = _watched()
    replica = model._replicate_for_data_parallel()
    assert replica.__dict__["forward"] is not model.__dict__["forward"]
    assert replica.forward.__self__ is replica
    x = torch.randn(3, 4)
    out = replica(x)  # a CPU replica shares the original's layers: it runs here
    assert torch.allclose(out, model(x))
    captured = probe._hooks.last_inputs
    assert captured is not None and captured[0] is model  # the latest forward: the model's
    replica(x)
    captured = probe._hooks.last_inputs
    assert captured is not None and captured[0] is replica
    probe.close()


def test_a_forward_already_wrapped_or_a_class_copied_its_own_way_gets_the_hook() -> None:
    """Where the wrapper could not stay out of sight (another wrapper on the instance, as
    accelerate's mixed precision puts there; a class whose copies bypass ``__getstate__``) the
    probe registers its forward pre-hook as before, and unwatching leaves the model's own."""
    torch.manual_seed(0)
    wrapped = Net()

    @functools.wraps(Net.forward)
    def users_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return Net.forward(wrapped, *args, **kwargs)

    wrapped.forward = users_forward  # type: ignore[method-assign]
    own = CopiesItself()
    for model in (wrapped, own):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        probe = tdbg.watch(model, opt, serve=False)
        assert len(model._forward_pre_hooks) == 1
        _train(model, opt, probe, 2)
        assert probe.steps == 2 and probe.errors == 0, probe.last_error
        assert probe._hooks.last_inputs is not None
        twin = copy.deepcopy(model) if model is own else None
        probe.close()
        assert not model._forward_pre_hooks
        if model is wrapped:
            assert model.__dict__["forward"] is users_forward
        else:
            assert twin is not None and "forward" not in model.__dict__


def test_accelerate_s_regional_compilation_rebinds_the_wrapper_to_its_copy() -> None:
    """accelerate's ``compile_regions`` copies the model's ``__dict__`` and rebinds the bound
    methods in it: the copy's forward runs the copy (its compiled blocks), watched."""
    compile_regions = pytest.importorskip("accelerate.utils").compile_regions

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.layer(x))

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = tdbg.watch(model, opt, serve=False)
    regional = compile_regions(model, backend="eager")
    assert regional is not model and regional.forward.__self__ is regional
    x = torch.randn(3, 4)
    for _ in range(2):
        loss = regional(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step(loss)
    captured = probe._hooks.last_inputs
    assert captured is not None and captured[0] is regional
    assert probe.steps == 2 and probe.errors == 0, probe.last_error
    probe.close()


def test_a_torch_nn_model_compiled_while_watched_still_compiles_once_unwatched() -> None:
    """``torch.compile`` picks how to enter a module by its forward (a torch.nn class's gets
    an extra frame to compile): it picks with the wrapper set aside, as for the model
    unwatched, so after ``probe.close()`` the compiled model still compiles
    (``fullgraph=True`` raises where it would compile nothing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = tdbg.watch(model, opt, serve=False)
    assert "forward" in model.__dict__
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(3, 4)
    for _ in range(2):
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step(loss)
    assert probe.steps == 2 and probe.errors == 0, probe.last_error
    probe.close()
    assert "forward" not in model.__dict__
    assert torch.allclose(compiled(x), model(x))


def test_a_wrapper_put_over_the_probe_s_keeps_no_batch_once_the_probe_is_closed() -> None:
    # Another wrapper put on the model's forward after watch() (accelerate's prepare() with
    # mixed precision does) leaves the probe's under it at close: inert, and holding nothing
    # of the loop's (the inputs a NaN's forward is re-run on are dropped).
    import gc
    import weakref

    model, opt, probe = _watched()
    inner = model.forward

    def outer(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    model.forward = outer  # type: ignore[method-assign]
    batch = torch.randn(5, 4)
    for _ in range(20):
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step(loss)
    assert probe._hooks.last_inputs is not None  # a CPU run keeps the latest batch
    kept = weakref.ref(batch)
    probe.close()
    del batch, loss
    gc.collect()
    assert kept() is None  # the closed probe (still referenced) keeps none of it
    model(torch.randn(5, 4))  # the wrapper left under the other still runs the model
    assert probe._hooks.last_inputs is None


def test_a_lean_record_whose_probe_is_gone_holds_nothing() -> None:
    # A probe dropped without close(): the record its hooks hold is off, and lets go of the
    # loop's last batch (a wrapper another put over the probe's outlives the probe).
    from tdbg.probe.training.lean import LeanStep

    class Owner:
        def settle(self) -> None:
            raise AssertionError("not settled once gone")

    owner = Owner()
    lean = LeanStep(owner.settle)
    lean.on, lean.inputs = True, (None, (torch.ones(1),), {})
    del owner
    assert not lean.on and lean.inputs is None
    lean.settle()  # a no-op now
