"""The job screen's figures: one row per rank, worst first, and the job's own loss and rate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tdbg.model.ending import ended_words
from tdbg.model.health import assess
from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.reports import GpuStats

SEVERITY_ORDER = {"hang": 0, "rank_divergence": 1, "nonfinite_ranks": 1, "straggler": 2}
SLOWER_THAN_TYPICAL = 1.05  # a rank this much over the job's median own work a step sorts first


@dataclass(frozen=True)
class RankRow:
    rank: int
    node: str
    step: int | None
    step_time: float | None
    data_time: float | None
    forward_time: float | None
    backward_time: float | None
    optimizer_time: float | None
    loss: float | None
    grad_total: float | None
    memory: int | None  # bytes: the CUDA allocator's peak when on a GPU, else the RSS
    gpu_util: float | None = None  # percent, NVML's, of the GPU the rank trains on
    on_gpu: bool = False  # the rank trains on a GPU (else its GPU util is "n/a")
    alerts: list[str] = field(default_factory=list)  # the active job alert kinds on this rank
    state: str = "live"  # live | stalled | ended | dead: <exit status> | lost (``ended_words``)


def rank_rows(job: Job, alerts: JobAlerts, now: float | None = None) -> list[RankRow]:
    """Every rank seen, worst first: ranks with job alerts (a hang, then divergence, then a
    straggler), then ranks that ended or stalled, then ranks over 5 % slower than the job's
    median (own work a step), slowest first, then the rest in rank order."""
    flagged = alerts.ranks_alerted()
    rows = [_row(rank, state, flagged.get(rank, []), now) for rank, state in job.ranks.items()]
    busy = {m.rank: m.busy for m in job.straggler_measures()}
    typical = float(np.percentile(list(busy.values()), 50, method="lower")) if busy else 0.0

    def badness(row: RankRow) -> tuple[float, float, float, int]:
        worst_alert = min((SEVERITY_ORDER.get(k, 3) for k in row.alerts), default=9)
        trouble = 0 if row.state != "live" else 1
        # Only ranks notably slower than the job's median are ordered by their slowness; the
        # rest keep rank order, so rows do not swap places on noise every frame.
        own = busy.get(row.rank, 0.0)
        slow = own if own > typical * SLOWER_THAN_TYPICAL else 0.0
        return (worst_alert, trouble, -slow, row.rank)

    return sorted(rows, key=badness)


def _row(rank: int, state: RunState, alerts: list[str], now: float | None) -> RankRow:
    mean = state.mean_recent
    grad = state.grad_total.values
    grad_total = float(grad[-1]) if grad.size else None
    status = "live"
    if state.ended:
        status = ended_words(state.end_reason)
    elif assess(state, now, by_arrival=True).word == "stalled":  # its own screen's verdict
        status = "stalled"
    return RankRow(
        rank=rank,
        node=str(state.run.get("node") or state.run.get("host") or "?"),  # ssh: as reached
        step=state.last_step,
        step_time=mean("step_time"),
        data_time=mean("data_time"),
        forward_time=mean("forward_time"),
        backward_time=mean("backward_time"),
        optimizer_time=mean("optimizer_time"),
        loss=state.last_loss,
        grad_total=grad_total,
        memory=_memory(state),
        gpu_util=rank_gpu_util(state),
        on_gpu=str(state.run.get("device") or "").startswith("cuda"),
        alerts=sorted(alerts, key=lambda k: SEVERITY_ORDER.get(k, 3)),
        state=status,
    )


def _memory(state: RunState) -> int | None:
    system = state.system
    if system is None:
        return None
    peaks = [d.peak for d in system.cuda if d.peak is not None]
    return max(peaks) if peaks else system.host.rss


def rank_gpu(state: RunState) -> GpuStats | None:
    """NVML's report of the rank's GPU: NVML's device of the index in the rank's ``cuda:K``
    (the same index unless CUDA_VISIBLE_DEVICES renumbers them), or the only one."""
    device = str(state.run.get("device") or "")
    gpus = state.system.gpus if state.system is not None else ()
    if not device.startswith("cuda") or not gpus:
        return None
    index = int(device.partition(":")[2]) if device.partition(":")[2].isdigit() else 0
    return next((g for g in gpus if g.index == index), gpus[0] if len(gpus) == 1 else None)


def rank_gpu_util(state: RunState) -> float | None:
    """NVML's utilisation of the rank's GPU (``rank_gpu``)."""
    mine = rank_gpu(state)
    util = None if mine is None else mine.util
    return util if util is not None and math.isfinite(util) else None


@dataclass(frozen=True)
class JobSummary:
    """The job as one run: its step, mean loss over the ranks, its step rate and samples/s."""

    ranks_seen: int
    world_size: int
    step: int | None  # the slowest rank's step: the job is only as far as that
    loss: float | None  # mean over the ranks' latest losses
    steps_per_sec: float | None  # the slowest rank's: the others wait for it
    samples_per_sec: float | None  # summed over the ranks


def summarize(job: Job) -> JobSummary:
    states = list(job.ranks.values())
    steps = [s.last_step for s in states if s.last_step is not None]
    losses = [x for s in states if (x := s.last_loss) is not None and math.isfinite(x)]
    rates = [r for s in states if (r := s.steps_per_sec()) is not None]
    samples = [r for s in states if (r := s.throughput("samples")) is not None]
    return JobSummary(
        ranks_seen=len(states),
        world_size=job.world_size,
        step=min(steps) if steps else None,
        loss=float(np.mean(losses)) if losses else None,
        steps_per_sec=min(rates) if rates else None,
        samples_per_sec=float(sum(samples)) if samples else None,
    )
