"""A run's diagnosis after the fact: verdicts over the whole run first, the evidence after.

Read from the model only (a RunState folded from a live run's history or a recording, and a job's
ranks with the alerts judged over them), so ``tdbg report``, its ``--json`` and its ``--html``
say the same thing, and a notebook can ask for it too. Each verdict reuses the judgement that
made it at the time (the probe's alerts, the job's alerts, the one stall rule) instead of
judging again: the report names what the screen named.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tdbg.format import finite_tree, fmt_bytes, fmt_loss, fmt_pct, fmt_seconds, fmt_span
from tdbg.model.ending import ending
from tdbg.model.health import Health, assess
from tdbg.model.job import PHASE_WORDS, Job
from tdbg.model.job_alerts import JobAlerts, finding_level
from tdbg.model.learning import collapsing_weights, concentrated_gradients, ratio_evidence
from tdbg.model.run_state import ANATOMY, INPUT_BOUND_SHARE, Alert, RunState

# Alert kinds by what they say about the run, in the order a reader needs them.
TROUBLE_KINDS = (
    "nonfinite_loss",
    "nonfinite_grad",
    "exploding_grad",
    "stalled",
    "anomaly",
    "oom",
)
WARNING_KINDS = (
    "loss_spike",
    "no_grad",
    "zero_grad",
    "update_stalled",
    "update_large",
    "lr_zero",
    "nonfinite_metric",
)
CHART_POINTS = 60  # points of a small chart (the text sparkline's width)
TOP_OPS = 5


@dataclass(frozen=True)
class Verdict:
    """One thing the run did: ``level`` ``bad`` (trouble), ``warn`` or ``ok``; a headline and
    the evidence lines under it; the first step it concerns, where there is one."""

    level: str
    headline: str
    evidence: list[str] = field(default_factory=list)
    step: int | None = None


@dataclass(frozen=True)
class Diagnosis:
    """Everything ``tdbg report`` says about one run."""

    name: str
    run: dict[str, Any]
    health: Health  # as the header would judge it at the run's last step
    verdicts: list[Verdict]  # worst first
    steps: int  # steps seen
    elapsed: float | None  # seconds from the run's start to its last step (live: to now)
    last_step: int | None
    loss_first: float | None
    loss_best: float | None
    loss_best_step: int | None
    loss_last: float | None
    phases: dict[str, float | None]  # mean share of a step over the whole run, per phase
    step_time: float | None  # median seconds a step
    steps_per_sec: float | None  # over the whole run
    samples_per_sec: float | None
    probe_cost: float | None  # the probe's own cost as a share of the step time
    memory: dict[str, Any]  # peak allocated / reserved per device, host RSS
    top_ops: list[dict[str, Any]]  # the last profile's top ops (name, share, self time µs)
    loss_chart: list[float]  # at most CHART_POINTS (NaN where no finite loss)
    grad_chart: list[float]  # the total gradient norm, likewise

    @property
    def level(self) -> str:
        """The worst verdict's level (``ok`` when there is none)."""
        levels = {v.level for v in self.verdicts}
        return "bad" if "bad" in levels else "warn" if "warn" in levels else "ok"

    def to_json(self) -> dict[str, Any]:
        """The diagnosis as JSON-ready values (non-finite numbers as "nan" / "inf" / "-inf")."""
        out = asdict(self)
        out["health"] = asdict(self.health)
        out["level"] = self.level
        return finite_tree(out)


@dataclass(frozen=True)
class JobDiagnosis:
    """A job's report: each rank's diagnosis, and the job's own findings as they were raised."""

    job: str
    world_size: int
    ranks: dict[int, Diagnosis]
    findings: list[Verdict]  # raised job alerts (straggler, diverged ranks, NaN on some, hang)

    @property
    def level(self) -> str:
        levels = {v.level for v in self.findings} | {d.level for d in self.ranks.values()}
        return "bad" if "bad" in levels else "warn" if "warn" in levels else "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "world_size": self.world_size,
            "level": self.level,
            "findings": [finite_tree(asdict(v)) for v in self.findings],
            "ranks": {str(r): d.to_json() for r, d in self.ranks.items()},
        }


