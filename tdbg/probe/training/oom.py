"""The CUDA out-of-memory post-mortem: at the allocation that failed, what was allocated, whose,
at which step and in which phase — one alert, sent and recorded before the error kills the run.

Zero cost until then: torch's allocator calls its out-of-memory observers only when an
allocation fails (``torch._C._cuda_attach_out_of_memory_observer``, what PyTorch's own
``_record_memory_history`` uses to dump a snapshot on OOM). The witness reads the allocator's
snapshot (its segments and blocks) and names the blocks holding the watched models'
parameters, their gradients and their optimizers' state by address; the rest is activations and
other tensors. With ``watch(oom_stacks=True)`` (``TDBG_OOM_STACKS=1``, ``tdbg run
--oom-stacks``) the allocator also keeps each live allocation's Python stack
(:func:`record_stacks`), and each of the largest blocks is given the user frames that allocated
it: a cost on every allocation, so opt-in.
"""

from __future__ import annotations

import bisect
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from tdbg.format import fmt_bytes
from tdbg.probe.alerts import alert
from tdbg.probe.log import warn
from tdbg.protocol.messages.alert import Alert

KIND = "oom"
LARGEST = 5  # the largest allocated blocks named in the alert
OTHER = "activations and other tensors"
USER_FRAMES = 2  # the innermost frames of the user's code named for a block
# Frames that are not the user's: the library's and the interpreter's own.
NOT_USER = (f"{os.sep}torch{os.sep}", f"{os.sep}tdbg{os.sep}", "site-packages", "dist-packages")
STACK_ENTRIES = 100_000  # the allocator's record of events, at most (RELIABILITY R29)
_stacks = False  # whether record_stacks() has the allocator keeping stacks now


def stacks_recording() -> bool:
    """Whether the allocator keeps stacks for the post-mortem (so that a memory snapshot dive,
    finding history on, knows it is the probe's to switch and to give back)."""
    return _stacks


def record_stacks() -> bool:
    """Have the CUDA allocator keep the Python stack of every live allocation (``state``: the
    live ones only, no history of events), which its snapshot then gives per block; False
    (said once) where it cannot. It costs a stack capture per allocation while on."""
    global _stacks
    try:
        torch.cuda.memory._record_memory_history(
            enabled="state", context="alloc", stacks="python", max_entries=STACK_ENTRIES
        )
        _stacks = True
        return True
    except Exception as exc:  # an old or odd torch: the post-mortem goes on without stacks
        warn(f"tdbg: oom_stacks: the allocator would not record stacks ({exc})")
        return False


def stop_stacks() -> None:
    """Turn the allocator's stack record off again (what :func:`record_stacks` turned on)."""
    global _stacks
    _stacks = False
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception as exc:
        warn(f"tdbg: oom_stacks: could not turn the allocator's stack record off ({exc})")


def user_frames(frames: Any) -> str:
    """A block's allocating stack (the snapshot's ``frames``, innermost first) as its innermost
    frames of the user's code, ``file.py:LINE fn ← file.py:LINE fn``; the innermost frames of
    any kind where none is the user's; "" without frames."""
    if not isinstance(frames, list):
        return ""
    found: list[str] = []
    fallback: list[str] = []
    for frame in frames:
        if not isinstance(frame, dict):
            continue
        filename = str(frame.get("filename", ""))
        where = f"{os.path.basename(filename)}:{frame.get('line', '?')} {frame.get('name', '?')}"
        if filename.startswith("<") or any(part in filename for part in NOT_USER):
            if len(fallback) < USER_FRAMES:
                fallback.append(where)
            continue
        found.append(where)
        if len(found) == USER_FRAMES:
            break
    return " ← ".join(found or fallback)


def attach(observer: Callable[[int, int, int, int], None]) -> bool:
    """Register ``observer`` with the CUDA allocator (device, requested bytes, the device's total,
    bytes free); False where there is no CUDA allocator to observe."""
    hook = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if hook is None or not torch.cuda.is_available():
        return False
    hook(observer)
    return True


def _on_cuda(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda


def tensor_owners(
    layers: Iterable[tuple[str, Iterable[torch.Tensor]]],
    optimizers: Iterable[tuple[str, torch.optim.Optimizer]],
    counted: Callable[[torch.Tensor], bool] = _on_cuda,
) -> Iterator[tuple[int, int, str, str]]:
    """(address, bytes, owner, kind) of every tensor the probe can name that ``counted`` keeps
    (the CUDA ones): each layer's parameters (``kind`` parameters) and their gradients
    (gradients), and each optimizer's state for them (optimizer state: Adam's moments,
    momentum buffers)."""
    names: dict[int, str] = {}
    for layer, params in layers:
        for k, param in enumerate(params):
            name = layer if k == 0 else f"{layer}[{k}]"
            names[id(param)] = name
            if counted(param):
                yield param.data_ptr(), param.numel() * param.element_size(), name, "parameters"
            grad = param.grad
            if grad is not None and counted(grad):
                size = grad.numel() * grad.element_size()
                yield grad.data_ptr(), size, f"{name}.grad", "gradients"
    for opt_name, optimizer in optimizers:
        for param, state in optimizer.state.items():
            owner = names.get(id(param), "?")
            for key, value in state.items() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor) and value.numel() > 1 and counted(value):
                    size = value.numel() * value.element_size()
                    yield value.data_ptr(), size, f"{opt_name} {key} of {owner}", "optimizer state"


