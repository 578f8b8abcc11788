"""Compaction: rewrite a recording keeping every scalar and thinning old bulky data by kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tdbg.protocol.framing import pack
from tdbg.protocol.steps import (
    batch_bytes,
    concat_steps,
    drop_grad_rows,
    grad_row_bytes,
    grad_rows,
    joinable,
    last_step,
)
from tdbg.recording.blocks import BlockWriter
from tdbg.recording.reader import Recording

THINNED_KINDS = (
    "grads",
    "activations",
    "system",
    "probe",
    "updates",
    "histograms",
    "console",
)  # what a budget bounds, kind by kind
CHUNK_BYTES = 1 << 20  # consecutive steps batches are joined into frames of about this much


@dataclass(slots=True)
class Tally:
    """How many items of each thinned kind a file holds, and their bytes (probe thread only)."""

    items: dict[str, int] = field(default_factory=lambda: dict.fromkeys(THINNED_KINDS, 0))
    size: dict[str, int] = field(default_factory=lambda: dict.fromkeys(THINNED_KINDS, 0))

    def add(self, kind: str, items: int, size: int) -> None:
        self.items[kind] += items
        self.size[kind] += size

    def copy(self) -> Tally:
        return Tally(dict(self.items), dict(self.size))

    def plus_since(self, now: Tally, then: Tally) -> Tally:
        """This tally plus what ``now`` gained over ``then``."""
        out = self.copy()
        for kind in THINNED_KINDS:
            out.add(kind, now.items[kind] - then.items[kind], now.size[kind] - then.size[kind])
        return out


def keep_newest(n: int, budget: int) -> bytearray | None:
    """Which of ``n`` items (oldest first) to keep so that at most ``budget`` remain, or None
    when all fit: like the probe's History, the older half loses every other item until they
    fit — so the newest items stay in full and the older an item, the sparser its neighbours.

    The kept items are a few ``range`` segments, never a list of n numbers: millions of rows
    cost a few KiB and a handful of slice operations, not a Python object per row."""
    if n <= budget:
        return None
    segments = [range(n)]
    total = n
    while total > budget:
        if budget <= 0:
            segments, total = [], 0
            break
        half = total // 2
        if half < 2:
            segments = _split(segments, 1)[1]  # two or three left over one slot: drop the oldest
            total -= 1
            continue
        old, new = _split(segments, half)
        thinned: list[range] = []
        position = 0  # index of the segment's first item within the old half
        for r in old:
            thinned.append(r[position % 2 :: 2])  # the old half's even positions
            position += len(r)
        segments = [r for r in thinned if len(r)] + new
        total = sum(len(r) for r in segments)
    mask = bytearray(n)
    for r in segments:
        if len(r):
            mask[r.start : r[-1] + 1 : r.step] = b"\x01" * len(r)
    return mask


def _split(segments: list[range], k: int) -> tuple[list[range], list[range]]:
    """The first ``k`` items of ``segments`` and the rest, as segments."""
    head: list[range] = []
    for i, r in enumerate(segments):
        if k <= 0:
            return head, segments[i:]
        if len(r) <= k:
            head.append(r)
            k -= len(r)
            continue
        return head + [r[:k]], [r[k:], *segments[i + 1 :]]
    return head, []


@dataclass(slots=True)
class Result:
    size: int  # bytes written to the new file
    tally: Tally  # what it holds of each thinned kind
    last_step: int | None


def compact(
    source: Path, end: int, fd: int, head: bytes, tally: Tally, budgets: dict[str, int]
) -> Result:
    """Write to ``fd`` a recording holding what ``source`` holds in its first ``end`` bytes (a
    mark boundary), with each thinned kind cut to its byte budget (``keep_newest``); ``head`` is
    the file header and ``recording`` frame. Raises on any error (the caller keeps the old file).
    """
    masks: dict[str, bytearray | None] = {}
    for kind in THINNED_KINDS:
        n, size = tally.items[kind], tally.size[kind]
        masks[kind] = None if size <= budgets[kind] else keep_newest(n, n * budgets[kind] // size)
    seen = dict.fromkeys(THINNED_KINDS, 0)
    out = Tally()
    writer = BlockWriter(fd, head[:12])
    writer.add(head[12:])
    pending: list[dict[str, Any]] = []
    pending_bytes = 0

    def flush_steps() -> None:
        nonlocal pending_bytes
        if pending:
            joined = concat_steps(pending) if len(pending) > 1 else pending[0]
            for msg in [joined] if joined is not None else pending:
                writer.add(pack(msg))
        pending.clear()
        pending_bytes = 0

    recording = Recording(source)
    for msg in recording.messages(end=end):
        mtype = msg.get("type")
        if mtype == "steps":
            rows = grad_rows(msg)
            mask = masks["grads"]
            first = seen["grads"]
            seen["grads"] += rows
            if mask is not None and rows:
                keep = mask[first : first + rows]
                keep += b"\x01" * (rows - len(keep))  # rows past the tally: kept
                if not all(keep):
                    msg = drop_grad_rows(msg, keep)
            kept = grad_rows(msg)
            out.add("grads", kept, kept * grad_row_bytes(msg))
            step = last_step(msg)
            if step is not None:
                writer.last_step = step
            size = batch_bytes(msg)
            if pending and (
                not joinable(pending[0], msg)
                or pending_bytes + size > CHUNK_BYTES  # a joined frame stays under the frame cap
            ):
                flush_steps()
            pending.append(msg)
            pending_bytes += size
            continue
        flush_steps()  # other messages stay where they were: the replay files them by position
        frame = pack(msg)
        if mtype in masks:
            kind = str(mtype)
            i = seen[kind]
            seen[kind] += 1
            mask = masks[kind]
            if mask is not None and i < len(mask) and not mask[i]:
                continue
            out.add(kind, 1, len(frame))
        writer.add(frame)
    flush_steps()
    if recording.stopped is not None:
        raise ValueError(recording.stopped)
    writer.close_block()
    return Result(writer.size, out, writer.last_step)
