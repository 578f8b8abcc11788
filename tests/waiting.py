"""How a test waits for an event: poll a condition until a deadline, never a bare sleep.

``wait_until`` for plain code, ``until`` inside a coroutine, ``wait_for`` for the TUI under its
Pilot (the Pilot spelling of ``until``). Each returns the condition's first true value and, past
the deadline, fails with what it was waiting for.

The deadline is a ceiling, not an expected time: this suite runs on a busy 2-core CI machine
where something that takes milliseconds alone can take seconds, and a condition that holds
returns at once, so the default is generous.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

TIMEOUT = 30.0


class _Pauses(Protocol):
    """What ``wait_for`` needs of a Textual ``Pilot``: a pause that lets the app process."""

    @property
    def app(self) -> Any: ...

    async def pause(self, delay: float | None = None) -> Any: ...


class _Deadline:
    """The one clock and the one failure message behind all three spellings."""

    def __init__(
        self,
        condition: Callable[[], object],
        timeout: float,
        what: str,
        detail: Callable[[], object] | None,
    ) -> None:
        self.condition, self.timeout, self.what, self.detail = condition, timeout, what, detail
        self.end = time.monotonic() + timeout

    def passed(self) -> bool:
        return time.monotonic() > self.end

    def failure(self) -> AssertionError:
        what = self.what or self._where()
        message = f"not within {self.timeout:g} s: {what}"
        if self.detail is not None:
            try:
                message += f"\n{self.detail()}"
            except Exception as exc:  # the detail must not hide the failure it explains
                message += f"\n(no detail: {exc!r})"
        return AssertionError(message)

    def _where(self) -> str:
        code = getattr(self.condition, "__code__", None)
        if code is None:
            return repr(self.condition)
        return f"the condition at {code.co_filename}:{code.co_firstlineno}"


def wait_until(
    condition: Callable[[], T | None],
    timeout: float = TIMEOUT,
    what: str = "",
    *,
    detail: Callable[[], object] | None = None,
    interval: float = 0.01,
) -> T:
    """Poll ``condition`` until it returns something true and return that; fail after
    ``timeout`` seconds naming ``what`` (and ``detail()``, e.g. the output so far)."""
    deadline = _Deadline(condition, timeout, what, detail)
    while True:
        value = condition()
        if value:
            return value
        if deadline.passed():
            raise deadline.failure()
        time.sleep(interval)


async def until(
    condition: Callable[[], T | None],
    timeout: float = TIMEOUT,
    what: str = "",
    *,
    pilot: _Pauses | None = None,
    detail: Callable[[], object] | None = None,
    interval: float = 0.02,
) -> T:
    """``wait_until`` inside a coroutine: between polls the event loop runs (through
    ``pilot.pause`` when a Textual Pilot is given, so that the app handles what is pending)."""
    deadline = _Deadline(condition, timeout, what, detail)
    while True:
        value = condition()
        if value:
            return value
        if deadline.passed():
            raise deadline.failure()
        if pilot is not None:
            await pilot.pause(interval)
        else:
            await asyncio.sleep(interval)


async def wait_for(
    pilot: _Pauses, condition: Callable[[], T | None], what: str = "", timeout: float = TIMEOUT
) -> T:
    """``until`` for the TUI under its Pilot; a failure shows the screen as it was."""
    from tdbg.tui.app import screen_text  # textual only for the tests that run the TUI

    def screen() -> str:
        return f"the screen:\n{screen_text(pilot.app)}"

    return await until(condition, timeout, what, pilot=pilot, detail=screen)
