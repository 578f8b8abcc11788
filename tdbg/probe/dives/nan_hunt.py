"""NaN hunt: hooks on every module for a few steps, naming the first to make a value non-finite."""

from __future__ import annotations

import itertools
import math
import threading
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdbg.probe.dives.activations import HostCopy, floating_tensors, nonfinite
from tdbg.probe.dives.base import Dive, DiveContext, remove_handles
from tdbg.probe.module_paths import user_paths
from tdbg.probe.origin import Origin
from tdbg.probe.training import state_tap
from tdbg.probe.training.hook_refs import ForwardHook
from tdbg.protocol.messages.results import NanHuntResult

# Why tensor hooks and not ``register_full_backward_hook``: a full backward hook wraps the
# module's outputs in a ``BackwardHookFunction``, so they become views made by a custom Function,
# and an in-place op after the module — ``nn.ReLU(inplace=True)`` right after a Linear, in every
# other model — then raises inside the user's forward ("Output 0 of BackwardHookFunction is a
# view and is being modified inplace"; checked on torch 2.13, and by
# tests/probe/test_nan_hunt.py::test_full_backward_hooks_break_inplace_relu). A hunt must never
# break the loop it inspects. Tensor hooks leave the graph alone; one registered before an
# in-place op still receives the gradient with respect to the value before the op (documented
# autograd behaviour), i.e. exactly the module's output gradient.
#
# The other choice that matters: input gradient hooks go on the inputs in the forward PRE-hook,
# before the module runs — an in-place module (ReLU(inplace=True)) has already overwritten its
# input by the time the forward hook sees it. Input min/max are read there for the same reason.
#
# Forward origin: the first call in completion order (children before parents) whose output is
# non-finite; if its inputs were already non-finite, the innermost enclosing call whose inputs
# were finite made the value in its own code, between its children (see _find).


class _Call:
    """One module call in a hunt step. Numbers index the step's ``counts`` and ``extrema``."""

    __slots__ = ("module", "parent", "extrema", "outputs", "out_numel")

    def __init__(self, module: int, parent: int | None) -> None:
        self.module = module
        self.parent = parent  # the call this one ran inside (None: outermost)
        self.extrema: list[tuple[int, int]] = []  # (min, max) per floating input
        self.outputs: list[int] = []  # non-finite count per floating output
        self.out_numel = 0


class _StepLog:
    """What one hunt step recorded; device scalars until the boundary copies them at once."""

    __slots__ = ("counts", "extrema", "calls", "order", "open", "stack", "params", "grads")

    def __init__(self) -> None:
        # 0-d device tensors in recording order: int64 non-finite counts, and input min/max in
        # their own dtypes (kept apart: stacked together, int64 and float16 make float16).
        self.counts: list[torch.Tensor] = []
        self.extrema: list[torch.Tensor] = []
        self.calls: list[_Call] = []  # in start (pre-hook) order; the index is the call id
        self.order: list[int] = []  # call ids in forward completion order: children first
        self.open: dict[int, list[int]] = {}  # module -> calls started, not yet finished
        self.stack: list[int] = []  # calls started, not yet finished, innermost last
        self.params: dict[int, list[int]] = {}  # module -> non-finite count per own param
        # Backward, in execution order: (seq, kind, ref, numel, count) where kind is "out"
        # (gradient arriving at call ``ref``'s output), "in" (leaving it for an input) or
        # "param" (accumulated into parameter ``ref``).
        self.grads: list[tuple[int, str, int, int, int]] = []


