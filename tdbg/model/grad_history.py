"""Per-layer gradient norms in bounded memory: recent rows exact, older ones evenly thinned."""

from __future__ import annotations

import numpy as np

RECENT_GRAD_ROWS = 512  # sampled grad rows kept at full resolution
OLD_GRAD_ROWS = 512  # decimated older rows; the stride doubles whenever this fills


class GradHistory:
    """Per-layer gradient norms in bounded memory.

    The latest ``recent`` sampled rows are kept at full resolution in a ring. Rows that fall out of
    the ring are decimated into ``old`` rows: one in ``stride`` is kept, and when the old store is
    full every other row is dropped and the stride doubles. Memory is (recent + old) x layers x 4
    bytes whatever the run's length: 4 MiB for 1,000 layers.
    """

    def __init__(self, n_layers: int, recent: int = RECENT_GRAD_ROWS, old: int = OLD_GRAD_ROWS):
        self.n_layers = n_layers
        self.recent_cap = recent
        self.old_cap = old
        self._ring = np.full((recent, n_layers), np.nan, dtype=np.float32)
        self._ring_steps = np.zeros(recent, dtype=np.int64)
        self._head = 0  # next slot to write
        self._count = 0
        self._old = np.full((old, n_layers), np.nan, dtype=np.float32)
        self._old_steps = np.zeros(old, dtype=np.int64)
        # Each old row's eviction number (rows leave the ring numbered 0, 1, 2, ...): the next
        # row kept is the one a whole stride after the last kept, whatever the batch sizes were.
        self._old_evicted = np.zeros(old, dtype=np.int64)
        self._old_n = 0
        self.stride = 1
        self._evicted = 0  # rows evicted from the ring so far
        self.total_rows = 0

    def __len__(self) -> int:
        return self._count + self._old_n

    def widen(self, n_layers: int) -> None:
        """Layers were added mid-run (the list only grows): earlier rows read NaN for them."""
        extra = n_layers - self.n_layers
        if extra <= 0:
            return
        self._ring = np.pad(self._ring, ((0, 0), (0, extra)), constant_values=np.nan)
        self._old = np.pad(self._old, ((0, 0), (0, extra)), constant_values=np.nan)
        self.n_layers = n_layers

    def recent_steps(self, n: int) -> np.ndarray:
        """The steps of :meth:`recent`'s rows, oldest first."""
        n = min(n, self._count)
        idx = (self._head - n + np.arange(n)) % self.recent_cap
        return self._ring_steps[idx]

    @classmethod
    def from_rows(
        cls,
        n_layers: int,
        steps: np.ndarray,
        rows: np.ndarray,
        recent: int = RECENT_GRAD_ROWS,
        old: int = OLD_GRAD_ROWS,
    ) -> GradHistory:
        """A history of ``rows`` (k x layers, step order) built at once, for a replay cursor:
        the last ``recent`` rows exact, the older ones one in a power-of-two stride so that at
        most ``old`` are kept, as :meth:`extend` would leave them. O((recent + old) x layers)."""
        history = cls(n_layers, recent, old)
        k = len(steps)
        r = min(k, recent)
        older = k - r
        stride = 1
        while older and -(-older // stride) > old:
            stride *= 2
        idx = np.arange(0, older, stride)
        history._put_old(steps[idx], rows[idx], idx)
        history.stride = stride
        history._evicted = older
        history._ring[:r] = rows[older:]
        history._ring_steps[:r] = steps[older:]
        history._head = r % recent
        history._count = r
        history.total_rows = k
        return history

    def extend(self, steps: np.ndarray, rows: np.ndarray) -> None:
        """Append sampled rows (k x layers) in step order. O(k x layers)."""
        k = rows.shape[0]
        if k == 0:
            return
        self.total_rows += k
        cap = self.recent_cap
        if k > cap:  # rows that would be overwritten within this very batch go straight to old
            self._evict(self._ordered_recent_steps(), self._ordered_recent())
            self._head, self._count = 0, 0
            self._evict(steps[: k - cap], rows[: k - cap])
            steps, rows, k = steps[k - cap :], rows[k - cap :], cap
        overflow = self._count + k - cap
        if overflow > 0:
            idx = (self._head - self._count + np.arange(overflow)) % cap
            self._evict(self._ring_steps[idx], self._ring[idx])
            self._count -= overflow
        idx = (self._head + np.arange(k)) % cap
        self._ring[idx] = rows
        self._ring_steps[idx] = steps
        self._head = (self._head + k) % cap
        self._count += k

    def _evict(self, steps: np.ndarray, rows: np.ndarray) -> None:
        m = rows.shape[0]
        numbers = self._evicted + np.arange(m)  # these rows' eviction numbers
        start = 0
        while start < m:
            # Keep every stride-th row counted from the last row kept (the run's first row when
            # nothing is kept yet), so old rows stay evenly spaced across batches and halvings.
            if self._old_n:
                due = int(self._old_evicted[self._old_n - 1]) + self.stride
            else:
                due = int(numbers[0])
            first = max(start, due - int(numbers[0]))
            take = np.arange(first, m, self.stride)
            room = self.old_cap - self._old_n
            if len(take) <= room:
                self._put_old(steps[take], rows[take], numbers[take])
                break
            keep = take[:room]
            self._put_old(steps[keep], rows[keep], numbers[keep])
            start = int(keep[-1]) + 1 if len(keep) else start
            self._compact()
        self._evicted += m

    def _put_old(self, steps: np.ndarray, rows: np.ndarray, numbers: np.ndarray) -> None:
        n = len(steps)
        self._old[self._old_n : self._old_n + n] = rows
        self._old_steps[self._old_n : self._old_n + n] = steps
        self._old_evicted[self._old_n : self._old_n + n] = numbers
        self._old_n += n

    def _compact(self) -> None:
        """Drop every other old row: the stride doubles, the spacing stays even."""
        n = len(range(0, self._old_n, 2))
        for store in (self._old, self._old_steps, self._old_evicted):
            store[:n] = store[: self._old_n : 2].copy()
        self._old_n = n
        self.stride *= 2

    def _ordered_recent(self) -> np.ndarray:
        idx = (self._head - self._count + np.arange(self._count)) % self.recent_cap
        return self._ring[idx]

    def _ordered_recent_steps(self) -> np.ndarray:
        idx = (self._head - self._count + np.arange(self._count)) % self.recent_cap
        return self._ring_steps[idx]

    def matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, rows x layers), oldest first: decimated old rows, then the recent ring."""
        steps = np.concatenate([self._old_steps[: self._old_n], self._ordered_recent_steps()])
        rows = np.concatenate([self._old[: self._old_n], self._ordered_recent()])
        return steps, rows

    def recent(self, n: int) -> np.ndarray:
        """The last ``n`` sampled rows (at most the ring), oldest first."""
        n = min(n, self._count)
        idx = (self._head - n + np.arange(n)) % self.recent_cap
        return self._ring[idx]

    def latest(self) -> np.ndarray | None:
        if self._count == 0:
            return None
        return self._ring[(self._head - 1) % self.recent_cap]

    def latest_step(self) -> int | None:
        if self._count == 0:
            return None
        return int(self._ring_steps[(self._head - 1) % self.recent_cap])
