"""HelpScreen: a modal listing the keys."""

from __future__ import annotations

import re
from collections.abc import Iterator

from rich.console import Console, ConsoleOptions
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = """\
q            quit
?            this help
r            switch run: pick another run on this machine (its step, loss, health)
b            compare: pick a recording (*.tdbg here, in the run's directory, or a path
             typed in) to draw under this run's loss up to its step; b again: clear it
ctrl+p       command palette: every action here, by name
tab / ⇧tab   next / previous panel
l            the chart shown: linear / log y (each chart keeps its own)
enter        on a metric: chart it in the loss panel; again: the loss
e            inspect cursor: the charts, LR, metrics and the selected
             layer's norm read one step; ← → move it (⇧: 10×), escape
C            colours: the theme's / colour-blind safe
h            gradients: table / heatmap
u            heatmap: gradient norms / each layer's update ratio (Δw/w)
o            gradient table: sort by name / norm / trend (or click a header)
t            gradients: each trend on its own scale / all on one (rows compare)
/            gradients: filter layers by name as you type; enter keeps, escape clears
g            distributions: the table's layer's |gradients| (w: |weights|) in log
             bins over the counted steps; [ ] another layer
j            the run's console (its print()s; TDBG_CONSOLE=fd: C too); / searches
i            the model: per layer its type, parameters, frozen or not,
             dtype, device, bytes, optimizer; what to look at (tdbg summary)
↑ ↓ PgUp PgDn  scroll the focused panel

Loss chart (tab to it; these keys while it has the focus):
w            the last 500 steps / every step
+ -          zoom in / out: half / twice the steps
, .          older / newer steps (← → too, outside a replay); at the newest
             the window follows the run
f            y-range: fitted to the steps shown / all of it
v            loss / step time of each step in ms (the caption gives steps/s);
             a red line and "NaN at step N" mark the first non-finite loss

Alerts (tab to them): the first alert of each kind on top, in the order
the kinds came (the first is usually the cause), repeats folded as ×N;
then later alerts with other messages, newest first.
↑ ↓ PgUp PgDn  move between the alerts; Home End: the first / last
enter        the alert in full (escape closes)

Deep dives (the probe runs them in the training process at the next step boundary):
p            profile the next steps: a form (steps, time cap, shapes / memory / stack)
m            memory snapshot of the next steps (CUDA runs only)
n            NaN hunt: name the first module whose output or gradient is NaN/Inf
a            autograd anomaly mode for 10 steps (global and slow while on)
s            activation statistics every 10 steps: on / off (beside the gradient norms)
c            cancel the running deep dive shown in the deep-dive panel
d            deep-dive panel: profile / memory snapshot / NaN hunt
[ ]          profile table: sort by the previous / next column (or click a header)
z            maximise the focused panel (any: loss, gradients, alerts, memory, deep dive...)
             to the full screen; escape or z again gives the layout back
x            close the deep-dive panel (one line again) until the next dive; d reopens it

Job screen (tdbg-tui --job JOB: every rank of a distributed job):
enter        open the cursor's rank: its full screen (deep dives go to that rank); escape back
p            profile the next 5 steps on every rank at once: the slowest and fastest rank
             (own time per step, collectives left out) and their top ops side by side, a
             line for each other rank and each rank with no profile; escape closes it

Replay (tdbg-tui replay FILE; the keys work whichever panel has focus):
← →          one recorded step back / forward
⇧← ⇧→        jump 5 % of the recording (at least 10 steps)
home end     the first / last recorded step

Heatmap colours: a log scale fitted to the layers shown, its ends on the heatmap's first line;
× marks NaN / Inf, ░ exact zeros. Profile Δ/call: ▲ slower, ▼ faster.

Theme, colours, views, sorts, chart windows and scales are kept in
$XDG_CONFIG_HOME/tdbg/settings.json (~/.config/tdbg/...).

↑ ↓ PgUp PgDn Home End scroll this help; escape or ? closes it."""


KEY_WIDTH = 13  # the key column of KEYS: a description starts after it
INDENT = KEY_WIDTH + 2  # where a description starts on screen (the longest key, two spaces)
MIN_TEXT = 24  # narrower than this beside the keys: each key on a line of its own
_ENTRY = re.compile(r"^(\S(?:.*?\S)?)\s{2,}(\S.*)$")


def help_blocks(text: str) -> list[tuple[str, str] | str | None]:
    """KEYS as what it says: (key, description) for a key's line and the lines under it that
    go on with its description, a paragraph's joined text for other lines, None for a blank
    line. The text is written for a wide terminal; these are re-flowed to any width."""
    blocks: list[tuple[str, str] | str | None] = []
    for line in text.splitlines():
        last = blocks[-1] if blocks else None
        entry = _ENTRY.match(line)
        if not line.strip():
            blocks.append(None)
        elif line.startswith(" " * KEY_WIDTH) and isinstance(last, tuple):
            blocks[-1] = (last[0], f"{last[1]} {line.strip()}")
        elif entry is not None and len(entry.group(1)) <= KEY_WIDTH:
            blocks.append((entry.group(1), entry.group(2)))
        elif isinstance(last, str):
            blocks[-1] = f"{last} {line.strip()}"
        else:
            blocks.append(line.strip())
    return blocks


class KeyHelp:
    """The keys, wrapped to the width they are drawn at: a description's lines stay to the
    right of its key (a terminal narrower than KEYS's lines wrapped them to the left edge)."""

    def __init__(self, text: str) -> None:
        self.blocks = help_blocks(text)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        for line in self._lines(console, max(1, options.max_width)):
            line.rstrip()  # the space a line was broken at
            yield line

    def _lines(self, console: Console, width: int) -> Iterator[Text]:
        beside = width - INDENT >= MIN_TEXT
        for block in self.blocks:
            if block is None:
                yield Text("")
            elif isinstance(block, str):
                yield from Text(block).wrap(console, width)
            else:
                key, description = block
                if beside:
                    lines = Text(description).wrap(console, width - INDENT)
                    for i, line in enumerate(lines):
                        lead = key.ljust(INDENT) if i == 0 else " " * INDENT
                        yield Text(lead) + line
                else:
                    yield Text(key)
                    for line in Text(description).wrap(console, max(1, width - 2)):
                        yield Text("  ") + line


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close"),
        Binding("q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        # A focused VerticalScroll: its keys scroll the help on a terminal too short for it.
        with VerticalScroll(id="help-box"):
            yield Static("tdbg — keys", id="help-title")
            yield Static(KeyHelp(KEYS), id="help-keys")

    def on_mount(self) -> None:
        self.query_one("#help-box").focus()

    def on_screen_resume(self) -> None:
        # The screen is kept between showings (see action_help): it opens at its top each time.
        self.query_one("#help-box").scroll_home(animate=False)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)
