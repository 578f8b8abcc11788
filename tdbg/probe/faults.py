"""Declared fault-injection points: where a test makes one part of a live probe fail or lie.

A test that checks "an error inside the probe is counted and never raised" has to make some
part of the probe fail. Reaching for the part's private methods from the tests ties them to
names the probe may rename; here the probe names those places once, as points, and
:func:`inject` swaps a point's callable on one probe (its instance, or the one module the point
lives in) and returns the undo. a test resolves every point on a real probe, so a
renamed method breaks here, next to the code, not in fifty tests.

Nothing in the probe consults this module: a probe no one injects into runs exactly the code
it always did, at no cost on any path (the training thread's included).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tdbg.probe.watch import Probe

# point -> the (part, attribute) pairs it replaces. A part is a Probe attribute ("_sampler") or
# "module:" + a module whose global the point is (a function the probe thread calls by name).
POINTS: dict[str, tuple[tuple[str, str], ...]] = {
    # The training thread's gradient pass at an update (the sampler's entries for it; the
    # step pre-hook calls on_grads_ready where a pass is due).
    "optimizer_step": (("_sampler", "on_optimizer_step"), ("_sampler", "on_grads_ready")),
    # The step's loss bookkeeping in probe.step(loss), on the training thread.
    "step_losses": (("_sampler", "_step_losses"),),
    # What the training thread tells the probe thread (a one-line note, e.g. a retried step).
    "sampler_tell": (("_sampler", "_tell"),),
    # The sampler's measured costs (gradient pass, step, ...), read by the budget.
    "measured_costs": (("_sampler", "measured_costs"),),
    # One tick of the probe thread's loop, and the handler it reports an error to.
    "server_tick": (("_server", "_tick"),),
    "server_error": (("_server", "_on_error"),),
    # Building a usual step from the values the training thread handed over (probe thread).
    "build_step": (("module:tdbg.probe.serving.server", "usual_record"),),
}


def targets(probe: Probe, point: str) -> list[tuple[Any, str]]:
    """The (object, attribute) pairs ``point`` replaces on ``probe``."""
    if point not in POINTS:
        raise KeyError(f"no fault point {point!r}; the points are {sorted(POINTS)}")
    found: list[tuple[Any, str]] = []
    for part, attribute in POINTS[point]:
        if part.startswith("module:"):
            # A module a live probe has loaded (no import here: the probe's paths import nothing
            # by name, .ci/no-unsafe-decoding checks it).
            owner: Any = sys.modules[part.removeprefix("module:")]
        else:
            owner = getattr(probe, part)
        if not hasattr(owner, attribute):
            raise AttributeError(f"fault point {point!r}: {part} has no {attribute!r}")
        found.append((owner, attribute))
    return found


def original(probe: Probe, point: str) -> Callable[..., Any]:
    """What ``point`` calls now (its first target): for a replacement that wraps it."""
    owner, attribute = targets(probe, point)[0]
    fn: Callable[..., Any] = getattr(owner, attribute)
    return fn


def inject(probe: Probe, point: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Make ``point`` call ``replacement`` on ``probe``; returns the undo (call it once)."""
    saved: list[tuple[Any, str, bool, Any]] = []
    for owner, attribute in targets(probe, point):
        own = attribute in getattr(owner, "__dict__", {})
        saved.append((owner, attribute, own, getattr(owner, attribute)))
        setattr(owner, attribute, replacement)

    def undo() -> None:
        for owner, attribute, own, before in reversed(saved):
            if own:
                setattr(owner, attribute, before)
            else:
                delattr(owner, attribute)  # the class's method shows through again

    return undo
