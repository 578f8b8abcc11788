"""The viewer's settings that persist: read at start, written atomically whenever one changes."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

PALETTES = ("default", "colour-blind")
SORTS = ("name", "norm", "trend")


@dataclass
class Settings:
    """What a user chose and expects back next time; every field has the default a new user
    gets, and a field the file lacks or spells wrong keeps it."""

    theme: str | None = None  # a Textual theme's name; None: Textual's default
    palette: str = "default"  # the colours that carry meaning: default or colour-blind safe
    heatmap: bool = False  # gradients as the heatmap, not the table
    grad_sort: str = "name"
    chart_window: int | None = None  # steps the loss chart shows; None: the whole run
    full_range: bool = False  # the loss chart's y-range: every value, not the robust fit
    log_y: list[str] = field(default_factory=list)  # the charts on a log y-axis (chart keys)


def settings_path() -> Path:
    """``$XDG_CONFIG_HOME/tdbg/settings.json``, by default ``~/.config/tdbg/settings.json``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "tdbg" / "settings.json"


def _valid(name: str, value: Any) -> bool:
    if name == "theme":
        return value is None or isinstance(value, str)
    if name == "palette":
        return value in PALETTES
    if name == "grad_sort":
        return value in SORTS
    if name in ("heatmap", "full_range"):
        return isinstance(value, bool)
    if name == "chart_window":
        whole = isinstance(value, int) and not isinstance(value, bool)
        return value is None or (whole and value > 0)
    if name == "log_y":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return False


def load_settings(path: Path) -> tuple[Settings, str | None]:
    """The settings in ``path`` and a one-line warning when the file could not be used (the
    defaults then, or the defaults for the fields it got wrong); no file is no warning."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings(), None
    except (OSError, UnicodeDecodeError) as exc:
        return Settings(), f"settings not read ({path}: {_why(exc)}): using the defaults"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return Settings(), f"settings not read ({path}: not JSON, {exc}): using the defaults"
    if not isinstance(data, dict):
        return Settings(), f"settings not read ({path}: not a JSON object): using the defaults"
    settings = Settings()
    wrong = []
    for f in fields(Settings):
        if f.name not in data:
            continue
        if _valid(f.name, data[f.name]):
            setattr(settings, f.name, data[f.name])
        else:
            wrong.append(f.name)
    if wrong:
        return settings, f"settings: {', '.join(wrong)} in {path} not understood: defaults used"
    return settings, None


def save_settings(settings: Settings, path: Path) -> None:
    """Write ``settings`` to ``path`` whole or not at all: a temporary file beside it, then a
    rename, so a crash mid-write never leaves a half file to be read next time (OSError on a
    directory that cannot be written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".settings-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(asdict(settings), out, indent=2, sort_keys=True)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or type(exc).__name__