class NanHuntDive(Dive):
    """``nan_hunt``: for up to ``steps`` steps, every module's calls are checked for the first
    non-finite value, forward (outputs) and backward (gradients); the first finding ends it
    (reported at the next boundary when later steps were already armed).

    Cost while armed, per module call: a pre-hook and a forward hook (Python), an ``aminmax``
    per floating input, a non-finite count (two passes, see :func:`nonfinite`) per floating
    output and, once per step, per direct parameter; one count per gradient in backward. All
    of it stays on the device; the boundary stacks the step's scalars and copies them to the
    host once, and the worker thread finds the origin. Disarmed, no hook is left anywhere.

    ``params_nonfinite`` counts the non-finite values of the module's own parameters
    (``recurse=False``) — their values for a forward finding (the optimizer made them so),
    their gradients for a backward one.

    The origin, when the probe already knows it (:class:`tdbg.probe.origin.Origin`, from
    the first non-finite step: a weight, a forward re-run, a backward): the hunt runs a step
    AFTER that, when an update has usually spread NaN into every weight and the first module
    it sees is no answer. So the result's headline (``phase``, ``module``, ``module_type``,
    ``step``, ``nonfinite``) names the origin instead; it is read when the result is built,
    from ``origin=`` or else from the context's ``nan_origin`` attribute (the probe thread sets
    ``ctx.nan_origin = origin`` before it submits the automatic hunt). Without one, the hunt's
    own finding stands, as before.
    """

    kind = "nan_hunt"

    def __init__(
        self,
        ctx: DiveContext,
        job: int,
        args: dict[str, Any],
        trigger: str,
        origin: Origin | None = None,
    ) -> None:
        super().__init__(ctx, job, args, trigger)
        self.origin = origin
        self.total = max(1, int(args.get("steps", 1)))
        self._names: list[str] = []
        self._types: list[str] = []
        self._params: list[list[nn.Parameter]] = []  # direct floating parameters per module
        self._owners: list[list[int]] = []  # modules owning each hooked parameter
        self._handles: list[RemovableHandle] = []  # module and parameter hooks, for the hunt
        self._tensor_handles: list[RemovableHandle] = []  # gradient hooks, for one step
        self._log = _StepLog()
        self._lock = threading.Lock()  # backward on several devices runs hooks in threads
        self._seq = itertools.count()
        self._failure: str | None = None
        # (state, step, message, result) from the worker, for the training thread to report
        self._outcome: tuple[str, int, str, NanHuntResult | None] | None = None

    # --- training thread --------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Arm: a pre-hook and a forward hook on every module (the root, name "", included)
        and a post-accumulate-grad hook on every trainable parameter."""
        owners: dict[int, int] = {}  # id(param) -> index in self._owners
        for index, (name, module) in enumerate(user_paths(self.ctx.model)):
            self._names.append(name)
            self._types.append(type(module).__name__)
            params = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
            self._params.append(params)
            # Weak, inert in a copy: a model whose class copies around __getstate__
            # (parametrize's spectral_norm, fx's GraphModule) copies with no lock or socket;
            # for the others state_tap leaves them out of the copy altogether.
            pre = ForwardHook(self._pre, index)
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(ForwardHook(self._post, index)))
            state_tap.cover(module)
            for param in params:
                if not param.requires_grad:
                    continue
                slot = owners.get(id(param))
                if slot is not None:  # tied weights: one hook, every owner remembered
                    self._owners[slot].append(index)
                    continue
                slot = owners[id(param)] = len(self._owners)
                self._owners.append([index])
                if hasattr(param, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                    hook = partial(self._on_param_grad, slot)
                    self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def boundary(self, step: int) -> None:
        if self._outcome is not None:  # the worker found it while another step was armed
            self.stepping = False
            self.release()
            self.emit(*self._outcome)
            return
        if self._failure is not None:
            raise RuntimeError(f"a hunt hook failed: {self._failure}")
        log, self._log = self._log, _StepLog()
        self._drop_tensor_hooks()
        self.count += 1
        checked = self.count
        last = checked >= (self.total or 1)
        if last:
            self.stepping = False
            self.release()
        copy = HostCopy([log.counts, log.extrema]) if log.counts or log.extrema else None

        def check() -> NanHuntResult | None:
            values = copy.wait().tolist() if copy is not None else []
            n = len(log.counts)
            return self._find(log, values[:n], values[n:], step, checked)

        def run() -> None:
            # Not done()/fail() from here while steps are armed: the job would be finished
            # while the training thread's hooks are still registered, and the runner drops
            # finished dives without a boundary call. The training thread reports it at the
            # next boundary, after release() — at most one step later. After the last step
            # nothing is armed, so the answer goes out from here at once; it is the first one
            # settled (the worker is FIFO): an earlier step's finding still queued wins.
            try:
                found = check()
            except Exception as exc:
                reason = f"analysis failed: {type(exc).__name__}: {exc}"[:300]
                self._settle(("failed", step, reason, None))
            else:
                if found is not None or last:
                    answer = self._headline(found or self._result(checked), checked)
                    self._settle(("done", step, "", answer))
            if last and self._outcome is not None:
                self.emit(*self._outcome)

        if last:
            self.emit("analysing", step)
        else:
            self.progress(step)
        self.ctx.submit(run)

    def cancelled(self, step: int, reason: str) -> None:
        if self._outcome is None:
            super().cancelled(step, reason)
            return
        self.stepping = False  # found before the cancel (or the run's end) came: report it
        self.release()
        self.emit(*self._outcome)

    def _settle(self, outcome: tuple[str, int, str, NanHuntResult | None]) -> None:
        with self._lock:
            if self._outcome is None:  # the first step's answer wins
                self._outcome = outcome

    def release(self) -> None:
        handles, self._handles = self._handles, []
        remove_handles(handles)
        self._drop_tensor_hooks()

    def _drop_tensor_hooks(self) -> None:
        # Last step's tensors may outlive it (a logged output); their hooks must not.
        handles, self._tensor_handles = self._tensor_handles, []
        remove_handles(handles)

    # --- hooks: training thread (forward), autograd threads (backward); never raise ---------
    def _count(self, log: _StepLog, x: torch.Tensor) -> int:
        scalar = nonfinite(x)
        with self._lock:
            log.counts.append(scalar)
            return len(log.counts) - 1

    def _extremum(self, log: _StepLog, scalar: torch.Tensor) -> int:
        with self._lock:
            log.extrema.append(scalar)
            return len(log.extrema) - 1

    def _failed(self, exc: BaseException) -> None:
        """A hook raised: counted by the probe now, and the job fails at the next boundary
        (a hunt that missed a call could name the wrong module)."""
        if self._failure is None:
            self._failure = f"{type(exc).__name__}: {exc}"[:300]
        if self.ctx.on_error is not None:
            self.ctx.on_error(exc)

    def _pre(self, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        try:
            log = self._log
            with self._lock:
                cid = len(log.calls)
                log.calls.append(_Call(index, log.stack[-1] if log.stack else None))
                log.open.setdefault(index, []).append(cid)
                log.stack.append(cid)
            call = log.calls[cid]
            for tensor in floating_tensors((args, kwargs)):
                x = tensor.detach()
                if x.numel():
                    low, high = torch.aminmax(x)  # NaN propagates: a NaN input shows as NaN
                    call.extrema.append((self._extremum(log, low), self._extremum(log, high)))
                    if tensor.requires_grad:
                        self._hook_grad(tensor, "in", cid)
        except Exception as exc:
            self._failed(exc)

    def _post(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        try:
            log = self._log
            with self._lock:
                started = log.open.get(index)
                if not started:
                    return
                cid = started.pop()
                if cid in log.stack:  # the top, unless a child raised out of its forward
                    del log.stack[log.stack.index(cid) :]
            call = log.calls[cid]
            for tensor in floating_tensors(output):
                x = tensor.detach()
                n = x.numel()
                if not n:
                    continue
                call.outputs.append(self._count(log, x))
                call.out_numel += n
                if tensor.requires_grad:
                    self._hook_grad(tensor, "out", cid)
            if index not in log.params and self._params[index]:
                # Once per module and step: the weights do not change during a forward.
                log.params[index] = [self._count(log, p.detach()) for p in self._params[index]]
            with self._lock:
                log.order.append(cid)
        except Exception as exc:
            self._failed(exc)

    def _hook_grad(self, tensor: torch.Tensor, kind: str, ref: int) -> None:
        self._tensor_handles.append(tensor.register_hook(partial(self._on_grad, kind, ref)))

    def _on_grad(self, kind: str, ref: int, grad: torch.Tensor | None) -> None:
        try:
            if grad is None or not grad.is_floating_point() or grad.layout != torch.strided:
                return
            x = grad.detach()
            if x.numel():
                log = self._log
                count = self._count(log, x)
                log.grads.append((next(self._seq), kind, ref, x.numel(), count))
        except Exception as exc:
            self._failed(exc)
        return None  # the gradient is left as it is

    def _on_param_grad(self, slot: int, param: torch.Tensor) -> None:
        self._on_grad("param", slot, param.grad)

    # --- worker thread ----------------------------------------------------------------------
    def _known_origin(self) -> Origin | None:
        origin = self.origin if self.origin is not None else getattr(self.ctx, "nan_origin", None)
        return origin if isinstance(origin, Origin) else None

    def _headline(self, found: NanHuntResult, checked: int) -> NanHuntResult:
        """The hunt's answer, its headline replaced by the known origin (if any)."""
        origin = self._known_origin()
        if origin is None:
            return found
        if origin.module is None and found.found and not found.params_nonfinite:
            return found  # the loss alone was known, and the hunt saw finite weights: its answer
        # The probe names the origin's module class with it (a layer's, a forward re-run's):
        # its names carry a model prefix with several models, and the root layer is named
        # after the model, so they are not looked up in one model's named_modules() here.
        module_type = origin.module_type
        if module_type is None and origin.module is not None:
            module = dict(user_paths(self.ctx.model)).get(origin.module)
            module_type = type(module).__name__ if module is not None else None
        return self._result(
            checked,
            found=True,
            phase=origin.phase,
            module=origin.module,
            module_type=module_type,
            step=origin.step,
            nonfinite=origin.nonfinite,
            numel=None,
            params_nonfinite=None,
        )

    def _result(self, checked: int, **found: Any) -> NanHuntResult:
        return NanHuntResult(steps_checked=checked, trigger=self.trigger, **found)

    def _find(
        self,
        log: _StepLog,
        counts: list[float],
        extrema: list[float],
        step: int,
        checked: int,
    ) -> NanHuntResult | None:
        """The origin in one step: forward first (it ran first), then backward."""

        def bad(index: int) -> int:
            return int(round(counts[index]))

        def inputs(cid: int | None) -> dict[str, Any]:
            if cid is None or not log.calls[cid].extrema:
                return {"input_min": None, "input_max": None}
            lows = [extrema[lo] for lo, _ in log.calls[cid].extrema]
            highs = [extrema[hi] for _, hi in log.calls[cid].extrema]
            nan = float("nan")
            return {
                "input_min": nan if any(v != v for v in lows) else min(lows),
                "input_max": nan if any(v != v for v in highs) else max(highs),
            }

        def report(phase: str, module: int, cid: int | None, **fields: Any) -> NanHuntResult:
            return self._result(
                checked,
                found=True,
                phase=phase,
                module=self._names[module],
                module_type=self._types[module],
                step=step,
                **inputs(cid),
                **fields,
            )

        def inputs_bad(cid: int) -> bool:
            # min/max propagate NaN and keep +-inf: one pair per floating input says it all
            return not all(math.isfinite(extrema[i]) for p in log.calls[cid].extrema for i in p)

        for cid in log.order:  # forward completion order: a child before its parent
            call = log.calls[cid]
            count = sum(bad(i) for i in call.outputs)
            if count <= 0:
                continue
            origin, numel = cid, call.out_numel
            if inputs_bad(cid):
                # It came in non-finite, and no call finished before with a non-finite output:
                # made by the code of an enclosing module between its children (a softmax of a
                # fully masked row inside an attention block, before its output Linear). The
                # first enclosing call whose inputs were finite made it; if there is none, the
                # data came in non-finite and the first module to take it is named.
                parent = call.parent
                while parent is not None and inputs_bad(parent):
                    parent = log.calls[parent].parent
                if parent is not None:
                    origin = parent
                    own = sum(bad(i) for i in log.calls[parent].outputs)
                    if own > 0:  # else its output came out finite: keep the child's counts
                        count, numel = own, log.calls[parent].out_numel
            module = log.calls[origin].module
            return report(
                "forward",
                module,
                origin,
                nonfinite=count,
                numel=numel,
                input_nonfinite=inputs_bad(origin),
                params_nonfinite=sum(bad(i) for i in log.params.get(module, [])),
            )

        calls_of: dict[int, list[int]] = {}
        for cid, call in enumerate(log.calls):
            calls_of.setdefault(call.module, []).append(cid)
        param_bad: dict[int, int] = {}  # module -> non-finite values in its params' grads
        for _, kind, ref, _, index in log.grads:
            if kind == "param":
                for owner in self._owners[ref]:
                    param_bad[owner] = param_bad.get(owner, 0) + bad(index)

        arrived: dict[int, int] = {}  # call -> non-finite values in its output gradients
        fallback: NanHuntResult | None = None
        for _, kind, ref, numel, index in sorted(log.grads):
            count = bad(index)
            if kind == "out":
                arrived[ref] = arrived.get(ref, 0) + count
            if not count:
                continue
            if kind == "param":
                candidates = [(owner, calls_of.get(owner, [])) for owner in self._owners[ref]]
            else:
                candidates = [(log.calls[ref].module, [ref])]
            for module, cids in candidates:
                seen = [cid for cid in cids if cid in arrived]
                already = any(arrived[cid] for cid in seen)
                fields = {
                    "nonfinite": count,
                    "numel": numel,
                    "input_nonfinite": already,
                    "params_nonfinite": param_bad.get(module, 0),
                }
                first = seen[0] if seen else (cids[0] if cids else None)
                if kind != "out" and seen and not already:
                    # The origin: the gradient arrived at its output finite and it made a
                    # non-finite one. A call whose output got no gradient (unused) is no
                    # evidence either way.
                    return report("backward", module, first, **fields)
                if fallback is None:
                    # The first non-finite gradient at all, named only if no module above
                    # qualifies: it came from outside the modules (the loss, a functional op
                    # between them), and it arrived at this module already non-finite.
                    fallback = report("backward", module, first, **fields)
        return fallback
