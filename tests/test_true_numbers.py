"""Issue 10: the numbers are true on the loops people write (copies, closures, clipping, LR
schedules, accumulation, several models) — each test fails on the probe before its fix."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path

import torch
from conftest import Loop, Reader

import tdbg


def test_a_watched_model_saves_copies_and_pickles_as_without_tdbg(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = Reader(probe.socket_path)  # type: ignore[arg-type]
    loop.run(2, probe)
    buffer = io.BytesIO()
    torch.save(loop.model, buffer)  # the whole module, hooks included: word_language_model
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(loop.model)  # an EMA / best-model copy
    opt_twin = copy.deepcopy(loop.opt)
    pickle.loads(pickle.dumps(loop.opt.state_dict()))  # noqa: S301 (our own bytes)
    pickle.loads(pickle.dumps(loop.model.state_dict()))  # noqa: S301
    for clone in (loaded, twin):
        assert torch.equal(clone(loop.x), loop.model(loop.x))
    # The copies report nothing into the original probe: their forwards and steps are inert.
    before = probe.steps
    twin(loop.x).sum().backward()
    opt_twin.step()
    assert probe.steps == before
    loop.run(2, probe)  # the original still reports
    reader.wait(lambda r: len(r.records()) >= 4)
    assert [r.step for r in reader.records()] == [0, 1, 2, 3]
    reader.close()


def test_a_watched_model_compiles(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    compiled = torch.compile(loop.model, backend="eager")
    for _ in range(3):
        loop.opt.zero_grad()
        loss = ((compiled(loop.x) - loop.y) ** 2).mean()
        loss.backward()
        loop.opt.step()
        probe.step(loss)
    assert probe.steps == 3 and probe.errors == 0


def test_a_copied_probe_hook_is_inert_and_holds_nothing() -> None:
    from tdbg.probe.hook_refs import InertHook, WeakHook

    class Target:
        calls = 0

        def hit(self, *args: object) -> None:
            self.calls += 1

    target = Target()
    hook = WeakHook(target.hit)
    hook(1)
    assert target.calls == 1
    assert isinstance(copy.deepcopy(hook), InertHook)
    assert isinstance(pickle.loads(pickle.dumps(hook)), InertHook)  # noqa: S301
    del target
    assert hook(1) is None  # the probe's object is gone: nothing kept it alive
