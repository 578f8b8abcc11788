"""The recording to compare the run on screen with: a list of the .tdbg files nearby, or a path
typed in; and, while one is drawn, the offer to stop comparing."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option

from tdbg.format import fmt_bytes, fmt_span

MAX_LISTED = 200  # files listed; a directory of thousands of recordings is typed into instead


def nearby_recordings(directories: Iterable[Path], skip: Path | None = None) -> list[Path]:
    """The ``*.tdbg`` files in ``directories`` (not below them), newest first, each once;
    ``skip`` (the run's own recording) left out."""
    seen: dict[Path, float] = {}
    for directory in directories:
        try:
            found = list(directory.glob("*.tdbg"))
        except OSError:
            continue  # gone, or not readable: nothing to offer from it
        for path in found:
            try:
                real, mtime = path.resolve(), path.stat().st_mtime
            except OSError:
                continue
            if path.is_file() and real != skip and real not in seen:
                seen[real] = mtime
    return sorted(seen, key=lambda p: -seen[p])[:MAX_LISTED]


def search_directories(run_cwd: object = None, recording: Path | None = None) -> list[Path]:
    """Where recordings to compare with are looked for: here, the run's own working directory
    (where ``tdbg run --record NAME.tdbg`` writes), ``$TDBG_RECORD``'s directory, and the
    directory of the recording being replayed."""
    out = [Path.cwd()]
    if isinstance(run_cwd, str) and run_cwd:
        out.append(Path(run_cwd))
    record = os.environ.get("TDBG_RECORD")
    if record:
        out.append(Path(record).expanduser().parent)
    if recording is not None:
        out.append(recording.parent)
    return list(dict.fromkeys(p.absolute() for p in out))


class ComparePickerScreen(ModalScreen[Path | None]):
    """Pick a recording (Enter on a row) or type its path (Enter in the field); Esc: none."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, files: list[Path], searched: list[Path]) -> None:
        super().__init__()
        self.files = files
        self.searched = searched

    def compose(self) -> ComposeResult:
        with Vertical(id="compare-box"):
            yield Static(
                "Compare with a recording — Enter draws it under this run's loss, Esc cancels",
                id="compare-title",
            )
            if self.files:
                yield OptionList(
                    *(Option(_row(path), id=str(i)) for i, path in enumerate(self.files)),
                    id="compare-list",
                )
            else:
                where = ", ".join(_home(p) for p in self.searched)
                yield Static(f"no .tdbg recordings in {where}", id="compare-none")
            yield Input(placeholder="or type a recording's path, then Enter", id="compare-path")

    def on_mount(self) -> None:
        self.query_one(OptionList if self.files else Input).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.files[int(event.option.id or 0)])

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if text:
            self.dismiss(Path(text).expanduser())

    def action_cancel(self) -> None:
        self.dismiss(None)


class ClearCompareScreen(ModalScreen[bool]):
    """While recordings are drawn under the run: clear them (y), or keep them (n, Esc)."""

    BINDINGS = [
        Binding("y", "answer(True)", "Clear"),
        Binding("n", "answer(False)", "Keep"),
        Binding("escape", "answer(False)", "Keep"),
    ]

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names

    def compose(self) -> ComposeResult:
        with Vertical(id="compare-box"):
            yield Static(f"Comparing with {', '.join(self.names)}", id="compare-title")
            yield Static("Stop comparing?  y: clear it   n / Esc: keep it", id="compare-ask")

    def action_answer(self, clear: bool) -> None:
        self.dismiss(clear)


def _row(path: Path) -> Text:
    """``name  size  age  directory``."""
    text = Text(path.name, "bold")
    try:
        stat = path.stat()
        text.append(f"  {fmt_bytes(stat.st_size)}  {fmt_span(time.time() - stat.st_mtime)} ago")
    except OSError:
        pass
    text.append(f"  {_home(path.parent)}", "dim")
    return text


def _home(path: Path) -> str:
    """A path with the home directory as ``~``: rows stay short."""
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home) :] if text == home or text.startswith(home + os.sep) else text