def diagnose(state: RunState) -> Diagnosis:
    """The run's diagnosis from everything its state holds."""
    steps = state.steps.values
    last_time = float(state.cols["time"].values[-1]) if state.n_steps else None
    health = assess(state, now=last_time)
    loss_first, loss_best, best_step, loss_last = loss_figures(state)
    return Diagnosis(
        name=str(state.run.get("name") or "?"),
        run=dict(state.run),
        health=health,
        verdicts=_verdicts(state),
        steps=state.n_steps,
        elapsed=state.elapsed(),
        last_step=state.last_step,
        loss_first=loss_first,
        loss_best=loss_best,
        loss_best_step=best_step,
        loss_last=loss_last,
        phases=run_phases(state),
        step_time=median_of(state.cols["step_time"].values),
        steps_per_sec=steps_per_second(steps, state.cols["time"].values),
        samples_per_sec=_throughput(state, "samples"),
        probe_cost=_probe_cost(state),
        memory=_memory(state),
        top_ops=_top_ops(state),
        loss_chart=_chart(state.loss.values),
        grad_chart=_chart(state.grad_total.values),
    )


def diagnose_job(job: Job, alerts: JobAlerts) -> JobDiagnosis:
    """A job's diagnosis: its ranks' and the job alerts raised over the run (oldest first)."""
    findings = [
        Verdict(
            finding_level(a.kind),
            f"{a.kind.replace('_', ' ')}: {a.message}",
            _cleared_after(a, alerts),
            a.step,
        )
        for a in reversed(alerts.events)
        if not a.cleared
    ]
    # Which rank was the slowest over time: a straggler that came and went, whose alerts
    # alone read as unrelated episodes.
    history = alerts.history
    findings.extend(
        Verdict("warn", f"slowest over time: {r.words()}", [history.whole_run(r)], r.first)
        for r in history.named()
    )
    return JobDiagnosis(
        job=job.job,
        world_size=job.world_size,
        ranks={rank: diagnose(state) for rank, state in job.ranks.items()},
        findings=findings,
    )


# --- verdicts -----------------------------------------------------------------------------------


def _verdicts(state: RunState) -> list[Verdict]:
    out: list[Verdict] = []
    alerts = list(reversed(state.alerts))  # oldest first
    how = ending(state.end_reason) if state.ended else None
    if how is not None and how.kind == "dead":
        out.append(Verdict("bad", f"the run died: {how.words}", step=state.last_step))
    if state.probe_disabled:
        out.append(Verdict("bad", "the probe switched itself off after errors"))
    if state.nonfinite_since is not None:
        origin = next((a for a in alerts if a.nonfinite), None)
        evidence = [origin.message] if origin is not None else []
        hunt = state.deep.nan_hunt
        if hunt is not None and getattr(hunt, "found", False):
            evidence.append(f"NaN hunt: first non-finite in {_hunt_words(hunt)}")
        out.append(
            Verdict(
                "bad",
                f"the loss is non-finite since step {state.nonfinite_since}",
                evidence,
                state.nonfinite_since,
            )
        )
    elif any(a.nonfinite for a in alerts):
        first = next(a for a in alerts if a.nonfinite)
        out.append(
            Verdict(
                "warn",
                f"non-finite values at step {first.step}, then the run recovered",
                [first.message],
                first.step,
            )
        )
    out.extend(_stalls(alerts))
    for kind in ("oom", "exploding_grad", "anomaly", *WARNING_KINDS):
        mine = [a for a in alerts if a.kind == kind]
        if mine:
            verdict = _repeated(kind, mine)
            if kind in ("update_stalled", "update_large"):
                # The alert named the layers; the run's whole record of their ratios says how
                # far from the others they stayed.
                named = sorted({layer for a in mine for layer in a.layers})
                verdict.evidence.extend(ratio_evidence(state, named[:8]))
            out.append(verdict)
    concentrated = concentrated_gradients(state)
    if concentrated:
        n = len(concentrated)
        out.append(
            Verdict(
                "warn",
                f"gradients concentrated in a few entries in {n} layer{'s' if n > 1 else ''}",
                [c.words() for c in concentrated[:8]]
                + [
                    "an outlier example or input feature, or a frequent token's embedding row; "
                    "with clipping, those entries set the scale of the whole update"
                ],
            )
        )
    collapsed = collapsing_weights(state)
    if collapsed:
        out.append(
            Verdict(
                "warn",
                f"weights collapsing to zero in {len(collapsed)} layer"
                f"{'s' if len(collapsed) > 1 else ''} (weight decay too strong? dead units?)",
                [c.words() for c in collapsed[:8]],
                collapsed[0].last_step,
            )
        )
    out.extend(_time_verdicts(state))
    clip = state.clipping()
    if clip is not None and clip.steps:
        rate = clip.active / clip.steps
        words = f"gradient clipping was active on {fmt_pct(rate)} of {clip.steps} steps"
        out.append(Verdict("warn" if rate > 0.5 else "ok", words, [f"max_norm {clip.max_norm:g}"]))
    growing = _growing_layers(state)
    if growing:
        out.append(Verdict("warn", "gradient norms growing", growing))
    if not state.n_steps:
        out.append(Verdict("warn", "no step recorded: the run had not reached an optimizer step"))
    if not out:
        out.append(Verdict("ok", "no trouble seen: no alert, no stall, finite loss throughout"))
    order = {"bad": 0, "warn": 1, "ok": 2}
    return sorted(out, key=lambda v: order.get(v.level, 3))


