"""``ssh://[user@]host[:port][/path]`` targets: a strict parser that refuses anything ambiguous."""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEME = "ssh://"

# A user or host that ssh could read as an option, or that carries shell or URL syntax, is
# refused rather than escaped: the URL's parts end up as separate argv items of ssh, and ssh
# itself re-parses some of them (a user name with '@' or ':' means something else to it).
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a name, an IPv4 address or an ssh alias
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?")


class SshUrlError(ValueError):
    """Not an acceptable ssh:// target; ``str()`` is the one-line reason."""


@dataclass(frozen=True)
class SshTarget:
    """A remote host reached with the system ssh, and optionally the probe's socket there.

    ``path`` is a socket, a run's ``.json`` or a runtime directory on the remote host (the
    bridge resolves it as a local ``tdbg dump PATH`` would); None means "discover".
    """

    host: str
    user: str | None = None
    port: int | None = None
    path: str | None = None

    @property
    def node(self) -> str:
        """``[user@]host[:port]``: the remote machine, as shown in the picker and in errors."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port is not None else ""
        return f"{user}{host}{port}"

    def url(self, path: str | None = None) -> str:
        """The URL again, with ``path`` (default: this target's own) as its socket path."""
        path = self.path if path is None else path
        return f"{SCHEME}{self.node}{path or ''}"

    def with_path(self, path: str | None) -> SshTarget:
        return SshTarget(self.host, self.user, self.port, path)

    def __str__(self) -> str:
        return self.url()


def is_ssh_url(text: str) -> bool:
    """True when ``text`` claims to be an ssh:// URL (it may still be refused by the parser)."""
    return text[: len(SCHEME)].lower() == SCHEME


def _control(text: str) -> str | None:
    for ch in text:
        if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0:
            names = {"\0": "NUL", "\r": "CR", "\n": "LF", "\x1b": "ESC", "\t": "TAB"}
            return names.get(ch, f"\\x{ord(ch):02x}")
    return None


def parse_ssh_url(text: str) -> SshTarget:
    """Parse ``ssh://[user@]host[:port][/path]``; raise SshUrlError with the reason otherwise."""
    bad = _control(text)
    if bad is not None:
        raise SshUrlError(f"ssh URL contains a control character ({bad})")
    if not is_ssh_url(text):
        raise SshUrlError("not an ssh URL: it must start with ssh://")
    rest = text[len(SCHEME) :]
    if "?" in rest:
        raise SshUrlError("ssh URL must not have a query string (?...)")
    if "#" in rest:
        raise SshUrlError("ssh URL must not have a fragment (#...)")
    authority, slash, path = rest.partition("/")
    user: str | None = None
    if "@" in authority:
        user, _, authority = authority.rpartition("@")
        if ":" in user:
            raise SshUrlError("ssh URL must not contain a password (use keys or an agent)")
        if not user:
            raise SshUrlError("ssh URL has an empty user name before '@'")
        if not _USER.fullmatch(user):
            raise SshUrlError(f"ssh URL has an invalid user name {user!r}")
    host, port = _split_port(authority)
    if not host:
        raise SshUrlError("ssh URL has no host")
    if host.startswith("-"):
        raise SshUrlError(f"ssh URL host must not start with '-' ({host!r})")
    if not (_HOST.fullmatch(host) or (":" in host and _IPV6.fullmatch(host))):
        raise SshUrlError(f"ssh URL has an invalid host {host!r}")
    socket_path = f"/{path}" if slash and path else None
    return SshTarget(host=host, user=user, port=port, path=socket_path)


def _split_port(authority: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if authority.startswith("["):
        host, sep, after = authority[1:].partition("]")
        if not sep:
            raise SshUrlError("ssh URL has an unclosed '[' in its host")
        if after and not after.startswith(":"):
            raise SshUrlError(f"ssh URL has text after the bracketed host: {after!r}")
        return host, _port(after[1:]) if after else None
    if authority.count(":") > 1:
        raise SshUrlError("ssh URL with an IPv6 host must put it in brackets: ssh://[::1]:22")
    host, sep, port = authority.partition(":")
    return host, _port(port) if sep else None


def _port(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise SshUrlError(f"ssh URL has an invalid port {text!r} (must be 1-65535)")
    port = int(text)
    if not 1 <= port <= 65535:
        raise SshUrlError(f"ssh URL port {port} is out of range (must be 1-65535)")
    return port
