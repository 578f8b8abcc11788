"""Recorder: appends the probe's outbound stream to a crash-safe, size-bounded recording file.

The recorder is a sink beside the clients on the probe thread: it gets the frames the server has
already encoded for them (``layers``, ``steps``, ``alert``, ``system``, ``probe``, ``job``,
``activations``) and appends them to a file in the format of :mod:`tdbg.recording.reader`:

* a fixed 12-byte header (``b"TDBG-REC"``, u16 format version, u16 protocol version), then the
  protocol's own length-prefixed msgpack frames, starting with a ``recording`` frame carrying the
  run info, so that the same sans-IO :class:`~tdbg.protocol.Decoder` reads sockets and files;
* frames are buffered in memory and written with ``os.write`` at least every
  :data:`FLUSH_SECONDS` (0.25 s), each write ending with a ``record_mark`` frame holding the
  CRC-32 of every byte written since the previous mark. A ``kill -9`` therefore loses at most the
  last flush interval (plus the probe's 0.1 s tick), and a reader can tell a flipped byte from
  data: it keeps everything up to the last mark that checks out.

Size bound: compaction. Everything is appended at full resolution, so the end of a run (where
the crash is) is always complete. When the file reaches its compaction threshold it is rewritten
(:mod:`tdbg.recording.compaction`) keeping every step's scalars, every alert, job and ``layers``
message, and — within the byte budgets of :class:`Bounds` — the per-layer gradient rows and the
``activations``, ``system`` and ``probe`` messages, each kind on its own: the newest half of a
budget in full, older ones thinned more the older they are. The rewrite runs on the sampler
thread (``submit_work``) into a private temp file beside the recording (``O_EXCL | O_NOFOLLOW``,
0600) while the probe thread goes on appending to the old file; back on the probe thread the
bytes appended meanwhile are copied over and the temp file is ``os.rename``d onto the recording.
A kill at any moment leaves either the old file or the new one, whole; a leftover temp file
(``.NAME.PID.compacting``) is removed by the next recorder that opens a file of that name.

Precisely, let ``K`` be what is never thinned (header, every step's scalars with their framing,
alerts, jobs, marks) and ``C`` the size right after the last compaction (``C <= K + grads +
activations + system + probe`` of :class:`Bounds`, each budget overshot by at most one item).
The file never exceeds::

    max(compact_at, C + min(C, max_growth))  +  one flush (<= FLUSH_BYTES + one tick's frames)
                                              +  what the run appends while a compaction runs

with the defaults (:data:`DEFAULT_BOUNDS`): 48 MiB of thinned data, no compaction below 64 MiB,
and at most 256 MiB of growth between compactions. A compaction costs about one decode of the
file, on the sampler thread: measured 0.38 s for 64 MiB and 0.78 s for 128 MiB (50 layers, 420k
steps, one core); the probe thread only copies what was appended meanwhile and renames. Up to
``max_growth`` the threshold doubles with the file (amortised O(1) a byte written); beyond it,
every ``max_growth`` of growth re-reads the compacted file once (at most about 48 MiB of thinned
data plus every step's scalars, ~105 bytes a step).

Errors (disk full, EACCES, a path that is a symlink) warn once on stderr and stop recording; the
training loop never sees them. A failed compaction warns and leaves the file as it was. The file
is created ``0600`` with ``O_EXCL | O_NOFOLLOW``: an existing file is never appended to (another
run's recording would be corrupted) — the recorder writes ``NAME.1.EXT``, ``NAME.2.EXT``, ...
instead and says so. ``{pid}``, ``{rank}`` and ``{name}`` in the path are replaced, so several
ranks sharing ``TDBG_RECORD`` get a file each.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tdbg import __version__
from tdbg.probe.log import warn
from tdbg.protocol.framing import PROTOCOL_VERSION, pack
from tdbg.protocol.messages import Layers, RunInfo, bye_message, layers_message
from tdbg.protocol.steps import grad_row_bytes, grad_rows, last_step
from tdbg.recording.blocks import block, write_all
from tdbg.recording.compaction import THINNED_KINDS, Result, Tally, compact
from tdbg.recording.reader import FILE_HEADER, FORMAT_VERSION, REC_MAGIC

FLUSH_SECONDS = 0.25  # a kill -9 loses at most this much (plus one 0.1 s probe tick)
FLUSH_BYTES = 1 << 20  # or sooner, when this much is buffered
MAX_RENAMES = 1000
TEMP_SUFFIX = ".compacting"


@dataclass(frozen=True, slots=True)
class Bounds:
    """Byte budgets a compaction cuts each thinned kind to, and when compactions run; see the
    module docstring."""

    grads: int = 32 << 20  # per-layer gradient rows
    activations: int = 8 << 20  # activation statistics samples
    system: int = 4 << 20  # 1 Hz system reports
    probe: int = 4 << 20  # 1 Hz probe reports
    updates: int = 8 << 20  # update ratios, one message per sampled step
    histograms: int = 16 << 20  # weight and gradient histograms, one message per counted step
    console: int = 4 << 20  # the run's stdout/stderr lines: the newest in full, older thinned
    compact_at: int = 64 << 20  # no compaction below this file size
    max_growth: int = 256 << 20  # the file grows by min(its compacted size, this) between them

    def budgets(self) -> dict[str, int]:
        return {kind: int(getattr(self, kind)) for kind in THINNED_KINDS}

    def threshold(self, compacted: int) -> int:
        """The file size that starts the next compaction, ``compacted`` bytes after the last."""
        return max(self.compact_at, compacted + min(compacted, self.max_growth))


DEFAULT_BOUNDS = Bounds()


class _Compaction:
    """One compaction in flight: the temp file (its descriptor owned by the worker until
    ``done``), the old file's length it copies, and the tally at that length."""

    def __init__(self, temp: Path, fd: int, end: int, tally: Tally) -> None:
        self.temp = temp
        self.fd = fd
        self.end = end
        self.tally = tally
        self.started = time.monotonic()
        self.running = False  # the worker started it (then the worker closes an abandoned fd)
        self.done = False
        self.result: Result | None = None
        self.error: str | None = None


