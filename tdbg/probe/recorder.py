"""Recorder: appends the probe's outbound stream to a crash-safe, size-bounded recording file.

The recorder is a sink beside the clients on the probe thread: it gets the frames the server has
already encoded for them (``layers``, ``steps``, ``alert``, ``system``, ``probe``, ``job``,
``activations``) and appends them to a file in the format of :mod:`tdbg.recording`:

* a fixed 12-byte header (``b"TDBG-REC"``, u16 format version, u16 protocol version), then the
  protocol's own length-prefixed msgpack frames, starting with a ``recording`` frame carrying the
  run info, so that the same sans-IO :class:`~tdbg.protocol.Decoder` reads sockets and files;
* frames are buffered in memory and written with ``os.write`` at least every
  :data:`FLUSH_SECONDS` (0.25 s), each write ending with a ``record_mark`` frame holding the
  CRC-32 of every byte written since the previous mark. A ``kill -9`` therefore loses at most the
  last flush interval (plus the probe's 0.1 s tick), and a reader can tell a flipped byte from
  data: it keeps everything up to the last mark that checks out.

Size bound. Every step's scalars are kept (about ``105 + 8 x lr_groups`` bytes a step, plus the
columnar batch overhead); alerts, jobs and the ``layers`` message are always kept (they are the
news, and rare). What grows with time is thinned by a :class:`Thinner`: per-layer gradient rows,
activation statistics and the 1 Hz ``system`` / ``probe`` reports are kept in full until a
level's byte budget is spent, then one in 2, one in 4, ... (the stride doubles each time a level
spends its budget), and once the category's total cap is reached no more of them are written.
So the file never exceeds::

    header + steps x per-step scalars + grad_bytes + activation_bytes + stats_bytes + alerts/jobs

with the defaults of :data:`DEFAULT_BOUNDS` (64 MiB of gradient rows, 16 MiB of activation
statistics, 8 MiB of system/probe reports), each cap overshooting by at most one message.

Errors (disk full, EACCES, a path that is a symlink) warn once on stderr and stop recording; the
training loop never sees them. The file is created ``0600`` with ``O_EXCL | O_NOFOLLOW``: an
existing file is never appended to (another run's recording would be corrupted) — the recorder
writes ``NAME.1.EXT``, ``NAME.2.EXT``, ... instead and says so. ``{pid}``, ``{rank}`` and
``{name}`` in the path are replaced, so several ranks sharing ``TDBG_RECORD`` get a file each.
"""

from __future__ import annotations

import errno
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tdbg import __version__
from tdbg.probe.log import warn
from tdbg.protocol import FLAG_HAS_GRADS, PROTOCOL_VERSION, pack
from tdbg.recording import FILE_HEADER, FORMAT_VERSION, REC_MAGIC

FLUSH_SECONDS = 0.25  # a kill -9 loses at most this much (plus one 0.1 s probe tick)
FLUSH_BYTES = 1 << 20  # or sooner, when this much is buffered
MAX_RENAMES = 1000


@dataclass(frozen=True, slots=True)
class Bounds:
    """Byte budgets of what is thinned; see the module docstring."""

    grad_level: int = 8 << 20
    grad_total: int = 64 << 20
    activations_level: int = 2 << 20
    activations_total: int = 16 << 20
    stats_level: int = 1 << 20
    stats_total: int = 8 << 20


DEFAULT_BOUNDS = Bounds()


