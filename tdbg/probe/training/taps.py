"""Process-wide taps on torch calls every loop makes: backward, GradScaler.scale, clipping, epochs.

A probe cannot ask the loop for what it does not pass: which scalars were backpropagated since
the last update (gradient accumulation, closures, one loss per optimizer), the norm before
``clip_grad_norm_`` scaled the gradients, when a DataLoader starts a new pass. These wrappers
see it for every live probe. Each is installed while at least one probe listens and removed
(where still ours) when the last one leaves. Cost: one Python call per backward, per optimizer
step, per clip and per DataLoader iteration; nothing here reads a device value (a CPU loss is
read once, before its backward).
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tdbg.probe.training import forward_tap
from tdbg.probe.training.hook_refs import is_compiling, is_tdbg_forward
from tdbg.probe.training.lean import LeanStep, float_rates
from tdbg.probe.training.release import HELD
from tdbg.probe.training.self_timing import TIMED


class Listener(Protocol):
    def on_backward(self, loss: torch.Tensor, value: float | None = None) -> None: ...

    def on_backward_failed(self, loss: torch.Tensor) -> None: ...

    def on_clip(self, parameters: list[Any], max_norm: float, total_norm: Any) -> None: ...

    def on_loader_iter(self, loader: Any) -> None: ...

    def on_scaler_update(self) -> None: ...

    def on_module_change(self, module: Any) -> None: ...

    def on_any_optimizer_step(self, optimizer: Any) -> None: ...


_listeners: weakref.WeakSet[Any] = weakref.WeakSet()
# What the taps call, rebuilt at attach/detach: iterating a WeakSet on every backward and
# optimizer step costs microseconds where the loop's caches are cold (right after backward).
_snapshot: tuple[weakref.ref[Any], ...] = ()
# The lean step record (lean.py) of the one listener, when there is exactly one: the backward
# tap writes a lean step's backward there. None with several (each takes the whole way).
_lean: LeanStep | None = None
_lock = threading.Lock()
# Seconds the per-step taps (backward, every optimizer step) spent since a probe last took them:
# part of what the probe costs the loop, which its own timer does not see. probe.step() reads
# and zeroes it in place (take_seconds(), written out where a call costs microseconds).
tap_seconds = [0.0]
_perf = time.perf_counter
_thread_id = threading.get_ident
_Tensor = torch.Tensor
_restore: list[Callable[[], None]] = []
# A CPU scalar about to be backpropagated is read there (a memory load, no sync). Tests of a
# GPU run's paths on the CPU turn it off, so that CPU scalars are kept unread as a device's.
READ_ON_HOST = True
_scaled: tuple[weakref.ref[Any], torch.Tensor] | None = None  # GradScaler.scale's last (out, in)
# Optimizers every listener has heard of, by id (checked against the weakref: ids are reused).
# Emptied when a listener attaches, so that it hears of each one too.
_told: dict[int, weakref.ref[Any]] = {}
# The lean record whose optimizer's own step pre-hook is out of its dict (PhaseHooks.take_pre
# _out): the optimizer tap does that hook's lean work, or puts it back to run; how to put it
# back. (A process-wide pre-hook registered since runs after the tap and before the
# optimizer's own hooks: it may set the learning rate the probe reads; the tap looks.)
_held_out: LeanStep | None = None
_put_back: Callable[[bool], None] | None = None
# torch's process-wide optimizer pre-hooks, and the tap's key there (once installed).
_global_pre: Any = None
_tap_id = -1


def hold_out(lean: LeanStep | None, put_back: Callable[[bool], None] | None = None) -> None:
    """``lean``'s optimizer pre-hook is out of its dict, ``put_back`` puts it back (None: back,
    or let go)."""
    global _held_out, _put_back
    _held_out, _put_back = lean, put_back


def tap_is_last() -> bool:
    """The optimizer tap is the last of torch's process-wide optimizer pre-hooks: nothing runs
    between it and an optimizer's own pre-hooks."""
    hooks = _global_pre
    return hooks is not None and next(reversed(hooks), None) == _tap_id


