"""Forward and optimizer hooks that time the step's phases; every handle kept, all removable."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdbg.probe.device_copy import recorded_event
from tdbg.probe.training import forward_tap, state_tap, taps
from tdbg.probe.training.hook_refs import COMPILE_STATE, ForwardHook, WeakHook, is_compiling
from tdbg.probe.training.lean import LeanStep, update_rates
from tdbg.probe.training.release import HELD
from tdbg.probe.training.self_timing import TIMED

perf = time.perf_counter
# The step pre-hook taken out on lean steps (PhaseHooks.take_pre_out; benchmarks/entry_floor.py
# turns it off to measure what it saves).
PRE_OUT = True
_thread_id = threading.get_ident


class CudaMark:
    """A point in the step on a GPU run: host time plus a CUDA event on the model's stream."""

    __slots__ = ("host", "event")

    def __init__(self, host: float, event: Any) -> None:
        self.host = host
        self.event = event


# On the CPU a mark is just the host time: a float is not tracked by the garbage collector, so
# the probe's per-step objects do not drive the collector into full (100 ms+) collections.
Mark = float | CudaMark


def marker(cuda_device: torch.device | None) -> Callable[[], Mark]:
    """What makes a mark for ``cuda_device``: on the CPU the clock itself (a C function, no
    Python frame: the probe marks in the cold moments around an update), on a GPU a CudaMark."""
    if cuda_device is None:
        return perf

    def cuda_mark() -> CudaMark:
        # On the model's device's stream, not the current device's (a rank may never
        # set_device).
        return CudaMark(perf(), recorded_event(cuda_device, timing=True))

    return cuda_mark


def host_time(point: Mark) -> float:
    return point if isinstance(point, float) else point.host


def span(start: Mark | None, end: Mark | None) -> float | None:
    """Seconds between two marks, or None while a CUDA event is still pending.

    Called from the probe thread; ``Event.query()`` never blocks.
    """
    if start is None or end is None:
        return float("nan")
    if isinstance(start, CudaMark) and isinstance(end, CudaMark):
        if not end.event.query():
            return None
        return float(start.event.elapsed_time(end.event)) / 1000.0
    return host_time(end) - host_time(start)


class StepTimeline:
    """Marks of one step: forward start/end, optimizer start/end, and where a watched model's
    forwards without grad began and ended, before the step's own (an evaluation, a rollout, a
    frozen teacher: time that is neither waiting for data nor the step's forward).

    Defaults on the class and no ``__init__``: one is made per step, after the update, where a
    Python ``__init__`` frame costs microseconds; a mark set goes into the instance's dict."""

    # Host clock readings (perf), on a GPU run too: where the first forward without grad began
    # and the last one ended (None: not seen; its end alone may be missing).
    no_grad_start: float | None = None
    no_grad_end: float | None = None
    forward_start: Mark | None = None
    forward_end: Mark | None = None
    optimizer_start: Mark | None = None
    optimizer_end: Mark | None = None


class OptimizerEvents(Protocol):
    """What the sampler hears from the optimizer hooks (``index``: the optimizer's slot) on
    any update but a usual one, whose work the hooks do themselves on the sampler's state."""

    def on_optimizer_pre(self, index: int, grads_ready: bool = False) -> None: ...

    def on_grads_ready(self, index: int) -> None: ...

    def on_optimizer_post(self, index: int) -> None: ...


