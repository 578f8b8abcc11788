"""watch(model, optimizer) -> Probe: wiring and lifecycle of the probe in the training process."""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from tdbg.probe.alerts import alert
from tdbg.probe.commands import CommandDesk
from tdbg.probe.dives.base import Dive, DiveContext, DiveRunner
from tdbg.probe.gradients import find_layers
from tdbg.probe.hooks import PhaseHooks
from tdbg.probe.log import warn
from tdbg.probe.sampler import StepSampler
from tdbg.probe.server import ProbeServer

MAX_ERRORS = 100  # circuit breaker (guarantees: training thread)

_live: weakref.WeakSet[Probe] = weakref.WeakSet()
_by_model: weakref.WeakKeyDictionary[nn.Module, Probe] = weakref.WeakKeyDictionary()


def _rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return 0


def _run_name(name: str | None) -> str:
    if name:
        return name
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return script.removesuffix(".py") or "python"


def _check_watched(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"tdbg.watch: model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "tdbg.watch: optimizer must be a torch.optim.Optimizer or None, "
            f"not {type(optimizer).__name__}"
        )


def _run_info(name: str, cuda_device: torch.device | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``hello`` message's run description, and the commands this run cannot serve (why)."""
    unavailable: dict[str, str] = {}
    if cuda_device is None:
        unavailable["snapshot"] = (
            "memory snapshots record the CUDA allocator: this run's model is on the cpu"
        )
    run_info = {
        "name": name,
        "pid": os.getpid(),
        "rank": _rank(),
        "host": socket.gethostname(),
        "argv": [str(a)[:200] for a in sys.argv[:32]],
        "start_time": time.time(),
        "cwd": os.getcwd(),
        "torch": torch.__version__,
        "device": str(cuda_device or "cpu"),
        "commands": unavailable,
    }
    return run_info, unavailable


# Dive factories import their module on first use: torch.profiler and friends are loaded only
# by a run that is profiled. The names are fixed here; nothing a client sends names a module.
def _profile(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.profiling import ProfileDive

    return ProfileDive(ctx, job, args, trigger)


def _snapshot(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.snapshot import SnapshotDive

    return SnapshotDive(ctx, job, args, trigger)


def _nan_hunt(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.nan_hunt import NanHuntDive

    return NanHuntDive(ctx, job, args, trigger)


def _anomaly(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.anomaly import AnomalyDive

    return AnomalyDive(ctx, job, args, trigger)


def _activations(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.activations import ActivationsDive

    return ActivationsDive(ctx, job, args, trigger)


DIVES = {
    "profile": _profile,
    "snapshot": _snapshot,
    "nan_hunt": _nan_hunt,
    "anomaly": _anomaly,
    "activations": _activations,
}


def _record_path(record: Any) -> str | os.PathLike[str] | None:
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
        return env
    return None


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

    def __post_init__(self) -> None:
        if not self.overhead_budget > 0:
            raise ValueError("tdbg.watch: overhead_budget must be > 0 (e.g. 0.01 for 1 %)")
        every = self.grad_every
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError("tdbg.watch: grad_every must be a positive integer or None (auto)")
        every = self.activations_every
        if every is not None and (not isinstance(every, int) or not 1 <= every <= 10_000):
            raise ValueError("tdbg.watch: activations_every must be an integer 1-10000 or None")

    @classmethod
    def of(cls, options: dict[str, Any]) -> ProbeOptions:
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"tdbg.watch: unexpected keyword argument {unknown[0]!r}")
        return cls(**options)


_F = TypeVar("_F", bound=Callable[..., Any])


def _with_options(fn: _F) -> _F:
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


class Probe:
    """Watches one model (and optionally its optimizer) and serves what it sees.

    Call :meth:`step` once per training iteration. Everything the probe does is wrapped so that
    an error inside it is counted and reported, never raised into the training loop.
    """

    @_with_options
    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: Any
    ) -> None:
        _check_watched(model, optimizer)
        opts = ProbeOptions.of(options)
        self.options = opts
        record_path = _record_path(opts.record)
        self.name = _run_name(opts.name)
        self.errors = 0
        self.last_error: str | None = None
        self.closed = False
        self._disabled = False
        self._pid = os.getpid()
        self._layers = find_layers(model)
        cuda_params = [p for layer in self._layers for p in layer.params if p.is_cuda]
        self._cuda_device: torch.device | None = cuda_params[0].device if cuda_params else None
        if not self._layers:
            warn(
                "tdbg: the model has no parameters: only loss, learning rate and timings are shown"
            )
        run_info, unavailable = _run_info(self.name, self._cuda_device)
        # Fixed at watch(): asked again on sampled steps, so not recounted there.
        frozen = [i for i, layer in enumerate(self._layers) if not layer.trainable]
        names = [layer.name for layer in self._layers]
        numels = [layer.numel for layer in self._layers]
        recorder = None
        if record_path is not None:
            from tdbg.probe.recorder import Recorder

            recorder = Recorder(record_path, run_info, names, numels)
        self._server = ProbeServer(
            run_info,
            names,
            numels,
            _rank(),
            self._stats,
            self._count_error,
            directory=opts.directory,
            frozen=frozen,
            on_grad_device_time=self._on_grad_device_time,
            recorder=recorder,
        )
        self._sampler = StepSampler(
            self._layers,
            optimizer,
            self._cuda_device,
            self._server,
            grad_every=opts.grad_every,
            overhead_budget=float(opts.overhead_budget),
            count_error=self._count_error,
        )
        self._dives = DiveRunner(
            DiveContext(
                model=model,
                optimizer=optimizer,
                cuda_device=self._cuda_device,
                run_info=run_info,
                artifacts=self._artifacts_dir,
                submit=self._server.submit_work,
                side_alerts=self._server.side_alerts,
                anomaly_check_nan=bool(opts.anomaly_check_nan),
                on_error=self._count_error,
            ),
            DIVES,
            self._count_error,
        )
        desk = CommandDesk(self._dives, unavailable, None)
        self._server.take_commands(desk, bool(opts.nan_hunt))
        # Hooks last: nothing above can leave them registered behind a failed watch().
        self._hooks = PhaseHooks(
            model, optimizer, self._cuda_device, self._sampler.on_optimizer_step, self._count_error
        )
        if opts.serve or record_path is not None:
            if opts.serve and multiprocessing.parent_process() is not None:
                warn("tdbg: watching from a multiprocessing child: serving its own socket")
            if self._server.start(listen=opts.serve):
                self._after_start(desk, opts.activations_every)
        _live.add(self)

    def _after_start(self, desk: CommandDesk, activations_every: int | None) -> None:
        # Also without a socket (serve=False, record=...): the samples go to the recording.
        if activations_every is not None:
            desk.submit("activations", {"every": activations_every, "enabled": True}, None, "watch")

    def _artifacts_dir(self) -> Path | None:
        """Where trace and snapshot files go: ``artifacts/`` beside the socket."""
        path = self._server.socket_path
        if path is None:
            return None
        from tdbg.probe.artifacts import artifact_dir

        return artifact_dir(Path(path).parent)

    # --- public API -------------------------------------------------------------------------
    @property
    def socket_path(self) -> str | None:
        """Where the probe serves, or None when it does not (see stderr for why)."""
        return self._server.socket_path if self._server.serving else None

    @property
    def grad_interval(self) -> int:
        """Gradients are sampled every this many steps (fixed by grad_every, else adaptive)."""
        return self._sampler.grad_interval

    @property
    def grad_every(self) -> int | None:
        return self._sampler.grad_every

    @property
    def overhead_budget(self) -> float:
        return self._sampler.overhead_budget

    def _on_grad_device_time(self, seconds: float) -> None:
        """From the probe thread (the sampler is made after the server, which needs this)."""
        self._sampler.on_grad_device_time(seconds)

    @property
    def steps(self) -> int:
        return self._sampler.step_count

    @property
    def recording_path(self) -> str | None:
        """The recording file (``record=``), once the probe thread created it; else None."""
        recorder = self._server.recorder
        return None if recorder is None or recorder.path is None else str(recorder.path)

    def step(self, loss: Any = None, *, samples: Any = None, tokens: Any = None) -> None:
        """Record one training iteration. ``loss``: a scalar tensor or number (NaN is an alert).

        ``samples`` / ``tokens``: how many this step processed, for samples/s and tokens/s.
        """
        if self._disabled:
            if self._hooks.handles and not self.closed:
                # Switched off by the circuit breaker: remove the hooks here, at a step
                # boundary, never from inside a hook while torch iterates over them.
                self._hooks.remove()
                self._dives.close("the probe switched itself off")
            return
        try:
            self._sampler.step(loss, samples, tokens, self._hooks)
        except Exception as exc:
            self._count_error(exc)
        if self._dives.busy:  # the one flag read per step while no command is armed
            try:
                self._dives.at_boundary(self._sampler.step_count - 1)
            except Exception as exc:
                self._count_error(exc)

    def close(self) -> None:
        """Remove every hook, stop serving and remove the socket; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self._disabled = True
        try:
            if os.getpid() == self._pid:
                self._dives.close()  # the profiler stopped, hooks removed, anomaly mode off
            self._hooks.remove()
            if os.getpid() == self._pid:
                self._server.stop()
        except Exception as exc:  # closing must never raise into the caller (or atexit)
            warn(f"tdbg: error while closing the probe: {exc}")
        _live.discard(self)

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"serving at {self.socket_path}"
        return f"<tdbg.Probe {self.name!r} step {self._sampler.step_count}, {state}>"

    # --- errors -----------------------------------------------------------------------------
    def _count_error(self, exc: BaseException) -> None:
        """Count an exception raised inside probe code; too many and the probe switches off."""
        try:
            self.errors += 1
            frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
            where = f" at {frame[0].filename.rsplit('/', 1)[-1]}:{frame[0].lineno}" if frame else ""
            self.last_error = f"{type(exc).__name__}: {exc}{where}"[:300]
            warn(f"tdbg: internal error (training continues): {self.last_error}")
            self._server.side_alerts.append(
                alert(
                    "probe_error",
                    "warning",
                    self._sampler.step_count,
                    f"probe error (training continues): {self.last_error}",
                )
            )
            if self.errors >= MAX_ERRORS and not self._disabled:
                warn(f"tdbg: {MAX_ERRORS} internal errors: the probe switches itself off")
                self._disabled = True
                self._hooks.active = False  # removed at the next probe.step() or close()
                threading.Thread(target=self._server.stop, daemon=True).start()
        except Exception:
            self._disabled = True

    def _stats(self) -> dict[str, Any]:
        return {
            "grad_interval": self.grad_interval,
            "grad_mode": "auto" if self.grad_every is None else "fixed",
            "overhead_budget": self.overhead_budget,
            "errors": self.errors,
            "last_error": self.last_error,
            "steps_seen": self._sampler.step_count,
            "disabled": self._disabled,
        }

    def _after_fork_in_child(self) -> None:
        self._disabled = True
        self.closed = True
        self._dives.forget()
        self._hooks.remove()
        self._server.abandon_after_fork()


@_with_options
def watch(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: Any
) -> Probe:
    """Start watching ``model`` (and ``optimizer``); returns at once with a serving Probe.

    ``overhead_budget``: the share of step time gradient statistics may cost (default 1 %);
    ``grad_every=k`` samples them every k steps instead (1 = every step). In a multiprocessing
    child (DataLoader workers with spawn) the probe is inert: it never starts a second server.

    Deep dives: ``nan_hunt`` hunts the first non-finite module automatically after the run's
    first non-finite alert (False: only when asked); ``anomaly_check_nan`` lets a client turn on
    anomaly mode with NaN checks, which raise inside the training loop; ``activations_every=k``
    gathers per-module activation statistics every k steps from the start.

    ``record=PATH`` (or ``$TDBG_RECORD`` in the main process) appends the probe's stream to a
    crash-safe recording for ``tdbg-tui replay PATH`` / ``tdbg dump PATH`` (see
    :mod:`tdbg.probe.recorder`); with ``serve=False`` it records without a socket. The first
    watch() that uses ``$TDBG_RECORD`` removes it from ``os.environ``: subprocesses started
    afterwards do not inherit it and record nothing unless given ``record=``.
    """
    # Only a module can be a key of the weak map: anything else gets Probe's clear TypeError.
    previous = _by_model.get(model) if isinstance(model, nn.Module) else None
    if previous is not None and not previous.closed:
        warn("tdbg.watch: this model was already watched; closing the earlier probe")
        previous.close()
    probe = Probe(model, optimizer, **options)
    _by_model[model] = probe
    return probe


def _close_all() -> None:
    for probe in list(_live):
        try:
            probe.close()
        except Exception:
            pass


def _after_fork() -> None:
    for probe in list(_live):
        try:
            probe._after_fork_in_child()
        except Exception:
            pass
    _live.clear()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork)