def attach(listener: Listener) -> None:
    global _snapshot, _lean
    with _lock:
        _told.clear()
        _listeners.add(listener)
        _snapshot = tuple(weakref.ref(each, _forget_dead) for each in _listeners)
        _lean = _only_lean(_snapshot)
        if not _restore:
            _install()


def install_early() -> None:
    """Install the taps before a listener attaches (they pass every call through until one
    does): ``tdbg run`` starts a probe inside an optimizer's step pre-hooks, where adding the
    taps' global step pre-hook would change the dict torch is iterating."""
    with _lock:
        if not _restore:
            _install()


def installed() -> bool:
    """The taps are in torch (a listener attached, or :func:`install_early`)."""
    return bool(_restore)


def detach(listener: Listener) -> None:
    global _snapshot, _lean
    with _lock:
        _listeners.discard(listener)
        _snapshot = tuple(weakref.ref(each, _forget_dead) for each in _listeners)
        _lean = _only_lean(_snapshot)
        if not _listeners:
            while _restore:
                _restore.pop()()


def take_seconds() -> float:
    """The per-step taps' time since the last call (from the training thread, at a step; with
    several probes in one process the first to step takes it)."""
    seconds, tap_seconds[0] = tap_seconds[0], 0.0
    return seconds


def lean_record() -> LeanStep | None:
    """The record the backward tap writes a lean step's backward into (None: none)."""
    return _lean


def _only_lean(snapshot: tuple[weakref.ref[Any], ...]) -> LeanStep | None:
    """The lean record of the only listener in ``snapshot``; None with several or none."""
    if len(snapshot) != 1:
        return None
    lean = getattr(snapshot[0](), "lean", None)
    return lean if isinstance(lean, LeanStep) else None


def _forget_dead(_: Any) -> None:
    """A listener dropped without detach(): the taps stop calling it. (From the garbage
    collector, on any thread: no lock; one tuple assignment is atomic.)"""
    global _snapshot, _lean
    try:
        _snapshot = tuple(ref for ref in _snapshot if ref() is not None)
        _lean = _only_lean(_snapshot)
    except Exception:  # at interpreter exit the module's globals may be gone: nothing to do
        pass


def _notify(event: str, *args: Any) -> None:
    """Call ``listener.<event>(*args)`` on every live listener (a method name, not a lambda:
    one Python call fewer per tap, in the cold moments around an update)."""
    lean = _lean
    if lean is not None and lean.on and lean.thread == _thread_id():
        try:
            lean.settle()  # a lean step hears of anything else the whole way (lean.py)
        except Exception:
            pass
    for ref in _snapshot:
        listener = ref()
        if listener is None:
            continue  # a probe dropped without close(): its WeakSet entry is gone too
        try:
            getattr(listener, event)(*args)
        except Exception:  # a listener counts its own errors; a tap never raises into the loop
            pass


