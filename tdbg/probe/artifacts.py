"""Artifact files (profiler traces, memory snapshots): a private directory, server-chosen names."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from pathlib import Path

from tdbg.connect.runtime import check_private_dir, make_private_dir
from tdbg.protocol.messages.results import FileInfo
from tdbg.protocol.messages.run import RunInfo

HASH_CHUNK = 1 << 20  # 1 MiB reads: hashing a 100 MB snapshot costs ~0.1 s on the worker thread
MAX_NAME_PART = 64
# What the artifacts directory may hold: past either bound the oldest files go (never the one
# just written). A run profiled every few minutes for weeks must not fill the disk.
ARTIFACTS_MAX_BYTES = 4 << 30
ARTIFACTS_MAX_FILES = 200
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def artifact_dir(base: Path) -> Path:
    """``<base>/artifacts`` created with mode 0700 and checked as the runtime directory is
    (a real directory, owned by us, 0700): a symlink or someone else's directory is refused
    with :class:`~tdbg.connect.runtime.RuntimeDirError` (guarantees: commands)."""
    check_private_dir(base)
    return make_private_dir(base / "artifacts", "artifacts directory")


def _part(text: object, fallback: str) -> str:
    """A name component: only ``[A-Za-z0-9._-]``, no leading dot, at most 64 characters."""
    cleaned = "" if text is None else _UNSAFE.sub("_", str(text)).lstrip(".")[:MAX_NAME_PART]
    return cleaned or fallback


def artifact_name(run_info: RunInfo, kind: str, first: int, last: int, suffix: str) -> str:
    """``<name>-r<rank>-p<pid>-<kind>-steps<first>-<last><suffix>``.

    Every part comes from the probe itself (the run's name, rank and pid, the dive's kind and
    the steps it covered), never from a client; the run name is sanitised anyway, since
    the user or argv chose it.
    """
    name = _part(run_info.get("name"), "run")
    rank = _part(run_info.get("rank", 0), "0")
    pid = _part(run_info.get("pid", os.getpid()), str(os.getpid()))
    return f"{name}-r{rank}-p{pid}-{_part(kind, 'artifact')}-steps{first}-{last}{suffix}"


def private_temp(directory: Path, final_name: str) -> Path:
    """Create an empty hidden temp file for ``final_name`` exclusively (O_EXCL|O_NOFOLLOW, 0600).

    Writers (kineto's trace export, pickle) then open it by name and truncate it, so the data
    is never readable by anyone else, even for the moment before :func:`finalize`.
    """
    for attempt in range(100):
        tmp = directory / f".{final_name}.{os.getpid()}.{attempt}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"no free temporary name for {final_name} in {directory}")


def _free_name(final: Path) -> Path:
    """``final``, or ``final`` with ``-2``, ``-3``... before the suffix if it already exists (a
    recycled pid from an earlier run must not have its file replaced)."""
    if not os.path.lexists(final):
        return final
    stem, suffix = final.name.split(".", 1) if "." in final.name else (final.name, "")
    dot = "." if suffix else ""
    for n in range(2, 1000):
        candidate = final.with_name(f"{stem}-{n}{dot}{suffix}")
        if not os.path.lexists(candidate):
            return candidate
    raise FileExistsError(f"no free name for {final}")


def finalize(tmp: Path, final: Path) -> FileInfo:
    """Make ``tmp`` mode 0600, hash it and rename it to ``final`` (or a free variant of it).

    Returns ``{path, size, sha256}`` for the job's result. Reads the whole file to hash it
    (~0.1 s per 100 MB): call from the probe's worker thread, never the training thread.
    """
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{tmp} is not a regular file")
        os.fchmod(fd, 0o600)  # the writer may have made it with the umask's mode
        digest = hashlib.sha256()
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    target = _free_name(final)
    os.replace(tmp, target)
    prune(target.parent, keep=target)
    return FileInfo(str(target), st.st_size, digest.hexdigest())


def prune(directory: Path, keep: Path) -> list[Path]:
    """Delete the oldest artifacts until the directory is within ARTIFACTS_MAX_FILES and
    ARTIFACTS_MAX_BYTES; ``keep`` (the newest) stays. Returns what went; never raises."""
    files: list[tuple[float, int, Path]] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                continue  # temp files of writes in progress are not ours to remove
            st = entry.stat(follow_symlinks=False)
            files.append((st.st_mtime, st.st_size, Path(entry.path)))
    files.sort()
    total = sum(size for _, size, _ in files)
    removed: list[Path] = []
    for _, size, path in files:
        if len(files) - len(removed) <= ARTIFACTS_MAX_FILES and total <= ARTIFACTS_MAX_BYTES:
            break
        if path == keep:
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
            total -= size
    return removed


def discard(tmp: Path | None) -> None:
    """Remove a temp file left by a failed write; never raises."""
    if tmp is not None:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