def post_mortem(
    device: int,
    requested: int,
    total: int,
    free: int,
    segments: list[dict[str, Any]],
    owners: Iterable[tuple[int, int, str, str]],
    step: int,
    phase: str,
) -> Alert:
    """The alert for an out-of-memory error: where it happened, what was asked, and what held the
    memory — by kind (parameters, gradients, optimizer state, the rest) and the largest blocks
    with their owners. ``total``: the device's memory (or the share the process is allowed,
    ``set_per_process_memory_fraction``), as the allocator tells its observers; what torch held
    allocated is summed from ``segments``: ``torch.cuda.memory_snapshot()``."""
    found: list[tuple[int, int, str]] = []  # (address, size, user frames) of allocated blocks
    for segment in segments:
        if segment.get("device", device) != device:
            continue
        address = int(segment.get("address", 0))
        for block in segment.get("blocks", []):
            size = int(block.get("size", 0))
            if block.get("state") == "active_allocated":
                start = int(block.get("address", address))
                found.append((start, size, user_frames(block.get("frames"))))
            address += size
    found.sort()
    allocated = sum(size for _, size, _ in found)
    blocks = [(a, size) for a, size, _ in found]
    starts = [a for a, _ in blocks]
    held: dict[int, list[str]] = {}  # block index -> the owners of tensors in it
    by_kind: dict[str, int] = {}
    for pointer, size, owner, kind in owners:
        i = bisect.bisect_right(starts, pointer) - 1
        if i >= 0 and pointer < blocks[i][0] + blocks[i][1]:
            held.setdefault(i, []).append(owner)
            by_kind[kind] = by_kind.get(kind, 0) + size
    known = sum(by_kind.values())
    by_kind[OTHER] = max(0, allocated - known)
    largest = sorted(range(len(blocks)), key=lambda i: -blocks[i][1])[:LARGEST]
    named = []
    for i in largest:
        whose = held.get(i, [])
        what = ", ".join(whose[:2]) + (f" +{len(whose) - 2}" if len(whose) > 2 else "")
        stack = f" (allocated at {found[i][2]})" if found[i][2] else ""
        named.append(f"{fmt_bytes(blocks[i][1])} {what if whose else OTHER}{stack}")
    kinds = ", ".join(f"{kind} {fmt_bytes(size)}" for kind, size in by_kind.items() if size)
    message = (
        f"CUDA out of memory at step {step} ({phase}): asked for {fmt_bytes(requested)} on "
        f"cuda:{device} with {fmt_bytes(allocated)} allocated by torch and {fmt_bytes(free)} of"
        f" {fmt_bytes(total)} free; held by {kinds}"
    )
    if named:
        message += "; largest blocks: " + "; ".join(named)
    layers = sorted(
        {o.split(" of ")[-1].removesuffix(".grad") for i in largest for o in held.get(i, ())}
    )
    return alert(KIND, "error", step, message, layers)


class OomWitness:
    """The observer the allocator calls on an out-of-memory error. It holds the probe weakly
    (the allocator keeps observers for the process's life) and never raises into the allocator.
    ``describe``: the probe's view at that moment (step, phase, the tensors it can name);
    ``tell``: where the alert goes (the probe thread's inbox)."""

    def __init__(
        self,
        describe: Callable[[], tuple[int, str, list[tuple[int, int, str, str]]]],
        tell: Callable[[Alert], None],
        snapshot: Callable[[], list[dict[str, Any]]] = torch.cuda.memory_snapshot,
    ) -> None:
        self._describe = weakref.WeakMethod(describe) if hasattr(describe, "__self__") else None
        self._plain = None if self._describe is not None else describe
        self._tell = tell
        self._snapshot = snapshot
        self.told = 0

    def __call__(self, device: int, requested: int, total: int, free: int) -> None:
        # (torch's observer arguments: the device, the bytes asked for, the device's memory or
        # the process's allowed share of it, and the bytes the driver has free.)
        try:
            describe = self._describe() if self._describe is not None else self._plain
            if describe is None:
                return  # the probe is gone
            step, phase, owners = describe()
            report = post_mortem(
                device, requested, total, free, self._snapshot(), owners, step, phase
            )
            self._tell(report)
            self.told += 1
        except Exception:  # inside the allocator's failure path: never a second error
            pass
