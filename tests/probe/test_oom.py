"""The CUDA out-of-memory post-mortem, tested with a fake at the allocator's boundary (no GPU
here): the snapshot the allocator would give, built from real tensors' addresses; the alert
reaches the recording before the error ends the run; nothing is attached without CUDA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop
from torch import nn

import tdbg
from tdbg.cli.main import run
from tdbg.probe.training import oom
from tdbg.probe.training.gradients import find_layers
from tdbg.recording.reader import Recording

MiB = 1 << 20


def _segments(tensors: list[torch.Tensor], extra: int) -> list[dict[str, Any]]:
    """An allocator snapshot: one segment per tensor (its block at the tensor's address) and
    one large block no watched tensor is in (the activations)."""
    out = [
        {
            "device": 0,
            "address": t.data_ptr(),
            "blocks": [
                {
                    "address": t.data_ptr(),
                    "size": t.numel() * t.element_size(),
                    "state": "active_allocated",
                }
            ],
        }
        for t in tensors
    ]
    out.append(
        {"device": 0, "address": 1, "blocks": [{"size": extra, "state": "active_allocated"}]}
    )
    out.append(
        {"device": 1, "address": 2, "blocks": [{"size": 1 << 40, "state": "active_allocated"}]}
    )
    return out


def test_the_alert_names_who_held_the_memory() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    layers = [(layer.name, layer.params) for layer in find_layers(model)]
    owners = list(oom.tensor_owners(layers, [("opt", opt)], counted=lambda t: True))
    kinds = {kind for _, _, _, kind in owners}
    assert kinds == {"parameters", "gradients", "optimizer state"}
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for s in opt.state.values() for v in s.values() if v.numel() > 1]
    allocated = sum(t.numel() * t.element_size() for t in tensors) + 64 * MiB
    report = oom.post_mortem(
        0, 2 * MiB, allocated, 3 * MiB, _segments(tensors, 64 * MiB), owners, 17, "in the backward"
    )
    assert report.kind == "oom" and report.severity == "error" and report.step == 17
    message = report.message
    assert message.startswith(
        "CUDA out of memory at step 17 (in the backward): asked for 2 MiB on cuda:0 with"
    )
    assert "parameters 530 KiB" in message and "gradients 530 KiB" in message
    assert (
        "optimizer state 1.04 MiB" in message and "activations and other tensors 64 MiB" in message
    )
    largest = message.split("largest blocks: ")[1].split("; ")
    assert largest[0] == "64 MiB activations and other tensors"
    assert largest[1].startswith("512 KiB ") and "0" in largest[1]  # the first layer's weight
    assert report.layers == ("0",)


def test_a_run_that_runs_out_of_memory_records_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    loop = Loop()
    path = tmp_path / "oom.tdbg"
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path)
    # What the allocator would call at step 3, in the middle of the forward (the fake: no GPU).
    witness = oom.OomWitness(
        probe._oom_view, probe._server.side_alerts.append, snapshot=lambda: _segments([], 8 * MiB)
    )

    def run_out(module: nn.Module, args: Any) -> None:
        if probe.steps == 3:
            witness(0, 1 << 30, 8 * MiB, 0)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    loop.model[2].register_forward_pre_hook(run_out)
    with pytest.raises(torch.OutOfMemoryError):
        loop.run(5, probe)
    probe.close()  # what the interpreter's exit does after the error
    alerts = [m for m in Recording(path).messages() if m.get("type") == "alert"]
    assert [a["kind"] for a in alerts] == ["oom"] and alerts[0]["step"] == 3
    assert "(in the forward): asked for 1 GiB" in alerts[0]["message"]
    assert witness.told == 1

    assert run(["report", "--json", str(path)]) == 0
    verdicts = json.loads(capsys.readouterr().out)["verdicts"]
    assert (
        verdicts[0]["headline"].startswith("CUDA out of memory") and verdicts[0]["level"] == "bad"
    )


def test_without_cuda_nothing_is_attached_and_a_gone_probe_is_not_called(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attached: list[Any] = []
    monkeypatch.setattr(
        torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not oom.attach(lambda *a: None) and not attached
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert oom.attach(print) and attached == [print]

    class Gone:
        def view(self) -> tuple[int, str, list[tuple[int, int, str, str]]]:
            raise AssertionError("a probe garbage-collected is never asked")

    told: list[Any] = []
    gone = Gone()
    witness = oom.OomWitness(gone.view, told.append, snapshot=lambda: [])
    del gone
    witness(0, 1, 2, 3)  # the allocator's call: no error, nothing said
    assert not told