class PhaseHooks:
    """Root-module forward wrappers (or pre-hooks) and optimizer step hooks feeding a StepTimeline.

    One forward wrapper per watched root module (not per layer): one Python call per forward;
    a forward pre-hook where the module's forward cannot be wrapped (forward_tap).
    Each hook's work is written into its ``__call__`` (on the CPU each Python frame around an
    update costs microseconds, counted by ``benchmarks/probe_calls.py``).
    The forward's end is marked where its backward starts, by the probe's backward tap
    (:meth:`StepSampler.on_backward`): the loss is part of the forward, and a hook called right
    after the forward's kernels (each Python call there costs microseconds) is saved.
    ``on_grads_ready`` runs once the gradients the update will use exist and before the
    optimizer consumes them, whatever the user's ``zero_grad`` placement: at the step
    pre-hook, or — for ``optimizer.step(closure)``, whose closure runs forward and backward
    inside the step — right after the closure's first call returns.
    """

    def __init__(
        self,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        cuda_device: torch.device | None,
        events: OptimizerEvents,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.cuda_device = cuda_device
        self._mark = marker(cuda_device)
        # On the CPU a mark is the clock itself: a hook marks with the reading that starts
        # its own timing (one clock call fewer, in the cold moments around the update). So on
        # a GPU run's steps whose phases are not timed (the sampler sets it per step).
        self.host_marks = cuda_device is None
        self.active = True  # False once the probe switched itself off; removal comes later
        self.timeline = StepTimeline()
        self.seconds = 0.0  # time spent inside these hooks since probe.step() last took it
        # From the gradients' being ready to the step's end: forwards and backwards in there
        # (LBFGS evaluating its closure again) are the optimizer's work, not the step's.
        self.updating = False
        # A watched forward with grad ran since the last backward the sampler heard of: that
        # backward's scalar is the watched model's (one that ran before probe.step() too).
        self.forward_pending = False
        # The thread that calls probe.step() (None until it first does): forwards without grad
        # on other threads are not the loop's evaluation.
        self.training_thread: int | None = None
        # Forward hooks marking where each forward without grad ends, by the id of the module's
        # forward-hook dict (DataParallel's replicas share it): from an evaluation's first
        # forward to the end of a step without any (each costs every forward meanwhile).
        self._no_grad_ends: dict[int, RemovableHandle] = {}
        # The sampler: the optimizer hooks do its usual work themselves (one frame each side
        # of an update), and hand it anything else.
        self._events = events
        # The sampler's record of a lean step (lean.py), which the hooks write while it is on.
        lean = getattr(events, "lean", None)
        self.lean: LeanStep = lean if isinstance(lean, LeanStep) else LeanStep()
        self._on_error = on_error
        # Weak and inert when copied: the model stays as picklable and copyable as without tdbg.
        self.handles: list[RemovableHandle | forward_tap.ForwardWrap] = []
        for model in models:
            if forward_tap.wrappable(model):
                # The forward's start marked by a wrapper on the instance's forward: no hook,
                # so torch calls the module on its fast path (forward_tap says why and how it
                # stays out of sight).
                self.handles.append(forward_tap.wrap(model, self))
                continue
            # With the forward's keyword arguments: a re-run of a model called with keywords
            # only (Hugging Face's model(**batch)) needs them.
            hook = _ForwardStart.owned_by(self)
            self.handles.append(model.register_forward_pre_hook(hook, with_kwargs=True))
            state_tap.cover(model)
        self._by_optimizer: dict[int, list[RemovableHandle]] = {}
        # The step pre-hook taken out of its optimizer's hook dict while steps are lean (its
        # handle), the hook itself: see take_pre_out.
        self._pre_out: tuple[RemovableHandle, _StepStart] | None = None
        # The optimizer tap had to put it back for an update that was not a lean one (a
        # closure, a tensor rate): it stays in until an update goes its lean way through it, so
        # a loop that is never lean at the optimizer does not take it out and back every step.
        self.pre_stays = False
        for index, optimizer in enumerate(optimizers):
            self.add_optimizer(index, optimizer)

    # The root module and arguments of the latest forward with grad, when asked for (kept in
    # the lean record, where a lean step's forward wrapper writes them: LeanStep.inputs).
    @property
    def capture_inputs(self) -> bool:
        return self.lean.capture

    @capture_inputs.setter
    def capture_inputs(self, value: bool) -> None:
        self.lean.capture = value

    @property
    def last_inputs(self) -> tuple[nn.Module, Any, Any] | None:
        return self.lean.inputs

    @last_inputs.setter
    def last_inputs(self, value: tuple[nn.Module, Any, Any] | None) -> None:
        self.lean.inputs = value

    def add_optimizer(self, key: int, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer``; its events name it ``key`` (the sampler's slot key). Its own
        step hooks, not a process-wide one: they run after the pre-hooks registered before
        them (a script's hook that sets the LR or rescales the gradients before ``tdbg run``
        starts the probe: the probe reads what the update uses) and before those registered
        later (``tdbg run``'s post-hook that calls ``probe.step()``)."""
        pre = optimizer.register_step_pre_hook(_StepStart.owned_by(self, key))
        post = optimizer.register_step_post_hook(_StepEnd.owned_by(self, key))
        self._by_optimizer[key] = [pre, post]
        self.handles.extend((pre, post))

    def take_pre_out(self, key: int, optimizer: Any) -> None:
        """Steps are lean from here: the step pre-hook of the optimizer ``key`` out of its hook
        dict, the process-wide optimizer tap doing its lean work (taps), one Python call fewer
        right after the backward (``benchmarks/entry_floor.py``). Only where nothing of the
        script's runs between the two (a hook before it may set the learning rate it reads):
        it is first of that optimizer's pre-hooks and the tap last of torch's process-wide
        ones (the tap puts it back when one is registered since). Called at a step's end,
        never while torch iterates over the hooks; :meth:`put_pre_back` undoes it."""
        handles = self._by_optimizer.get(key)
        if self._pre_out is not None or self.pre_stays or not handles or not PRE_OUT:
            return
        handle = handles[0]
        hooks = handle.hooks_dict_ref()
        if hooks is None or next(iter(hooks), None) != handle.id or not taps.tap_is_last():
            return  # a hook of the script's would run between the tap and this one
        hook = hooks.pop(handle.id)
        self._pre_out = (handle, hook)
        self.lean.optimizer = optimizer
        self.lean.pre_hook = hook
        taps.hold_out(self.lean, self.put_pre_back)

    def put_pre_back(self, stay: bool = False) -> None:
        """The step pre-hook back, first of its optimizer's (where it was), the tap's lean work
        off (``stay``: until an update goes its lean way through it). Never while torch
        iterates over the pre-hooks: before the update's tap began it, at a step's end, or from
        the tap itself (torch iterates over the process-wide hooks first)."""
        if stay:
            self.pre_stays = True
        out, self._pre_out = self._pre_out, None
        if out is None:
            return
        self.lean.optimizer = self.lean.pre_hook = None
        taps.hold_out(None)
        handle, hook = out
        hooks = handle.hooks_dict_ref()
        if hooks is not None:
            hooks[handle.id] = hook
            hooks.move_to_end(handle.id, last=False)

    def remove_optimizer(self, key: int) -> None:
        """Unhook the optimizer ``key`` (at a step boundary, never from inside its hooks)."""
        handles = self._by_optimizer.get(key)
        if handles and self._pre_out is not None and self._pre_out[0] is handles[0]:
            self._let_pre_go()
        for handle in self._by_optimizer.pop(key, []):
            handle.remove()
            if handle in self.handles:
                self.handles.remove(handle)

    def forward_began(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A watched root module's forward begins (the forward wrapper's work, forward_tap,
        and the pre-hook's where the forward cannot be wrapped): on a lean step before its
        backward its start and the inputs a NaN's forward is re-run on (lean.py); otherwise,
        the lean record settled first, the step's forward start or an evaluation's (a forward
        without grad) begun."""
        lean = self.lean
        if lean.on and lean.loss is None and torch.is_grad_enabled():
            t0 = perf()
            if lean.forward_start is None:
                lean.forward_start = t0
            if self.capture_inputs:
                self.last_inputs = (module, args, kwargs)
            if TIMED[0]:
                self.seconds += perf() - t0
            return
        if not self.active:
            return
        try:
            if lean.on and self._on_training_thread():
                # Not the usual pattern: the whole way from here. (Another thread's forward,
                # an actor's or an evaluation server's, is not the loop's: settled from there
                # it would race the training thread's own writes into the record.)
                lean.settle()
            t0 = perf()  # the whole call is the probe's cost, not just its mark
            if torch.is_grad_enabled():
                self.forward_pending = True
                if self.timeline.forward_start is None:
                    self.timeline.forward_start = t0 if self.host_marks else self._mark()
                if self.capture_inputs and not self.updating:
                    self.last_inputs = (module, args, kwargs)
            elif self.timeline.forward_start is None:
                # No training forward runs without grad: an evaluation (or a rollout) between
                # the steps, which the data phase would otherwise take for a wait on input.
                self.mark_no_grad(module)
            if TIMED[0]:  # a sampled step (self_timing)
                self.seconds += perf() - t0
        except Exception as exc:
            self._on_error(exc)

    def mark_no_grad(self, module: nn.Module | None = None) -> None:
        """A forward without grad of ``module`` begins, or (None) a framework's evaluation: the
        no-grad phase starts at the first of them, before the step's own forward, on the
        training thread (another thread's forwards — an actor's, a server's — are not the
        loop's time; DataParallel's replicas run on its threads for the loop). For ``module`` a
        forward hook marks where each such forward ends, until a step without any (a loop
        that runs the model without grad every step keeps it): the phase ends at the last of
        them, so what the loop does after (fetching the next batch) is still data."""
        if self.lean.on and self._on_training_thread():
            self.lean.settle()  # a lean step has no no-grad phase: the whole way from here
        timeline = self.timeline
        replica = module is not None and getattr(module, "_is_replica", False)
        if (
            not self.active
            or timeline.forward_start is not None
            or self.updating
            or not (replica or self._on_training_thread())
        ):
            return
        if timeline.no_grad_start is None:
            timeline.no_grad_start = perf()
        if module is not None:
            hooks = module._forward_hooks  # shared by DataParallel's replicas: one hook there
            if id(hooks) not in self._no_grad_ends:
                handle = module.register_forward_hook(_NoGradEnd.owned_by(self))
                state_tap.cover(module)
                # Replicas get here at once on their threads: one handle kept, others removed.
                if self._no_grad_ends.setdefault(id(hooks), handle) is not handle:
                    handle.remove()

    def end_no_grad(self, replica: bool = False) -> None:
        """A forward without grad (or a framework's evaluation) ended."""
        if self.lean.on and self._on_training_thread():
            self.lean.settle()
        timeline = self.timeline
        if (
            timeline.no_grad_start is not None
            and timeline.forward_start is None
            and (replica or self._on_training_thread())
        ):
            timeline.no_grad_end = perf()

    def _on_training_thread(self) -> bool:
        return self.training_thread is None or _thread_id() == self.training_thread

    def drop_no_grad_ends(self) -> None:
        """A step without forwards without grad ended (or the hooks go): no forward ends to
        mark until the next evaluation."""
        ends, self._no_grad_ends = self._no_grad_ends, {}
        for handle in ends.values():
            handle.remove()

    def take(self) -> StepTimeline:
        """Hand over this step's marks and start a fresh timeline."""
        timeline, self.timeline = self.timeline, StepTimeline()
        self.updating = False  # also after a step() that raised between the hooks
        if self._no_grad_ends and timeline.no_grad_start is None:
            self.drop_no_grad_ends()
        return timeline

    def _closure(self, index: int, closure: Callable[[], Any]) -> Callable[[], Any]:
        first = [True]

        def run_closure() -> Any:
            out = closure()
            if first[0] and self.active:  # LBFGS calls it again: the first call's gradients
                first[0] = False
                self.updating = True
                try:
                    t0 = perf()
                    self.timeline.optimizer_start = t0 if self.host_marks else self._mark()
                    self._events.on_grads_ready(index)
                    if TIMED[0]:
                        self.seconds += perf() - t0
                except Exception as exc:
                    self._on_error(exc)
            return out

        return run_closure

    def remove(self) -> None:
        """Every hook off; inert from here (a wrapper another put over the probe's forward
        stays on the model under it: it marks and keeps nothing)."""
        self.active = False
        self._let_pre_go()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._by_optimizer.clear()
        self.drop_no_grad_ends()

    def _let_pre_go(self) -> None:
        """The pre-hook taken out stays out: its handle is being removed."""
        if self._pre_out is not None:
            self._pre_out = None
            self.lean.optimizer = self.lean.pre_hook = None
            taps.hold_out(None)


class _ForwardStart(ForwardHook):
    """PhaseHooks' forward pre-hook, where the forward cannot be wrapped (forward_tap, whose
    wrapper does the same work): PhaseHooks.forward_began after one compile check."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if is_compiling() or COMPILE_STATE._is_compiling_flag:  # ForwardHook's check
            return None
        hooks = self._owner()
        if hooks is not None:
            hooks.forward_began(module, args, kwargs)
        return None


class _NoGradEnd(ForwardHook):
    """Where a watched model's forward without grad ends (registered from an evaluation's first
    forward to the end of a step without any: see PhaseHooks.mark_no_grad)."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if is_compiling() or COMPILE_STATE._is_compiling_flag:
            return None
        hooks = self._owner()
        if hooks is not None and not torch.is_grad_enabled():
            try:
                hooks.end_no_grad(getattr(module, "_is_replica", False))
            except Exception as exc:
                hooks._on_error(exc)
        return None


class _StepStart(WeakHook):
    """PhaseHooks' optimizer step pre-hook, the sampler's work at the step's start written into
    its ``__call__``: it runs right after the backward, where each Python frame costs
    microseconds (``benchmarks/probe_calls.py`` counts them), so a usual update (no closure, the
    learning rates plain floats, no AMP skip to forget) is one frame here, not this hook and
    then the sampler's :meth:`~GradientPasses.on_optimizer_pre`. Anything else goes there."""

    __slots__ = ()

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if is_compiling():
            return _step_start_outside_graph(self, optimizer, args, kwargs)
        hooks = self._owner()
        if hooks is None:
            return None
        lean = hooks.lean
        if lean.on and lean.opt_start is None and lean.loss is not None:
            # A lean step's update (lean.py) while this hook is in place (the optimizer tap
            # does this where it is out: PhaseHooks.take_pre_out).
            t0 = perf()
            rates = update_rates(optimizer, args, kwargs)
            if rates is not None:
                lean.lrs = rates
                lean.opt_start = t0
                hooks.pre_stays = False  # the tap may do this again (PhaseHooks.take_pre_out)
                if TIMED[0]:
                    hooks.seconds += perf() - t0
                return None
        if not hooks.active:
            return None
        key = self._args[0]
        try:
            if lean.on:
                lean.settle()  # not the usual pattern: the whole way from here
            t0 = perf()  # the whole hook is the probe's cost, not just its mark
            timeline = hooks.timeline
            if timeline.optimizer_start is None:
                timeline.optimizer_start = t0 if hooks.host_marks else hooks._mark()
            sampler = hooks._events
            # torch passes step()'s own arguments: (optimizer, closure?, ...), {closure?}.
            closure = args[1] if len(args) > 1 else kwargs.get("closure")
            if callable(closure):
                # The closure computes this step's gradients inside step(): read them after it.
                sampler.on_optimizer_pre(key)
                wrapped = hooks._closure(key, closure)
                if TIMED[0]:
                    hooks.seconds += perf() - t0
                if len(args) > 1:
                    return (args[0], wrapped, *args[2:]), kwargs
                return args, {**kwargs, "closure": wrapped}
            hooks.updating = True
            slot = sampler._by_key.get(key)
            if slot is not None:
                # GradientPasses.on_optimizer_pre(key, grads_ready=True) for a usual update,
                # written out (tests/probe/test_optimizer_hooks.py holds the two to the same
                # state): the learning rates the update uses, read before a scheduler
                # changes them.
                lrs: list[float] | None = []
                for group in slot.optimizer.param_groups:
                    lr = group.get("lr")
                    if type(lr) is not float:
                        lrs = None  # a tensor, a number of another type: the whole way
                        break
                    lrs.append(lr)  # type: ignore[union-attr]
                if lrs is None or sampler._amp_skip:
                    sampler.on_optimizer_pre(key, grads_ready=True)
                else:
                    slot.in_step = True
                    slot.closure_loss = None
                    slot.closure_nonfinite = False
                    slot.lr = lrs
                    if slot.guard is not None or (
                        slot.sample is None
                        and (sampler._sample_now or sampler._forced or sampler._pending_nonfinite)
                    ):
                        sampler.on_grads_ready(key)
            if TIMED[0]:  # a sampled step (self_timing)
                hooks.seconds += perf() - t0
        except Exception as exc:
            hooks._on_error(exc)
        return None


class _StepEnd(WeakHook):
    """PhaseHooks' optimizer step post-hook, the sampler's work at the update's end written
    into its ``__call__`` (it runs right after the update, where each Python frame costs
    microseconds): a usual update (no closure's loss, no stray scalar, no update ratios being
    measured) is one frame here; anything else goes to :meth:`LossTally.on_optimizer_post`."""

    # The lean record, held (it holds nothing of the probe's strongly: LeanStep): a lean
    # update's end is written there without the probe's objects touched.
    __slots__ = ("_lean",)
    _lean: LeanStep

    @classmethod
    def owned_by(cls, owner: Any, *args: Any) -> WeakHook:
        """As every WeakHook, and the owner's (PhaseHooks') lean record with it."""
        hook = cast(_StepEnd, super().owned_by(owner, *args))
        hook._lean = owner.lean
        return hook

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if is_compiling():
            return _step_end_outside_graph(self, optimizer, args, kwargs)
        lean = self._lean
        if lean.on and lean.opt_start is not None and lean.opt_end is None:
            t0 = lean.opt_end = perf()  # a lean step's update ended (lean.py)
            if TIMED[0]:
                hooks = self._owner()
                if hooks is not None:
                    hooks.seconds += perf() - t0
            return None
        hooks = self._owner()
        if hooks is None or not hooks.active:
            return None
        try:
            if lean.on:
                lean.settle()  # not the usual pattern: the whole way from here
            t0 = perf()
            hooks.timeline.optimizer_end = t0 if hooks.host_marks else hooks._mark()
            hooks.updating = False
            sampler = hooks._events
            key = self._args[0]
            slot = sampler._by_key.get(key)
            if slot is None:
                pass
            elif slot.measuring or slot.closure_loss is not None or sampler._stray is not None:
                sampler.on_optimizer_post(key)
            else:
                # LossTally.on_optimizer_post for a usual update, written out (its comments say
                # why each line is there; tests/probe/test_optimizer_hooks.py holds the two to
                # the same state).
                slot.in_step = False
                sampler._updated = True
                slot.closure_nonfinite = sampler._pending_nonfinite = False
                micro = slot.micro = sampler._micro
                sampler._micro = 0
                last = sampler._last_backward
                if last is not None:
                    sampler._last_backward = last.detach() if micro > 1 else None
                    HELD.append(last)  # its graph freed once the hook's timer stopped
                slot.loss = sampler._pending_loss
                sampler._pending_loss = None
            if TIMED[0]:  # a sampled step (self_timing)
                hooks.seconds += perf() - t0
            if HELD:
                HELD.clear()  # a scalar the bookkeeping let go of: freed outside the timer
        except Exception as exc:
            hooks._on_error(exc)
        return None


# Under torch.compile(optimizer.step): eager, outside the graph (is_compiling() reads False
# inside, so the call does the work).
_step_start_outside_graph = torch.compiler.disable(_StepStart.__call__)
_step_end_outside_graph = torch.compiler.disable(_StepEnd.__call__)
