"""ProfileFormScreen: the small form behind ``p`` (steps, time cap, shapes / memory / stack)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Checkbox, Input, Label, Static

from tdbg.protocol.framing import ProtocolError
from tdbg.protocol.messages import COMMANDS, command_args

SCHEMA = COMMANDS["profile"]  # bounds and defaults come from the wire's own schema


def _bounds(name: str) -> str:
    spec = SCHEMA[name]
    return f"{spec.lo:g}–{spec.hi:g}"


class ProfileFormScreen(ModalScreen[dict[str, Any] | None]):
    """Dismisses with the ``profile`` command's args, or None when cancelled. Invalid input
    shows an inline message and sends nothing."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        # Priority: enter submits from any field, including a focused checkbox.
        Binding("enter", "submit", "Profile", priority=True),
    ]

    def compose(self) -> ComposeResult:
        with Vertical(id="profile-form"):
            yield Static("Profile the next steps", id="profile-form-title")
            with Horizontal(classes="form-row"):
                yield Label(f"steps ({_bounds('steps')})", classes="form-label")
                yield Input(str(SCHEMA["steps"].default), type="integer", id="profile-steps")
            with Horizontal(classes="form-row"):
                yield Label(f"time cap, s ({_bounds('max_seconds')})", classes="form-label")
                yield Input(
                    f"{SCHEMA['max_seconds'].default:g}", type="number", id="profile-seconds"
                )
            yield Checkbox("record shapes", id="profile-record-shapes")
            yield Checkbox("profile memory", id="profile-memory")
            yield Checkbox("with stack", id="profile-with-stack")
            yield Static("", id="profile-error")
            yield Static(
                "enter: profile · escape: cancel · space: tick a box", id="profile-form-keys"
            )

    def on_mount(self) -> None:
        self.query_one("#profile-steps", Input).focus()

    def args(self) -> dict[str, Any]:
        """The form's values checked against the schema; raises ValueError with the reason."""
        steps_text = self.query_one("#profile-steps", Input).value.strip()
        seconds_text = self.query_one("#profile-seconds", Input).value.strip()
        try:
            steps = int(steps_text)
        except ValueError:
            raise ValueError(f"steps must be a whole number {_bounds('steps')}") from None
        try:
            seconds = float(seconds_text)
        except ValueError:
            raise ValueError(
                f"time cap must be a number of seconds {_bounds('max_seconds')}"
            ) from None
        raw = {
            "steps": steps,
            "max_seconds": seconds,
            "record_shapes": self.query_one("#profile-record-shapes", Checkbox).value,
            "profile_memory": self.query_one("#profile-memory", Checkbox).value,
            "with_stack": self.query_one("#profile-with-stack", Checkbox).value,
        }
        try:
            return command_args("profile", raw)
        except ProtocolError as exc:
            raise ValueError(str(exc).replace("profile.", "")) from None

    def action_submit(self) -> None:
        try:
            args = self.args()
        except ValueError as exc:
            self.query_one("#profile-error", Static).update(str(exc))
            self.query_one("#profile-form").add_class("-invalid")
            return
        self.dismiss(args)

    def action_cancel(self) -> None:
        self.dismiss(None)
