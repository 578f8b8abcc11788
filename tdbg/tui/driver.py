"""Textual's Linux driver with an Esc key seen in ESCAPE_DELAY rather than a 100 ms poll later."""

from __future__ import annotations

import os
import selectors
from codecs import getincrementaldecoder

from textual import constants
from textual._loop import loop_last
from textual._parser import ParseError
from textual._time import get_time
from textual._xterm_parser import XTermParser
from textual.drivers.linux_driver import LinuxDriver

# How long a lone ESC waits for the rest of an escape sequence before it is the Esc key.
# Textual's default is 100 ms. A key's sequence (an arrow: ESC [ A) is written by the terminal
# in one write and, over ssh, sent in one channel message, so its bytes arrive together; the
# wait only matters when a sequence is split in transit, which takes a stall of tens of ms
# inside three bytes. 30 ms covers that on a slow link and is what users of other terminal
# programs run with (tmux's escape-time is 10 ms since 3.5, neovim's ttimeoutlen 50 ms).
# ESCDELAY in the environment (ms, as curses and Textual read it) still wins.
ESCAPE_DELAY = 0.030

# The poll while nothing is pending: Textual's own (the thread wakes 10 times a second to see
# whether the app is exiting; that is the idle cost, unchanged).
IDLE_POLL = 0.1


def poll_timeout(deadline: float | None, now: float) -> float:
    """How long the input thread may wait for bytes: until the parser's pending escape
    sequence times out (``deadline``), at most ``IDLE_POLL``."""
    if deadline is None:
        return IDLE_POLL
    return min(IDLE_POLL, max(0.0, deadline - now))


class TdbgLinuxDriver(LinuxDriver):
    """The input thread of Textual 8's LinuxDriver, polling until the parser's deadline.

    Textual's thread polls with ``select(0.1)`` and its parser decides a lone ESC is the Esc key
    only on the ``tick()`` after a poll returns, so with nothing else typed every Esc was seen
    100-200 ms late whatever ESCDELAY said. Here the poll ends when the pending sequence's
    wait does, and the wait itself is ``ESCAPE_DELAY``."""

    def start_application_mode(self) -> None:
        if "ESCDELAY" not in os.environ:
            # Textual reads this module attribute each time an ESC starts a sequence.
            setattr(constants, "ESCAPE_DELAY", ESCAPE_DELAY)  # noqa: B010 (a Final in Textual)
        super().start_application_mode()

    def run_input_thread(self) -> None:
        """Textual's ``run_input_thread`` (8.2.8), the poll's timeout apart."""
        selector = selectors.SelectSelector()
        selector.register(self.fileno, selectors.EVENT_READ)
        fileno = self.fileno
        parser = XTermParser(self._debug)
        feed = parser.feed
        tick = parser.tick
        decode = getincrementaldecoder("utf-8")().decode

        def process(events: list[tuple[selectors.SelectorKey, int]], final: bool = False) -> None:
            for last, (_key, mask) in loop_last(events):
                if mask & selectors.EVENT_READ:
                    data = decode(os.read(fileno, 1024 * 4), final=final and last)
                    if not data:  # stdin piped and at its end
                        break
                    for event in feed(data):
                        self.process_message(event)
            for event in tick():
                self.process_message(event)

        def timeout() -> float:
            # The deadline of a sequence in progress (None: nothing pending); Textual's Parser
            # keeps it in this attribute and ``tick()`` compares it with the same clock. A
            # Textual without it polls as its own driver does.
            return poll_timeout(getattr(parser, "_timeout_time", None), get_time())

        try:
            while not self.exit_event.is_set():
                process(selector.select(timeout()))
            selector.unregister(self.fileno)
            process(selector.select(IDLE_POLL), final=True)
        finally:
            selector.close()
            try:
                for _event in feed(""):
                    pass
            except (EOFError, ParseError):
                pass
