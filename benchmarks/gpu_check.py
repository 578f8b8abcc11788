"""The CUDA paths, proven on a real GPU: no host-device sync added by the probe, device-side
norms right, NVML and allocator figures against nvidia-smi and torch, a memory snapshot and a
profile with CUDA times, and the probe's cost. On a machine without CUDA it says so, exit 0.

    make gpu-check        (or: .venv/bin/python benchmarks/gpu_check.py)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tdbg  # noqa: E402
from tdbg.connect.client import ProbeClient  # noqa: E402

STEPS = 60
results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
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
        for m in client.messages(timeout=0.5):
            if m.get("type") == "system" and m.get("cuda"):
                system = m
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


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine: nothing to check (exit 0)")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"gpu-check: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    for part in (no_sync_added, norms_right, figures_and_dives, cost):
        try:
            part(device)
        except Exception as exc:  # one failing part must not hide the others' results
            check(part.__name__, False, f"{type(exc).__name__}: {exc}")
    failed = [name for name, ok, _ in results if not ok]
    print(f"gpu-check: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
