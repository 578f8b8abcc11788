"""A model watched by tdbg saves, loads, copies and compiles as one that is not: a checkpoint
loads where tdbg is not installed, and ``torch.compile(fullgraph=True)`` trains true."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop, Reader, handed_over

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


def test_a_checkpoint_saved_while_watched_loads_without_tdbg(
    runtime_dir: Path, tmp_path: Path
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    loop.run(2, probe)
    path = tmp_path / "checkpoint.pt"
    out = loop.model(loop.x)
    torch.save({"model": loop.model, "opt": loop.opt, "x": loop.x, "out": out}, path)
    # -I: no PYTHONPATH, no user site; the guard in the script stops an installed tdbg too.
    done = subprocess.run(
        [sys.executable, "-I", "-c", LOAD_WITHOUT_TDBG, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "loaded ['tdbg']", done.stdout  # only the guard's None
    probe.close()


def test_a_deep_copy_carries_no_hook_into_the_probe(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    loop.run(1, probe)
    twin, opt_twin = copy.deepcopy(loop.model), copy.deepcopy(loop.opt)
    hooks = [
        *twin._forward_pre_hooks.values(),
        *twin._forward_hooks.values(),
        *opt_twin._optimizer_step_pre_hooks.values(),
        *opt_twin._optimizer_step_post_hooks.values(),
    ]
    assert hooks and all(type(h).__module__ == "functools" for h in hooks), hooks
    before = probe.steps
    twin(loop.x).sum().backward()
    opt_twin.step()
    assert probe.steps == before
    probe.close()


def test_a_watched_model_compiles_with_fullgraph_and_trains_true(runtime_dir: Path) -> None:
    """fullgraph=True refuses any graph break; the probe's forward hooks are a no-op the graph
    absorbs. The run's losses and gradient norms are those of the same run unwatched."""
    from norm_oracle import reference_norms

    from tdbg.probe.gradients import find_layers

    def train(watch: bool) -> tuple[list[float], list[float], Reader | None]:
        loop = Loop()
        probe = tdbg.watch(loop.model, loop.opt, grad_every=1) if watch else None
        reader = Reader(probe.socket_path) if probe is not None else None  # type: ignore[arg-type]
        compiled = torch.compile(loop.model, backend="eager", fullgraph=True)
        torch._dynamo.utils.counters.clear()
        losses, totals = [], []
        for _ in range(4):
            loop.opt.zero_grad()  # type: ignore[union-attr]
            loss = ((compiled(loop.x) - loop.y) ** 2).mean()
            loss.backward()
            totals.append(reference_norms(find_layers(loop.model))[0])
            loop.opt.step()  # type: ignore[union-attr]
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
        reader = Reader(probe.socket_path) if probe is not None else None  # type: ignore[arg-type]
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
            loop.opt.zero_grad()  # type: ignore[union-attr]
            loss = ((compiled(loop.x[:rows]) - loop.y[:rows]) ** 2).mean()
            loss.backward()
            loop.opt.step()  # type: ignore[union-attr]
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
    assert all(not leaf._forward_hooks for leaf in model)  # the dive's hooks: released
    reader.close()


def test_a_compiled_optimizer_step_still_runs_the_probe_hooks(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.compile(optimizer.step)`` (the compiled-optimizer recipe): the step hooks run
    eagerly around the compiled update, so each step has its LR, its gradient pass before the
    update and its optimizer phase; no probe error. (The hooks skip dynamo's wrapper in eager
    mode and go through it only while dynamo traces them.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe = tdbg.watch(model, opt, name="compiled-step", grad_every=1)
    sent = handed_over(probe, monkeypatch)
    try:
        step = torch.compile(opt.step, backend="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                opt.zero_grad()
                loss = ((model(torch.randn(16, 4)) - torch.randn(16, 1)) ** 2).mean()
                loss.backward()
                step()
                probe.step(loss)
        # dynamo never traced the probe's hooks or taps (it warned about their clock reads)
        assert not [w for w in caught if "Dynamo" in str(w.message)], caught
        assert len(sent) == 4
        for pending in sent:
            assert pending.lr == [0.01]
            assert pending.grads is not None
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
    assert len(before) == 2
    scripted = torch.jit.script(loop.model)
    assert list(loop.model._forward_pre_hooks.items()) == before
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
    tdbg's, on any module), a forward meanwhile is timed by the probe."""
    import functools
    import sys

    from torch.jit import _recursive

    from tdbg.probe.hook_refs import INERT_EVENT

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
            probe._hooks.timeline.forward_start = None
            loop.model(loop.x)
            assert probe._hooks.timeline.forward_start is not None  # the probe's hook ran
            # A checkpoint taken meanwhile (another thread's) is the model's, loadable as ever.
            twin = copy.deepcopy(loop.model)
            assert type(twin._forward_hooks) is type(twin._forward_pre_hooks) is OrderedDict
            buffer = io.BytesIO()
            torch.save(loop.model, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            assert type(saved._forward_hooks) is OrderedDict
        return _recursive.infer_methods_to_compile(module)

    scripted = _recursive.create_script_module(loop.model, stubs)
    assert torch.allclose(scripted.forward(loop.x), loop.model(loop.x))
    hooks = list(loop.model._forward_hooks)
    assert leaving.id not in hooks and hooks == [arrived[0].id]
    assert list(loop.model[2]._forward_hooks) == [arrived[1].id]
    assert len(loop.model._forward_pre_hooks) == 1  # the probe's, back in place
    for handle in arrived:  # registered meanwhile, removable as ever
        handle.remove()
    assert not loop.model._forward_hooks and not loop.model[2]._forward_hooks
    probe._hooks.timeline.forward_start = None
    loop.run(2, probe)
    assert probe.errors == 0 and probe.steps == 3
    probe.close()
