"""The run's history for late clients: packed step batches and alerts, in bounded memory."""

from __future__ import annotations

from collections import deque
from typing import Any

from tdbg.protocol.framing import MAX_OUTBOUND_FRAME
from tdbg.protocol.steps import (
    StepRecord,
    batch_bytes,
    concat_steps,
    pack_steps,
    row_bytes,
    unpack_steps,
)

MERGE_EVERY = 64  # small live batches merged into one chunk this often
CHUNK_BYTES = 1 << 20  # a merged chunk holds about this much (well under the 4 MiB frame cap)


class History:
    """Every step's scalars and the sampled per-layer rows, as packed ``steps`` messages.

    Stored packed (about 100 bytes a step plus 4 bytes a layer per sampled row) so a long run
    costs little. Over ``budget`` bytes, the older half loses every other per-layer row — the
    scalars of every step are kept; only if they alone exceed the budget are old steps thinned.
    """

    def __init__(self, n_layers: int, budget: int = 64 << 20, max_alerts: int = 1024) -> None:
        self.n_layers = n_layers
        self.budget = budget
        self.chunks: list[dict[str, Any]] = []
        self._recent: list[dict[str, Any]] = []
        self.bytes = 0
        self.alerts: deque[dict[str, Any]] = deque(maxlen=max_alerts)
        self.thinned = 0

    def add(self, msg: dict[str, Any]) -> None:
        self._recent.append(msg)
        self.bytes += batch_bytes(msg)
        if len(self._recent) >= MERGE_EVERY:
            self._merge_recent()
        if self.bytes > self.budget:
            self._thin()

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
        if joined is None:  # param groups changed mid-way: re-pad through records (rare)
            self.chunks.extend(self._repack([r for m in group for r in unpack_steps(m)]))
        else:
            self.chunks.append(joined)

    def _thin(self) -> None:
        self._merge_recent()
        half = max(1, len(self.chunks) // 2)
        old = [r for msg in self.chunks[:half] for r in unpack_steps(msg)]
        sampled = [r for r in old if r.grad_norms is not None]
        if len(sampled) > 1:
            for r in sampled[1::2]:
                r.grad_norms = None
                r.grad_total = None
        else:  # no per-layer rows left to drop: thin the scalars themselves
            old = old[::2]
        self.thinned += 1
        self.chunks[:half] = self._repack(old)
        self.bytes = sum(batch_bytes(m) for m in self.chunks)

    def replay(self) -> list[dict[str, Any]]:
        """Messages a late client gets before live data: steps (oldest first), then alerts."""
        out = [dict(m, history=True) for m in (*self.chunks, *self._recent)]
        out.extend(dict(a, history=True) for a in self.alerts)
        return out
