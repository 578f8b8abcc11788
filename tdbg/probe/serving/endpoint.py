"""The probe's listening socket and metadata file, made and removed as docs/guarantees.md says."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
from pathlib import Path

from tdbg.connect.runtime import (
    MAX_SOCKET_PATH,
    RuntimeDirError,
    ensure_runtime_dir,
    probe_socket,
    runtime_dir,
    short_fallback_dir,
    socket_basename,
    write_private_json,
)
from tdbg.protocol.framing import PROTO_MAX, PROTO_MIN
from tdbg.protocol.messages import RunInfo

LISTEN_BACKLOG = 16


class EndpointError(Exception):
    """The probe cannot serve; the message says why, in one line."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class Endpoint:
    """A bound, listening AF_UNIX socket plus the metadata file that lets runs be discovered."""

    def __init__(
        self, rank: int, run_info: RunInfo, directory: str | os.PathLike[str] | None = None
    ) -> None:
        self.rank = rank
        self.pid = os.getpid()
        self.run_info = run_info
        # watch(directory=...) documents str or PathLike: a str here broke `base / name`.
        self.directory = Path(directory) if directory is not None else None
        self.listener: socket.socket | None = None
        self.path: Path | None = None
        self.meta_path: Path | None = None
        self.inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound

    def _choose_dir(self) -> Path:
        base = self.directory or runtime_dir()
        try:
            base = ensure_runtime_dir(base)
        except RuntimeDirError as exc:
            raise EndpointError(str(exc)) from None
        longest = base / f"{socket_basename(self.rank, self.pid)}-99.sock.lock"
        if len(os.fsencode(longest)) <= MAX_SOCKET_PATH + 5:
            return base
        try:
            return ensure_runtime_dir(short_fallback_dir())
        except RuntimeDirError as exc:
            raise EndpointError(f"socket path too long under {base}, and {exc}") from None

    def open(self) -> socket.socket:
        directory = self._choose_dir()
        stem = socket_basename(self.rank, self.pid)
        for attempt in range(100):
            name = stem if attempt == 0 else f"{stem}-{attempt}"
            path = directory / f"{name}.sock"
            sock = self._bind_unique(path)
            if sock is not None:
                break
        else:
            raise EndpointError(f"no free socket name for {stem} in {directory}")
        self.listener, self.path = sock, path
        st = os.stat(path)
        self.inode = (st.st_dev, st.st_ino)
        self.meta_path = path.with_suffix(".json")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.meta_path)  # ours by name: pid + rank, the socket was just bound
        info: RunInfo = {
            **self.run_info,
            "socket": str(path),
            "proto_min": PROTO_MIN,
            "proto_max": PROTO_MAX,
        }
        try:
            write_private_json(self.meta_path, dict(info))
        except (OSError, RuntimeDirError) as exc:
            self.close()
            raise EndpointError(f"cannot write metadata {self.meta_path}: {exc}") from None
        self.run_info = info
        return sock

    def _bind_unique(self, path: Path) -> socket.socket | None:
        """Bind at ``path`` under its flock, or None when the name is taken by a live socket."""
        lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                st = None
            if st is not None:
                if not stat.S_ISSOCK(st.st_mode):
                    raise EndpointError(f"{path} exists and is not a socket; refusing to touch it")
                if probe_socket(path):
                    return None  # a live probe owns this name
                os.unlink(path)  # ECONNREFUSED: left by a dead process
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(os.fspath(path))
                os.chmod(path, 0o600)  # before listen(): nobody can connect in between
                sock.listen(LISTEN_BACKLOG)
                sock.setblocking(False)
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    return None
                raise EndpointError(f"cannot bind {path}: {exc.strerror}") from None
            return sock
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            os.close(lock_fd)

    def still_ours(self) -> bool:
        """Does the socket path still hold the socket we bound (guarantees: socket files)?
        A file put there since is not ours even where it got our freed inode's number (ext4
        hands a freed number out again at once): only a socket with our device and inode is."""
        if self.path is None:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self.inode

    def close(self, unlink: bool = True) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.close()
            self.listener = None
        if unlink and os.getpid() == self.pid:  # only the creating pid removes the files
            for path in (self.path, self.meta_path):
                if path is None:
                    continue
                with contextlib.suppress(OSError):
                    if path == self.path and not self.still_ours():
                        continue
                    os.unlink(path)
            if self.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(f"{self.path}.lock")
