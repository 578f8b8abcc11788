"""The suite's one polling helper: it returns as soon as the condition holds, and its failure
says what was awaited."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Static
from waiting import until, wait_for, wait_until


def test_wait_until_returns_the_first_true_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "done", what="three polls") == "done"
    assert next(counter) == 4  # polled exactly until it held, not once more


def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"not within 0\.05 s: the door to open\nstill shut"):
        wait_until(lambda: False, 0.05, "the door to open", detail=lambda: "still shut")


def test_an_unnamed_condition_is_named_by_its_place() -> None:
    with pytest.raises(AssertionError, match=r"the condition at .*test_waiting\.py:\d+"):
        wait_until(lambda: False, 0.05)


def test_a_failing_detail_does_not_hide_the_failure() -> None:
    with pytest.raises(AssertionError, match=r"the door(.|\n)*no detail: ZeroDivisionError"):
        wait_until(lambda: False, 0.05, "the door", detail=lambda: 1 / 0)


async def test_until_lets_the_event_loop_run() -> None:
    done = asyncio.Event()
    asyncio.get_running_loop().call_soon(done.set)
    assert await until(done.is_set, what="the callback") is True
    with pytest.raises(AssertionError, match="not within 0.05 s: never"):
        await until(lambda: False, 0.05, "never")


class Hello(App[None]):
    def compose(self) -> ComposeResult:
        yield Static("hello from the screen")


async def test_wait_for_under_a_pilot_shows_the_screen_on_failure() -> None:
    app = Hello()
    async with app.run_test(size=(30, 3)) as pilot:
        assert await wait_for(pilot, lambda: app.screen.query_one(Static), "the widget")
        with pytest.raises(AssertionError, match=r"goodbye(.|\n)*hello from the screen"):
            await wait_for(pilot, lambda: False, "goodbye", 0.05)
