"""The CUDA paths, proven on a real GPU: no host-device sync added by the probe (a plain loop,
the demos' models and the Lightning and Hugging Face callbacks), device-side norms right, NVML
and allocator figures against nvidia-smi and torch, a memory snapshot and a profile with CUDA
times, and the probe's cost. On a machine without CUDA it says so and lists what it would
check, exit 0 (tests/probe/test_gpu_check.py runs that path in CI).

    make gpu-check        (or: .venv/bin/python benchmarks/gpu_check.py [PART ...])
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))  # the demos' models: models.make_mlp, ...

import tdbg  # noqa: E402
from tdbg.connect.client import ProbeClient  # noqa: E402
from tdbg.recording.reader import Recording  # noqa: E402

STEPS = 60
TORCH = str(Path(torch.__file__).resolve().parent)
results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, *details: str) -> None:
    detail = "; ".join(details)
    results.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)


def model_and_data(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    return model, opt, x, y


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def no_sync_added(device: torch.device) -> None:
    """The training loop under sync debug mode "error": any synchronising call in it raises."""
    model, opt, x, y = model_and_data(device)
    probe = tdbg.watch(model, opt, grad_every=1, name="gpu-check")
    for _ in range(5):  # warm-up outside the strict mode: cuBLAS handles, the probe's plan
        probe.step(train_step(model, opt, x, y))
    torch.cuda.synchronize()
    error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(STEPS):
            loss = train_step(model, opt, x, y)
            probe.step(loss)
            tdbg.log(device_metric=loss)  # a device tensor: read off the training thread
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check("no host-device sync in 60 probed steps (sync debug mode 'error')", not error, error)
    check("the probe counted no internal errors", probe.errors == 0, str(probe.last_error or ""))
    probe.close()


def activation_histograms(device: torch.device) -> None:
    """The activation-statistics dive's histograms counted on the GPU: every step sampled
    under sync debug mode "error" (no sync added by the counting), each module's counts
    adding up to the elements it counted, and its exact-zero bin agreeing with the dive's
    exact zero share."""
    model, opt, x, y = model_and_data(device)
    relu = nn.Sequential(nn.Linear(512, 512), nn.ReLU()).to(device)
    path = Path(tempfile.mkdtemp()) / "activations.tdbg"
    net = nn.Sequential(relu, model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    probe = tdbg.watch(net, opt, name="gpu-act", serve=False, record=path, activations_every=1)
    for _ in range(3):
        probe.step(train_step(net, opt, x, y))
    torch.cuda.synchronize()
    error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            probe.step(train_step(net, opt, x, y))
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    errors = probe.errors
    probe.close()
    check("activation histograms add no host-device sync", not error and errors == 0, error)
    samples = [m for m in Recording(path).messages() if m.get("type") == "activations"]
    last = samples[-1] if samples else {}
    hists, strides = last.get("hist") or [], last.get("hist_stride") or []
    numel = 256 * 512  # the ReLU's output: one call
    relu_at = (last.get("names") or []).index("0.1") if "0.1" in (last.get("names") or []) else -1
    ok = bool(hists) and relu_at >= 0
    detail = f"{len(samples)} samples"
    if ok:
        counts, stride = hists[relu_at], strides[relu_at]
        share = counts[0] / max(1, sum(counts))
        exact = last["zero_frac"][relu_at]
        ok = sum(counts) == math.ceil(numel / stride) and abs(share - exact) < 0.05
        detail += (
            f"; ReLU: {sum(counts)} counted (stride {stride}), zeros {share:.3f} vs {exact:.3f}"
        )
    check("activation histograms counted on the GPU", ok, detail)


def norms_right(device: torch.device) -> None:
    model, opt, x, y = model_and_data(device)
    probe = tdbg.watch(model, opt, grad_every=1, name="gpu-norms")
    assert probe.socket_path
    client = ProbeClient.connect(probe.socket_path)
    truth: list[float] = []
    for _ in range(10):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        total = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
        truth.append(float(total))
        opt.step()
        probe.step(loss)
    from tdbg.protocol.steps import unpack_steps

    got: dict[int, float] = {}
    deadline = time.monotonic() + 20
    while len(got) < 10 and time.monotonic() < deadline:
        for m in client.messages(timeout=0.5):
            if m.get("type") == "steps":
                for r in unpack_steps(m):
                    if r.grad_total is not None:
                        got[r.step] = r.grad_total
    worst = max(
        (abs(got[i] - t) / t for i, t in enumerate(truth) if i in got and t > 0), default=math.inf
    )
    check(
        "device-side gradient norms match a float64 reference",
        len(got) == 10 and worst < 1e-4,
        f"{len(got)} steps, worst relative error {worst:.2e}",
    )
    client.close()
    probe.close()


def lone_loss(device: torch.device) -> None:
    """The usual step: no clipping, the automatic interval, so most steps copy the loss alone
    (as it is, in its own dtype) and its copy's event also ends the step. Per dtype: every
    step's loss as the loop computed it, no sync, no internal error; the phase times and the
    data gap finite and >= 0 on the steps whose phases were timed (these short steps: one in a
    few, under MAX_PHASE_GAP apart), NaN on the others; and with every step timed (the
    probe's rule for steps of 20 ms or more), every step's."""
    from tdbg.probe.training import cost_model

    for dtype in (torch.float32, torch.bfloat16):
        lone_loss_of(device, dtype, every_step=False)
    timed_from = cost_model.MARK_EVERY_STEP_FROM
    cost_model.MARK_EVERY_STEP_FROM = 0.0  # steps of any length: every one timed
    try:
        lone_loss_of(device, torch.float32, every_step=True)
    finally:
        cost_model.MARK_EVERY_STEP_FROM = timed_from


def rewritten_loss(device: torch.device) -> None:
    """A loop that passes memory it writes again after the step, in the ways no version
    counter sees: a CUDA graph's static output (replayed each step: the next replay
    overwrites it), and two buffers in turn written through ``.data``, doubled in place after
    ``probe.step()`` (as an in-place all-reduce would). Each step's loss is copied into the
    loss ring at its step (loss_ring.py): every recorded loss is the step's own, no sync, the
    ring kept (not given up)."""
    model, opt, x, y = model_and_data(device)
    static_in = torch.zeros(1, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up before capture, as torch.cuda.graph asks
            static_out = (static_in * 2.0).sum()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = (static_in * 2.0).sum()
    buffers = [torch.zeros((), device=device), torch.zeros((), device=device)]
    probe = tdbg.watch(model, opt, name="gpu-rewritten")
    truth: list[torch.Tensor] = []

    def step(k: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        truth.append(loss.detach().clone())
        if k % 3 == 0:
            static_in.copy_(loss.detach().reshape(1) / 2.0)
            graph.replay()  # static_out = the loss, written without a version bump
            probe.step(static_out)
        else:
            buffer = buffers[k % 2]
            buffer.data.copy_(loss.detach())
            probe.step(buffer.detach())
            buffer.data.mul_(2.0)  # after its step, in place, no version bump

    each_step_s_own_loss(
        "a graph's static output and buffers written again after the step: each step's own loss",
        probe,
        step,
        truth,
    )


def each_step_s_own_loss(
    what: str, probe: tdbg.Probe, step: Callable[[int], None], truth: list[torch.Tensor]
) -> None:
    """``step(k)`` run 5 times, then STEPS times with syncs an error, ``truth`` getting each
    step's loss: every recorded loss is its step's own, no sync, the loss ring kept."""
    from tdbg.protocol.steps import unpack_steps

    assert probe.socket_path
    client = ProbeClient.connect(probe.socket_path)
    for k in range(5):
        step(k)
    with sync_is_an_error() as caught:
        for k in range(5, 5 + STEPS):
            step(k)
    torch.cuda.synchronize()  # (ours, after the loop)
    values = [float(v) for v in truth]
    got: dict[int, Any] = {}
    deadline = time.monotonic() + 20
    while len(got) < len(values) and time.monotonic() < deadline:
        for m in client.messages(timeout=0.5):
            if m.get("type") == "steps":
                got.update((r.step, r) for r in unpack_steps(m))
    ring = probe._sampler._loss_ring
    kept = ring is not None and ring.spoiled is None
    client.close()
    probe.close()
    wrong = [
        f"step {s}: {r.loss} vs {values[s]}"
        for s, r in sorted(got.items())
        if not (r.loss == r.loss and math.isclose(r.loss, values[s], rel_tol=1e-6))
    ]
    check(
        what,
        len(got) == len(values) and not wrong and not caught and kept,
        f"{len(got)} of {len(values)} steps, ring kept: {kept}",
        *caught,
        *wrong[:3],
    )


def loss_on_streams(device: torch.device) -> None:
    """A loop whose steps run on two streams in turn (each waiting for the other's last
    step), through a loss ring of 8 slots: batches a step each, slots written again on the
    other stream after the wrap (loss_ring.py: a slot is rewritten once its batch is back on
    the host). Every recorded loss is its step's own, no sync, the ring kept."""
    from tdbg.probe.training import loss_ring

    model, opt, x, y = model_and_data(device)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    capacity, loss_ring.CAPACITY = loss_ring.CAPACITY, 8
    try:
        probe = tdbg.watch(model, opt, name="gpu-streams")
        truth: list[torch.Tensor] = []

        def step(k: int) -> None:
            stream = streams[k % 2]
            stream.wait_stream(streams[(k + 1) % 2])  # the other stream's step first
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                truth.append(loss.detach().clone())
                probe.step(loss)

        each_step_s_own_loss(
            "steps on two streams in turn, a ring of 8 slots: each step's own loss",
            probe,
            step,
            truth,
        )
    finally:
        loss_ring.CAPACITY = capacity


