"""SteadyFooter: a Footer that rebuilds its keys only when the keys it would show changed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.widgets import Footer

if TYPE_CHECKING:
    from textual.screen import Screen


def shown_keys(screen: Screen[object]) -> tuple[tuple[str, str, str, bool, str], ...]:
    """What a footer on ``screen`` shows: each shown binding's key, action, words, whether it
    is enabled and its tooltip."""
    return tuple(
        (binding.key, binding.action, binding.description, enabled, tooltip)
        for _node, binding, enabled, tooltip in screen.active_bindings.values()
        if binding.show
    )


class SteadyFooter(Footer):
    """Textual's Footer recomposes (mounts and styles ~25 key widgets) whenever its screen's
    bindings may have changed: each focus move, and each return from a screen pushed over it.
    Coming back from the help took ~70 ms of that for the same keys: the keys' signature is
    compared first, and an unchanged footer is left as it is."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._shown: tuple[tuple[str, str, str, bool, str], ...] | None = None

    def bindings_changed(self, screen: Screen[object]) -> None:
        if self.is_attached and screen is self.screen and self.app.app_focus:
            shown = shown_keys(screen)
            if shown == self._shown and self._bindings_ready:
                return
            self._shown = shown
        super().bindings_changed(screen)
