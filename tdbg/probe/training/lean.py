"""The usual step's record: what the hooks and taps write while a step follows the usual pattern.

A usual CPU step is one forward (or several) with grad, one backward of a finite CPU scalar,
one update without a closure whose learning rates are floats, then ``probe.step()``. Right
after the loop's kernels each bytecode the probe runs costs tens of nanoseconds (its code and
data are cold): the full bookkeeping of such a step (the hooks' timeline, the loss tally, the
optimizer's slot, about 870 bytecodes) cost ~20 us a step on the micro model. While a step is
*lean* (``on``, armed at the end of the step before when nothing rare is pending) each entry
point writes only its reading here, and ``probe.step()`` hands the step over from it. (The
optimizer's own step pre-hook is then out of the way: the process-wide optimizer tap reads
the update's start and learning rates here, PhaseHooks.take_pre_out.)

Anything else (a second backward, a clip, a closure, a NaN, a forward without grad, a new
optimizer, an AMP iteration, any tap's rare event) first *settles* the record: the sampler
replays what it holds into the full bookkeeping, in order, with the readings taken at the
time (``StepSampler.settle``), and the step goes on the whole way, exactly as if it had never
been lean (tests/probe/test_lean.py holds the two to the same records).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

from tdbg.protocol.steps import MAX_LR_COLUMNS

# Lean steps on (tests turn them off to compare the two ways).
ENABLED = True


def _nothing() -> None:
    return None


class LeanStep:
    """One step's readings while it is lean; reused from step to step (no allocation)."""

    __slots__ = ("on", "forward_start", "forward_end", "loss", "value", "lrs", "opt_start",
                 "opt_end", "_settle", "thread", "optimizer", "pre_hook", "device_loss",
                 "capture", "inputs", "__weakref__")  # fmt: skip

    def __init__(self, settle: Callable[[], None] = _nothing) -> None:
        self.on = False  # this step is lean: the entry points write here
        # The sampler's replay into the full bookkeeping, weakly (a bound method's: the hooks
        # hold this record, and a hook never keeps the probe alive; hook_refs.WeakHook). Once
        # the sampler is gone (a probe dropped without close()), the record is off and holds
        # nothing of the loop's: a wrapper left on the model writes nothing here.
        self._settle: Callable[[], Callable[[], None] | None] = (
            weakref.WeakMethod(settle, _gone_with(weakref.ref(self)))
            if isinstance(settle, types.MethodType)
            else lambda: settle
        )
        # Whether a forward's root module and arguments are kept (``capture``), and the latest
        # ones with grad (``inputs``; PhaseHooks.last_inputs): a non-finite step's forward is
        # re-run on them (its weights still intact) to name the module that overflowed. One
        # reference to a batch, nothing copied. Here, where a lean step's forward wrapper
        # writes them, not in PhaseHooks: the usual step's entry points touch this record
        # alone (each object touched right after the loop's kernels costs cache misses).
        self.capture = False
        self.inputs: tuple[Any, Any, Any] | None = None
        # The thread that calls probe.step() (None: not yet): the taps' rare events settle
        # the record from there only; another thread's (an actor's optimizer seen for the
        # first time) would race the training thread's writes, and what they change is
        # looked at in probe.step() (layout_dirty, a DataLoader's new pass) anyway.
        self.thread: int | None = None
        # While the optimizer's own step pre-hook is out of its hook dict (PhaseHooks.take_pre
        # _out): that optimizer, whose lean updates the process-wide optimizer tap starts
        # (taps), and the hook it hands anything else to. None while the hook is in place.
        self.optimizer: Any = None
        self.pre_hook: Callable[[Any, Any, Any], Any] | None = None
        # A GPU run's device (its loss ring's): a scalar on it backpropagated or passed is
        # kept unread (reading it waits for the device); its value comes back a tick later
        # with its neighbours' (loss_ring.py). None on a CPU run: there a device scalar is
        # not the usual pattern.
        self.device_loss: Any = None
        self.clear()

    def settle(self) -> None:
        """Replay what this step's record holds into the full bookkeeping (the sampler's
        ``settle``; nothing once the sampler is gone)."""
        settle = self._settle()
        if settle is not None:
            settle()

    def forget(self) -> None:
        """Off, and nothing of the loop's held: the step's readings, the inputs kept for a
        NaN's forward (a probe closed or gone: a wrapper another one put over the probe's
        outlives it)."""
        self.on = False
        self.inputs = None
        self.clear()

    def clear(self) -> None:
        """Nothing read yet. (A lean step's hand-over resets only what the hooks test:
        ``forward_start``, ``loss``, ``opt_start`` and ``opt_end``; each other reading is written
        with one of those, before anything reads it.)"""
        self.forward_start: float | None = None  # the first forward with grad began
        self.forward_end: float | None = None  # the backward began
        self.loss: Any = None  # the scalar backpropagated
        # Its value, read before its backward (finite); None for a device scalar (a GPU run's).
        self.value: float | None = None
        self.lrs: list[float] | None = None  # the update's learning rates, at its pre-hook
        self.opt_start: float | None = None
        self.opt_end: float | None = None


def _gone_with(record: weakref.ref[LeanStep]) -> Callable[[Any], None]:
    """What a record does when its sampler is gone: off, and nothing of the loop's held."""

    def gone(_: Any) -> None:
        lean = record()
        if lean is not None:
            lean.forget()

    return gone


def update_rates(optimizer: Any, args: Any, kwargs: Any) -> list[float] | None:
    """The learning rates a lean update uses, read before a scheduler changes them: its
    optimizer's, when each is a float and ``step()`` was given no closure (``step(None)``,
    accelerate's call, is none); else None, and the whole way says what. (The optimizer tap
    writes this out: it is the first Python after the backward, where a frame costs.)"""
    if kwargs or (len(args) != 1 and (len(args) != 2 or args[1] is not None)):
        return None
    try:
        groups = optimizer.param_groups
        if len(groups) == 1:
            rate = groups[0].get("lr")
            return [rate] if type(rate) is float else None
        return float_rates(groups)
    except Exception:  # an optimizer of its own kind
        return None


def float_rates(groups: list[dict[str, Any]]) -> list[float] | None:
    """The learning rates of ``groups`` when each is a float and a step can carry them all;
    else None (more than a step's columns: the whole way keeps the first ones and says so)."""
    if len(groups) > MAX_LR_COLUMNS:
        return None
    rates = []
    for group in groups:
        rate = group.get("lr")
        if type(rate) is not float:
            return None
        rates.append(rate)
    return rates