def lone_loss_of(device: torch.device, dtype: torch.dtype, every_step: bool) -> None:
    from tdbg.protocol.steps import MAX_PHASE_GAP, unpack_steps

    model, opt, x, y = model_and_data(device)
    probe = tdbg.watch(model, opt, name=f"gpu-lone-{dtype}")
    assert probe.socket_path
    client = ProbeClient.connect(probe.socket_path)
    losses: list[torch.Tensor] = []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).to(dtype), y)
        loss.backward()
        opt.step()
        probe.step(loss)
        losses.append(loss.detach())

    for _ in range(5):
        step()
    with sync_is_an_error() as caught:
        for _ in range(STEPS):
            step()
    truth = [float(v) for v in losses]  # read after the loop: these syncs are ours
    got: dict[int, Any] = {}
    deadline = time.monotonic() + 20
    while len(got) < len(truth) and time.monotonic() < deadline:
        for m in client.messages(timeout=0.5):
            if m.get("type") == "steps":
                got.update((r.step, r) for r in unpack_steps(m))
    records = [got[i] for i in sorted(got)]
    wrong = [
        f"step {r.step}: {r.loss} vs {truth[r.step]}"
        for r in records
        if not math.isclose(r.loss, truth[r.step], rel_tol=1e-6)
    ]
    times = ("data_time", "forward_time", "backward_time", "optimizer_time")
    timed = [r.step for r in records[1:] if math.isfinite(r.forward_time)]
    bad = [
        f"step {r.step} {name} {getattr(r, name)}"
        for r in records[1:]
        for name in times
        if not (getattr(r, name) >= 0 if r.step in timed else math.isnan(getattr(r, name)))
    ]
    gaps = [b - a for a, b in zip([0, *timed], [*timed, len(truth)], strict=True)]
    if every_step:
        bad += [f"{len(timed)} of {len(records) - 1} steps timed"] * (len(timed) < len(records) - 1)
    else:
        bad += [f"{max(gaps)} steps between timed ones"] * (max(gaps) >= MAX_PHASE_GAP)
    what = "every step timed" if every_step else "phases of one step in a few"
    check(
        f"{dtype}, {what}: the loss alone copied as it is: every step's loss and phase times right",
        len(records) == len(truth) and not wrong and not bad and not caught,
        f"{len(records)} of {len(truth)} steps, {len(timed)} timed",
        *caught,
        *wrong[:2],
        *bad[:2],
    )
    check(f"{dtype}, {what}: no internal errors", probe.errors == 0, str(probe.last_error or ""))
    client.close()
    probe.close()


