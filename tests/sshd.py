"""A throwaway OpenSSH sshd on 127.0.0.1 for the ssh:// tests: its own host key, an authorized
key made for the test, and the client options that reach it without touching ~/.ssh."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from waiting import TIMEOUT, wait_until

SSHD = "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tdbg-test", "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )


class Sshd:
    """``sshd -D -e`` on a free loopback port; ``client_options`` are ``-o`` options for ssh."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = free_port()
        self.user = os.environ.get("USER") or "root"
        if os.geteuid() == 0:
            self.user = "root"
        self.host_key = base / "host_ed25519"
        self.client_key = base / "client_ed25519"
        self.other_key = base / "other_ed25519"  # not authorized: for the auth-failure test
        for key in (self.host_key, self.client_key, self.other_key):
            _keygen(key)
        authorized = base / "authorized_keys"
        authorized.write_text((base / "client_ed25519.pub").read_text())
        authorized.chmod(0o600)
        self.log = base / "sshd.log"
        self.config = base / "sshd_config"
        self.config.write_text(
            "\n".join(
                [
                    "ListenAddress 127.0.0.1",
                    f"Port {self.port}",
                    f"HostKey {self.host_key}",
                    f"AuthorizedKeysFile {authorized}",
                    f"PidFile {base / 'sshd.pid'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "UsePAM no",
                    "StrictModes no",
                    "PrintMotd no",
                    "AllowStreamLocalForwarding no",
                    "AllowTcpForwarding no",
                    "X11Forwarding no",
                    "LogLevel VERBOSE",
                    "",
                ]
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def client_options(self, key: Path | None = None) -> list[str]:
        """``-o`` options (each already split for argv) that reach this sshd non-interactively."""
        pairs = [
            f"IdentityFile={key or self.client_key}",
            "IdentitiesOnly=yes",
            f"UserKnownHostsFile={self.base / 'known_hosts'}",
            "GlobalKnownHostsFile=/dev/null",
            "StrictHostKeyChecking=accept-new",
            "BatchMode=yes",
            "LogLevel=ERROR",
        ]
        out: list[str] = []
        for pair in pairs:
            out += ["-o", pair]
        return out

    def url(self, path: str = "") -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}{path}"

    def start(self, timeout: float = TIMEOUT) -> None:
        # Debian's sshd refuses to start without its privilege separation directory.
        with contextlib.suppress(OSError):
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        log = open(self.log, "ab")  # handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        finally:
            log.close()
        proc = self.proc

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited {proc.returncode}: {self.log.read_text()}")
            # Its own word first: whatever else took the port would accept the connect below.
            if f"Server listening on 127.0.0.1 port {self.port}" not in self.log.read_text():
                return False
            with socket.socket() as s:
                s.settimeout(0.2)
                try:
                    s.connect(("127.0.0.1", self.port))
                except OSError:
                    return False
            return True

        wait_until(
            listening, timeout, f"sshd listening on port {self.port}", detail=self.log.read_text
        )

    def stop_listener(self) -> None:
        """Stop the listening sshd; sessions already open live on in their own processes."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(TIMEOUT)
        self.proc = None

    def stop(self) -> None:
        """Stop the listener and every session process it started."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh") is not None


@contextlib.contextmanager
def running_sshd() -> Iterator[Sshd]:
    base = Path(tempfile.mkdtemp(prefix="tdbg-sshd-", dir="/tmp"))
    os.chmod(base, 0o700)
    try:
        server = _started(base)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _started(base: Path, tries: int = 3) -> Sshd:
    """A started Sshd in ``base``; on another port when its free port was taken before sshd
    could bind it (by another process of the machine: an xdist worker's job, another suite)."""
    for attempt in range(tries):
        own = base / f"try{attempt}"  # fresh keys and config: ssh-keygen overwrites nothing
        own.mkdir(mode=0o700)
        server = Sshd(own)
        try:
            server.start()
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt == tries - 1:
                raise
            continue
        return server
    raise AssertionError("unreachable")
