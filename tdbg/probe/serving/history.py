"""The run's history for late clients: packed step batches and alerts, in bounded memory."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from tdbg.protocol.framing import MAX_OUTBOUND_FRAME
from tdbg.protocol.messages.alert import Alert
from tdbg.protocol.steps import (
    StepRecord,
    batch_bytes,
    concat_steps,
    drop_grad_rows,
    grad_rows,
    pack_steps,
    row_bytes,
    thin_rows,
    unpack_steps,
)

MERGE_EVERY = 64  # small live batches merged into one chunk this often
CHUNK_BYTES = 1 << 20  # a merged chunk holds about this much (well under the 4 MiB frame cap)
MAX_PASSES = 256  # thinning passes one add() may run (each touches one or two chunks)


class History:
    """Every step's scalars and the sampled per-layer rows, as packed ``steps`` messages, kept
    within ``budget`` bytes after every :meth:`add`.

    Stored packed (about 130 bytes a step plus 4 bytes a layer per sampled row). Over budget,
    one pass at a time, oldest first and lowest resolution first: a chunk loses every other
    per-layer row; once no old chunk has rows left to lose, a chunk's steps are halved (every
    other step kept) and it is joined with its older neighbour of the same resolution. So the
    scalars of every step are kept as long as the budget allows, old stretches thin evenly,
    and each pass touches one or two chunks (~1-2 MiB, a few milliseconds): the probe thread
    never reworks the whole history at once. The newest chunk and the live batches after it
    are never thinned (unless the budget cannot hold even them).
    """

    def __init__(self, n_layers: int, budget: int = 64 << 20, max_alerts: int = 1024) -> None:
        self.n_layers = n_layers
        self.budget = budget
        self.chunks: list[dict[str, Any]] = []
        self.grad_levels: list[int] = []  # per chunk: times its per-layer rows were halved
        self.step_levels: list[int] = []  # per chunk: times its steps were halved
        self._recent: list[dict[str, Any]] = []
        self.bytes = 0
        self.alerts: deque[Alert] = deque(maxlen=max_alerts)
        self.thinned = 0  # thinning passes so far

    def add(self, msg: dict[str, Any]) -> None:
        self._recent.append(msg)
        self.bytes += batch_bytes(msg)
        if len(self._recent) >= MERGE_EVERY or (self.bytes > self.budget and self._recent):
            # Over budget the live batches join the chunks at once: they are the newest, so
            # the older chunks (not one old chunk again and again) pay for the room they need.
            self._merge_recent()
        passes = 0
        while self.bytes > self.budget and passes < MAX_PASSES:
            if not self._thin_once():
                if not self._recent:
                    break
                self._merge_recent()  # live batches become a chunk that can be thinned
                continue
            passes += 1

    # --- chunks ---------------------------------------------------------------------------------
    def _append_chunk(self, msg: dict[str, Any]) -> None:
        self.chunks.append(msg)
        self.grad_levels.append(0)
        self.step_levels.append(0)

    def _repack(self, records: list[StepRecord]) -> list[dict[str, Any]]:
        """Pack records into chunks of about CHUNK_BYTES."""
        row = row_bytes(self.n_layers)
        per_chunk = max(1, min(CHUNK_BYTES, MAX_OUTBOUND_FRAME // 2) // row)
        return [
            pack_steps(records[i : i + per_chunk], self.n_layers)
            for i in range(0, len(records), per_chunk)
        ]

    def _merge_recent(self) -> None:
        """Join the small live batches into chunks of about CHUNK_BYTES, byte-wise."""
        group: list[dict[str, Any]] = []
        size = 0
        for msg in self._recent:
            if group and size + batch_bytes(msg) > CHUNK_BYTES:
                self._append_joined(group)
                group, size = [], 0
            group.append(msg)
            size += batch_bytes(msg)
        if group:
            self._append_joined(group)
        self._recent = []

    def _append_joined(self, group: list[dict[str, Any]]) -> None:
        joined = concat_steps(group)
        if joined is None:  # layers or param groups changed mid-way: re-pad through records
            for chunk in self._repack([r for m in group for r in unpack_steps(m)]):
                self._append_chunk(chunk)
        else:
            self._append_chunk(joined)

    # --- thinning -------------------------------------------------------------------------------
    def _replace(self, i: int, msg: dict[str, Any]) -> None:
        self.bytes += batch_bytes(msg) - batch_bytes(self.chunks[i])
        self.chunks[i] = msg

    def _thin_once(self) -> bool:
        """One pass on one or two chunks; False when no chunk can give anything more."""
        # The newest chunk stays whole while there are older ones to thin.
        candidates = range(max(1, len(self.chunks) - 1)) if self.chunks else range(0)
        with_rows = [i for i in candidates if grad_rows(self.chunks[i])]
        if with_rows:
            i = min(with_rows, key=lambda j: (self.grad_levels[j], j))
            rows = grad_rows(self.chunks[i])
            keep = [1 if k % 2 == 0 else 0 for k in range(rows)] if rows > 1 else [0]
            self._replace(i, drop_grad_rows(self.chunks[i], keep))
            self.grad_levels[i] += 1
            self.thinned += 1
            return True
        thinnable = [i for i in candidates if int(self.chunks[i]["n"]) > 1]
        if not thinnable:
            return False
        i = min(thinnable, key=lambda j: (self.step_levels[j], j))
        self._replace(i, thin_rows(self.chunks[i]))
        self.step_levels[i] += 1
        self.thinned += 1
        # Joined with its older neighbour of the same resolution: the chunk count stays small.
        if i > 0 and self.step_levels[i - 1] == self.step_levels[i]:
            older, newer = self.chunks[i - 1], self.chunks[i]
            if batch_bytes(older) + batch_bytes(newer) <= CHUNK_BYTES:
                joined = concat_steps([older, newer])
                if joined is not None:
                    self.bytes -= batch_bytes(older) + batch_bytes(newer) - batch_bytes(joined)
                    self.chunks[i - 1 : i + 1] = [joined]
                    self.grad_levels[i - 1 : i + 1] = [max(self.grad_levels[i - 1 : i + 1])]
                    del self.step_levels[i]
        return True

    def replay(self) -> list[dict[str, Any]]:
        """Messages a late client gets before live data: steps (oldest first), then alerts."""
        out = [dict(m, history=True) for m in (*self.chunks, *self._recent)]
        out.extend(replace(a, history=True).to_wire() for a in self.alerts)
        return out
