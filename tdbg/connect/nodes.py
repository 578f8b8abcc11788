"""The node list of a multi-node job: ``ssh://`` URLs with brace ranges (``gpu{01..08}``) and
lists (``{a,b}``), and hostfiles; every mistake is one line (a TargetError, exit code 2)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from tdbg.connect.sshurl import SCHEME, SshTarget, SshUrlError, is_ssh_url, parse_ssh_url
from tdbg.connect.target_errors import TargetError, not_ssh_error

MAX_NODES = 4096  # an expansion past this is a typo ({1..100000}), not a cluster
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
_SLOTS = re.compile(r"(max_)?slots=\d+")  # MPI / DeepSpeed hostfiles: the slot counts are theirs


def expand_braces(text: str) -> list[str]:
    """``gpu{01..03}`` -> gpu01 gpu02 gpu03; ``{a,b}-x`` -> a-x b-x; several groups multiply.

    A zero-padded end (``{01..08}``) pads every number to its width, as bash does. Nested
    braces, an empty item, a group that is neither a list nor a numeric range, and an unclosed
    or stray brace are refused (TargetError).
    """
    start = text.find("{")
    close = text.find("}")
    if start < 0:
        if close >= 0:
            raise TargetError(f"{text!r}: '}}' without '{{'")
        return [text]
    if close < 0:
        raise TargetError(f"{text!r}: '{{' is not closed")
    if close < start:
        raise TargetError(f"{text!r}: '}}' without '{{'")
    inner = text[start + 1 : close]
    if "{" in inner:
        raise TargetError(f"{text!r}: nested braces are not supported")
    head, tail = text[:start], text[close + 1 :]
    items = _group(text, inner)
    rests = expand_braces(tail)
    if len(items) * len(rests) > MAX_NODES:
        raise TargetError(f"{text!r} expands to more than {MAX_NODES} nodes")
    return [head + item + rest for item in items for rest in rests]


def _group(text: str, inner: str) -> list[str]:
    if "," in inner:
        items = inner.split(",")
        if any(not item for item in items):
            raise TargetError(f"{text!r}: empty item in {{{inner}}}")
        return items
    match = _RANGE.fullmatch(inner)
    if match is None:
        raise TargetError(
            f"{text!r}: {{{inner}}} is neither a list {{a,b}} nor a number range {{01..08}}"
        )
    first, last = match.group(1), match.group(2)
    lo, hi = int(first), int(last)
    if abs(hi - lo) + 1 > MAX_NODES:
        raise TargetError(f"{text!r} expands to more than {MAX_NODES} nodes")
    digits = (first.lstrip("-"), last.lstrip("-"))
    padded = any(len(d) > 1 and d.startswith("0") for d in digits)
    width = max(len(first), len(last)) if padded else 0
    step = 1 if hi >= lo else -1
    return [str(n).zfill(width) for n in range(lo, hi + step, step)]


def read_hostfile(path: str) -> list[str]:
    """The node URLs of a hostfile: one host a line (``host``, ``user@host:port``, or a whole
    ``ssh://`` URL, braces allowed), ``#`` comments and blank lines skipped, an MPI-style
    ``slots=N`` after the host ignored. TargetError naming the file and line otherwise."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise TargetError(f"cannot read hostfile {path}: {why}") from None
    urls: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        extra = [w for w in words[1:] if not _SLOTS.fullmatch(w)]
        if extra:
            raise TargetError(
                f"hostfile {path} line {number}: one host a line (unexpected {extra[0]!r})"
            )
        host = words[0]
        url = host if is_ssh_url(host) else SCHEME + host
        where = f"hostfile {path} line {number}"
        for one in _expand(url, where):
            try:
                parse_ssh_url(one)
            except SshUrlError as exc:
                raise TargetError(f"{where}: {exc}") from None
            urls.append(one)
    if not urls:
        raise TargetError(f"hostfile {path} names no host")
    return urls


def _expand(text: str, where: str) -> list[str]:
    try:
        return expand_braces(text)
    except TargetError as exc:
        raise TargetError(f"{where}: {exc}") from None


def node_targets(
    texts: Sequence[str], hostfile: str | None = None, hint: str = "nodes must be ssh:// URLs"
) -> list[SshTarget]:
    """The nodes that ``texts`` (each an ``ssh://`` URL, braces expanded) and ``hostfile`` name,
    in order; every one is checked before any ssh starts, a node named twice is refused."""
    urls: list[str] = []
    for text in texts:
        if not is_ssh_url(text):
            raise not_ssh_error(text, hint)
        urls.extend(expand_braces(text))
    if hostfile is not None:
        urls.extend(read_hostfile(hostfile))
    nodes: list[SshTarget] = []
    seen: set[SshTarget] = set()
    for url in urls:
        try:
            node = parse_ssh_url(url)
        except SshUrlError as exc:
            raise TargetError(str(exc)) from None  # as resolve() words it for one URL
        if node in seen:
            raise TargetError(f"node {node.url()} is named twice")
        seen.add(node)
        nodes.append(node)
    if len(nodes) > MAX_NODES:
        raise TargetError(f"more than {MAX_NODES} nodes")
    return nodes