def _stalls(alerts: list[Alert]) -> list[Verdict]:
    stalled = [a for a in alerts if a.kind == "stalled"]
    if not stalled:
        return []
    evidence = [a.message for a in stalled[:3]]
    resumed = [a for a in alerts if a.kind == "resumed"]
    still = alerts[-1].kind == "stalled" if alerts else False
    headline = f"the loop stalled {len(stalled)} time{'s' if len(stalled) > 1 else ''}"
    if resumed:
        headline += f", resumed {len(resumed)}"
    if still:
        headline += "; still stalled when the run was last seen"
    return [Verdict("bad", headline, evidence, stalled[0].step)]


def _repeated(kind: str, alerts: list[Alert]) -> Verdict:
    words = {
        "oom": "CUDA out of memory",
        "exploding_grad": "exploding gradients",
        "anomaly": "autograd anomaly errors",
        "loss_spike": "loss spikes",
        "no_grad": "layers without a gradient",
        "zero_grad": "layers whose gradient is zero",
        "update_stalled": "layers that stopped learning (their updates move nothing)",
        "update_large": "updates too large for their weights",
        "lr_zero": "a learning rate of zero",
        "nonfinite_metric": "non-finite logged metrics",
    }[kind]
    steps = [a.step for a in alerts if a.step is not None]
    where = f" at steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else ""
    where = f" at step {steps[0]}" if len(steps) == 1 else where
    layers = sorted({layer for a in alerts for layer in a.layers})
    evidence = [alerts[0].message]
    if layers:
        evidence.append("layers: " + ", ".join(layers[:8]) + (" …" if len(layers) > 8 else ""))
    level = "bad" if kind in TROUBLE_KINDS else "warn"
    count = f"{len(alerts)}× " if len(alerts) > 1 else ""
    return Verdict(level, f"{count}{words}{where}", evidence, steps[0] if steps else None)


def _time_verdicts(state: RunState) -> list[Verdict]:
    phases = run_phases(state)
    data = phases.get("data_time")
    if data is None or not data > INPUT_BOUND_SHARE:
        return []
    return [
        Verdict(
            "warn",
            f"input-bound: {fmt_pct(data)} of each step waiting for data",
            ["the loader is the bottleneck: more workers, pinned memory, prefetching"],
        )
    ]


def _growing_layers(state: RunState) -> list[str]:
    trends = state.layer_trends()
    names = state.layer_names
    idx = [i for i in np.argsort(-np.nan_to_num(trends, nan=-np.inf)) if trends[i] > 1.0][:5]
    return [f"{names[i]}: ×{10 ** trends[i]:.3g} over recent samples" for i in idx]


def _hunt_words(hunt: Any) -> str:
    module = getattr(hunt, "module", None) or "the root model"
    phase = getattr(hunt, "phase", None) or "?"
    return f"{module} ({phase}) at step {getattr(hunt, 'step', '?')}"


def _cleared_after(alert: Any, alerts: JobAlerts) -> list[str]:
    later = [
        a
        for a in alerts.events
        if a.cleared and a.kind == alert.kind and a.ranks == alert.ranks and a.step >= alert.step
    ]
    return [f"cleared at step {later[-1].step}"] if later else ["never cleared"]


# --- figures ------------------------------------------------------------------------------------


def loss_figures(
    state: RunState,
) -> tuple[float | None, float | None, int | None, float | None]:
    has = state.has_loss.values
    if not has.any():
        return None, None, None, None
    idx = np.flatnonzero(has)
    losses = state.loss.values[idx]
    finite = np.flatnonzero(np.isfinite(losses))
    if not finite.size:
        return float(losses[0]), None, None, float(losses[-1])
    best = int(finite[np.argmin(losses[finite])])
    return (
        float(losses[0]),
        float(losses[best]),
        int(state.steps.values[idx[best]]),
        float(losses[-1]),
    )


