"""Layers are named as in the model the user wrote, whatever wraps it: ``torch.compile``,
DataParallel / DDP, checkpoint wrappers; a module's own child called ``module`` stays."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import reader_on
from torch import nn

import tdbg
from tdbg.probe.module_paths import user_paths
from tdbg.probe.training.gradients import find_layers


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


class _Holder(nn.Module):
    """A user's module whose child happens to be called ``module`` (not a wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.head = nn.Linear(2, 1)


def test_wrapper_segments_are_left_out_of_layer_names() -> None:
    plain = [layer.name for layer in find_layers(_model(), "model")]
    assert plain == ["0", "2"]
    wrapped = [
        torch.compile(_model(), backend="eager"),
        nn.DataParallel(_model()),
        torch.compile(nn.DataParallel(_model()), backend="eager"),
    ]
    for model in wrapped:
        assert isinstance(model, nn.Module), type(model)  # torch.compile's module is one
        assert [layer.name for layer in find_layers(model, "model")] == plain, type(model)
    # A compiled bare layer: its parameters are the root layer, named after the model.
    compiled = torch.compile(nn.Linear(2, 2))
    assert isinstance(compiled, nn.Module)
    assert [layer.name for layer in find_layers(compiled, "net")] == ["net"]
    # Not a wrapper: a user's child named "module" keeps its name.
    assert [layer.name for layer in find_layers(_Holder(), "m")] == ["module", "head"]
    # A user's class named like a wrapper, with more than the wrapped child: names as they are.
    named_like = type("DataParallel", (_Holder,), {})()
    assert [layer.name for layer in find_layers(named_like, "m")] == ["module", "head"]
    assert [name for name, _ in user_paths(nn.DataParallel(_Holder()))] == [
        "",
        "",
        "module",
        "head",
    ]


def test_a_checkpoint_wrapped_block_is_named_as_the_block() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model()
    model[0] = checkpoint_wrapper(model[0])
    assert [layer.name for layer in find_layers(model, "model")] == ["0", "2"]


def test_a_watched_compiled_model_shows_the_layers_and_norms_of_the_plain_one(
    runtime_dir: Path,
) -> None:
    """``model = torch.compile(model); tdbg.watch(model, opt)``: the stream's layers are the
    model's own names and its norms those of the same run watched uncompiled."""

    def run(compiled: bool) -> tuple[list[str], list[list[float]]]:
        torch._dynamo.reset()
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net = torch.compile(model, backend="eager") if compiled else model
        assert isinstance(net, nn.Module)
        probe = tdbg.watch(net, opt, grad_every=1)
        reader = reader_on(probe)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        for _ in range(3):
            loss = ((net(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            probe.step(loss)
        reader.wait(lambda r: len(r.records()) >= 3)
        layers = list(reader.of("layers")[-1]["names"])
        norms = [list(record.grad_norms) for record in reader.records()]
        reader.close()
        probe.close()
        return layers, norms

    plain_layers, plain_norms = run(compiled=False)
    layers, norms = run(compiled=True)
    assert layers == plain_layers == ["0", "2"]
    assert len(norms) == len(plain_norms) == 3
    for got, want in zip(norms, plain_norms, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
