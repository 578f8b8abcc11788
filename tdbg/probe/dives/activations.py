"""Activation statistics: every K steps, per leaf module the output's mean/std/min/max/zeros/NaN."""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdbg.probe.device_copy import host_copy
from tdbg.probe.dives.base import Dive, DiveContext, as_event, remove_handles
from tdbg.probe.log import warn
from tdbg.probe.module_paths import user_paths
from tdbg.probe.training import state_tap
from tdbg.probe.training.histograms import counts_per_tensor, sample_stride
from tdbg.probe.training.hook_refs import ForwardHook
from tdbg.protocol.messages.histograms import N_BINS
from tdbg.protocol.messages.results import ACTIVATION_STATS, Activations

MAX_DEPTH = 6  # how deep floating_tensors looks into nested tuples/lists/dicts
MAX_TENSORS = 64  # and how many tensors it yields from one output: a module returning a
# list of thousands of tensors must not cost thousands of kernels per call

# One call's row: (leaf, numel, [mean, var, min, max], [nonzero, nonfinite], the copy of its
# elements to count, the stride they were taken with).
Row = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, int]


def acc_dtype(device: torch.device) -> torch.dtype:
    """The dtype a step's scalars travel to the host in: float64 holds float32/float16 values
    exactly and counts up to 2**53; MPS has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def floating_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Floating-point dense tensors in ``obj`` (a tensor, or tuples/lists/dicts of them, nested),
    each once, in order. Everything else (None, ints, integer or sparse tensors, meta tensors of
    a tracing pass) is skipped: a module's odd output is not an error."""
    seen: set[int] = set()
    count = 0
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack and count < MAX_TENSORS:
        item, depth = stack.pop()
        if isinstance(item, torch.Tensor):
            if (
                id(item) not in seen
                and item.is_floating_point()
                and item.layout == torch.strided
                and item.device.type != "meta"
            ):
                seen.add(id(item))
                count += 1
                yield item
        elif depth < MAX_DEPTH:
            if isinstance(item, (tuple, list)):
                stack.extend((child, depth + 1) for child in reversed(item))
            elif isinstance(item, dict):
                stack.extend((child, depth + 1) for child in reversed(list(item.values())))


def nonfinite(x: torch.Tensor) -> torch.Tensor:
    """Non-finite elements of a floating tensor, exactly, as an int64 0-d tensor on its device.

    ``x - x`` is 0 where x is finite and NaN where it is NaN or +-inf; NaN counts as non-zero.
    Two passes, where ``isfinite(x).sum()`` takes five (isfinite is composite: eq, abs, ne, mul)
    — 4-9x faster on a CPU for 32k-4M elements."""
    return torch.count_nonzero(x - x)


