"""``--webhook-template``: the body a webhook is posted, with an alert's fields filled in — JSON
(each field escaped as the JSON around it needs) or plain text — checked before any alert."""

from __future__ import annotations

import datetime
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS = ("kind", "level", "message", "run", "step", "host", "time", "where", "json")
# What a field reads when the alert lacks it: the template is tried with these at start.
_SAMPLE = {
    "kind": "stalled",
    "level": "error",
    "message": 'no step for 30 s "quoted"\n',
    "run": "train",
    "step": 12,
    "host": "gpu-1",
    "time": "2026-01-01T00:00:00+00:00",
    "where": "train.py:42",
    "json": {"type": "alert", "kind": "stalled"},
}


class TemplateError(ValueError):
    """The template cannot be used; the message is one line."""


@dataclass(frozen=True)
class Piece:
    """A stretch of the template: literal text, or a field and whether it sits inside a JSON
    string (escaped as string content there; a JSON value of its own outside one)."""

    text: str = ""
    field: str | None = None
    in_string: bool = False


@dataclass(frozen=True)
class WebhookTemplate:
    """A parsed template: its pieces and whether the body is JSON."""

    pieces: tuple[Piece, ...]
    is_json: bool

    @property
    def content_type(self) -> str:
        return "application/json" if self.is_json else "text/plain; charset=utf-8"

    @classmethod
    def parse(cls, text: str) -> WebhookTemplate:
        """``TEMPLATE`` as given: the text itself, or ``@FILE``. TemplateError names what is
        wrong: an unreadable file, an unknown field, a ``$`` that starts none, JSON that does
        not parse once filled in."""
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TemplateError(
                    f"{text[1:]}: {getattr(exc, 'strerror', None) or exc}"
                ) from None
        is_json = text.lstrip()[:1] in ("{", "[")
        template = cls(tuple(_pieces(text, is_json)), is_json)
        if is_json:
            try:
                json.loads(template.render(_SAMPLE))
            except ValueError as exc:
                raise TemplateError(f"not JSON once its fields are filled in: {exc}") from None
        return template

    def render(self, fields: dict[str, Any]) -> str:
        out = []
        for piece in self.pieces:
            if piece.field is None:
                out.append(piece.text)
                continue
            value = fields.get(piece.field)
            if not self.is_json:
                out.append(_plain(value))
            elif piece.in_string:  # "…${message}…": the value as the string's content
                out.append(json.dumps(_plain(value))[1:-1])
            else:  # {"step": ${step}, "alert": ${json}}: a JSON value
                out.append(json.dumps(value))
        return "".join(out)


def _plain(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def _pieces(text: str, is_json: bool) -> list[Piece]:
    """The template split at its ``$name`` / ``${name}`` fields (``$$`` is a ``$``), each field
    marked with whether a JSON string holds it."""
    pattern = string.Template.pattern
    out: list[Piece] = []
    at = 0
    in_string = False
    for match in pattern.finditer(text):
        literal = text[at : match.start()]
        in_string = _still_in_string(literal, in_string) if is_json else False
        out.append(Piece(text=literal))
        at = match.end()
        if match.group("escaped") is not None:
            out.append(Piece(text="$"))
            continue
        name = match.group("named") or match.group("braced")
        if name is None:
            line = text.count("\n", 0, match.start()) + 1
            raise TemplateError(f"a '$' at line {line} starts no field (write $$ for a '$')")
        if name not in FIELDS:
            raise TemplateError(f"unknown field ${{{name}}} (fields: {', '.join(FIELDS)})")
        out.append(Piece(field=name, in_string=in_string))
    out.append(Piece(text=text[at:]))
    return out


def _still_in_string(literal: str, in_string: bool) -> bool:
    """Whether a JSON string is open after ``literal`` (given whether one was before it)."""
    escaped = False
    for char in literal:
        if escaped:
            escaped = False
        elif char == "\\" and in_string:
            escaped = True
        elif char == '"':
            in_string = not in_string
    return in_string


def alert_fields(line: str, alert: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """An alert's fields for a template: ``alert`` as ``tdbg alerts --json`` prints it, ``run``
    the hello's run of its rank (or of any rank, for a job's finding), ``line`` its one line."""
    stamp = alert.get("time")
    when = (
        datetime.datetime.fromtimestamp(stamp).astimezone().isoformat(timespec="seconds")
        if isinstance(stamp, int | float)
        else ""
    )
    layers = alert.get("layers")
    where = alert.get("where") or (", ".join(map(str, layers)) if layers else "")
    if alert.get("type") == "job_alert":
        name = f"job {alert.get('job') or run.get('job') or '?'}"
    else:
        name = str(run.get("name") or "")
    return {
        "kind": str(alert.get("kind") or "alert"),
        "level": "cleared" if alert.get("notice") == "cleared" else str(alert.get("severity")),
        "message": str(alert.get("message") or line),
        "run": name,
        "step": alert.get("step") if isinstance(alert.get("step"), int) else None,
        "host": str(run.get("host") or ""),
        "time": when,
        "where": str(where),
        "json": alert,
    }
