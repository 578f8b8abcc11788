"""Runs grouped into distributed jobs (a job id and a world size), and which job a set of runs
across nodes shows: one job, or a one-line refusal when ranks of several jobs are there."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tdbg.connect.runtime import RunEntry, discover
from tdbg.connect.target_errors import TargetError

SHOWN = 4  # jobs named in the "several jobs" refusal
# A job of more ranks than this is read through node summaries (the job screen at scale); up
# to this many, every rank's whole stream (the per-rank table).
SCALE_FROM = 16


def job_of(entry: RunEntry) -> str | None:
    """The job id of a rank of a distributed job; None for a single run."""
    job = str(entry.meta.get("job") or "")
    return job if job and isinstance(entry.meta.get("world_size"), int) else None


def job_entries(entries: Sequence[RunEntry]) -> dict[str, dict[int, RunEntry]]:
    """Runs that belong to a distributed job, by job and rank; a rank seen twice (a restart) is
    its newest run (``entries`` oldest first, as discovery lists them)."""
    jobs: dict[str, dict[int, RunEntry]] = {}
    for entry in entries:
        job = job_of(entry)
        if job is not None:
            jobs.setdefault(job, {})[int(entry.meta.get("rank") or 0)] = entry
    return jobs


def job_size(entries: Sequence[RunEntry], job: str) -> int:
    """The job's world size as its listed ranks say it (else how many are listed)."""
    ranks = [e for e in entries if job_of(e) == job]
    sizes = [w for e in ranks if isinstance(w := e.meta.get("world_size"), int)]
    return max([len(ranks), *sizes])


def _ranks(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"ranks {ordered[0]}-{ordered[-1]}"
    return f"rank{'s' if len(ordered) > 1 else ''} {', '.join(map(str, ordered))}"


def one_job(
    entries: Sequence[RunEntry], node_of: Callable[[RunEntry], str] = lambda e: ""
) -> str | None:
    """The job that ``entries`` (the runs listed on the nodes) show as one screen: every run is a
    rank of the same job; None when some run is not a rank of a job (the run picker then).

    Ranks of several jobs are never mixed: TargetError naming each job, its ranks and nodes, and
    how to pick one. ``node_of`` names an entry's node for that message.
    """
    by_job: dict[str, list[RunEntry]] = {}
    for entry in entries:
        job = job_of(entry)
        if job is not None:
            by_job.setdefault(job, []).append(entry)
    if len(by_job) > 1:
        parts = []
        for job, ranks in list(by_job.items())[:SHOWN]:
            nodes = sorted({node_of(e) for e in ranks} - {""})
            where = f" on {', '.join(nodes)}" if nodes else ""
            parts.append(f"{job} ({_ranks([int(e.meta.get('rank') or 0) for e in ranks])}{where})")
        more = f"; and {len(by_job) - SHOWN} more" if len(by_job) > SHOWN else ""
        raise TargetError(
            f"ranks of {len(by_job)} different jobs here: {'; '.join(parts)}{more}; "
            "pick one with --job JOB"
        )
    if len(by_job) == 1 and sum(map(len, by_job.values())) == len(entries):
        return next(iter(by_job))
    return None


def job_ranks(job: str, entries: Sequence[RunEntry]) -> dict[int, RunEntry]:
    """The live ranks of job ``job`` among ``entries`` (the runs discovery lists), by rank;
    TargetError naming the jobs there are when it has none."""
    jobs = job_entries(entries)
    if job in jobs:
        return dict(sorted(jobs[job].items()))
    shown = list(jobs.items())[:SHOWN]
    there = "; ".join(f"{name} ({_ranks(list(ranks))})" for name, ranks in shown)
    raise TargetError(
        f"no rank of job {job} is running here"
        + (f"; jobs here: {there}" if there else ": no distributed job is running here"),
        "missing",
    )


def local_job(directory: Path | None = None) -> str | None:
    """The job id when every local run is a rank of one job (two ranks or more), else None:
    ``tdbg-tui`` alone then shows the job screen."""
    entries = discover(directory)
    jobs = job_entries(entries)
    if len(entries) < 2 or len(jobs) != 1:
        return None
    job, ranks = next(iter(jobs.items()))
    return job if len(ranks) == len(entries) else None
