"""While steps are lean the optimizer's own step pre-hook is out of its dict and the
process-wide optimizer tap does its work: the script's hooks run as before, in their order,
and read and set what they did; the optimizer is left as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import handed_over
from torch import nn

import tdbg


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt, torch.randn(16, 4), torch.randn(16, 1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any, probe: Any) -> None:
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    probe.step(loss)


def test_the_script_s_later_pre_hooks_run_after_the_probe_s_work_in_order(
    runtime_dir: Path, monkeypatch: Any
) -> None:
    # Two pre-hooks registered after the probe's: they run on every update, in their order,
    # after the probe read the learning rate, as with its hook in place (the second halves
    # it: the probe read 0.05 before it on the first update, 0.025 since); the probe's comes
    # back first of them on the steps that are not lean (a gradient pass every 5).
    model, opt, x, y = _setup()
    probe = tdbg.watch(model, opt, name="after", grad_every=5)
    sent = handed_over(probe, monkeypatch)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("first"))

    def halve(optimizer: Any, args: Any, kwargs: Any) -> None:
        calls.append("second")
        optimizer.param_groups[0]["lr"] = 0.025

    opt.register_step_pre_hook(halve)
    everything = list(opt._optimizer_step_pre_hooks)
    out = 0
    try:
        for step in range(12):
            calls.clear()
            keys = list(opt._optimizer_step_pre_hooks)
            if keys == everything[1:]:
                out += 1
            else:
                assert keys == everything, step  # in place: first, where it was
            _train(model, opt, x, y, probe)
            assert calls == ["first", "second"], step
    finally:
        probe.close()
    assert out >= 6  # the lean steps (not those with a gradient pass or after one)
    assert [p.lr for p in sent] == [[0.05]] + [[0.025]] * 11
    assert list(opt._optimizer_step_pre_hooks) == everything[1:]  # closed: the script's only
    assert probe.errors == 0, probe.last_error


def test_a_pre_hook_before_the_probe_s_keeps_it_in_place(
    runtime_dir: Path, monkeypatch: Any
) -> None:
    # A script's pre-hook registered before the probe's sets the learning rate each update
    # uses (a warm-up): the probe's hook stays in place, after it, and reads what it set.
    model, opt, x, y = _setup()
    rates = iter([0.01 * (i + 1) for i in range(10)])

    def warm_up(optimizer: Any, args: Any, kwargs: Any) -> None:
        optimizer.param_groups[0]["lr"] = next(rates)

    opt.register_step_pre_hook(warm_up)
    probe = tdbg.watch(model, opt, name="before", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    try:
        for _ in range(10):
            _train(model, opt, x, y, probe)
            assert len(opt._optimizer_step_pre_hooks) == 2
    finally:
        probe.close()
    assert [p.lr[0] for p in sent] == [0.01 * (i + 1) for i in range(10)]
    assert len(opt._optimizer_step_pre_hooks) == 1


def test_a_second_probe_in_the_process_puts_the_hook_back(
    runtime_dir: Path, monkeypatch: Any
) -> None:
    # Lean steps need one probe listening: with a second, the first's steps go the whole way
    # and its pre-hook is back in place; every step of both is recorded with its rate.
    model, opt, x, y = _setup()
    other_model, other_opt, _, _ = _setup()
    probe = tdbg.watch(model, opt, name="one", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    try:
        for _ in range(4):
            _train(model, opt, x, y, probe)
        assert not opt._optimizer_step_pre_hooks  # lean: out
        second = tdbg.watch(other_model, other_opt, name="two", grad_every=10**9)
        try:
            for _ in range(4):
                _train(model, opt, x, y, probe)
                _train(other_model, other_opt, x, y, second)
            assert len(opt._optimizer_step_pre_hooks) == 1  # back
            assert second.steps == 4 and second.errors == 0
        finally:
            second.close()
    finally:
        probe.close()
    assert len(sent) == 8 and all(p.lr == [0.05] for p in sent)
    assert all(p.timeline.optimizer_start is not None for p in sent)
    assert probe.errors == 0, probe.last_error


def test_a_process_wide_pre_hook_registered_later_sets_what_the_probe_reads(
    runtime_dir: Path, monkeypatch: Any
) -> None:
    # torch runs the process-wide pre-hooks before an optimizer's own: one registered after the
    # probe's tap (here mid-run, on a lean step) runs between the tap and the probe's hook, and
    # sets the rate each update uses. The probe reads what it set, from that step on.
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    model, opt, x, y = _setup()
    probe = tdbg.watch(model, opt, name="global", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)
    rates = iter([0.01 * (i + 1) for i in range(8)])

    def warm_up(optimizer: Any, args: Any, kwargs: Any) -> None:
        optimizer.param_groups[0]["lr"] = next(rates)

    handle = None
    try:
        for step in range(12):
            if step == 4:
                assert not opt._optimizer_step_pre_hooks  # lean: out
                handle = register_optimizer_step_pre_hook(warm_up)
            _train(model, opt, x, y, probe)
        assert len(opt._optimizer_step_pre_hooks) == 1  # back, and kept there
    finally:
        if handle is not None:
            handle.remove()
        probe.close()
    assert [p.lr[0] for p in sent] == [0.05] * 4 + [0.01 * (i + 1) for i in range(8)]
    assert probe.errors == 0, probe.last_error
