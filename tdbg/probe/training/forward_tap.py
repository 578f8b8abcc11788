"""A watched root module's ``forward`` wrapped on the instance: the probe's forward mark, no hook.

A module with any forward hook takes torch's slower call path (``_call_impl`` checks and runs
every hook dict, a few microseconds a forward on the 2-core VM before the hook's own frame),
which a short step pays on every forward. An instance attribute ``forward`` is what
``_call_impl`` calls on its fast path: the probe's work there costs one Python frame. It stays
out of sight: the module's ``__getstate__`` leaves it out of pickles, ``torch.save`` and copies
(state_tap), ``torch.jit.script`` sees the class's forward (script_tap), ``torch.compile``
traces straight through it (``fullgraph=True`` too) and picks how to enter the module without
it (taps), ``inspect.signature(model.forward)`` shows
the real parameters, a DataParallel replica or a copy whose methods are rebound (accelerate's
regional compilation) runs itself, and unwatching takes it off. Where any of that cannot be
promised (the instance has a ``forward`` of its own already, a class that pickles or copies
around ``__getstate__``, a ScriptModule, a forward that is not a plain function) the caller
registers its forward pre-hook instead. Unlike a hook it is a frame in the tracebacks of the
model's own errors (``forward_tap.py``, between ``_call_impl`` and the model's ``forward``).
"""

from __future__ import annotations

import functools
import inspect
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tdbg.probe.training import state_tap
from tdbg.probe.training.hook_refs import COMPILE_STATE, FORWARD_MARK, is_compiling, is_tdbg_forward
from tdbg.probe.training.lean import LeanStep
from tdbg.probe.training.self_timing import TIMED

_object_reduce = object.__reduce__
_grad_enabled = torch.is_grad_enabled
_perf = time.perf_counter  # hooks.perf: the clock every mark of a step is read on
_object_reduce_ex = object.__reduce_ex__


def wrappable(module: nn.Module) -> bool:
    """Whether ``module``'s forward can be wrapped on the instance, out of every copy's sight."""
    cls = type(module)
    if "forward" in module.__dict__ or isinstance(module, torch.jit.ScriptModule):
        return False  # another wrapper there (accelerate's, another probe's), or TorchScript's
    if not isinstance(inspect.getattr_static(cls, "forward", None), types.FunctionType):
        return False  # a staticmethod, a descriptor: not called as type(m).forward(m, ...)
    # A copy or a pickle made without __getstate__ would take the wrapper along.
    if getattr(cls, "__reduce_ex__", None) is not _object_reduce_ex:
        return False
    if getattr(cls, "__reduce__", None) is not _object_reduce:
        return False
    if hasattr(cls, "__deepcopy__") or hasattr(cls, "__copy__"):
        return False
    state_tap.cover(module)
    return state_tap.covers(module)


class ForwardWrap:
    """One wrapped forward, removable as a hook's handle is (``id``: none of torch's)."""

    __slots__ = ("_module", "_wrapper")
    id = -1

    def __init__(self, module: nn.Module, wrapper: Any) -> None:
        self._module = weakref.ref(module)
        self._wrapper = wrapper

    def remove(self) -> None:
        """The class's forward back (unless another wrapper was put over ours since: then ours
        stays under it, inert once the probe is gone)."""
        module = self._module()
        if module is not None and module.__dict__.get("forward") is self._wrapper:
            del module.__dict__["forward"]


def wrap(module: nn.Module, hooks: Any) -> ForwardWrap:
    """Put the probe's wrapper on ``module.forward`` (checked :func:`wrappable` first).

    A method bound to the module, as the class's forward is when looked up: ``__self__`` is
    the module (code that rebinds a copy's methods, as accelerate's regional compilation
    does, rebinds it too), ``inspect.signature`` drops ``self`` from the class forward's
    (``__wrapped__``). The module holds it and it holds the module: while watched the probe
    holds the model anyway, and unwatching takes it off."""
    wrapper = types.MethodType(_function(type(module), weakref.ref(hooks), hooks.lean), module)
    module.__dict__["forward"] = wrapper
    return ForwardWrap(module, wrapper)


def _function(cls: type, owner: weakref.ref[Any], lean: LeanStep) -> Callable[..., Any]:
    """The wrapper's function for a module of ``cls`` (its work: PhaseHooks.forward_began,
    as the forward pre-hook's); ``owner``: the probe's PhaseHooks, weakly; ``lean``: its lean
    step record (which holds nothing of the probe's strongly)."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Traced (torch.compile, torch.export): a constant to dynamo, nothing of the probe's.
        if not (is_compiling() or COMPILE_STATE._is_compiling_flag):
            if lean.on and lean.loss is None and _grad_enabled():
                # PhaseHooks.forward_began's lean branch written out, on the lean record
                # alone: each object touched right after the loop's kernels costs cache
                # misses (tests/probe/test_lean.py holds both ways to the same records).
                t0 = _perf()
                if lean.forward_start is None:
                    lean.forward_start = t0
                if lean.capture:
                    lean.inputs = (self, args, kwargs)
                if TIMED[0]:
                    hooks = owner()
                    if hooks is not None:
                        hooks.seconds += _perf() - t0
            else:
                hooks = owner()
                if hooks is not None:
                    hooks.forward_began(self, args, kwargs)
        return type(self).forward(self, *args, **kwargs)

    # A code object of its own per watched model: dynamo keeps its compiled frames (and their
    # recompile limit) per code object, and one shared by every watched model would pool them.
    forward.__code__ = forward.__code__.replace()
    functools.update_wrapper(forward, cls.forward)  # type: ignore[attr-defined]
    setattr(forward, FORWARD_MARK, owner)
    return forward


def rebind(replica: nn.Module) -> None:
    """A DataParallel replica (a copy of a module's ``__dict__``) got the original's wrapper,
    bound to the original: the same one bound to the replica (else it would run the
    original, on its device)."""
    wrapper: Any = replica.__dict__.get("forward")
    if is_tdbg_forward(wrapper) and getattr(wrapper, "__self__", replica) is not replica:
        replica.__dict__["forward"] = types.MethodType(wrapper.__func__, replica)