def _swap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` by ``make(original)``; put it back later unless replaced since."""
    original = getattr(owner, name, None)
    if original is None:
        return
    wrapper = make(original)
    setattr(owner, name, wrapper)

    def restore() -> None:
        if getattr(owner, name, None) is wrapper:
            setattr(owner, name, original)

    _restore.append(restore)


def _install() -> None:
    _swap(torch.autograd, "backward", _wrap_backward)
    scaler_class = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_class is not None:
        _swap(scaler_class, "scale", _wrap_scale)
        _swap(scaler_class, "update", _wrap_update)
    from torch.nn.utils import clip_grad

    # clip_grad_norm_ looks this up in its module at each call: wrapping it here also sees a
    # clip_grad_norm_ the script imported before watch() (`from torch.nn.utils import ...`).
    _swap(clip_grad, "_clip_grads_with_norm_", _wrap_clip)
    from torch.utils.data import DataLoader

    _swap(DataLoader, "__iter__", _wrap_loader_iter)
    # A DataParallel replica is a copy of its module's __dict__: a watched module's forward
    # wrapper (forward_tap) would run the original module; the replica gets its own.
    _swap(torch.nn.Module, "_replicate_for_data_parallel", _wrap_replicate)
    # torch.compile(model) decides how to enter a module by its forward: the wrapper set
    # aside meanwhile, it decides as for the unwatched model (else a torch.nn class compiled
    # while watched would compile nothing once unwatched).
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(optimized, "OptimizedModule", None)
    if optimized is not None:
        _swap(optimized, "_initialize", _wrap_compiled_initialize)
    # A layer or parameter assigned into a module (``model.fc = nn.Linear(...)``), and any
    # optimizer's step (a new optimizer for the model): global registries, so no per-module cost.
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    global _global_pre, _tap_id
    tap = optimizer_mod.register_optimizer_step_pre_hook(_on_optimizer_step)
    _global_pre, _tap_id = tap.hooks_dict_ref(), tap.id
    for handle in (
        module_mod.register_module_module_registration_hook(_on_module_registered),
        module_mod.register_module_parameter_registration_hook(_on_module_registered),
        tap,
    ):
        _restore.append(handle.remove)


def _on_module_registered(module: Any, name: str, value: Any) -> None:
    if _snapshot:
        _notify("on_module_change", module)


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
    """Every optimizer's step: the listeners hear of each optimizer once (a new one may update
    a watched model); for one they have heard of, the usual case on every step, the tap
    returns after one dict lookup, before asking whether dynamo traces it (a Python call, where
    each costs microseconds: right after the backward). Traced, the lookup is what dynamo
    reads too; an optimizer not yet told goes to the listeners outside the graph.

    While steps are lean the watched optimizer's own pre-hook is out of its dict (PhaseHooks.
    take_pre_out) and this tap, which torch calls first, does its lean work: the learning
    rates the update uses and its start (as ``_StepStart``'s lean path); anything else goes to
    that hook (:func:`_not_lean_update`)."""
    lean = _held_out
    if lean is not None and optimizer is lean.optimizer:
        if (
            not is_compiling()  # first: dynamo reads (and guards on) nothing of the record
            and lean.on
            and lean.opt_start is None
            and lean.loss is not None
            and not kwargs
            and (len(args) == 1 or (len(args) == 2 and args[1] is None))  # no closure passed
            # None registered since, to run after this one (handle ids only grow: a count
            # would miss one removed and another registered). The tap alone there, the usual
            # case, is asked without an iterator made on every step.
            and (len(_global_pre) == 1 or next(reversed(_global_pre), None) == _tap_id)
        ):
            # lean.update_rates written out: a frame fewer, right after the backward.
            t0 = _perf()
            rates: list[float] | None = None
            try:
                groups = optimizer.param_groups
                if len(groups) == 1:
                    rate = groups[0].get("lr")
                    rates = [rate] if type(rate) is float else None
                else:
                    rates = float_rates(groups)
            except Exception:  # an optimizer of its own kind: the whole way says what
                pass
            if rates is not None:
                lean.lrs = rates
                lean.opt_start = t0
                if TIMED[0]:
                    tap_seconds[0] += _perf() - t0
                return None
        return _not_lean_update(lean, optimizer, args, kwargs)
    told = _told.get(id(optimizer))
    if told is not None and told() is optimizer:
        return None
    if is_compiling():
        return _tell_outside_graph(optimizer)
    return _tell(optimizer)


def _not_lean_update(lean: LeanStep, optimizer: Any, args: Any, kwargs: Any) -> Any:
    """The watched optimizer's update is not a lean one while its pre-hook is out: the record
    settled and the hook put back in its dict, where torch calls it next, after the
    process-wide pre-hooks (it is not iterating over the optimizer's own yet). Traced by
    dynamo, the hook is called from here instead (its compiled path: nothing is changed)."""
    if is_compiling():
        hook = lean.pre_hook
        return None if hook is None else hook(optimizer, args, kwargs)
    told = _told.get(id(optimizer))
    if told is None or told() is not optimizer:
        _tell(optimizer)  # a listener attached since (it empties _told): it hears of it
    put_back = _put_back
    if _held_out is lean and put_back is not None:
        try:
            put_back(True)  # and kept there while updates are not lean ones (PhaseHooks)
        except Exception:  # a tap never raises into the loop
            pass
    if lean.on:
        try:
            lean.settle()
        except Exception:  # the listener counts its own errors
            pass
    return None


def _tell(optimizer: Any) -> None:
    told = _told.get(id(optimizer))  # checked again for the compiled path, which comes here
    if not _snapshot or (told is not None and told() is optimizer):
        return
    t0 = _perf()
    try:
        _told[id(optimizer)] = weakref.ref(optimizer)
        if len(_told) > 64:  # optimizers come and go (a fresh one per fold): forget the dead
            # A copy made in one C call: another thread may attach (and clear) meanwhile.
            for key, ref in list(_told.items()):
                if ref() is None:
                    _told.pop(key, None)
    except Exception:  # not weak-referenceable (told at each step then); a tap never raises
        pass
    _notify("on_any_optimizer_step", optimizer)
    tap_seconds[0] += _perf() - t0


# Under torch.compile(optimizer.step) dynamo would trace the listeners (and warn about the
# clock): they run eagerly, outside the graph (a graph break), as the probe's own step hooks do.
_tell_outside_graph = torch.compiler.disable(_tell)


def _wrap_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    # Tensor.backward() calls torch.autograd.backward(): one wrapper sees both spellings.
    @functools.wraps(original)
    def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
        loss = None
        if grad_tensors is None and _snapshot:
            # All of the tap's work comes before the backward: right after it (on a CPU run
            # the gradients have just streamed through the caches) each Python call costs
            # several times as much (an empty one: ~4.4 us there, ~1 us here, on the cnn
            # demo). A CPU loss is read once, here: the listeners keep its value (nothing to
            # detach, and whether it is NaN or Inf is what a NaN's origin needs on steps whose
            # gradients go unsampled; the tensor itself only until probe.step(), to know it
            # when passed back). A backward that raises is taken back.
            # The usual call (``loss.backward()`` on a CPU float loss) is written out: each
            # function entered here costs microseconds (cold caches), not nanoseconds.
            lean = _lean
            if lean is not None and lean.on:
                if (
                    type(tensors) is _Tensor
                    and _scaled is None
                    and lean.loss is None
                    and lean.forward_start is not None
                ):
                    # A lean step's one backward (lean.py): a finite CPU scalar's value read,
                    # the tensor kept until probe.step(); on a GPU run a device scalar kept
                    # unread (its value comes back with its tick's: loss_ring.py).
                    t0 = _perf()
                    value = None
                    kept = False
                    if tensors.is_cpu and READ_ON_HOST:
                        try:
                            value = tensors.item()
                        except (RuntimeError, TypeError, ValueError, OverflowError):
                            pass
                        kept = type(value) is float and value - value == 0.0
                    elif (
                        lean.device_loss is not None
                        and tensors.numel() == 1
                        and tensors.device == lean.device_loss
                    ):
                        kept = True
                    if kept:
                        lean.loss, lean.value, lean.forward_end = tensors, value, t0
                        if TIMED[0]:
                            tap_seconds[0] += _perf() - t0
                        try:
                            return original(tensors, grad_tensors, *args, **kwargs)
                        except BaseException:
                            _notify("on_backward_failed", tensors)  # settled first: taken back
                            raise
                try:
                    lean.settle()  # not the usual pattern: the whole way from here
                except Exception:
                    pass
            t0 = _perf() if TIMED[0] else 0.0  # a sampled step (self_timing)
            if type(tensors) is _Tensor and _scaled is None:
                loss = tensors
                value = None
                if loss.is_cpu and READ_ON_HOST:
                    try:
                        value = loss.item()
                        if type(value) is not float:  # an int or bool loss (float(): a call)
                            value = float(value)
                    except (RuntimeError, TypeError, ValueError, OverflowError):
                        value = None
                for ref in _snapshot:
                    listener = ref()
                    if listener is not None:
                        try:
                            listener.on_backward(loss, value)
                        except Exception:  # a listener counts its own errors
                            pass
            else:
                loss = _scalar(tensors)
                if loss is not None:
                    _notify("on_backward", loss, host_value(loss))
            if t0:
                tap_seconds[0] += _perf() - t0
            if HELD:
                HELD.clear()  # the previous scalar's graph: freed outside the timer
        if loss is None:
            return original(tensors, grad_tensors, *args, **kwargs)
        try:
            return original(tensors, grad_tensors, *args, **kwargs)
        except BaseException:
            # A loop may go on (a batch skipped after an out-of-memory backward): that scalar
            # was not backpropagated.
            _notify("on_backward_failed", loss)
            raise

    return backward


def host_value(tensor: torch.Tensor) -> float | None:
    """The value of a CPU scalar (one memory read); None for a device tensor (reading it would
    wait for the device) and for anything that is not one real number."""
    if not tensor.is_cpu or not READ_ON_HOST:
        return None
    try:
        return float(tensor.item())
    except (RuntimeError, TypeError, ValueError, OverflowError):
        return None


def nonfinite_on_host(tensor: torch.Tensor) -> bool:
    """``tensor`` is a CPU scalar that is NaN or Inf; a device tensor is never read: False."""
    value = host_value(tensor)
    return value is not None and not math.isfinite(value)


def _scalar(tensors: Any) -> torch.Tensor | None:
    """The loss a backward call was given (before GradScaler scaled it), as given; or None.
    Called before a backward without a ``grad_tensors``, which torch allows only for
    one-element tensors: no size is checked here (one that is not fails in the backward, and
    the listeners take it back). Several at once (a multi-task loop's
    ``torch.autograd.backward([a, b])``): their sum, what one backward of ``a + b`` gives."""
    global _scaled
    tensor = tensors
    if isinstance(tensor, (list, tuple)):
        if len(tensor) != 1:
            total = summed_scalars(tensor, _scaled_losses.unscaled)
            _scaled = None
            _scaled_losses.clear()
            return total
        tensor = tensor[0]
    if not isinstance(tensor, torch.Tensor):
        return None
    _scaled_losses.clear()
    scaled = _scaled
    if scaled is not None and scaled[0]() is tensor:
        _scaled = None
        return scaled[1]
    return tensor


class ScaledLosses:
    """What ``GradScaler.scale()`` returned for which loss since the last backward, for a
    backward of several at once (``backward([scaler.scale(a), scaler.scale(b)])``, or of
    ``scaler.scale([a, b])``): each is reported unscaled. A few kept, the newest last."""

    KEPT = 16

    def __init__(self) -> None:
        self._pairs: list[tuple[weakref.ref[Any], Any]] = []

    def note(self, outputs: Any, out: Any) -> tuple[weakref.ref[Any], Any] | None:
        """``scale(outputs)`` returned ``out``: a tensor (its pair is returned, for the one-loss
        backward), or the same structure of them."""
        if isinstance(outputs, torch.Tensor):
            pairs = [(outputs, out)]
        elif isinstance(outputs, (list, tuple)) and isinstance(out, (list, tuple)):
            pairs = list(zip(outputs, out, strict=False))
        else:
            return None
        kept = None
        for loss, scaled in pairs:
            if isinstance(loss, torch.Tensor) and isinstance(scaled, torch.Tensor):
                try:
                    kept = (weakref.ref(scaled), loss.detach())  # a view: no copy, no sync
                except TypeError:
                    continue
                self._pairs.append(kept)
        if len(self._pairs) > self.KEPT:
            del self._pairs[: -self.KEPT]
        return kept if isinstance(outputs, torch.Tensor) else None

    def unscaled(self, tensor: Any) -> Any:
        """The loss ``tensor`` is the scaled form of, or ``tensor`` itself."""
        for ref, loss in self._pairs:
            if ref() is tensor:
                return loss
        return tensor

    def clear(self) -> None:
        if self._pairs:
            self._pairs.clear()


_scaled_losses = ScaledLosses()


def summed_scalars(
    tensors: list[Any] | tuple[Any, ...], unscaled: Callable[[Any], Any] | None = None
) -> torch.Tensor | None:
    """The sum of several one-element tensors backpropagated in one call, detached (a CPU sum
    is a host read; a device one launches its adds, no sync), each taken back to the loss
    GradScaler scaled (``unscaled``); None where they are not that (a tensor with more
    elements, other devices: not one loss)."""
    if not tensors or not all(
        isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point() for t in tensors
    ):
        return None
    losses = [unscaled(t) for t in tensors] if unscaled is not None else list(tensors)
    try:
        total = losses[0].detach().reshape(())
        for tensor in losses[1:]:
            total = total + tensor.detach().reshape(())
        return total
    except RuntimeError:  # on several devices
        return None


def _wrap_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    """AMP: ``scaler.scale(loss).backward()`` backpropagates loss x scale; remember which tensor
    ``scale()`` returned for which loss, so the loss reported is the script's own."""

    @functools.wraps(original)
    def scale(scaler: Any, outputs: Any, *args: Any, **kwargs: Any) -> Any:
        global _scaled
        out = original(scaler, outputs, *args, **kwargs)
        if out is not outputs and _snapshot:
            # Each (scaled, loss) kept for a backward of several at once; a tensor's also as
            # the one a usual backward looks up.
            _scaled = _scaled_losses.note(outputs, out)
        return out

    return scale


def _wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
    """``scaler.update()`` ends an AMP iteration: whether or not ``scaler.step()`` skipped it."""

    @functools.wraps(original)
    def update(scaler: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(scaler, *args, **kwargs)
        if _snapshot:
            _notify("on_scaler_update")
        return out

    return update


def _wrap_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip(parameters: Any, max_norm: float, total_norm: Any, *args: Any, **kwargs: Any) -> Any:
        if _snapshot:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            parameters = params  # a generator is read once: pass the list on
            # Before the original scales the gradients: the listener reads them unclipped.
            _notify("on_clip", params, max_norm, total_norm)
        return original(parameters, max_norm, total_norm, *args, **kwargs)

    return clip


def _wrap_loader_iter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def loader_iter(loader: Any) -> Any:
        if _snapshot:
            _notify("on_loader_iter", loader)
        return original(loader)

    return loader_iter


def _wrap_replicate(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _replicate_for_data_parallel(module: Any) -> Any:
        replica = original(module)
        if "forward" in module.__dict__:
            forward_tap.rebind(replica)
        return replica

    return _replicate_for_data_parallel


def _wrap_compiled_initialize(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _initialize(compiled: Any) -> Any:
        attrs = getattr(getattr(compiled, "_orig_mod", None), "__dict__", None)
        wrapper = attrs.get("forward") if isinstance(attrs, dict) else None
        if attrs is None or not is_tdbg_forward(wrapper):
            return original(compiled)
        del attrs["forward"]  # a forward another thread runs meanwhile goes unmarked
        try:
            return original(compiled)
        finally:
            attrs.setdefault("forward", wrapper)

    return _initialize