def figures_and_dives(device: torch.device) -> None:
    """NVML and allocator figures against nvidia-smi and torch; a snapshot and a profile."""
    model, opt, x, y = model_and_data(device)
    probe = tdbg.watch(model, opt, name="gpu-dives")
    assert probe.socket_path
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            probe.step(train_step(model, opt, x, y))

    trainer = threading.Thread(target=loop, daemon=True)
    trainer.start()
    client = ProbeClient.connect(probe.socket_path)
    system: dict[str, Any] | None = None
    deadline = time.monotonic() + 10
    while system is None and time.monotonic() < deadline:
        # A live run streams steps without a pause: the idle timeout never ends this loop.
        for m in client.messages(timeout=0.5):
            if m.get("type") == "system" and m.get("cuda"):
                system = m
            if system is not None or time.monotonic() >= deadline:
                break
    client.close()
    if system is None:
        check("system figures arrive", False, "no system message with CUDA figures in 10 s")
    else:
        cuda = system["cuda"][0]
        allocated = torch.cuda.memory_allocated(device)
        check(
            "allocator figures match torch.cuda.memory_allocated",
            abs(cuda["allocated"] - allocated) <= 0.25 * max(allocated, 1),
            f"probe {cuda['allocated']} vs torch {allocated} bytes",
        )
        gpus = system.get("gpus") or []
        smi = shutil.which("nvidia-smi")
        if not gpus or not smi:
            check("NVML figures present", bool(gpus), f"missing: {system.get('missing')}")
        else:
            out = subprocess.run(
                [smi, "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            ).stdout.splitlines()[device.index or 0]
            used_mib, total_mib = (float(v) for v in out.split(","))
            g = gpus[0]
            check(
                "NVML memory figures match nvidia-smi",
                abs((g["mem_total"] or 0) / 2**20 - total_mib) < 64
                and abs((g["mem_used"] or 0) / 2**20 - used_mib) < max(512, 0.1 * used_mib),
                f"probe used {(g['mem_used'] or 0) / 2**20:.0f} MiB / "
                f"{(g['mem_total'] or 0) / 2**20:.0f} vs smi {used_mib:.0f} / {total_mib:.0f}",
            )
    env_runtime = str(Path(probe.socket_path).parent)
    for command, extra in (("snapshot", ["--steps", "2"]), ("profile", ["--steps", "3"])):
        proc = subprocess.run(
            [sys.executable, "-m", "tdbg.cli", command, probe.socket_path, *extra, "--json"],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "TDBG_RUNTIME_DIR": env_runtime},
        )
        ok = proc.returncode == 0
        detail = proc.stderr.strip()[-300:]
        if ok and command == "snapshot":
            result = json.loads(proc.stdout)
            file = (result.get("result") or result).get("file") or {}
            ok = bool(file.get("path")) and Path(file["path"]).exists()
            detail = f"{file.get('path')} ({file.get('size')} bytes)"
        if ok and command == "profile":
            result = json.loads(proc.stdout)
            table = result.get("result") or result
            rows = table.get("rows") or []
            timed = [r for r in rows if (r.get("self_device") or 0) > 0]
            ok = bool(table.get("device")) and bool(timed)
            detail = f"{len(timed)} of {len(rows)} ops with CUDA time"
        check(f"tdbg {command} on the GPU", ok, detail)
    stop.set()
    trainer.join(10)
    probe.close()


def cost(device: torch.device) -> None:
    """Step time with the probe (default budget) against without, blocks alternating."""
    model, opt, x, y = model_and_data(device)
    ratios = []
    for _ in range(5):
        times = {}
        for probed in (False, True, True, False):
            probe = tdbg.watch(model, opt, name="gpu-cost") if probed else None
            for _ in range(10):
                loss = train_step(model, opt, x, y)
                if probe:
                    probe.step(loss)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                loss = train_step(model, opt, x, y)
                if probe:
                    probe.step(loss)
            torch.cuda.synchronize()
            times.setdefault(probed, []).append(time.perf_counter() - t0)
            if probe:
                probe.close()
        ratios.append(sum(times[True]) / sum(times[False]))
    median = statistics.median(ratios)
    check(
        "probe cost at the default budget (median of 5 ABBA rounds)",
        median < 1.05,
        f"step-time ratio {median:.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)})",
    )


def out_of_memory(device: torch.device) -> None:
    """A real CUDA out-of-memory error in a watched step: the probe's ``oom`` alert names the
    phase and what held the memory (the allocator's observer, proven here, faked in the tests)."""
    model, opt, x, y = model_and_data(device)
    path = Path(tempfile.mkdtemp()) / "oom.tdbg"
    probe = tdbg.watch(model, opt, name="gpu-oom", serve=False, record=path)
    for _ in range(3):
        probe.step(train_step(model, opt, x, y))
    free, _ = torch.cuda.mem_get_info(device)
    out = None
    try:
        opt.zero_grad()
        out = model(x)
        torch.empty(int(free * 4), dtype=torch.uint8, device=device)  # in the forward
        raise SystemExit("the oversized allocation succeeded: no out-of-memory error to check")
    except torch.OutOfMemoryError:
        pass
    finally:
        del out
    probe.close()
    alerts = [m for m in Recording(path).messages() if m.get("type") == "alert"]
    found = [a for a in alerts if a.get("kind") == "oom"]
    message = found[0]["message"] if found else "no oom alert"
    check(
        "an out-of-memory error is recorded with its phase and holders",
        bool(found) and "(in the forward)" in message and "parameters" in message,
        message[:300],
    )


def allocate_too_much(device: torch.device) -> None:
    free, _ = torch.cuda.mem_get_info(device)
    torch.empty(int(free * 4), dtype=torch.uint8, device=device)


def out_of_memory_stacks(device: torch.device) -> None:
    """The same with ``watch(oom_stacks=True)``: the post-mortem's largest blocks name the code
    that allocated them (this file's frames: the model and its data are made here), and the
    allocator's stack record is off again after close()."""
    gc.collect()
    torch.cuda.empty_cache()  # the earlier parts' blocks, allocated before any stack was kept
    model, opt, x, y = model_and_data(device)
    path = Path(tempfile.mkdtemp()) / "oom-stacks.tdbg"
    probe = tdbg.watch(model, opt, name="gpu-oom-stacks", serve=False, record=path, oom_stacks=True)
    # The largest block then: one this file allocates while the stacks are kept (a cache the
    # script holds), larger than anything an earlier part may have left alive.
    held = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    for _ in range(3):
        probe.step(train_step(model, opt, x, y))
    try:
        allocate_too_much(device)
        raise SystemExit("the oversized allocation succeeded: no out-of-memory error to check")
    except torch.OutOfMemoryError:
        pass
    probe.close()
    del held
    alerts = [m for m in Recording(path).messages() if m.get("type") == "alert"]
    found = [a for a in alerts if a.get("kind") == "oom"]
    message = found[0]["message"] if found else "no oom alert"
    check(
        "with oom_stacks the largest blocks name their allocating frames",
        bool(found) and "(allocated at gpu_check.py:" in message,
        message[:600],
    )
    late = torch.empty(1 << 20, device=device)  # allocated after close(): no stack kept for it
    address = late.untyped_storage().data_ptr()
    frames = [
        b.get("frames")
        for segment in torch.cuda.memory_snapshot()
        for b in segment.get("blocks", [])
        if b.get("address") == address
    ]
    check("the stack record is off after close()", frames in ([], [None], [[]]), str(frames)[:300])


# --- the demos and the real frameworks under sync debug mode --------------------------------


@contextlib.contextmanager
def sync_is_an_error() -> Iterator[list[str]]:
    """Sync debug mode "error" inside; yields a list that gets the first sync's message and
    where it was called (file:line), which the check prints."""
    caught: list[str] = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield caught
    except RuntimeError as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        caught.append(f"{str(exc).splitlines()[0]} at {where.filename}:{where.lineno}")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def demo_tasks() -> list[tuple[str, Any, Callable[[int], object] | None]]:
    """(label, task, before_step) for each demo: demos/mlp.py, transformer.py, cnn.py and
    nan.py's case (a layer's gradients turn NaN at step 20, read by the probe's alerts)."""
    import models  # demos/models.py

    nan_task = models.make_mlp()
    layer = nan_task.model.body[2]

    def poison(step: int) -> None:
        if step == 20:
            with torch.no_grad():
                for param in layer.parameters():
                    if param.grad is not None:
                        param.grad.fill_(float("nan"))

    tasks = [(name, make(), None) for name, make in models.MAKERS.items()]
    return [*tasks, ("nan", nan_task, poison)]


def demos_on_the_gpu(device: torch.device) -> None:
    """Each demo's model trained on the GPU with the probe, the loop under sync debug mode
    "error"."""
    for label, task, before_step in demo_tasks():
        demo_on_the_gpu(device, label, task, before_step)


def demo_on_the_gpu(
    device: torch.device, label: str, task: Any, before_step: Callable[[int], object] | None
) -> None:
    """The batches are made and copied to the GPU first: a copy from pageable host memory is
    a sync of the demo's own, not the probe's."""
    batches = task.on_device(device, 4)
    probe = tdbg.watch(task.model, task.optimizer, grad_every=1, name=f"gpu-{label}")

    def step(i: int) -> None:
        inputs, targets = batches[i % len(batches)]
        hook = (lambda: before_step(i)) if before_step is not None else None
        loss = task.train_step(inputs, targets, hook)
        probe.step(loss, samples=task.batch_size, tokens=task.tokens)

    for i in range(5):  # warm-up outside the strict mode: cuBLAS/cuDNN handles, the plan
        step(i)
    with sync_is_an_error() as caught:
        for i in range(5, 5 + STEPS):
            step(i)
    check(f"demo {label}: no host-device sync in {STEPS} probed steps", not caught, *caught)
    check(f"demo {label}: the probe counted no internal errors", probe.errors == 0)
    probe.close()


@contextlib.contextmanager
def syncs_from_tdbg() -> Iterator[list[str]]:
    """Sync debug mode "warn" inside; yields a list that gets one line per sync whose Python
    stack passes through tdbg. The frameworks sync on their own (Hugging Face reads each
    loss for its NaN filter, Lightning its progress), so "error" would stop at theirs first:
    each sync is kept as a warning and blamed on tdbg only when tdbg code is on its stack."""
    package = str(Path(tdbg.__file__).resolve().parent)
    ours: list[str] = []
    shown = warnings.showwarning

    def record(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if "synchronizing CUDA operation" not in str(message):
            shown(message, category, filename, lineno, file, line)
            return
        # The code that made the syncing call: the innermost frame outside torch (and outside
        # this handler and the warnings machinery). A sync inside the loop's own forward, which
        # tdbg's forward wrapper calls, is the model's, not tdbg's.
        stack = traceback.extract_stack()[:-1]
        callers = [
            f for f in stack if not f.filename.startswith(TORCH) and "warnings" not in f.filename
        ]
        if callers and callers[-1].filename.startswith(package):
            ours.append(f"{callers[-1].filename}:{callers[-1].lineno} ({message})")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield ours
        finally:
            torch.cuda.set_sync_debug_mode("default")


def lightning_on_the_gpu(device: torch.device) -> None:
    """A real Lightning Trainer on the GPU with tdbg's callback (tests/probe/test_integrations_
    lightning.py's case, moved to CUDA)."""
    import lightning.pytorch as lightning

    from tdbg.integrations.lightning import TdbgCallback

    class Regression(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class KeepProbe(lightning.Callback):
        """The callback lets go of its probe at the end of fit(): keep it to read its counts."""

        def on_train_batch_end(self, *args: Any) -> None:
            kept[:] = [callback.probe]

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
    callback = TdbgCallback(grad_every=1, name="gpu-lightning")
    kept: list[Any] = []
    trainer = lightning.Trainer(
        accelerator="gpu",
        devices=[device.index or 0],
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, KeepProbe()],  # type: ignore[list-item]  # a TdbgCallback is one
    )
    with syncs_from_tdbg() as ours:
        trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=16))
    check("Lightning: no host-device sync from tdbg's callback or probe", not ours, *ours[:3])
    probed(f"Lightning: {STEPS} steps probed without internal errors", kept)