class Thinner:
    """Keeps items in full until ``level`` bytes were kept, then one in 2, 4, 8, ... (the stride
    doubles each time a level has kept ``level`` bytes); nothing more after ``total`` bytes."""

    def __init__(self, level: int, total: int) -> None:
        self.level = max(1, level)
        self.total = total
        self.stride = 1
        self.kept_bytes = 0
        self._level_bytes = 0
        self._seen = 0
        self.dropped = 0

    @property
    def full(self) -> bool:
        return self.kept_bytes >= self.total

    def keep(self, size: int) -> bool:
        """Should the next item (of ``size`` bytes) be written?"""
        if self.full:
            self.dropped += 1
            return False
        index, self._seen = self._seen, self._seen + 1
        if index % self.stride:
            self.dropped += 1
            return False
        self.kept_bytes += size
        self._level_bytes += size
        if self._level_bytes >= self.level:
            self.stride *= 2
            self._level_bytes = 0
            self._seen = 1  # this item opens the new level: the next is one new stride on
        return True


def thin_steps(msg: dict[str, Any], thinner: Thinner) -> dict[str, Any] | None:
    """``msg`` with the per-layer rows ``thinner`` drops removed (scalars untouched), or None
    when every row is kept. Byte slicing only: no Python object per step."""
    flags = bytes(msg["flags"])
    n_layers = int(msg["layers"])
    row = 8 + 4 * n_layers
    keep: list[bool] = []
    for f in flags:
        if f & FLAG_HAS_GRADS:
            keep.append(thinner.keep(row))
    if all(keep):
        return None
    out = dict(msg)
    totals, norms = bytes(msg["grad_total"]), bytes(msg["grad_norms"])
    width = 4 * n_layers
    out["grad_total"] = b"".join(totals[8 * g : 8 * g + 8] for g, k in enumerate(keep) if k)
    out["grad_norms"] = b"".join(
        norms[width * g : width * (g + 1)] for g, k in enumerate(keep) if k
    )
    new_flags = bytearray(flags)
    g = 0
    for i, f in enumerate(flags):
        if f & FLAG_HAS_GRADS:
            if not keep[g]:
                new_flags[i] = f & ~FLAG_HAS_GRADS
            g += 1
    out["flags"] = bytes(new_flags)
    return out


def expand_path(path: str | os.PathLike[str], run_info: dict[str, Any]) -> Path:
    """``{pid}``, ``{rank}`` and ``{name}`` in ``path`` replaced from the run info."""
    text = os.fspath(path)
    for key in ("pid", "rank", "name"):
        text = text.replace("{" + key + "}", str(run_info.get(key, "")))
    return Path(text).expanduser()


def _numbered(path: Path, n: int) -> Path:
    """``run.tdbgrec`` -> ``run.1.tdbgrec``; ``run`` -> ``run.1``."""
    if path.suffix:
        return path.with_name(f"{path.stem}.{n}{path.suffix}")
    return path.with_name(f"{path.name}.{n}")


