"""The optimizer step hooks do the sampler's usual work themselves, as its own methods would."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import handed_over
from torch import nn

import tdbg
from tdbg.probe.training import hooks as hooks_module
from tdbg.probe.training.hooks import perf
from tdbg.probe.training.release import HELD


def _through_the_sampler_start(self: Any, optimizer: Any, args: Any, kwargs: Any) -> None:
    """The step pre-hook as it was: its marks, then the sampler's on_optimizer_pre."""
    hooks = self._owner()
    if hooks.timeline.optimizer_start is None:
        hooks.timeline.optimizer_start = perf()
    hooks.updating = True
    hooks._events.on_optimizer_pre(self._args[0], grads_ready=True)


def _through_the_sampler_end(self: Any, optimizer: Any, args: Any, kwargs: Any) -> None:
    """The step post-hook as it was: its marks, then the sampler's on_optimizer_post."""
    hooks = self._owner()
    hooks.timeline.optimizer_end = perf()
    hooks.updating = False
    hooks._events.on_optimizer_post(self._args[0])
    HELD.clear()


def _number(value: Any) -> str:
    """A loss as the sampler keeps it (a float, a tensor, None), comparable with NaN."""
    if value is None:
        return "None"
    return repr(float(value))


def _state(probe: tdbg.Probe) -> dict[str, Any]:
    """What the hooks leave for ``probe.step()``, right after an update."""
    sampler = probe._sampler
    slot = sampler._slots[0]
    return {
        "loss": _number(slot.loss),
        "lr": slot.lr,
        "micro": slot.micro,
        "in_step": slot.in_step,
        "closure_loss": slot.closure_loss,
        "pending": _number(sampler._pending_loss),
        "sampler_micro": sampler._micro,
        "updated": sampler._updated,
        "nonfinite": sampler._pending_nonfinite,
        "sampled": slot.sample is not None,
        "forced": sampler._forced,
        "last_backward": _number(sampler._last_backward),
        "updating": probe._hooks.updating,
        "marked": probe._hooks.timeline.optimizer_end is not None,
    }


def _run(
    monkeypatch: pytest.MonkeyPatch,
    through_sampler: bool,
    *,
    micro: int,
    grad_every: int,
    tensor_lr: bool,
    lr: float = 0.05,
) -> tuple[list[dict[str, Any]], list[tuple[str, Any, float | None]]]:
    """A real loop (accumulating ``micro`` micro-batches, a scheduler stepped after the update,
    a NaN loss at step 4) watched with the hooks as they are or the old way; each step's state
    after the update and what was handed to the probe thread. No lean steps (lean.py: their
    hooks write the state only when a step turns out not to be one)."""
    from tdbg.probe.training import lean

    monkeypatch.setattr(lean, "ENABLED", False)
    if through_sampler:
        monkeypatch.setattr(hooks_module._StepStart, "__call__", _through_the_sampler_start)
        monkeypatch.setattr(hooks_module._StepEnd, "__call__", _through_the_sampler_end)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    # A tensor LR made per run: the scheduler changes it in place.
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(lr) if tensor_lr else lr)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    probe = tdbg.watch(model, opt, name="hooks", grad_every=grad_every)
    sent = handed_over(probe, monkeypatch)
    states: list[dict[str, Any]] = []
    try:
        for step in range(8):
            opt.zero_grad()
            for _ in range(micro):
                loss = ((model(x) - y) ** 2).mean() / micro
                if step == 4:
                    loss = loss * float("nan")
                loss.backward()
            opt.step()
            states.append(_state(probe))
            schedule.step()
            probe.step(loss)
            if step == 4:  # the NaN's weights are not carried on: the loop restarts clean
                with torch.no_grad():
                    for p in model.parameters():
                        p.nan_to_num_(0.0)
    finally:
        probe.close()
    assert probe.errors == 0, probe.last_error
    handed = [(_number(s.loss), s.lr, s.micro_batches) for s in sent]
    return states, handed


@pytest.mark.parametrize(
    ("micro", "grad_every", "tensor_lr"),
    [
        (1, 10**9, False),  # the usual step: no pass after the first
        (1, 1, False),  # every step sampled
        (3, 10**9, False),  # accumulation
        (3, 3, False),
        (1, 10**9, True),  # a tensor learning rate: the whole way
    ],
)
def test_the_hooks_leave_the_state_the_sampler_s_own_methods_leave(
    runtime_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    micro: int,
    grad_every: int,
    tensor_lr: bool,
) -> None:
    """The step hooks' usual work is the sampler's on_optimizer_pre / on_optimizer_post
    written out: the same state after each update, the same steps handed over (losses,
    the update's LR, micro-batches), a NaN loss's pass forced at its own update."""
    with monkeypatch.context() as old:
        before, handed_before = _run(
            old, True, micro=micro, grad_every=grad_every, tensor_lr=tensor_lr
        )
    after, handed_after = _run(
        monkeypatch, False, micro=micro, grad_every=grad_every, tensor_lr=tensor_lr
    )
    assert after == before
    assert handed_after == handed_before
    assert after[4]["sampled"]  # the NaN's pass ran at its own update, due or not
    assert math.isnan(float(after[4]["loss"]))
    # The LR each update used, before the scheduler halved it after steps 1, 3, 5, 7.
    assert [lrs for _, lrs, _ in handed_after] == [
        [pytest.approx(0.05 * 0.5 ** (step // 2))] for step in range(8)
    ]


@pytest.mark.parametrize("lean_steps", [False, True])
def test_one_python_frame_each_side_of_a_usual_update(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, lean_steps: bool
) -> None:
    """A usual update enters the probe's pre-hook and post-hook and nothing of the sampler's
    (on_optimizer_pre / on_optimizer_post are for closures, AMP, strays, update ratios). On a
    lean step the optimizer's own pre-hook is out of the way: the process-wide optimizer tap,
    which torch calls first, does its work."""
    import sys

    from tdbg.probe.training import lean

    monkeypatch.setattr(lean, "ENABLED", lean_steps)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    probe = tdbg.watch(model, opt, name="frames", grad_every=10**9)
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(str(Path(tdbg.__file__).parent)):
            entered.append(frame.f_code.co_qualname)

    try:
        for step in range(4):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            if step == 3:
                sys.setprofile(profile)
                assert len(opt._optimizer_step_pre_hooks) == (0 if lean_steps else 1)
            try:
                opt.step()
            finally:
                sys.setprofile(None)
            probe.step()
    finally:
        probe.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    # The process-wide optimizer tap (taps), then the probe's own hooks.
    if lean_steps:
        assert entered == ["_on_optimizer_step", "_StepEnd.__call__"]
    else:
        assert entered == ["_on_optimizer_step", "_StepStart.__call__", "_StepEnd.__call__"]
