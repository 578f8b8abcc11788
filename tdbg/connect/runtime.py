"""Where runs live on disk: the per-user runtime directory, socket names, metadata, discovery."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_SOCKET_PATH = 100  # bytes; sun_path is 108 on Linux, 104 on macOS, 92 on some systems
WAITING_SUFFIX = ".waiting"  # ``<pid>.waiting``: that client waits for a run to appear here
NOTE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW


class RuntimeDirError(Exception):
    """The runtime directory is unsafe or cannot be made; the probe must not serve from it."""


def runtime_dir() -> Path:
    """``$TDBG_RUNTIME_DIR``, else ``tdbg-<euid>`` under the temp dir (as tmux does).

    ``$XDG_RUNTIME_DIR`` is not used by default: logind deletes it when the user logs out while
    the job runs on.
    """
    configured = os.environ.get("TDBG_RUNTIME_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"tdbg-{os.geteuid()}"


def check_private_dir(path: Path) -> None:
    """Raise RuntimeDirError unless ``path`` is a real directory owned by us with mode 0700."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RuntimeDirError(f"cannot stat runtime directory {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime directory {path} is not a real directory")
    if st.st_uid != os.geteuid():
        raise RuntimeDirError(f"runtime directory {path} is owned by uid {st.st_uid}, not us")
    if st.st_mode & 0o077:
        raise RuntimeDirError(
            f"runtime directory {path} has mode {oct(st.st_mode & 0o777)}; it must be 0700"
        )


def ensure_runtime_dir(path: Path | None = None) -> Path:
    """Create (mode 0700, umask untouched) and verify the runtime directory."""
    return make_private_dir(path or runtime_dir(), "runtime directory")


def make_private_dir(path: Path, what: str) -> Path:
    """Create ``path`` with mode 0700 (umask untouched) unless it exists, then check it as the
    runtime directory is checked (docs/guarantees.md, socket files): RuntimeDirError naming
    ``what`` otherwise."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RuntimeDirError(f"cannot create {what} {path}: {exc.strerror}") from None
    check_private_dir(path)
    return path


def socket_basename(rank: int, pid: int) -> str:
    return f"{rank}-{pid}"


def short_fallback_dir() -> Path:
    """A short base directory for when the configured one makes socket paths too long."""
    return Path("/tmp") / f"tdbg-{os.geteuid()}"


def probe_socket(path: str | os.PathLike[str], timeout: float = 0.5) -> bool:
    """True when something accepts connections on the Unix socket at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_private_json(path: Path, data: dict[str, Any]) -> None:
    """Create ``path`` with its JSON whole, or not at all: written to a private temporary file
    (O_EXCL|O_NOFOLLOW, 0600, mode verified) that is then hard-linked into place. A reader never
    sees it empty or half-written, and, as with O_EXCL, an existing ``path`` (or a symlink
    planted there) is never overwritten or followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
                raise RuntimeDirError(f"{path} was created with a mode other than 0600")
            os.write(fd, json.dumps(data, indent=1).encode())
        finally:
            os.close(fd)
        os.link(tmp, path, follow_symlinks=False)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@dataclass(frozen=True)
class RunEntry:
    """A run found on disk: its metadata file and what it says."""

    socket: Path
    meta: dict[str, Any]

    @property
    def pid(self) -> int:
        return int(self.meta.get("pid", -1))

    @property
    def name(self) -> str:
        return str(self.meta.get("name") or self.socket.stem)

    def describe(self) -> str:
        argv = " ".join(self.meta.get("argv") or [])
        return f"{self.name}  pid {self.pid}  rank {self.meta.get('rank', 0)}  {argv}".strip()


def discover(directory: Path | None = None, clean: bool = True) -> list[RunEntry]:
    """Live runs in the runtime directory, oldest first; stale files of dead pids are removed."""
    directory = directory or runtime_dir()
    entries: list[RunEntry] = []
    try:
        check_private_dir(directory)
        names = sorted(os.listdir(directory))
    except (RuntimeDirError, OSError):
        return entries
    for name in names:
        if not name.endswith(".json"):
            continue
        meta_path = directory / name
        try:
            meta = json.loads(meta_path.read_text())
            pid = int(meta["pid"])
            sock = Path(meta["socket"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not pid_alive(pid):
            if clean:
                remove_stale(meta_path, sock)
            continue
        if not sock.exists():
            continue
        entries.append(RunEntry(sock, meta))
    entries.sort(key=lambda e: float(e.meta.get("start_time", 0)))
    return entries


def remove_stale(meta_path: Path, sock: Path) -> None:
    """Remove a dead run's files — only a socket that refuses connections (docs/guarantees.md,
    socket files and processes)."""
    with contextlib.suppress(OSError):
        if sock.exists() and stat.S_ISSOCK(os.lstat(sock).st_mode) and not probe_socket(sock):
            os.unlink(sock)
    for path in (meta_path, Path(str(sock) + ".lock")):
        with contextlib.suppress(OSError):
            os.unlink(path)


# --- clients waiting for a run ---------------------------------------------------------------
# Polling alone can miss a short run: a client that gets no CPU for the second the run lives
# (a busy machine) looks only after its socket is gone. So a waiting client leaves a note, and a
# run that ends while a note names a client that has not attached keeps serving a moment (the
# probe's linger): the client finds it late, but whole, history and goodbye included.


class WaitingNote:
    """This process's note that it waits for a run to appear in ``directory`` (default: the
    runtime directory, made if need be): ``put()`` while waiting, ``take()`` once attached (or
    while not waiting: a person choosing among runs); both idempotent. Best effort: a
    directory that is not ours gets no note (and is refused by discovery anyway)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self.path: Path | None = None

    def put(self) -> None:
        if self.path is not None:
            return
        where = self.directory or runtime_dir()
        path = where / f"{os.getpid()}{WAITING_SUFFIX}"
        try:
            make_private_dir(where, "runtime directory")
            os.close(os.open(path, NOTE_FLAGS, 0o600))
        except (OSError, RuntimeDirError):
            return
        self.path = path

    def take(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None


@contextlib.contextmanager
def waiting_for_run(directory: Path | None = None) -> Iterator[WaitingNote]:
    """While the block runs, this process is noted as waiting for a run to appear in
    ``directory``. Leave the block once attached, not before: the note is what holds an
    ending run for this client."""
    note = WaitingNote(directory)
    note.put()
    try:
        yield note
    finally:
        note.take()


def waiting_pids(directory: Path) -> set[int]:
    """The pids of the live clients waiting for a run in ``directory`` (``waiting_for_run``);
    the note of one that died is removed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    pids: set[int] = set()
    for name in names:
        stem = name.removesuffix(WAITING_SUFFIX)
        if stem == name or not stem.isdigit():
            continue
        if pid_alive(int(stem)):
            pids.add(int(stem))
        else:
            with contextlib.suppress(OSError):
                os.unlink(directory / name)
    return pids