def expand_path(path: str | os.PathLike[str], run_info: RunInfo) -> Path:
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


def temp_path(path: Path) -> Path:
    """The private file a compaction of ``path`` writes: hidden, beside it, named by our pid."""
    return path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")


def remove_stale_temps(target: Path) -> None:
    """Remove temp files that a killed run's compaction of a file named like ``target`` left:
    ours (same uid), regular, named ``.NAME[.N].EXT.PID.compacting`` with PID not running."""
    try:
        candidates = list(target.parent.glob(f".{target.stem}*{TEMP_SUFFIX}"))
    except OSError:
        return
    for temp in candidates:
        try:
            pid = int(temp.name[: -len(TEMP_SUFFIX)].rsplit(".", 1)[1])
            st = os.lstat(temp)
            if not os.path.isfile(temp) or temp.is_symlink() or st.st_uid != os.getuid():
                continue
            try:
                os.kill(pid, 0)
                continue  # its writer still runs
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            os.unlink(temp)
        except (ValueError, IndexError, OSError):
            continue


class Recorder:
    """Appends frames to a recording; every method runs on the probe thread and never raises.

    ``submit`` (the server's ``submit_work``) runs compactions on another thread; without it
    (tests, tools) they run inline in :meth:`maybe_flush`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        run_info: RunInfo,
        layer_names: list[str],
        layer_numel: list[int],
        bounds: Bounds | None = None,
        submit: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.requested = path
        self.run_info = run_info
        # The layers message a recording starts with: the server keeps it current (a layer
        # replaced mid-run, a model added) for a recording created after the change.
        self.layers: Layers = layers_message(layer_names, layer_numel)
        self.bounds = DEFAULT_BOUNDS if bounds is None else bounds
        self.submit = submit
        self.path: Path | None = None
        self.fd: int | None = None
        self.failed: str | None = None
        self.closed = False
        self.written = 0  # bytes in the file
        self.last_step: int | None = None
        self.tally = Tally()  # what the file holds of each thinned kind
        self.compactions = 0
        self.compaction_seconds: list[float] = []  # how long each took, start to rename
        self.next_compaction = self.bounds.threshold(0)
        self._head = b""  # the file header and the recording frame: a compaction's start
        self._job: _Compaction | None = None
        self._lock = threading.Lock()  # the job's hand-over between the worker and this thread
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
        remove_stale_temps(target)
        header = {
            "type": "recording",
            "format": FORMAT_VERSION,
            "proto": PROTOCOL_VERSION,
            "tdbg": __version__,
            "created": time.time(),
            "run": self.run_info,
        }
        head = FILE_HEADER.pack(REC_MAGIC, FORMAT_VERSION, PROTOCOL_VERSION)
        self._head = head + pack(header)
        self._write_raw(head)
        self.add(self._head[len(head) :])
        self.add(pack(self.layers))
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
        if self.active:
            self.add(pack(bye_message("shutdown")))
            self.flush()
        self._drop_job()
        self._close_fd()

    def abandon(self) -> None:
        """In a forked child: close the inherited descriptors, write or remove nothing."""
        # The child has one thread: a lock another thread held at fork would never be released.
        self._lock = threading.Lock()
        with self._lock:
            self.closed = True
            job, self._job = self._job, None
        if job is not None:
            _close_quietly(job.fd)
        self._buf.clear()
        self._close_fd()

    def _close_fd(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            _close_quietly(fd)

    def _fail(self, why: str) -> None:
        self.failed = why
        self._buf.clear()
        warn(f"tdbg: {why}; recording stopped (training continues)")
        self._drop_job()
        self._close_fd()

    # --- frames -------------------------------------------------------------------------------
    def add(self, frame: bytes) -> None:
        if self.active:
            self._buf += frame

    def add_steps(self, msg: dict[str, Any], frame: bytes) -> None:
        """A live ``steps`` batch, written as is (compactions thin its per-layer rows later)."""
        if not self.active:
            return
        try:
            rows = grad_rows(msg)
            self._buf += frame
            self.tally.add("grads", rows, rows * grad_row_bytes(msg))
            step = last_step(msg)
            if step is not None:
                self.last_step = step
        except Exception as exc:  # a malformed batch is the server's bug: record without it
            warn(f"tdbg: recorder skipped a steps batch: {exc}")

    def add_thinned(self, kind: str, frame: bytes) -> None:
        """A ``system`` / ``probe`` report, an ``activations`` sample, an ``updates`` or a
        ``histograms`` message: written now, thinned
        by later compactions within its kind's own budget."""
        if not self.active:
            return
        self._buf += frame
        if kind in self.tally.items:
            self.tally.add(kind, 1, len(frame))

    def maybe_flush(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._buf and (now - self._last_flush >= FLUSH_SECONDS or len(self._buf) >= FLUSH_BYTES):
            self.flush(now)
        self._maybe_compact()

    def flush(self, now: float | None = None) -> None:
        """Write the buffered frames and a ``record_mark`` frame checking them, in one write."""
        self._last_flush = time.monotonic() if now is None else now
        if not self.active or not self._buf:
            return
        data = bytes(self._buf)
        self._buf.clear()
        self._write_raw(block(data, self.last_step))

    def _write_raw(self, data: bytes) -> None:
        if self.fd is None:
            return
        try:
            write_all(self.fd, data, self._wrote)
        except OSError as exc:
            self._fail(f"cannot write the recording {self.path}: {exc.strerror or exc}")

    def _wrote(self, n: int) -> None:
        self.written += n

    # --- compaction ---------------------------------------------------------------------------
    def _maybe_compact(self) -> None:
        job = self._job
        if job is not None:
            if job.done:
                self._finish(job)
            return
        if self.active and self.written >= self.next_compaction:
            self.compact()

    def compact(self) -> None:
        """Start a compaction of what the file holds now (inline without ``submit``)."""
        if not self.active or self._job is not None or self.path is None:
            return
        self.flush()  # the old file ends at a mark: the copy made of it does too
        if not self.active:
            return
        temp = temp_path(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                fd = os.open(temp, flags, 0o600)
            except FileExistsError:
                # No compaction of ours is in flight (``_job`` is None): a file by this name was
                # left by a killed run that had our pid (containers reuse pids). Replace it.
                os.unlink(temp)
                fd = os.open(temp, flags, 0o600)
            os.fchmod(fd, 0o600)
        except OSError as exc:
            self._compaction_failed(f"cannot create {temp}: {exc.strerror or exc}")
            return
        job = _Compaction(temp, fd, self.written, self.tally.copy())
        self._job = job
        work = lambda: self._run(job, self.path)  # noqa: E731 - closes over this job only
        if self.submit is None:
            work()
            self._finish(job)
        else:
            self.submit(work)

    def _run(self, job: _Compaction, source: Path | None) -> None:
        """The rewrite, on the worker thread: touches the temp file and ``job`` only."""
        with self._lock:
            if self._job is not job:  # closed before the worker got to it: fd already closed
                return
            job.running = True
        try:
            assert source is not None
            job.result = compact(
                source, job.end, job.fd, self._head, job.tally, self.bounds.budgets()
            )
        except Exception as exc:  # disk full, a damaged old file, ...: keep the old file
            job.error = str(exc) or type(exc).__name__
        with self._lock:
            # Decide before publishing ``done``: the probe thread reads ``done`` without the
            # lock and then adopts ``job.fd``; after that this thread must not touch it.
            abandoned = self._job is not job
            job.done = True
        if abandoned:  # the recorder closed meanwhile and removed the temp file
            _close_quietly(job.fd)

    def _finish(self, job: _Compaction) -> None:
        """Back on the probe thread: copy what was appended meanwhile, then rename over."""
        self._job = None
        if job.error is not None or job.result is None or self.path is None or not self.active:
            self._discard(job)
            self._compaction_failed(job.error or "the recording stopped")
            return
        try:
            tail = self.written - job.end
            copied = 0
            with open(self.path, "rb") as old:
                old.seek(job.end)
                while copied < tail:
                    chunk = old.read(min(FLUSH_BYTES, tail - copied))
                    if not chunk:
                        raise OSError(errno.EIO, "the recording shrank during its compaction")
                    view = memoryview(chunk)
                    while view:
                        n = os.write(job.fd, view)
                        view = view[n:]
                    copied += len(chunk)
            os.rename(job.temp, self.path)
        except OSError as exc:
            self._discard(job)
            self._compaction_failed(str(exc.strerror or exc))
            return
        self._close_fd()
        self.fd = job.fd
        self.written = job.result.size + tail
        self.tally = job.result.tally.plus_since(self.tally, job.tally)
        self.compactions += 1
        self.compaction_seconds.append(time.monotonic() - job.started)
        self.next_compaction = self.bounds.threshold(self.written)

    def _discard(self, job: _Compaction) -> None:
        _close_quietly(job.fd)
        try:
            os.unlink(job.temp)
        except OSError:
            pass

    def _compaction_failed(self, why: str) -> None:
        warn(f"tdbg: recording compaction failed ({why}); the recording goes on uncompacted")
        self.next_compaction = self.bounds.threshold(self.written)  # retry after more growth

    def _drop_job(self) -> None:
        """Closing: a compaction in flight is abandoned and its temp file removed."""
        with self._lock:
            self.closed = True
            job, self._job = self._job, None
            ours = job is not None and (job.done or not job.running)
        if job is None:
            return
        if ours:
            # The worker finished, or never started (the sampler may stop before it runs the
            # queued rewrite): the descriptor is ours to close. A running one closes it itself.
            _close_quietly(job.fd)
        try:
            os.unlink(job.temp)
        except OSError:
            pass


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
