"""What watch() is given: its keyword options checked once, its models and optimizers named."""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from tdbg.probe.console import parse as console_mode
from tdbg.probe.run_info import job_info

OOM_STACKS_ENV = "TDBG_OOM_STACKS"


@dataclass(frozen=True)
class ProbeOptions:
    """watch()'s keyword options, checked once: the one definition watch() and Probe share."""

    name: str | None = None
    overhead_budget: float = 0.01
    grad_every: int | None = None
    serve: bool = True
    directory: str | os.PathLike[str] | None = None
    nan_hunt: bool = True
    anomaly_check_nan: bool = False
    activations_every: int | None = None
    record: str | os.PathLike[str] | None = None
    total_steps: int | None = None
    skip_nonfinite: bool = False
    oom_stacks: bool | None = None  # None: as $TDBG_OOM_STACKS says (off unless set to 1)
    console: bool | str | None = None  # None: as $TDBG_CONSOLE says (on unless 0)

    def __post_init__(self) -> None:
        if not self.overhead_budget > 0:
            raise ValueError("tdbg.watch: overhead_budget must be > 0 (e.g. 0.01 for 1 %)")
        every = self.grad_every
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError("tdbg.watch: grad_every must be a positive integer or None (auto)")
        every = self.activations_every
        if every is not None and (not isinstance(every, int) or not 1 <= every <= 10_000):
            raise ValueError("tdbg.watch: activations_every must be an integer 1-10000 or None")
        if isinstance(self.console, str):
            try:
                console_mode(self.console)
            except ValueError as exc:
                raise ValueError(f"tdbg.watch: {exc}") from None
        elif self.console is not None and not isinstance(self.console, bool):
            raise ValueError("tdbg.watch: console must be True, False, 'fd' or None")
        total = self.total_steps
        if total is not None and (
            isinstance(total, bool) or not isinstance(total, int) or total < 1
        ):
            raise ValueError("tdbg.watch: total_steps must be a positive integer or None")

    @property
    def wants_oom_stacks(self) -> bool:
        """Whether the allocator should keep allocation stacks for the OOM post-mortem:
        ``oom_stacks=``, else ``$TDBG_OOM_STACKS`` (``tdbg run --oom-stacks`` sets it; every
        process that watches reads it, a job's ranks alike)."""
        if self.oom_stacks is not None:
            return bool(self.oom_stacks)
        return os.environ.get(OOM_STACKS_ENV, "").strip().lower() in ("1", "true", "yes", "on")

    @classmethod
    def of(cls, options: dict[str, Any]) -> ProbeOptions:
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"tdbg.watch: unexpected keyword argument {unknown[0]!r}")
        return cls(**options)


_F = TypeVar("_F", bound=Callable[..., Any])


def with_options(fn: _F) -> _F:
    """Show ProbeOptions' fields as ``fn``'s keyword-only parameters (help(), IDEs, inspect):
    ``fn`` takes ``**options`` so that the options are written down once, in ProbeOptions."""
    signature = inspect.signature(fn)
    keep = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    keywords = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in dataclasses.fields(ProbeOptions)
    ]
    fn.__signature__ = signature.replace(parameters=[*keep, *keywords])  # type: ignore[attr-defined]
    return fn


def run_name(name: str | None) -> str:
    if name:
        return name
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return script.removesuffix(".py") or "python"


def named(
    what: Any, kind: type, label: str, default: str, caller: dict[int, str]
) -> list[tuple[str, Any]]:
    """``watch()``'s model/optimizer argument as ``[(name, object)]``: one object, a list or
    tuple of them, or a dict ``name -> object``. An unnamed object takes the name the calling
    code binds it to (``netG``), else ``default`` (numbered when there are several)."""
    if what is None:
        return []
    if isinstance(what, kind):
        items: list[tuple[str | None, Any]] = [(None, what)]
    elif isinstance(what, dict):
        items = list(what.items())
    elif isinstance(what, list | tuple):
        items = [(None, item) for item in what]
    else:
        items = [(None, what)]
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for key, obj in items:
        if not isinstance(obj, kind):
            spelled = "torch.nn.Module" if kind is nn.Module else "torch.optim.Optimizer or None"
            raise TypeError(
                f"tdbg.watch: {label} must be a {spelled} (or a list or dict of them), "
                f"not {type(obj).__name__}"
            )
        if key is not None and not isinstance(key, str):
            raise TypeError(f"tdbg.watch: {label} names must be strings, not {key!r}")
        obj = _unwrapped(obj)
        if id(obj) in seen:
            continue  # the same object twice is watched once
        seen.add(id(obj))
        out.append((key or caller.get(id(obj)) or "", obj))
    taken = {name for name, _ in out if name}
    for i, (name, obj) in enumerate(out):
        if not name:
            name = default if len(out) == 1 else f"{default}{i}"
            while name in taken:
                name += "_"
            taken.add(name)
            out[i] = (name, obj)
    return out


def _unwrapped(obj: Any) -> Any:
    """The torch optimizer inside a wrapper that subclasses Optimizer without being one
    (Accelerate's AcceleratedOptimizer, and the like): its hooks are the real optimizer's."""
    for _ in range(4):
        inner = getattr(obj, "optimizer", None)
        if "_optimizer_step_pre_hooks" in vars(obj) or not isinstance(inner, torch.optim.Optimizer):
            return obj
        obj = inner
    return obj


def caller_names(depth: int = 2) -> dict[int, str]:
    """id -> name of what the calling code's variables hold (its locals, then its globals), so
    that a run shows ``netG`` and ``optD`` rather than class names."""
    names: dict[int, str] = {}
    try:
        frame: Any = sys._getframe(depth)
    except ValueError:
        return names
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(
        ("tdbg.", "torch.")
    ):
        frame = frame.f_back  # watch(), tdbg run's discovery, torch's hooks: the user is above
    if frame is None:
        return names
    for scope in (frame.f_globals, frame.f_locals):
        for key, value in list(scope.items()):
            if isinstance(value, nn.Module | torch.optim.Optimizer) and not key.startswith("_"):
                names[id(value)] = key
    return names


def record_path(record: Any) -> str | os.PathLike[str] | None:
    """Where to record: ``record=``, else ``$TDBG_RECORD`` in the main process only (spawned
    children inherit the environment and must not write a second recording; guarantees: processes).

    The main process claims ``$TDBG_RECORD``: it is removed from ``os.environ``, so that a plain
    ``subprocess`` started later (an evaluation script that calls watch() too) does not write a
    ``NAME.1.EXT`` beside the run's recording. Pass ``record=`` to record such a child."""
    if record is not None:
        if not isinstance(record, str | os.PathLike) or not os.fspath(record):
            raise TypeError("tdbg.watch: record must be a file path (str or os.PathLike) or None")
        return record
    env = os.environ.get("TDBG_RECORD", "")
    if env and multiprocessing.parent_process() is None:
        os.environ.pop("TDBG_RECORD", None)
        if job_info() and "{rank}" not in env:
            # Every rank of a torchrun job reads the same variable: one file per rank.
            path = Path(env)
            suffix = path.suffix
            env = str(path.with_name(f"{path.stem}.rank{{rank}}{suffix}"))
        return env
    return None
