"""tdbg's actions in Textual's command palette (ctrl+p), read from the keys that run them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from textual.app import App, SystemCommand
from textual.dom import DOMNode

# A palette title and a line of help per action; an action missing here (a key added later)
# still appears, under its binding's own description.
WORDS: dict[str, tuple[str, str]] = {
    "profile": ("Profile", "torch.profiler over the next steps: a form first"),
    "snapshot": ("Memory snapshot", "CUDA allocator history over the next steps"),
    "nan_hunt": ("NaN hunt", "name the first module whose output or gradient is NaN/Inf"),
    "anomaly": ("Anomaly mode", "autograd anomaly detection for 10 steps (slow while on)"),
    "activations": ("Activation statistics", "per-module output statistics: on / off"),
    "cancel_job": ("Cancel deep dive", "cancel the running deep dive"),
    "cycle_view": ("Deep-dive view", "the deep-dive panel: profile / snapshot / NaN hunt"),
    "profile_sort(-1)": ("Sort profile table ←", "by the previous column"),
    "profile_sort(1)": ("Sort profile table →", "by the next column"),
    "zoom": ("Zoom", "the focused panel to the full screen (escape returns)"),
    "close_deep": ("Close deep dive", "give the deep-dive panel's space back"),
    "cycle_sort": ("Sort gradient table", "by name / norm / trend"),
    "toggle_heatmap": ("Heatmap", "gradients: table / heatmap"),
    "toggle_log": ("Log scale", "the chart shown: linear / log y (each chart keeps its own)"),
    "switch_run": ("Switch run", "pick another run on this machine"),
    "compare_recording": ("Compare with a recording", "draw a .tdbg under the loss; again: clear"),
    "inspect": ("Inspect cursor", "read every chart at one step: ← → move, escape leaves"),
    "cycle_palette": ("Colours", "the theme's colours / colour-blind safe ones (kept)"),
    "help": ("Help", "the keys"),
    "quit": ("Quit", "leave tdbg-tui (the run goes on)"),
}


def palette_commands(app: App[Any], screen: DOMNode) -> Iterator[SystemCommand]:
    """One command per action bound on ``screen`` (the monitor) or on ``app`` itself (Textual's
    own app keys aside), titled from WORDS, its keys in the help line; selecting it runs the
    same action as the key, on the same node."""
    own = {binding.action for binding in type(app).BINDINGS if not isinstance(binding, tuple)}
    keys: dict[str, list[str]] = {}
    nodes: dict[str, DOMNode] = {}
    descriptions: dict[str, str] = {}
    for active in screen.active_bindings.values() if hasattr(screen, "active_bindings") else ():
        node, binding = active.node, active.binding
        if node is not screen and not (node is app and binding.action in own):
            continue  # a widget's scroll keys, Textual's ctrl+q and friends
        if not binding.description:
            continue
        nodes.setdefault(binding.action, node)
        descriptions.setdefault(binding.action, binding.description)
        keys.setdefault(binding.action, []).append(app.get_key_display(binding))
    for action, node in nodes.items():
        title, help_text = WORDS.get(action, (descriptions[action], ""))
        shown = " / ".join(keys[action])
        yield SystemCommand(
            title,
            f"{help_text} — key {shown}" if help_text else f"key {shown}",
            _runner(app, action, node),
        )


def _runner(app: App[Any], action: str, node: DOMNode) -> Any:
    async def run() -> None:
        await app.run_action(action, node)

    return run