def run_phases(state: RunState) -> dict[str, float | None]:
    """Each phase's share of the step time over the whole run (the steps that timed it)."""
    total = state.cols["step_time"].values
    out: dict[str, float | None] = {}
    for name in ANATOMY:
        part = state.cols[name].values
        timed = np.isfinite(part) & np.isfinite(total) & (total > 0)
        out[name] = (
            min(1.0, max(0.0, float(part[timed].sum() / total[timed].sum())))
            if timed.any() and total[timed].sum() > 0
            else None
        )
    return out


def median_of(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else None


def steps_per_second(steps: np.ndarray, times: np.ndarray) -> float | None:
    if len(steps) < 2 or not times[-1] > times[0]:
        return None
    return float((steps[-1] - steps[0]) / (times[-1] - times[0]))


def _throughput(state: RunState, column: str) -> float | None:
    counts, times = state.cols[column].values, state.cols["step_time"].values
    ok = np.isfinite(counts) & np.isfinite(times)
    return float(counts[ok].sum() / times[ok].sum()) if ok.any() and times[ok].sum() > 0 else None


def _probe_cost(state: RunState) -> float | None:
    cost = state.probe.cost_fraction if state.probe is not None else None
    return cost if cost is not None and math.isfinite(cost) else None


def _memory(state: RunState) -> dict[str, Any]:
    system = state.system
    if system is None:
        return {"cuda": [], "host_rss": None}
    devices = [
        {"index": d.index, "name": d.name, "peak": d.peak, "reserved": d.reserved}
        for d in system.cuda
    ]
    return {"cuda": devices, "host_rss": system.host.rss}


def _top_ops(state: RunState) -> list[dict[str, Any]]:
    """The last profile's ops with the most self time, and each one's share (the profile's own
    definition of it, as the TUI's table prints it)."""
    profile = state.deep.profile
    if profile is None:
        return []
    column = profile.share_column
    ranked = sorted(profile.rows, key=lambda r: -(r.value(column) or 0.0))[:TOP_OPS]
    return [
        {"name": row.name, "self_us": row.value(column), "share": profile.share(row)}
        for row in ranked
    ]


def _chart(values: np.ndarray) -> list[float]:
    """At most CHART_POINTS evenly spaced means of ``values`` (NaN where none is finite)."""
    if not len(values):
        return []
    chunks = np.array_split(values.astype(np.float64), min(CHART_POINTS, len(values)))
    out = []
    for chunk in chunks:
        finite = chunk[np.isfinite(chunk)]
        out.append(float(finite.mean()) if finite.size else math.nan)
    return out


# --- words for a figure (shared by the text and the HTML report) ------------------------------


def phase_words(name: str) -> str:
    return PHASE_WORDS.get(name, name)


def figure_lines(d: Diagnosis) -> list[tuple[str, str]]:
    """The evidence table under the verdicts: (label, value), in reading order."""
    last = d.last_step if d.last_step is not None else "n/a"
    lines = [
        ("steps", f"{d.steps} (last step {last}) in {fmt_span(d.elapsed)}"),
        (
            "loss",
            f"first {fmt_loss(d.loss_first)} · best {fmt_loss(d.loss_best)}"
            + (f" at step {d.loss_best_step}" if d.loss_best_step is not None else "")
            + f" · last {fmt_loss(d.loss_last)}",
        ),
        (
            "speed",
            f"{fmt_seconds(d.step_time)} a step (median) · "
            + (f"{d.steps_per_sec:.3g} steps/s" if d.steps_per_sec else "n/a steps/s")
            + (f" · {d.samples_per_sec:.4g} samples/s" if d.samples_per_sec else ""),
        ),
    ]
    shares = [f"{phase_words(k)} {fmt_pct(v)}" for k, v in d.phases.items() if v]
    measured = [v for v in d.phases.values() if v is not None]
    if measured and sum(measured) < 0.95:  # the rest: the script's own work between phases
        shares.append(f"other {fmt_pct(1.0 - sum(measured))}")
    if shares:
        lines.append(("time went to", " · ".join(shares)))
    if d.probe_cost is not None:
        lines.append(("probe cost", f"{fmt_pct(d.probe_cost)} of the step time"))
    for dev in d.memory.get("cuda") or []:
        lines.append(
            (
                f"memory cuda:{dev.get('index', '?')}",
                f"peak {fmt_bytes(dev.get('peak'))} · reserved {fmt_bytes(dev.get('reserved'))}",
            )
        )
    if d.memory.get("host_rss") is not None:
        lines.append(("host memory", f"{fmt_bytes(d.memory['host_rss'])} resident"))
    return lines