class Recorder:
    """Appends frames to a recording; every method runs on the probe thread and never raises."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        run_info: dict[str, Any],
        layer_names: list[str],
        layer_numel: list[int],
        bounds: Bounds = DEFAULT_BOUNDS,
    ) -> None:
        self.requested = path
        self.run_info = run_info
        self.layer_names = layer_names
        self.layer_numel = layer_numel
        self.path: Path | None = None
        self.fd: int | None = None
        self.failed: str | None = None
        self.closed = False
        self.grads = Thinner(bounds.grad_level, bounds.grad_total)
        self.activations = Thinner(bounds.activations_level, bounds.activations_total)
        self.stats = Thinner(bounds.stats_level, bounds.stats_total)
        self.written = 0  # bytes in the file
        self.last_step: int | None = None
        self._buf = bytearray()
        self._last_flush = time.monotonic()

    @property
    def active(self) -> bool:
        return self.fd is not None and self.failed is None

    # --- lifecycle ----------------------------------------------------------------------------
    def open(self) -> bool:
        """Create the file and write its header; False (with one warning) when that fails."""
        if self.fd is not None or self.failed is not None or self.closed:
            return self.active
        try:
            target = expand_path(self.requested, self.run_info)
            self.fd, self.path = self._create(target)
        except OSError as exc:
            self._fail(f"cannot record to {self.requested}: {exc.strerror or exc}")
            return False
        except Exception as exc:  # a bad path string, ...: still never into the training loop
            self._fail(f"cannot record to {self.requested}: {exc}")
            return False
        header = {
            "type": "recording",
            "format": FORMAT_VERSION,
            "proto": PROTOCOL_VERSION,
            "tdbg": __version__,
            "created": time.time(),
            "run": self.run_info,
        }
        head = FILE_HEADER.pack(REC_MAGIC, FORMAT_VERSION, PROTOCOL_VERSION)
        self._write_raw(head)
        self.add(pack(header))
        self.add(pack({"type": "layers", "names": self.layer_names, "numel": self.layer_numel}))
        self.flush()
        return self.active

    def _create(self, target: Path) -> tuple[int, Path]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        candidate = target
        for n in range(1, MAX_RENAMES + 1):
            try:
                fd = os.open(candidate, flags, 0o600)
            except FileExistsError:
                if candidate.is_symlink():
                    raise OSError(errno.ELOOP, f"{candidate} is a symbolic link") from None
                candidate = _numbered(target, n)
                continue
            # The umask may have narrowed the mode, never widened it; make it exactly 0600.
            os.fchmod(fd, 0o600)
            if candidate != target:
                warn(
                    f"tdbg: {target} exists (another run's recording?): recording to "
                    f"{candidate} instead"
                )
            return fd, candidate
        raise OSError(errno.EEXIST, f"{target} and {MAX_RENAMES} numbered names exist")

    def close(self) -> None:
        """Write the end marker, flush and close. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.active:
            self.add(pack({"type": "bye", "reason": "shutdown"}))
            self.flush()
        self._close_fd()

    def abandon(self) -> None:
        """In a forked child: close the inherited descriptor, write nothing."""
        self.closed = True
        self._buf.clear()
        self._close_fd()

    def _close_fd(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _fail(self, why: str) -> None:
        self.failed = why
        self._buf.clear()
        warn(f"tdbg: {why}; recording stopped (training continues)")
        self._close_fd()

    # --- frames -------------------------------------------------------------------------------
    def add(self, frame: bytes) -> None:
        if self.active:
            self._buf += frame

    def add_steps(self, msg: dict[str, Any], frame: bytes) -> None:
        """A live ``steps`` batch: written as is, or with old per-layer rows thinned."""
        if not self.active:
            return
        try:
            thinned = thin_steps(msg, self.grads)
            self._buf += frame if thinned is None else pack(thinned)
            if msg["n"]:
                self.last_step = int.from_bytes(bytes(msg["step"])[-8:], "little", signed=True)
        except Exception as exc:  # a malformed batch is the server's bug: record without it
            warn(f"tdbg: recorder skipped a steps batch: {exc}")

    def add_thinned(self, kind: str, frame: bytes) -> None:
        """A ``system`` / ``probe`` report or an ``activations`` sample, subject to its budget."""
        thinner = self.activations if kind == "activations" else self.stats
        if self.active and thinner.keep(len(frame)):
            self._buf += frame

    def maybe_flush(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._buf and (now - self._last_flush >= FLUSH_SECONDS or len(self._buf) >= FLUSH_BYTES):
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Write the buffered frames and a ``record_mark`` frame checking them, in one write."""
        self._last_flush = time.monotonic() if now is None else now
        if not self.active or not self._buf:
            return
        data = bytes(self._buf)
        self._buf.clear()
        mark = pack(
            {
                "type": "record_mark",
                "crc": zlib.crc32(data),
                "bytes": len(data),
                "step": self.last_step,
                "time": time.time(),
            }
        )
        self._write_raw(data + mark)

    def _write_raw(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view and self.fd is not None:
                n = os.write(self.fd, view)
                self.written += n
                view = view[n:]
        except OSError as exc:
            self._fail(f"cannot write the recording {self.path}: {exc.strerror or exc}")
