"""Synthetic probe messages: a plausible run for tests, demos and screenshots without a probe."""

from __future__ import annotations

import math
import random
from typing import Any

from tdbg.protocol import StepRecord, pack_steps

RUN = {
    "name": "synthetic",
    "pid": 4242,
    "rank": 0,
    "host": "testhost",
    "argv": ["train.py"],
    "start_time": 1_700_000_000.0,
    "socket": "/nonexistent/0-4242",
    "proto_min": 1,
    "proto_max": 1,
}


def layer_names(n: int) -> list[str]:
    return [f"blocks.{i // 4}.{('attn', 'mlp', 'norm', 'proj')[i % 4]}.weight" for i in range(n)]


def step_records(
    start: int,
    count: int,
    n_layers: int,
    grad_every: int = 1,
    t0: float = RUN["start_time"],  # type: ignore[assignment]
    nan_at: int | None = None,
    data_share: float = 0.1,
    seed: int = 0,
) -> list[StepRecord]:
    """``count`` steps from ``start``: a decaying noisy loss, two LR groups, per-layer norms."""
    rng = random.Random(seed + start)
    out = []
    step_time = 0.05
    for s in range(start, start + count):
        loss = 2.5 * math.exp(-s / 300) + 0.1 + 0.05 * rng.random()
        if nan_at is not None and s >= nan_at:
            loss = math.nan
        norms = None
        if s % grad_every == 0:
            norms = [
                10 ** (-3 + 2 * (i / max(1, n_layers - 1))) * (1 + 0.1 * rng.random())
                for i in range(n_layers)
            ]
            if n_layers > 2:
                norms[1] = 1e-9  # a vanished layer
            if nan_at is not None and s >= nan_at and n_layers:
                norms[0] = math.nan
        rest = step_time * (1 - data_share)
        out.append(
            StepRecord(
                step=s,
                time=t0 + s * step_time,
                loss=loss,
                lr=[1e-3 * min(1.0, (s + 1) / 100), 1e-4],
                step_time=step_time,
                samples=32.0,
                tokens=32.0 * 512,
                data_time=step_time * data_share,
                forward_time=rest * 0.3,
                backward_time=rest * 0.55,
                optimizer_time=rest * 0.1,
                probe_time=step_time * 0.005,
                grad_total=None if norms is None else math.sqrt(sum(n * n for n in norms)),
                grad_norms=norms,
            )
        )
    return out


def system_message(gpu: bool = False) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "type": "system",
        "time": RUN["start_time"],
        "host": {
            "rss": 2.5 * 2**30,
            "cpu_percent": 103.0,
            "ram_used": 30 * 2**30,
            "ram_total": 128 * 2**30,
        },
        "cuda": [],
        "gpus": [],
        "missing": ["GPU: NVML not available (no driver)", "CUDA: not in use"],
    }
    if gpu:
        msg["cuda"] = [
            {
                "index": 0,
                "name": "H100",
                "allocated": 12 * 2**30,
                "reserved": 14 * 2**30,
                "peak": 13 * 2**30,
                "retries": 0,
                "ooms": 0,
            }
        ]
        msg["gpus"] = [
            {
                "index": 0,
                "name": "NVIDIA H100",
                "util": 87,
                "mem_used": 15 * 2**30,
                "mem_total": 80 * 2**30,
                "temp": 61,
                "power": 412.0,
                "power_limit": 700.0,
                "sm_clock": 1980,
            }
        ]
        msg["missing"] = []
    return msg


def synthetic_run(
    steps: int = 400,
    n_layers: int = 12,
    batch: int = 50,
    grad_every: int = 1,
    nan_at: int | None = None,
    gpu: bool = False,
    data_share: float = 0.1,
) -> list[dict[str, Any]]:
    """A full message list as a probe would send it: layers, step batches, alerts, system."""
    names = layer_names(n_layers)
    msgs: list[dict[str, Any]] = [
        {"type": "layers", "names": names, "numel": [1000] * n_layers},
    ]
    for start in range(0, steps, batch):
        count = min(batch, steps - start)
        records = step_records(
            start, count, n_layers, grad_every, nan_at=nan_at, data_share=data_share
        )
        msgs.append(pack_steps(records, n_layers))
    msgs.append(
        {
            "type": "alert",
            "kind": "loss_spike",
            "severity": "warning",
            "step": steps // 3,
            "time": RUN["start_time"],
            "message": "loss jumped 4.1x above its running mean",
            "layers": [],
        }
    )
    msgs.append(
        {
            "type": "alert",
            "kind": "zero_grad",
            "severity": "info",
            "step": steps // 2,
            "time": RUN["start_time"],
            "message": "gradient norm is below 1e-8",
            "layers": [names[1]] if n_layers > 1 else [],
        }
    )
    if nan_at is not None:
        msgs.append(
            {
                "type": "alert",
                "kind": "nonfinite_loss",
                "severity": "error",
                "step": nan_at,
                "time": RUN["start_time"],
                "message": "loss is NaN",
                "layers": names[:1],
            }
        )
    msgs.append(system_message(gpu))
    msgs.append(
        {
            "type": "probe",
            "time": RUN["start_time"],
            "cost_fraction": 0.006,
            "grad_interval": grad_every,
            "overhead_budget": 0.02,
            "errors": 0,
            "last_error": None,
            "dropped": 0,
            "clients": 1,
            "steps_seen": steps,
        }
    )
    msgs.append({"type": "synced"})
    return msgs
