"""A distributed job seen whole: its ranks' states compared — stragglers, diverged ranks, NaN on
some ranks only. Everything is compared here, outside the training processes (no collective)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tdbg.tui.state.run_state import RunState

RECENT = 20  # steps a straggler is judged over
STRAGGLER_RATIO = 1.25  # a rank this much slower than the others' median...
STRAGGLER_MIN_SECONDS = 0.002  # ...and at least this much slower per step (noise on tiny steps)
DIVERGENCE_RTOL = 1e-3  # DDP: the all-reduced gradients agree to this relative tolerance
PHASES = ("data_time", "forward_time", "backward_time", "optimizer_time")
PHASE_WORDS = {
    "data_time": "input wait",
    "forward_time": "forward",
    "backward_time": "backward",
    "optimizer_time": "optimizer",
}


@dataclass(frozen=True)
class JobFinding:
    kind: str  # "straggler" | "rank_divergence" | "nonfinite_ranks"
    ranks: list[int]
    message: str
    layers: list[str] = field(default_factory=list)


@dataclass
class Job:
    """The ranks of one job (same job id), by rank."""

    job: str
    ranks: dict[int, RunState]

    @staticmethod
    def group(states: list[RunState]) -> tuple[list[Job], list[RunState]]:
        """Jobs (runs that share a job id and have a world size) and the single runs left."""
        jobs: dict[str, dict[int, RunState]] = {}
        single: list[RunState] = []
        for state in states:
            job = str(state.run.get("job") or "")
            if not job or not isinstance(state.run.get("world_size"), int):
                single.append(state)
                continue
            jobs.setdefault(job, {})[int(state.run.get("rank") or 0)] = state
        return [Job(job, dict(sorted(r.items()))) for job, r in jobs.items()], single

    @property
    def world_size(self) -> int:
        sizes = [s.run.get("world_size") for s in self.ranks.values()]
        return max((int(w) for w in sizes if isinstance(w, int)), default=len(self.ranks))

    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.ranks]

    def findings(self) -> list[JobFinding]:
        out: list[JobFinding] = list(self._hang())
        out.extend(self._stragglers())
        out.extend(self._divergence())
        out.extend(self._nonfinite())
        return out

    # --- where a hang is stuck ---------------------------------------------------------------
    def _hang(self) -> list[JobFinding]:
        """Stalled ranks' last collectives compared: the others wait in collective #N; the
        ranks whose last is below N never entered it, and their stacks say where they are."""
        last: dict[int, tuple[int, str, str]] = {}  # rank -> (seq, op, where it is stuck)
        for rank, state in self.ranks.items():
            stalls = [a for a in state.alerts if a.kind == "stalled" and a.collective]
            if not stalls:
                continue
            latest = stalls[0]  # alerts are kept newest first
            collective = latest.collective or {}
            seq = collective.get("seq")
            if isinstance(seq, int):
                where = latest.message.split(" — stuck at ", 1)[-1]
                last[rank] = (seq, str(collective.get("op") or "collective"), where)
        if len(last) < 2:
            return []
        top = max(seq for seq, _, _ in last.values())
        behind = sorted(r for r, (seq, _, _) in last.items() if seq < top)
        waiting = sorted(r for r, (seq, _, _) in last.items() if seq == top)
        if not behind:
            return []
        op = last[waiting[0]][1]
        where = "; ".join(f"rank {r} stuck at {last[r][2]}" for r in behind if last[r][2])
        return [
            JobFinding(
                "hang",
                behind,
                f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} never "
                f"entered collective #{top} ({op}) that rank{'s' if len(waiting) > 1 else ''} "
                f"{', '.join(map(str, waiting))} wait{'' if len(waiting) > 1 else 's'} in"
                + (f"; {where}" if where else ""),
            )
        ]

    # --- stragglers ---------------------------------------------------------------------------
    def _recent(self, state: RunState, column: str) -> float | None:
        values = state.cols[column].values[-RECENT:]
        values = values[np.isfinite(values)]
        return float(np.median(values)) if values.size >= RECENT // 2 else None

    def _busy(self, state: RunState) -> float | None:
        """A rank's own time per step: the step less its backward. Under data parallelism the
        ranks wait for each other inside backward (the all-reduce), so their step times are
        equal; what the straggler spends elsewhere (waiting for data, a slow forward) the
        others spend waiting in backward."""
        step = state.cols["step_time"].values[-RECENT:]
        backward = state.cols["backward_time"].values[-RECENT:]
        busy = np.where(np.isfinite(backward), step - backward, step)
        busy = busy[np.isfinite(busy)]
        return float(np.median(busy)) if busy.size >= RECENT // 2 else None

    def _stragglers(self) -> list[JobFinding]:
        known = {r: t for r, s in self.ranks.items() if (t := self._busy(s)) is not None}
        if len(known) < 2:
            return []
        slow: list[int] = []
        for rank, t in known.items():
            typical = float(np.median([v for r, v in known.items() if r != rank]))
            if t > STRAGGLER_RATIO * typical and t - typical > STRAGGLER_MIN_SECONDS:
                slow.append(rank)
        if not slow or len(slow) == len(known):
            return []
        out = []
        for rank in slow:
            peers = [r for r in known if r not in slow]
            typical = float(np.median([known[r] for r in peers]))
            phase, extra = self._why_slow(rank, peers)
            because = f"; mostly {PHASE_WORDS[phase]} (+{extra * 1e3:.1f} ms)" if phase else ""
            out.append(
                JobFinding(
                    "straggler",
                    [rank],
                    f"rank {rank} holds the others up: {known[rank] * 1e3:.1f} ms of its own "
                    f"work a step vs {typical * 1e3:.1f} ms on the others{because}",
                )
            )
        return out

    def _why_slow(self, rank: int, others: list[int]) -> tuple[str | None, float]:
        best, extra = None, 0.0
        for phase in ("data_time", "forward_time", "optimizer_time"):
            mine = self._recent(self.ranks[rank], phase)
            theirs = [self._recent(self.ranks[r], phase) for r in others]
            known = [t for t in theirs if t is not None]
            if mine is None or not known:
                continue
            diff = mine - float(np.median(known))
            if diff > extra:
                best, extra = phase, diff
        return best, extra

    # --- diverged ranks -------------------------------------------------------------------------
    def data_parallel(self) -> bool:
        """Whether the rule 'every rank has the same gradients' applies: every rank watches the
        same layers with the same sizes (DDP). FSDP shards and model parallelism differ."""
        layouts = {(tuple(s.layer_names), tuple(s.layer_numel)) for s in self.ranks.values()}
        return len(layouts) == 1 and len(self.ranks) > 1 and bool(next(iter(layouts))[0])

    def _divergence(self) -> list[JobFinding]:
        if not self.data_parallel():
            return []
        rows = {r: _grad_rows(s) for r, s in self.ranks.items()}
        common = set.intersection(*(set(rows[r]) for r in rows))
        if not common:
            return []
        names = next(iter(self.ranks.values())).layer_names
        bad: dict[int, list[str]] = {}
        diverged: list[int] = []  # common steps where some rank disagreed
        for step in sorted(common):
            reference = np.median(np.stack([rows[r][step] for r in rows]), axis=0)
            found = False
            for rank, by_step in rows.items():
                with np.errstate(invalid="ignore", divide="ignore"):
                    rel = np.abs(by_step[step] - reference) / np.maximum(np.abs(reference), 1e-12)
                layers = [names[i] for i in np.flatnonzero(rel > DIVERGENCE_RTOL) if i < len(names)]
                if layers:
                    found = True
                    bad.setdefault(rank, [])
                    bad[rank] = sorted(set(bad[rank]) | set(layers))
            if found:
                diverged.append(step)
        if not bad:
            return []
        # With two ranks (or most ranks off the median) there is no majority to blame: name
        # every rank that disagrees.
        layers = sorted({name for names_ in bad.values() for name in names_})
        ranks = sorted(bad)
        shown = ", ".join(layers[:5]) + (f" (+{len(layers) - 5})" if len(layers) > 5 else "")
        return [
            JobFinding(
                "rank_divergence",
                ranks,
                f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: gradients "
                f"differ from the other ranks' in {shown} at {len(diverged)} of the "
                f"{len(common)} latest steps all ranks sampled (first: step {diverged[0]}) — "
                "under data "
                "parallelism they should be equal after the all-reduce (a skipped all-reduce, "
                "a comm hook, other weights?)",
                layers,
            )
        ]

    def _nonfinite(self) -> list[JobFinding]:
        bad = [r for r, s in self.ranks.items() if _last_loss_nonfinite(s)]
        if not bad or len(bad) == len(self.ranks):
            return []
        return [
            JobFinding(
                "nonfinite_ranks",
                bad,
                f"non-finite loss on rank{'s' if len(bad) > 1 else ''} "
                f"{', '.join(map(str, bad))} only",
            )
        ]


def _grad_rows(state: RunState) -> dict[int, np.ndarray]:
    """The newest sampled per-layer rows, by step (enough to find a step every rank sampled)."""
    steps, rows = state.grads.recent_steps(RECENT), state.grads.recent(RECENT)
    return {int(step): row for step, row in zip(steps, rows, strict=True)}


def _last_loss_nonfinite(state: RunState) -> bool:
    loss = state.last_loss
    return loss is not None and not math.isfinite(loss)
