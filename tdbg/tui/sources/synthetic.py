"""Synthetic probe messages: a plausible run for tests, demos and screenshots without a probe.

Every message is built as its typed definition in :mod:`tdbg.protocol.messages` (through the
builders the probe uses, where there is one), so the type checker holds it to the wire contract.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from tdbg.protocol.messages import (
    Metrics,
    RunInfo,
    Synced,
    alert_message,
    layers_message,
    metrics_message,
)
from tdbg.protocol.messages.histograms import N_BINS, NONFINITE_BIN, ZERO_BIN, bin_labels
from tdbg.protocol.messages.jobs import Job
from tdbg.protocol.messages.reports import CudaStats, GpuStats, HostStats, ProbeHealth, System
from tdbg.protocol.messages.results import FileInfo, NanHuntResult, ProfileResult, ProfileRow
from tdbg.protocol.steps import StepRecord, pack_steps

START_TIME = 1_700_000_000.0
RUN: RunInfo = {
    "name": "synthetic",
    "pid": 4242,
    "rank": 0,
    "host": "testhost",
    "argv": ["train.py"],
    "start_time": START_TIME,
    "cwd": "/nonexistent",
    "torch": "2.0.0",
    "device": "cpu",
    "commands": {},
    "models": ["netG", "netD"],
    "optimizers": [
        {"name": "optG", "type": "Adam", "groups": 1},
        {"name": "optD", "type": "Adam", "groups": 1},
    ],
    "param_groups": 2,
    "socket": "/nonexistent/0-4242",
    "proto_min": 1,
    "proto_max": 1,
}
MODELS = ("netG", "netD")
STEPS_PER_EPOCH = 100
MICRO_BATCHES = 4
CLIP_MAX = 1.0


def layer_names(n: int) -> list[str]:
    return [f"blocks.{i // 4}.{('attn', 'mlp', 'norm', 'proj')[i % 4]}.weight" for i in range(n)]


def step_records(
    start: int,
    count: int,
    n_layers: int,
    grad_every: int = 1,
    t0: float = START_TIME,
    nan_at: int | None = None,
    data_share: float = 0.1,
    seed: int = 0,
    true_numbers: bool = True,
    tokens: bool = True,
    eval_every: int | None = None,
) -> list[StepRecord]:
    """``count`` steps from ``start``: a decaying noisy loss, two LR groups, per-layer norms;
    with ``true_numbers`` also 4 micro-batches a step, ``clip_grad_norm_(max_norm=1.0)`` active
    on about 40% of the steps (the norms are the pre-clip ones) and 100 steps an epoch;
    ``tokens=False``: a run that counts samples only (not a language model); ``eval_every``:
    a validation pass (forwards without grad, 20 steps' time) before every such step."""
    rng = random.Random(seed + start)
    out = []
    step_time = 0.05
    for s in range(start, start + count):
        loss = 2.5 * math.exp(-s / 300) + 0.1 + 0.05 * rng.random()
        if nan_at is not None and s >= nan_at:
            loss = math.nan
        norms = None
        clip_norm = 0.8 + 0.35 * rng.random()  # the pre-clip total norm clip measured
        if s % grad_every == 0:
            norms = [
                10 ** (-3 + 2 * (i / max(1, n_layers - 1))) * (1 + 0.1 * rng.random())
                for i in range(n_layers)
            ]
            if true_numbers and norms:
                scale = clip_norm / math.sqrt(sum(n * n for n in norms))
                norms = [n * scale for n in norms]
            if n_layers > 2:
                norms[1] = 1e-9  # a vanished layer
            if nan_at is not None and s >= nan_at and n_layers:
                norms[0] = math.nan
        rest = step_time * (1 - data_share)
        no_grad = math.nan
        if eval_every is not None:
            no_grad = 20 * step_time if s and s % eval_every == 0 else 0.0
        out.append(
            StepRecord(
                step=s,
                time=t0 + s * step_time,
                loss=loss,
                lr=[1e-3 * min(1.0, (s + 1) / 100), 1e-4],
                step_time=step_time + (no_grad if no_grad == no_grad else 0.0),
                samples=32.0,
                tokens=32.0 * 512 if tokens else math.nan,
                data_time=step_time * data_share,
                no_grad_time=no_grad,
                forward_time=rest * 0.3,
                backward_time=rest * 0.55,
                optimizer_time=rest * 0.1,
                probe_time=step_time * 0.005,
                micro_batches=MICRO_BATCHES if true_numbers else math.nan,
                clip_max=CLIP_MAX if true_numbers else math.nan,
                clip_norm=clip_norm if true_numbers else math.nan,
                epoch=float(s // STEPS_PER_EPOCH) if true_numbers else math.nan,
                grad_total=None if norms is None else math.sqrt(sum(n * n for n in norms)),
                grad_norms=norms,
            )
        )
    return out


def system_message(gpu: bool = False) -> dict[str, Any]:
    """A ``system`` report as the probe sends it: a CPU run, or one on an H100 (``gpu``)."""
    host = HostStats(
        rss=int(2.5 * 2**30), cpu_percent=103.0, ram_used=30 * 2**30, ram_total=128 * 2**30
    )
    if not gpu:
        missing = ("GPU: NVML not available (no driver)", "CUDA: not in use")
        return System(START_TIME, host, missing=missing).to_wire()
    cuda = CudaStats(0, "H100", 12 * 2**30, 14 * 2**30, 13 * 2**30, 0, 0)
    nvml = GpuStats(0, "NVIDIA H100", 87.0, 15 * 2**30, 80 * 2**30, 61.0, 412.0, 700.0, 1980)
    return System(START_TIME, host, (cuda,), (nvml,)).to_wire()


def metric_points(
    start: int,
    count: int,
    nan_at: int | None = None,
    extra: int = 0,
    models: Sequence[str] = MODELS,
) -> list[tuple[int, str, float]]:
    """The metrics a run logs over steps ``[start, start + count)``: a loss per optimizer
    (``loss/NAME``) every step, ``val_loss`` and ``val/acc`` every 50 steps (NaN from
    ``nan_at``), a framework's ``grad_scale`` every 10 and ``extra`` more names every 50."""
    points: list[tuple[int, str, float]] = []
    for s in range(start, start + count):
        base = 2.5 * math.exp(-s / 300) + 0.1
        if len(models) > 1:
            for k, name in enumerate(models):
                points.append((s, f"loss/{name}", base * (1.2 - 0.3 * k) + 0.02 * math.sin(s)))
        if s % 10 == 0:
            points.append((s, "grad_scale", 65536.0 / 2 ** ((s // 150) % 3)))
        if s % 50 == 0:
            val = base * 1.1 + 0.05
            points.append((s, "val_loss", math.nan if nan_at is not None and s >= nan_at else val))
            points.append((s, "val/acc", min(0.99, 0.3 + s / 600)))
            for i in range(extra):
                points.append((s, f"extra/metric_{i:03d}", i + s / 1000))
    return points


def synthetic_run(
    steps: int = 400,
    n_layers: int = 12,
    batch: int = 50,
    grad_every: int = 1,
    nan_at: int | None = None,
    gpu: bool = False,
    data_share: float = 0.1,
    models: Sequence[str] = MODELS,
    total_steps: int | None = 1000,
    skipped_steps: int = 0,
    closed: bool = False,
    metrics: bool = True,
    extra_metrics: int = 0,
    true_numbers: bool = True,
    t0: float = START_TIME,
    tokens: bool = True,
    eval_every: int | None = None,
) -> list[dict[str, Any]]:
    """A full message list as a probe would send it: layers, step batches, metrics, alerts,
    system, the probe's health. ``models`` split the layers (the first half the first
    model's...); ``true_numbers=False`` and ``metrics=False`` give what an older probe sent
    (no micro-batches, clipping, epoch, metrics, total steps)."""
    names = layer_names(n_layers)
    layers = layers_message(names, [1000] * n_layers)
    if true_numbers and models:
        per = max(1, -(-n_layers // len(models)))
        layers = layers_message(
            names,
            [1000] * n_layers,
            model=[min(i // per, len(models) - 1) for i in range(n_layers)],
            models=list(models),
        )
    msgs: list[dict[str, Any]] = [dict(layers)]
    for start in range(0, steps, batch):
        count = min(batch, steps - start)
        records = step_records(
            start,
            count,
            n_layers,
            grad_every,
            nan_at=nan_at,
            data_share=data_share,
            true_numbers=true_numbers,
            t0=t0,
            tokens=tokens,
            eval_every=eval_every,
        )
        msgs.append(pack_steps(records, n_layers))
        if metrics:
            batch_metrics: Metrics = metrics_message(
                metric_points(start, count, nan_at, extra_metrics, models)
            )
            msgs.append(dict(batch_metrics))
    alerts: list[dict[str, Any]] = [
        alert_message(
            "loss_spike",
            "warning",
            steps // 3,
            "loss jumped 4.1x above its running mean",
            [],
            START_TIME,
        ),
        alert_message(
            "zero_grad",
            "info",
            steps // 2,
            "gradient norm is below 1e-8",
            [names[1]] if n_layers > 1 else [],
            START_TIME,
        ),
    ]
    if nan_at is not None:
        alerts.append(
            alert_message("nonfinite_loss", "error", nan_at, "loss is NaN", names[:1], START_TIME)
        )
    msgs.extend(dict(a) for a in alerts)
    msgs.append(system_message(gpu))
    msgs.append(probe_message(steps, grad_every, total_steps, skipped_steps, closed))
    synced: Synced = {"type": "synced"}
    msgs.append(dict(synced))
    return msgs


def probe_message(
    steps: int,
    grad_every: int = 1,
    total_steps: int | None = 1000,
    skipped_steps: int = 0,
    closed: bool = False,
    disabled: bool = False,
    errors: int = 0,
) -> dict[str, Any]:
    """The probe's 1 Hz health message."""
    return ProbeHealth(
        time=START_TIME,
        clients=1,
        dropped=0,
        rejected_peers=0,
        history_bytes=0,
        cost_fraction=0.006,
        grad_interval=grad_every,
        grad_mode="fixed",
        overhead_budget=0.02,
        errors=errors,
        last_error="RuntimeError: boom" if errors else None,
        steps_seen=steps,
        disabled=disabled,
        closed=closed,
        total_steps=total_steps,
        skipped_steps=skipped_steps,
    ).to_wire()


# --- deep dives: jobs and results as the wire contract types them -----------------------------

OPS = (  # name, calls per step, self CPU us per call, total CPU us per call
    ("aten::addmm", 3, 180.0, 210.0),
    ("aten::mm", 4, 150.0, 160.0),
    ("aten::linear", 3, 8.0, 230.0),
    ("aten::tanh", 1, 40.0, 42.0),
    ("aten::tanh_backward", 1, 35.0, 37.0),
    ("aten::mse_loss", 1, 20.0, 45.0),
    ("aten::add_", 6, 12.0, 13.0),
    ("aten::t", 6, 3.0, 6.0),
    ("aten::sum", 3, 15.0, 18.0),
    ("Optimizer.step#SGD.step", 1, 60.0, 140.0),
)


def profile_result(
    steps: tuple[int, int] = (100, 104),
    slower: dict[str, float] | None = None,
    device: bool = False,
    trace: str | None = "/tmp/tdbg-run/profile-step100.pt.trace.json",
) -> dict[str, Any]:
    """A ``profile`` job's result; ``slower`` scales some ops' times (for comparisons)."""
    n = steps[1] - steps[0] + 1
    rows: list[ProfileRow] = []
    for name, calls, self_us, total_us in OPS:
        k = (slower or {}).get(name, 1.0)
        row = ProfileRow(
            name=name,
            calls=calls * n,
            self_cpu=self_us * calls * n * k,
            cpu_total=total_us * calls * n * k,
            self_device=self_us * calls * n * k * 0.4 if device else 0.0,
            device_total=total_us * calls * n * k * 0.4 if device else 0.0,
            cpu_memory=4096 * calls * n,
            device_memory=8192 * calls * n if device else 0,
        )
        rows.append(row)
    return ProfileResult.of_ops(
        rows,
        device,
        steps=steps,
        wall_seconds=0.0123 * n,
        trace=None if trace is None else FileInfo(trace, 1_234_567, "0" * 64),
    ).to_wire()


def job_messages(
    job: int,
    command: str,
    args: dict[str, Any],
    result: dict[str, Any] | None,
    total: int | None = 5,
    start: int = 100,
    final: str = "done",
    message: str = "",
    history: bool = False,
) -> list[dict[str, Any]]:
    """A job's progress from armed to ``final`` (done with ``result``, failed, cancelled)."""

    def msg(
        state: str, step: int | None, done: int, res: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        out = Job(
            job,
            command,
            state,
            step,
            START_TIME + start,
            done=done,
            total=total,
            message=message if state in ("failed", "cancelled") else "",
            args=args,
            history=history,
        ).to_wire()
        out["result"] = res  # as given: a test may hand the reader a malformed result
        return out

    out = [msg("armed", None, 0)]
    for i in range(total or 0):
        out.append(msg("running", start + i, i + 1))
    if final == "done":
        out.append(msg("analysing", start + (total or 1) - 1, total or 0))
    out.append(
        msg(final, start + (total or 1) - 1, total or 0, result if final == "done" else None)
    )
    return out


def synthetic_nan_hunt(found: bool = True) -> dict[str, Any]:
    if not found:
        return NanHuntResult(steps_checked=1, trigger="manual").to_wire()
    return NanHuntResult(
        steps_checked=1,
        trigger="manual",
        found=True,
        phase="forward",
        module="body.1",
        module_type="Linear",
        step=151,
        nonfinite=12,
        numel=4096,
        input_min=-3.25,
        input_max=4.5,
    ).to_wire()


def snapshot_result() -> dict[str, Any]:
    return {
        "file": {"path": "/tmp/tdbg-run/snapshot-step100.pickle", "size": 3_456_789, "sha256": ""},
        "steps": [100, 102],
        "history_owner": "tdbg",
        "top": [
            {
                "site": "train.py:42 forward (torch/nn/modules/linear.py:125)",
                "bytes": 2**30,
                "count": 12,
            },
            {
                "site": "train.py:57 step (torch/optim/adam.py:400)",
                "bytes": 512 * 2**20,
                "count": 40,
            },
            {
                "site": "train.py:40 batch (torch/utils/data/_utils/collate.py:200)",
                "bytes": 64 * 2**20,
                "count": 3,
            },
        ],
        "active_bytes": 3 * 2**30,
        "reserved_bytes": 4 * 2**30,
    }


def activations_message(step: int = 110, n_modules: int = 8) -> dict[str, Any]:
    """Per-module output statistics: one dead ReLU (all zeros) and one module with NaN outputs."""
    names = [f"blocks.{i // 2}.{'fc' if i % 2 == 0 else 'act'}" for i in range(n_modules)]
    types = ["Linear" if i % 2 == 0 else "ReLU" for i in range(n_modules)]
    mean = [0.01 * (i + 1) for i in range(n_modules)]
    std = [0.5 + 0.1 * i for i in range(n_modules)]
    lo = [-2.0 - i for i in range(n_modules)]
    hi = [2.0 + i for i in range(n_modules)]
    zero = [0.0 if i % 2 == 0 else 0.45 for i in range(n_modules)]
    nonfinite = [0.0] * n_modules
    if n_modules > 3:
        zero[3] = 1.0  # a dead ReLU
        mean[3], std[3], lo[3], hi[3] = 0.0, 0.0, 0.0, 0.0
    if n_modules > 4:
        nonfinite[4] = 7.0
        mean[4], std[4], hi[4] = math.nan, math.nan, math.inf
    hist = [_activation_hist(zero[i], int(nonfinite[i]), i) for i in range(n_modules)]
    return {
        "type": "activations",
        "step": step,
        "names": names,
        "types": types,
        "mean": mean,
        "std": std,
        "min": lo,
        "max": hi,
        "zero_frac": zero,
        "nonfinite": nonfinite,
        "hist": hist,
        "hist_stride": [1] * n_modules,
    }


def _activation_hist(zero_frac: float, nonfinite: int, i: int, n: int = 1024) -> list[int]:
    """1,024 outputs in the histograms' bins: ``zero_frac`` exact zeros, ``nonfinite`` NaN/Inf,
    the rest spread over 1e-3 .. 3 (a bell around 0.3, a little wider deeper in)."""
    counts = [0] * N_BINS
    zeros = round(zero_frac * n)
    counts[ZERO_BIN] = zeros
    counts[NONFINITE_BIN] = nonfinite
    rest = n - zeros - nonfinite
    centre = bin_labels().index("3e-1")
    weights = {centre - 3: 1, centre - 2: 3, centre - 1: 8, centre: 10, centre + 1: 5 + i}
    total = sum(weights.values())
    for b, w in weights.items():
        counts[b] = rest * w // total
    counts[centre] += rest - sum(counts[b] for b in weights)
    return counts
