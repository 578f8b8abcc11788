"""A job's per-rank profiles as text: the slowest and fastest rank's top ops side by side, then
one line per other rank."""

from __future__ import annotations

from typing import Any, TextIO

from tdbg.cli.report import _console
from tdbg.format import fmt, fmt_bytes, fmt_us
from tdbg.model.rank_profiles import compare_profiles, rank_line


def print_job_profile(
    job: str, results: dict[int, Any], out: TextIO, sort: str | None = None, limit: int = 20
) -> None:
    """The slowest and the fastest rank's ops aligned by name (time per step, and how much
    more the slowest spends), then every other rank's line and the traces' paths."""
    from rich.table import Table

    console = _console(out)
    comparison = compare_profiles(results, limit)
    if comparison is None:
        console.print(f"job {job}: no rank answered")
        return
    slow, fast = comparison.slowest, comparison.fastest
    console.print(f"job {job}: {len(comparison.ranks)} ranks profiled", soft_wrap=True)
    console.print(f"slowest {rank_line(slow)}")
    if fast is not slow:
        console.print(f"fastest {rank_line(fast)}")
    column = slow.column.replace("_", " ")
    table = Table(title=f"{column} per step, by op", title_justify="left")
    table.add_column("op", no_wrap=True, overflow="ellipsis", min_width=12, max_width=60)
    sides = [slow] if fast is slow else [slow, fast]
    for side in sides:
        table.add_column(f"rank {side.rank} calls", justify="right", no_wrap=True)
        table.add_column(f"rank {side.rank}", justify="right", no_wrap=True)
    if fast is not slow:
        table.add_column("slowest - fastest", justify="right", no_wrap=True)
    ops = comparison.ops
    if sort == "name":
        ops = sorted(ops, key=lambda op: op.name)
    for op in ops:
        cells = [op.name]
        for side, row, per_step in ((slow, op.slow, op.slow_us), (fast, op.fast, op.fast_us)):
            if side is fast and fast is slow:
                break
            cells += [fmt(row.calls, "d") if row else "-", fmt_us(per_step)]
        if fast is not slow:
            cells.append(op.difference_text)
        table.add_row(*cells)
    console.print(table)
    biggest = comparison.biggest_difference_line()
    if biggest is not None:
        console.print(biggest, soft_wrap=True)
    for other in comparison.others:
        console.print(rank_line(other))
    for p in comparison.ranks:
        trace = p.profile.trace
        where = f"{trace.path} ({fmt_bytes(trace.size)})" if trace else "none written"
        console.print(f"rank {p.rank} trace: {where}", soft_wrap=True)
