"""The CUDA out-of-memory post-mortem, tested with a fake at the allocator's boundary (no GPU
here): the snapshot the allocator would give, built from real tensors' addresses; the alert
reaches the recording before the error ends the run; nothing is attached without CUDA."""

from __future__ import annotations

import json
import traceback
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


def test_what_torch_held_is_counted_from_the_snapshot_not_the_device_total() -> None:
    # The allocator tells its observers the device's whole memory (or the process's allowed
    # share), not what torch held: on an 80 GiB card with 64 MiB of activations allocated,
    # the alert must say 64 MiB, not 80 GiB (an H200 read "140 GiB allocated and 139 free").
    total = 80 << 30
    report = oom.post_mortem(
        0, 100 << 30, total, 79 << 30, _segments([], 64 * MiB), [], 5, "in the forward"
    )
    assert "with 64 MiB allocated by torch and 79 GiB of 80 GiB free;" in report.message
    assert "held by activations and other tensors 64 MiB;" in report.message


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


# --- allocation stacks, opt-in (watch(oom_stacks=True), TDBG_OOM_STACKS=1) ------------------


def allocator_frames() -> list[dict[str, Any]]:
    """The Python stack here, innermost first, as the allocator's snapshot gives a block's
    ``frames`` with stacks="python", with torch's own frame on top (the fake's boundary)."""
    here = [
        {"filename": f.filename, "line": f.lineno, "name": f.name}
        for f in reversed(traceback.extract_stack()[:-1])
    ]
    torch_frame = {"filename": f"{torch.__file__}/../nn/modules/linear.py", "line": 125}
    return [{**torch_frame, "name": "forward"}, *here]


def allocate_activations() -> list[dict[str, Any]]:
    return allocator_frames()  # the line the alert names as the allocating frame


def test_user_frames_skip_the_library_and_name_the_innermost_user_code() -> None:
    frames = [
        {
            "filename": "/usr/lib/python3/site-packages/torch/nn/functional.py",
            "line": 9,
            "name": "f",
        },
        {"filename": "/home/me/model.py", "line": 42, "name": "forward"},
        {"filename": "/home/me/.venv/lib/site-packages/torch/nn/modules/module.py", "line": 1},
        {"filename": "/home/me/train.py", "line": 88, "name": "<module>"},
        {"filename": "/home/me/other.py", "line": 1, "name": "outer"},
    ]
    assert oom.user_frames(frames) == "model.py:42 forward ← train.py:88 <module>"
    library_only = frames[:1]
    assert oom.user_frames(library_only) == "functional.py:9 f"
    assert oom.user_frames(None) == "" and oom.user_frames([]) == "" and oom.user_frames("x") == ""


def test_record_stacks_asks_the_allocator_for_live_allocations_python_stacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(
        torch.cuda.memory,
        "_record_memory_history",
        lambda enabled="all", **kw: calls.append((enabled, kw)),
    )
    assert oom.record_stacks()
    oom.stop_stacks()
    assert calls == [
        ("state", {"context": "alloc", "stacks": "python", "max_entries": 100_000}),
        (None, {}),
    ]

    def refuse(*_: Any, **__: Any) -> None:
        raise RuntimeError("no CUDA allocator")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse)
    assert not oom.record_stacks()  # said, never raised into watch()
    oom.stop_stacks()


def test_oom_stacks_without_cuda_is_said_once_and_touches_no_allocator(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(a)
    )
    monkeypatch.setenv("TDBG_OOM_STACKS", "1")
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False)
    probe.close()
    probe = tdbg.watch(loop.model, loop.opt, serve=False, oom_stacks=False)
    probe.close()
    assert calls == []
    said = [r.getMessage() for r in caplog.records if "oom_stacks" in r.getMessage()]
    assert said == ["tdbg: oom_stacks needs CUDA: this run has none, no allocation stacks recorded"]


def oom_recording(path: Path) -> Path:
    """A real loop that runs out of memory at step 3, in the forward, with allocation stacks
    recorded: the fake allocator's snapshot has a 512 MiB block (the activations) whose frames
    are this process's real stack at the allocation."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path)
    segments: list[dict[str, Any]] = []

    def snapshot() -> list[dict[str, Any]]:
        return segments

    witness = oom.OomWitness(probe._oom_view, probe._server.side_alerts.append, snapshot=snapshot)

    def run_out(module: nn.Module, args: Any) -> None:
        if probe.steps == 3:
            frames = allocate_activations()
            block = {"size": 512 * MiB, "state": "active_allocated", "frames": frames}
            segments.append({"device": 0, "address": 1, "blocks": [block]})
            witness(0, 1 << 30, 512 * MiB, 0)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    loop.model[2].register_forward_pre_hook(run_out)
    with pytest.raises(torch.OutOfMemoryError):
        loop.run(5, probe)
    probe.close()
    return path


def test_with_stacks_the_largest_blocks_name_the_code_that_allocated_them(
    tmp_path: Path,
) -> None:
    path = oom_recording(tmp_path / "oom.tdbg")
    [found] = [m for m in Recording(path).messages() if m.get("type") == "alert"]
    line = allocate_activations.__code__.co_firstlineno + 1
    assert (
        f"512 MiB activations and other tensors (allocated at test_oom.py:{line}"
        " allocate_activations ← test_oom.py:" in found["message"]
    )
    assert "run_out" in found["message"]


def test_tdbg_run_oom_stacks_sets_the_variable_every_watching_process_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from tdbg.cli.run import child_env
    from tdbg.probe.watch_args import ProbeOptions

    monkeypatch.delenv("TDBG_OOM_STACKS", raising=False)
    base = {"name": None, "grad_every": None, "record": None}
    assert "TDBG_OOM_STACKS" not in child_env(argparse.Namespace(**base, oom_stacks=False))
    env = child_env(argparse.Namespace(**base, oom_stacks=True))
    assert env["TDBG_OOM_STACKS"] == "1"
    assert not ProbeOptions().wants_oom_stacks
    monkeypatch.setenv("TDBG_OOM_STACKS", env["TDBG_OOM_STACKS"])
    assert ProbeOptions().wants_oom_stacks and not ProbeOptions(oom_stacks=False).wants_oom_stacks