def _stack_on(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    # A model spread over devices: move the odd ones to ``device`` (rare; a cross-device copy
    # each) so that one stack and one copy to the host remain.
    return torch.stack(
        [t if t.device == device else t.to(device, non_blocking=True) for t in tensors]
    )


class HostCopy:
    """Groups of device tensors, each stacked and cast to :func:`acc_dtype`, concatenated flat
    and on their way to the host: one device-to-host copy. Groups keep dtypes apart that must
    not meet in one stack (int64 counts beside float16 values would promote to float16).

    On CUDA the copy is asynchronous (into pinned memory) and an event recorded after it on the
    same stream says when it landed; :meth:`wait` blocks on that event, so only the probe's
    worker thread may call it — never the training thread.
    """

    __slots__ = ("values", "ready")

    def __init__(self, groups: list[list[torch.Tensor]]) -> None:
        device = next(t for group in groups for t in group).device
        acc = acc_dtype(device)
        flat = [_stack_on(group, device).to(acc).flatten() for group in groups if group]
        vector = flat[0] if len(flat) == 1 else torch.cat(flat)
        self.ready: Any
        self.values, self.ready = host_copy(vector)

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.values


def is_leaf(module: nn.Module) -> bool:
    return next(iter(module.children()), None) is None


def ran_compiled(model: nn.Module) -> bool:
    """Whether this process shows torch.compile at work on ``model``: a module compiled in
    place (``module.compile()``), a compiled wrapper inside it, or any graph dynamo compiled
    (``torch.compile(model)`` returns a wrapper the probe never sees)."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            return True
        if type(module).__name__ == "OptimizedModule":
            return True
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled
    try:
        return bool(utils is not None and utils.counters["stats"]["unique_graphs"])
    except Exception:  # a private counter: gone in another torch, then no evidence
        return False


def unseen_reason(model: nn.Module, step: int) -> str:
    """Why a sampled step brought no module output: what the failed job says."""
    if ran_compiled(model):
        return (
            f"no module output seen at step {step}: the model runs compiled (torch.compile), "
            "and a compiled forward calls no forward hooks; activation statistics need the "
            "model run uncompiled"
        )
    return (
        f"no module output seen at step {step}: no module of the model ran through its "
        "forward hooks (a compiled, scripted or traced forward, or no forward in the step)"
    )


class ActivationsDive(Dive):
    """``activations``: while enabled, hooks on the leaf modules for one step in every ``every``.

    Leaf modules (no children) hold what users look at: a ReLU's output shows dead units, a
    norm's output its scale. Per call of a leaf, its first non-empty floating output costs a
    float32 copy (for non-float32 outputs) and about seven small kernels (var_mean, aminmax, two
    count_nonzero, a subtraction, two stacks), leaving six device scalars, and a copy of at most
    LAYER_ELEMENTS of its elements (one in k past that: :func:`sample_stride`) for its
    histogram; at the next boundary the copies are counted in the histograms' fixed bins in one
    pass, all rows are stacked and copied to the host once, the hooks are removed (none stay
    between samples), and the worker builds the ``activations`` message. The job stays ``running``
    (total None) until a new ``activations`` command replaces it; ``enabled: false`` is such a
    command, ending at once as ``cancelled``.

    Under ``torch.compile`` the hooks are no-ops the graph absorbs (:class:`ForwardHook`): a
    compiled forward, ``fullgraph=True`` included, neither breaks nor fails, and runs no hook.
    A sampled step whose armed hooks were never called saw nothing: the job fails then, saying
    so, rather than reporting an empty sample as statistics.

    Also what ``watch(activations_every=K)`` starts: the runner's factory with
    ``{"every": K, "enabled": True}`` and trigger ``"watch"``.
    """

    kind = "activations"

    def __init__(self, ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> None:
        super().__init__(ctx, job, args, trigger)
        self.total = None  # runs until replaced: no k/N
        self.every = max(1, int(args.get("every", 10)))
        self.enabled = bool(args.get("enabled", True))
        self._leaves: list[tuple[str, str, nn.Module]] = []
        self._handles: list[RemovableHandle] = []
        # (leaf, numel, [mean, var, min, max], [nonzero, nonfinite], sample, its stride) per call
        self._rows: list[Row] = []
        self._calls = 0  # hook calls since the last boundary: 0 on a sampled step = unseen
        self._lock = threading.Lock()  # DataParallel replicas run forward hooks in threads
        self._since = 0  # boundaries since start
        self._failure: str | None = None

    # --- training thread --------------------------------------------------------------------
    def start(self, step: int) -> None:
        if not self.enabled:
            self.stepping = False
            self.emit("cancelled", step, "activation statistics off")
            return
        self._leaves = [
            (name, type(module).__name__, module)
            for name, module in user_paths(self.ctx.model)
            if is_leaf(module)
        ]
        self._arm()  # the first sample is the very next step: the user asked to see it now

    def boundary(self, step: int) -> None:
        if self._failure is not None:
            raise RuntimeError(f"activation statistics failed: {self._failure}")
        self.count += 1  # no progress event per step: the job is simply running
        self._since += 1
        sample_next = self._since % self.every == 0
        if self._handles:
            with self._lock:
                rows, self._rows = self._rows, []
                calls, self._calls = self._calls, 0
            if calls == 0:
                self._fail_unseen(step)
                return
            if not sample_next:
                self.release()  # zero hooks until the next sampled step
            if rows:
                self._ship(step, rows)
        if sample_next and not self._handles:
            self._arm()  # every == 1 keeps the same hooks armed instead

    def release(self) -> None:
        handles, self._handles = self._handles, []
        remove_handles(handles)

    def _fail_unseen(self, step: int) -> None:
        # Compiled (or scripted, traced) forwards run no hook: every later sample would be as
        # empty, so the job ends here with the reason, and the user's loop goes on untouched.
        self.stepping = False
        self.release()
        reason = unseen_reason(self.ctx.model, step)
        warn(f"tdbg: activations failed (training continues): {reason}")
        self.fail(step, reason)

    def _arm(self) -> None:
        self._calls = 0
        for index, (_, _, module) in enumerate(self._leaves):
            # Weak and inert when copied: a checkpoint taken while sampling stays picklable;
            # a no-op inside a graph torch.compile traces: fullgraph=True still compiles.
            hook = ForwardHook(self._on_output, index)
            self._handles.append(module.register_forward_hook(hook))
            state_tap.cover(module)

    def _on_output(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        # No lock: DataParallel threads may lose an increment, never turn a call into none.
        self._calls += 1
        self._record(index, output)

    def _record(self, index: int, output: Any) -> None:
        """Forward hook: one row of device scalars; no .item(), no host sync."""
        try:
            for tensor in floating_tensors(output):
                x = tensor.detach()
                n = x.numel()
                if n == 0:
                    continue
                x = x.float()  # float32 statistics: a float16 variance overflows at 256**2
                var, mean = torch.var_mean(x, correction=0)  # one pass; std derived on the host
                low, high = torch.aminmax(x)
                stats = torch.stack([mean, var, low, high])
                # Zeros as n - nonzero: one reduction, no mask (NaN counts as non-zero).
                counts = torch.stack([torch.count_nonzero(x), nonfinite(x)])
                # Counted at the boundary, all calls' at once: a copy, since the output may be
                # changed in place before then (an in-place ReLU after a Linear).
                stride = sample_stride(n)
                sample = x.reshape(-1)[::stride].clone()
                with self._lock:
                    self._rows.append((index, n, stats, counts, sample, stride))
                return
        except Exception as exc:  # never into the user's forward; the job fails at the boundary
            if self._failure is None:
                self._failure = f"{type(exc).__name__}: {exc}"[:300]
            if self.ctx.on_error is not None:
                self.ctx.on_error(exc)

    def _ship(self, step: int, rows: list[Row]) -> None:
        # float32 statistics, int64 counts and the histograms' counts: three groups, one copy
        # (see HostCopy).
        bins = counts_per_tensor([r[4] for r in rows])
        copy = HostCopy([[r[2] for r in rows], [r[3] for r in rows], [bins.reshape(-1)]])
        meta = [(index, n, stride) for index, n, _, _, _, stride in rows]

        def work() -> None:
            try:
                flat = copy.wait()
                r = len(meta)
                stats = flat[: 4 * r].view(-1, 4).tolist()
                counts = flat[4 * r : 6 * r].view(-1, 2).tolist()
                hists = flat[6 * r :].view(-1, N_BINS).tolist()
                # Turned off or replaced meanwhile: nobody wants it. The run ending is not that:
                # a sample taken before close reaches the clients and the recording.
                if not self.finished or self.run_ended:
                    message = self._message(step, meta, stats, counts, hists)
                    self.ctx.events.append(as_event(message))
            except Exception as exc:
                # Not fail() from here: a finished dive is dropped by the runner without a
                # boundary call, and the next sample's hooks may be armed; the training thread
                # raises it at the next boundary, where the runner fails the job and releases.
                if self._failure is None:
                    self._failure = f"statistics: {type(exc).__name__}: {exc}"[:300]

        self.ctx.submit(work)

    # --- worker thread ----------------------------------------------------------------------
    def _message(
        self,
        step: int,
        meta: list[tuple[int, int, int]],
        stats: list[list[float]],
        counts: list[list[float]],
        hists: list[list[float]],
    ) -> Activations:
        """The ``activations`` message; calls of one module (weight sharing, a shared ReLU)
        are merged exactly: counts add, means and variances combine (Chan et al.); histograms
        add, their stride the largest of the calls'."""
        merged: dict[int, list[float]] = {}  # leaf -> [n, mean, m2, min, max, zeros, nonfinite]
        bins: dict[int, tuple[list[float], int]] = {}  # leaf -> (counts, stride)
        rows = zip(meta, stats, counts, hists, strict=True)
        for (index, n, stride), (mean, var, low, high), (nonzero, bad), hist in rows:
            m2 = var * n
            zeros = n - nonzero
            seen = bins.get(index)
            if seen is None:
                bins[index] = (hist, stride)
            else:
                bins[index] = (
                    [a + b for a, b in zip(seen[0], hist, strict=True)],
                    max(seen[1], stride),
                )
            acc = merged.get(index)
            if acc is None:
                merged[index] = [float(n), mean, m2, low, high, zeros, bad]
                continue
            total = acc[0] + n
            delta = mean - acc[1]
            acc[1] += delta * n / total
            acc[2] += m2 + delta * delta * acc[0] * n / total
            acc[3] = _nan_min(acc[3], low)
            acc[4] = _nan_max(acc[4], high)
            acc[0] = total
            acc[5] += zeros
            acc[6] += bad
        names: list[str] = []
        types: list[str] = []
        columns: dict[str, list[float]] = {key: [] for key in ACTIVATION_STATS}
        for index in sorted(merged):  # named_modules() order, whatever the call order was
            count, mean, m2, low, high, zeros, bad = merged[index]
            name, type_name, _ = self._leaves[index]
            names.append(name)
            types.append(type_name)
            columns["mean"].append(mean)
            # Unbiased, as x.std(); NaN for one element, as torch gives (without its warning).
            std = math.sqrt(m2 / (count - 1)) if count > 1 and m2 >= 0 else math.nan
            columns["std"].append(std)
            columns["min"].append(low)
            columns["max"].append(high)
            columns["zero_frac"].append(zeros / count)
            columns["nonfinite"].append(int(round(bad)))  # a count: sent as an integer
        order = sorted(merged)
        return Activations(
            step,
            tuple(names),
            tuple(types),
            **{key: tuple(values) for key, values in columns.items()},  # type: ignore[arg-type]
            hist=tuple(tuple(int(round(c)) for c in bins[index][0]) for index in order),
            hist_stride=tuple(bins[index][1] for index in order),
        )


def _nan_min(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)


def _nan_max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
