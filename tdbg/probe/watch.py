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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from tdbg.probe import taps
from tdbg.probe.alerts import alert
from tdbg.probe.commands import CommandDesk
from tdbg.probe.dives.base import Dive, DiveContext, DiveRunner
from tdbg.probe.gradients import Layer, find_layers
from tdbg.probe.hooks import PhaseHooks
from tdbg.probe.log import warn
from tdbg.probe.metrics import MetricsDesk
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


def _env_int(var: str) -> int | None:
    try:
        return int(os.environ[var])
    except (KeyError, ValueError):
        return None


def _process_group() -> tuple[int, int] | None:
    """(rank, world size) of an initialised default process group, else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None


def _job_info() -> dict[str, Any]:
    """Where this process sits in a distributed job, from the launcher's environment (torchrun,
    torch.distributed.run, mpirun-style RANK/WORLD_SIZE); {} for a single process."""
    world = _env_int("WORLD_SIZE")
    if world is None:
        group = _process_group()
        if group is not None and group[1] > 1:
            # mp.spawn and friends pass rank and world size to init_process_group, not the
            # environment: read them from torch.distributed (local calls, no collective).
            master = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
            job = ":".join(master) if all(master) else ""
            return {"world_size": group[1], "job": job, "rank": group[0]}
    if world is None or world < 2:
        return {}
    job = os.environ.get("TORCHELASTIC_RUN_ID") or ""
    if not job or job == "none":
        master = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        job = ":".join(master) if all(master) else ""
    info: dict[str, Any] = {"world_size": world, "job": job}
    local = _env_int("LOCAL_RANK")
    if local is not None:
        info["local_rank"] = local
    return info


def _run_name(name: str | None) -> str:
    if name:
        return name
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return script.removesuffix(".py") or "python"


def _named(
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


def _schedule_length(optimizers: list[torch.optim.Optimizer]) -> int | None:
    """The total steps a OneCycleLR driving one of ``optimizers`` was built for (the one
    scheduler whose length is the run's, by construction); None when there is none. Found
    once, at watch(), among what refers to the optimizer (a scheduler keeps a reference)."""
    if not optimizers:
        return None
    import gc

    try:
        from torch.optim.lr_scheduler import OneCycleLR

        for optimizer in optimizers:
            for ref in gc.get_referrers(optimizer):
                # The scheduler itself, or its attribute dict (how Python may hold it): only a
                # dict that looks like a OneCycleLR's is worth a second scan of the heap.
                if isinstance(ref, dict):
                    looks = ref.get("optimizer") is optimizer and "total_steps" in ref
                    owners = gc.get_referrers(ref) if looks else []
                else:
                    owners = [ref]
                for owner in owners:
                    total = (
                        getattr(owner, "total_steps", None)
                        if isinstance(owner, OneCycleLR)
                        else None
                    )
                    if isinstance(total, int) and total > 0:
                        return total
    except Exception:
        return None
    return None


def _caller_names(depth: int = 2) -> dict[int, str]:
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


def _run_info(
    name: str,
    cuda_device: torch.device | None,
    models: list[tuple[str, nn.Module]],
    optimizers: list[tuple[str, torch.optim.Optimizer]],
) -> tuple[dict[str, Any], dict[str, str]]:
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
        **_job_info(),
        "host": socket.gethostname(),
        "argv": [str(a)[:200] for a in sys.argv[:32]],
        "start_time": time.time(),
        "cwd": os.getcwd(),
        "torch": torch.__version__,
        "device": str(cuda_device or "cpu"),
        "commands": unavailable,
        "models": [model_name for model_name, _ in models],
        "optimizers": [
            {"name": opt_name, "type": type(opt).__name__, "groups": len(opt.param_groups)}
            for opt_name, opt in optimizers
        ],
        "param_groups": sum(len(opt.param_groups) for _, opt in optimizers),
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
        if _job_info() and "{rank}" not in env:
            # Every rank of a torchrun job reads the same variable: one file per rank.
            path = Path(env)
            suffix = path.suffix
            env = str(path.with_name(f"{path.stem}.rank{{rank}}{suffix}"))
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
    total_steps: int | None = None
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        if not self.overhead_budget > 0:
            raise ValueError("tdbg.watch: overhead_budget must be > 0 (e.g. 0.01 for 1 %)")
        every = self.grad_every
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError("tdbg.watch: grad_every must be a positive integer or None (auto)")
        every = self.activations_every
        if every is not None and (not isinstance(every, int) or not 1 <= every <= 10_000):
            raise ValueError("tdbg.watch: activations_every must be an integer 1-10000 or None")
        total = self.total_steps
        if total is not None and (
            isinstance(total, bool) or not isinstance(total, int) or total < 1
        ):
            raise ValueError("tdbg.watch: total_steps must be a positive integer or None")

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
        caller = _caller_names()
        models = _named(model, nn.Module, "model", "model", caller)
        if not models:
            raise TypeError(
                "tdbg.watch: no model given (a torch.nn.Module, or a list or dict of them)"
            )
        optimizers = _named(optimizer, torch.optim.Optimizer, "optimizer", "optimizer", caller)
        opts = ProbeOptions.of(options)
        self.options = opts
        record_path = _record_path(opts.record)
        self.name = _run_name(opts.name)
        self.errors = 0
        self.last_error: str | None = None
        self.closed = False
        self._disabled = False  # switched off by the error breaker, or closed
        self._broken = False  # switched off by the error breaker
        self._pid = os.getpid()
        self.total_steps: int | None = opts.total_steps
        seen: set[int] = set()
        self._layers = []
        layer_models: list[int] = []
        for index, (model_name, module) in enumerate(models):
            prefix = f"{model_name}." if len(models) > 1 else ""
            found = find_layers(module, model_name, prefix, seen)
            self._layers.extend(found)
            layer_models.extend([index] * len(found))
        self.models = [model_name for model_name, _ in models]
        self._models = models
        # Fixed once per model: a model added later must not rename the first one's layers.
        self._prefixes = [f"{name}." if len(models) > 1 else "" for name, _ in models]
        self._optimizers = [(i, opt_name, opt) for i, (opt_name, opt) in enumerate(optimizers)]
        self._layer_models = layer_models
        self._optimizer_names: dict[int, str] = {}  # names add() was given, until hooked
        cuda_params = [p for layer in self._layers for p in layer.params if p.is_cuda]
        self._cuda_device: torch.device | None = cuda_params[0].device if cuda_params else None
        if not self._layers:
            warn(
                "tdbg: the model has no parameters: only loss, learning rate and timings are shown"
            )
        run_info, unavailable = _run_info(self.name, self._cuda_device, models, optimizers)
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
            layer_models=layer_models if len(models) > 1 else None,
        )
        self._sampler = StepSampler(
            self._layers,
            optimizers,
            self._cuda_device,
            self._server,
            grad_every=opts.grad_every,
            overhead_budget=float(opts.overhead_budget),
            count_error=self._count_error,
            skip_nonfinite=bool(opts.skip_nonfinite),
        )
        self._server.skipped_steps = lambda: self._sampler.skipped_steps
        self._server.nan_origin.layer_types = [layer.module_type for layer in self._layers]
        self._metrics = MetricsDesk(self._sampler.report_once)
        self._server.metrics_inbox = self._metrics.inbox
        first_model = models[0][1]
        first_optimizer = optimizers[0][1] if optimizers else None
        self._dives = DiveRunner(
            DiveContext(
                model=first_model,
                optimizer=first_optimizer,
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
            [module for _, module in models],
            [opt for _, opt in optimizers],
            self._cuda_device,
            self._sampler,
            self._count_error,
        )
        # The latest forward's inputs are kept (a reference) where re-running a non-finite step's
        # forward can name the module that overflowed: with the guard, or on the CPU, where
        # the norms are read without a sync.
        self._hooks.capture_inputs = bool(opts.skip_nonfinite) or self._cuda_device is None
        self._sampler.captured = lambda: self._hooks.last_inputs
        if self.total_steps is None and optimizers:
            # A scan of the heap (tens of ms): on the probe's worker thread, once, not here.
            opts_only = [opt for _, opt in optimizers]
            self._server.submit_work(lambda: self._adopt_schedule(opts_only))
        self._note_watched()
        taps.attach(self._sampler)
        self._created = time.monotonic()
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
        """Record one optimizer update. ``loss``: a scalar tensor or number (NaN is an alert);
        None: what the probe saw backpropagated for it — the sum of the scalars since the last
        step (the mean micro-batch loss when the script divides by the accumulation steps), the
        closure's loss for ``optimizer.step(closure)``, the first optimizer's with several. A
        loss passed is shown as passed, except the very tensor backpropagated last when the
        update had several micro-batches (one of them, not the update's): then the update's,
        with a note. The micro-batches of the update are counted either way.

        ``samples`` / ``tokens``: how many this step processed, for samples/s and tokens/s.
        """
        if self._disabled:
            if self._hooks.handles and not self.closed:
                # Switched off by the circuit breaker: remove the hooks here, at a step
                # boundary, never from inside a hook while torch iterates over them.
                self._hooks.remove()
                taps.detach(self._sampler)
                self._dives.close("the probe switched itself off")
            return
        ident = threading.get_ident()
        if self._server.training_thread != ident:
            self._server.training_thread = ident  # where a stall's stack is read
        if self._sampler.layout_dirty:
            try:
                self._relayout()
            except Exception as exc:
                self._count_error(exc)
        try:
            self._sampler.step(loss, samples, tokens, self._hooks)
        except Exception as exc:
            self._count_error(exc)
        if self._dives.busy:  # the one flag read per step while no command is armed
            try:
                self._dives.at_boundary(self._sampler.step_count - 1)
            except Exception as exc:
                self._count_error(exc)

    def log(
        self, metrics: Mapping[str, Any] | None = None, /, *, step: Any = None, **scalars: Any
    ) -> None:
        """Record your own metrics: ``probe.log(val_loss=v, acc=a)`` or ``probe.log({"val/loss":
        v})``. Numbers or one-element tensors (a device tensor is read off the training thread:
        no sync). ``step``: the step they belong to (default: the last step recorded). A bad
        name or value is reported once and dropped; nothing raises into the loop."""
        if self._disabled:
            return
        try:
            merged: dict[Any, Any] = {}
            if metrics is not None:
                if isinstance(metrics, Mapping):
                    merged.update(metrics)
                else:
                    self._sampler.report_once(
                        "log-arg",
                        f"tdbg.log: expected a dict of metrics, not {type(metrics).__name__}",
                    )
            merged.update(scalars)
            at = max(0, self._sampler.step_count - 1)
            if step is not None:
                if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                    at = step
                else:
                    self._sampler.report_once(
                        "log-step", f"tdbg.log(step={step!r}): not a step number — ignored"
                    )
            self._metrics.log(at, merged)
        except Exception as exc:
            self._count_error(exc)

    def add(self, model: nn.Module | None = None, optimizer: Any = None) -> None:
        """Watch one more model and/or optimizer from now on (``tdbg run`` finds a GAN's second
        pair at its first step). Its layers are appended; clients get a new ``layers``. Call it
        between steps, or from torch's global optimizer pre-step hook."""
        try:
            caller = _caller_names()
            if model is not None:
                taken = {name for name, _ in self._models}
                for name, module in _named(model, nn.Module, "model", "model", caller):
                    if any(m is module for _, m in self._models):
                        continue
                    while name in taken:
                        name += "_"
                    taken.add(name)
                    self._models.append((name, module))
                    self._prefixes.append(f"{name}.")
                self.models = [name for name, _ in self._models]
            if optimizer is not None:
                for name, opt in _named(optimizer, torch.optim.Optimizer, "o", "", caller):
                    self._sampler.new_optimizers.append(weakref.ref(opt))
                    if name:
                        self._optimizer_names[id(opt)] = name
            self._relayout()
        except Exception as exc:
            self._count_error(exc)

    def _adopt_schedule(self, optimizers: list[torch.optim.Optimizer]) -> None:
        total = _schedule_length(optimizers)
        if total is not None and self.total_steps is None:
            self.total_steps = total

    def note_backward(self, loss: Any, inside_step: bool = False) -> None:
        """A scalar backpropagated before this probe's taps existed (``tdbg run`` starts the
        probe at the first backward): counted into the step as if the taps had seen it.
        ``inside_step``: it came from the closure of an ``optimizer.step(closure)`` already
        running (its pre-hook came before the probe did)."""
        try:
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                if inside_step:
                    self._sampler.on_optimizer_pre(0)
                self._sampler.on_backward(loss.detach())
        except Exception as exc:
            self._count_error(exc)

    def set_progress(self, *, epoch: Any = None, total_steps: Any = None) -> None:
        """Say where the run is: the current ``epoch`` (from now on instead of counting the
        DataLoader's passes) and the ``total_steps`` it will take (for the ETA)."""
        try:
            if epoch is not None:
                value = float(epoch)
                if value == value:
                    self._sampler.epoch = value
                    self._sampler.epoch_given = True
            if total_steps is not None:
                total = int(total_steps)
                self.total_steps = total if total > 0 else None
        except (TypeError, ValueError, OverflowError):
            self._sampler.report_once(
                "progress", f"probe.set_progress: not numbers: {epoch!r}, {total_steps!r}"
            )
        except Exception as exc:
            self._count_error(exc)

    def close(self) -> None:
        """Remove every hook, stop serving and remove the socket; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self._disabled = True
        taps.detach(self._sampler)
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
                self._broken = True
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
            "disabled": self._broken,
            "closed": self.closed and not self._broken,
            "total_steps": self.total_steps,
            "skipped_steps": self._sampler.skipped_steps,
            # Updates AMP's GradScaler skipped (inf gradients at its scale): routine, counted.
            "amp_skipped_steps": self._sampler.amp_skipped_steps,
        }

    # --- following the model when it changes ---------------------------------------------------
    def _note_watched(self) -> None:
        """What the taps compare against: every module and parameter of the watched models."""
        modules: set[int] = set()
        params: set[int] = set()
        for _, model in self._models:
            modules.update(id(m) for m in model.modules())
            params.update(id(p) for p in model.parameters())
        self._sampler.watched_modules = modules
        self._sampler.watched_params = params

    def _relayout(self) -> None:
        """At a step boundary, after a watched module changed or a new optimizer updates it:
        follow the model's parameters as they are now. A layer replaced under the same name
        keeps its index and reports the new parameters; new layers are appended; a layer whose
        parameters left the model is *gone* (no norms, no alerts); an optimizer that no longer
        updates any of it is unhooked and a new one is hooked. Clients get a new ``layers``."""
        sampler = self._sampler
        sampler.layout_dirty = False
        index_of = {layer.name: i for i, layer in enumerate(self._layers)}
        layers = list(self._layers)
        layer_models = list(self._layer_models)
        seen: set[int] = set()
        present: set[int] = set()
        for m, (model_name, model) in enumerate(self._models):
            prefix = self._prefixes[m]
            for layer in find_layers(model, model_name, prefix, seen):
                present.add(index_of.setdefault(layer.name, len(layers)))
                i = index_of[layer.name]
                if i == len(layers):
                    layers.append(layer)
                    layer_models.append(m)
                else:
                    layers[i] = layer  # the same name, maybe new parameters: follow them
        gone = [i for i in range(len(layers)) if i not in present]
        for i in gone:
            layers[i] = Layer(layers[i].name, (), layers[i].module_type)
        current = {id(p) for layer in layers for p in layer.params}
        arrived = [o for o in (ref() for ref in sampler.new_optimizers) if o is not None]
        newly_held = {id(p) for o in arrived for g in o.param_groups for p in g["params"]}

        def still_used(optimizer: torch.optim.Optimizer) -> bool:
            # Kept while it updates a parameter of the model that no newcomer took over.
            mine = {id(p) for g in optimizer.param_groups for p in g["params"]} & current
            return bool(mine - newly_held)

        optimizers = [entry for entry in self._optimizers if still_used(entry[2])]
        for key, _, _ in self._optimizers:
            if all(key != kept[0] for kept in optimizers):
                self._hooks.remove_optimizer(key)
        next_key = max((key for key, _, _ in self._optimizers), default=-1) + 1
        names = {name for _, name, _ in optimizers}
        caller = _caller_names() if arrived else {}
        for optimizer in arrived:
            if any(o is optimizer for _, _, o in optimizers):
                continue
            name = (
                self._optimizer_names.pop(id(optimizer), "")
                or caller.get(id(optimizer))
                or f"optimizer{next_key}"
            )
            while name in names:
                name += "_"
            optimizers.append((next_key, name, optimizer))
            names.add(name)
            self._hooks.add_optimizer(next_key, optimizer)
            next_key += 1
        sampler.new_optimizers = []
        self._layers, self._layer_models, self._optimizers = layers, layer_models, optimizers
        sampler.rebuild(layers, optimizers)
        self._note_watched()
        # Read with the names by index (names only grow); set before the new names go out.
        self._server.nan_origin.layer_types = [layer.module_type for layer in layers]
        self._server.relayout(
            [layer.name for layer in layers],
            [layer.numel for layer in layers],
            layer_models if len(self._models) > 1 else None,
            [name for name, _ in self._models],
            gone,
            [
                {"name": name, "type": type(opt).__name__, "groups": len(opt.param_groups)}
                for _, name, opt in optimizers
            ],
        )

    def _after_fork_in_child(self) -> None:
        self._disabled = True
        self.closed = True
        taps.detach(self._sampler)
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
    modules = _modules_of(model)
    for module in modules:
        previous = _by_model.get(module)
        if previous is not None and not previous.closed:
            warn("tdbg.watch: this model was already watched; closing the earlier probe")
            previous.close()
    probe = Probe(model, optimizer, **options)
    for module in modules:
        _by_model[module] = probe
    return probe


def _modules_of(model: Any) -> list[nn.Module]:
    """The modules in watch()'s model argument (only a module can key the weak map: anything
    else gets Probe's clear TypeError)."""
    items = model.values() if isinstance(model, dict) else model
    if isinstance(model, nn.Module):
        return [model]
    if isinstance(items, list | tuple) or isinstance(model, dict):
        return [m for m in items if isinstance(m, nn.Module)]
    return []


def log(metrics: Mapping[str, Any] | None = None, /, *, step: Any = None, **scalars: Any) -> None:
    """``tdbg.log(val_loss=v, acc=a)``: record metrics into the run's live probe (the one
    ``watch()`` or ``tdbg run`` started; the newest when there are several). A no-op when
    nothing is watched. See :meth:`Probe.log`."""
    probes = [p for p in list(_live) if not p.closed]
    if probes:
        max(probes, key=lambda p: p._created).log(metrics, step=step, **scalars)


def _close_all() -> None:
    died = getattr(sys, "last_value", None)  # set when an uncaught exception ends the process
    for probe in list(_live):
        try:
            if died is not None:  # the readers learn why: Python exits 1 on an uncaught error
                probe._server.bye_reason = f"exit 1: {type(died).__name__}: {died}"[:200]
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