def huggingface_on_the_gpu(device: torch.device) -> None:
    """A real transformers Trainer on the GPU with tdbg's callback: a tiny GPT-2 built from
    its config (no download), as tests/probe/test_integrations_huggingface.py does on the CPU."""
    import tempfile

    import transformers

    from tdbg.integrations.huggingface import TdbgCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (256, 32))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    callback = TdbgCallback(grad_every=1, name="gpu-huggingface")
    kept: list[Any] = []

    class KeepProbe(transformers.TrainerCallback):
        """The callback lets go of its probe at the end of train(): keep it to read its counts."""

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            kept[:] = [callback.probe]

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            max_steps=STEPS,
            learning_rate=1e-3,
            logging_steps=10,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=rows,
            callbacks=[callback, KeepProbe()],  # type: ignore[list-item]  # a TdbgCallback is one
        )
        with syncs_from_tdbg() as ours:
            trainer.train()
    check("Hugging Face: no host-device sync from tdbg's callback or probe", not ours, *ours[:3])
    probed(f"Hugging Face: {STEPS} steps probed without internal errors", kept)


def probed(name: str, kept: list[Any]) -> None:
    """A framework's probe (kept by the run's last step) stepped STEPS times, with no error."""
    probe = kept[0] if kept else None
    steps, errors = getattr(probe, "steps", None), getattr(probe, "errors", None)
    check(name, steps == STEPS and errors == 0, f"{steps} steps, {errors} errors")


PARTS = (
    no_sync_added,
    demos_on_the_gpu,
    lightning_on_the_gpu,
    huggingface_on_the_gpu,
    norms_right,
    lone_loss,
    rewritten_loss,
    loss_on_streams,
    figures_and_dives,
    activation_histograms,
    out_of_memory,
    out_of_memory_stacks,
    cost,
)


def main(argv: list[str] | None = None) -> int:
    """Every part, or the parts named on the command line (a rerun of the ones that failed)."""
    names = sys.argv[1:] if argv is None else argv
    known = {part.__name__: part for part in PARTS}
    unknown = [name for name in names if name not in known]
    if unknown:
        print(f"gpu-check: no part {', '.join(unknown)}; the parts: {', '.join(known)}")
        return 2
    parts = [known[name] for name in names] or list(PARTS)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine: nothing to check (exit 0)")
        print(f"gpu-check: on a CUDA machine it runs {', '.join(p.__name__ for p in PARTS)}")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"gpu-check: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    for part in parts:
        try:
            part(device)
        except Exception as exc:  # one failing part must not hide the others' results
            check(part.__name__, False, f"{type(exc).__name__}: {exc}")
    failed = [name for name, ok, _ in results if not ok]
    print(f"gpu-check: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
