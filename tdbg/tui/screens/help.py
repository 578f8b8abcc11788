"""HelpScreen: a modal listing the keys."""

from __future__ import annotations

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
v            loss / step time of each step in ms (the caption gives steps/s)
             a red line and "NaN at step N" mark the first non-finite loss

Alerts (tab to them): the first alert of each kind on top, in the order
the kinds came (the first is usually the cause), repeats folded as ×N;
then later alerts with other messages, newest first.
↑ ↓ PgUp PgDn Home End   move     enter   the alert in full (escape closes)

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
            yield Static(KEYS, id="help-keys", markup=False)

    def on_mount(self) -> None:
        self.query_one("#help-box").focus()

    def on_screen_resume(self) -> None:
        # The screen is kept between showings (see action_help): it opens at its top each time.
        self.query_one("#help-box").scroll_home(animate=False)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)
