"""HelpScreen: a modal listing the keys."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = """\
q            quit
?            this help
tab / ⇧tab   next / previous panel
l            loss chart: linear / log scale
h            gradients: table / heatmap
s            gradient table: sort by name / norm / trend (or click a header)
p            profile the next steps (comes with the deep-dive commands)
↑ ↓ PgUp PgDn  scroll the focused panel

Heatmap colours: low (vanishing) … high (exploding) on a log scale from 1e-8 to 1e4;
× marks NaN / Inf, a separate colour marks exact zeros.

escape or ? closes this help."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close"),
        Binding("q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Static("tdbg — keys", id="help-title")
            yield Static(KEYS, id="help-keys")

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)
