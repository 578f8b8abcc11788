"""watch(model, optimizer) -> Probe: wiring and lifecycle of the probe in the training process."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tdbg.probe import console
from tdbg.probe.alerts import alert
from tdbg.probe.dives.base import DiveContext, DiveRunner
from tdbg.probe.dives.registry import DIVES
from tdbg.probe.log import warn
from tdbg.probe.run_info import (
    describe_run,
    place,
    rank,
    schedule_length,
    watched_optimizer,
)
from tdbg.probe.serving.commands import CommandDesk
from tdbg.probe.serving.connection import Connection
from tdbg.probe.serving.server import ProbeServer
from tdbg.probe.training import oom, script_tap, taps
from tdbg.probe.training.gradients import Layer, find_layers
from tdbg.probe.training.hooks import PhaseHooks, perf
from tdbg.probe.training.layer_facts import layer_facts
from tdbg.probe.training.metrics import MetricsDesk
from tdbg.probe.training.oom import OomWitness
from tdbg.probe.training.sampler import StepSampler
from tdbg.probe.watch_args import (
    ProbeOptions,
    caller_names,
    named,
    record_path,
    run_name,
    with_options,
)
from tdbg.protocol.messages import ProbeStats, RunInfo

# What watch() takes (watch_args.named): one model or optimizer, a list of them, or a dict that
# names them ({"netG": netG, "netD": netD}).
Models = nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module]
Optimizers = (
    torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | Mapping[str, torch.optim.Optimizer]
)

MAX_ERRORS = 100  # circuit breaker (guarantees: training thread)

_live: weakref.WeakSet[Probe] = weakref.WeakSet()
_thread_id = threading.get_ident  # one global read a step, not two lookups
# Which probe watches a module, both weakly: a probe holds its modules, so a strong value would
# keep every watched model (and its probe) alive for good, closed or dropped.
_by_model: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Probe]] = weakref.WeakKeyDictionary()


class Probe:
    """Watches one model (and optionally its optimizer) and serves what it sees.

    Call :meth:`step` once per training iteration. Everything the probe does is wrapped so that
    an error inside it is counted and reported, never raised into the training loop.
    """

    @with_options
    def __init__(self, model: Models, optimizer: Optimizers | None = None, **options: Any) -> None:
        caller = caller_names()
        models = named(model, nn.Module, "model", "model", caller)
        if not models:
            raise TypeError(
                "tdbg.watch: no model given (a torch.nn.Module, or a list or dict of them)"
            )
        optimizers = named(optimizer, torch.optim.Optimizer, "optimizer", "optimizer", caller)
        self.options = opts = ProbeOptions.of(options)
        record = record_path(opts.record)
        self.name = run_name(opts.name)
        self._init_health(opts)
        self._find_layers(models, optimizers)
        run_info, unavailable = describe_run(self.name, self._cuda_device, models, optimizers)
        self._server = self._make_server(run_info, opts, record)
        self._sampler = self._make_sampler(optimizers, opts)
        self._metrics = MetricsDesk(self._sampler.report_once, self._server.metrics_inbox)
        self._dives, desk = self._make_dives(run_info, unavailable, opts)
        # Hooks last: nothing above can leave them registered behind a failed watch().
        self._hooks = self._make_hooks(opts)
        self._lean = self._sampler.lean  # the lean step's record (lean.py): read first per step
        self._begin(opts, record, desk)

    # --- the pieces of watch(), in order ----------------------------------------------------
    def _init_health(self, opts: ProbeOptions) -> None:
        """The probe's own state: errors, the circuit breaker, closing."""
        self.errors = 0
        self.last_error: str | None = None
        self.closed = False
        self._disabled = False  # switched off by the error breaker, or closed
        self._broken = False  # switched off by the error breaker
        self._pid = os.getpid()
        self.total_steps: int | None = opts.total_steps
        self._oom_stacks = False  # whether this probe turned on the allocator's stack record
        self._console: console.Capture | None = None  # stdout/stderr captured

    def _find_layers(
        self,
        models: list[tuple[str, nn.Module]],
        optimizers: list[tuple[str, torch.optim.Optimizer]],
    ) -> None:
        """The watched layers of every model (prefixed by the model's name when there are
        several), the optimizers in lr column order, and the CUDA device the model is on."""
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
        self._layer_since = [0] * len(self._layers)  # per layer, its first step (Layers.since)
        self._gone_at: dict[int, int] = {}  # a gone layer's first step without it (gone_at)
        self._optimizer_names: dict[int, str] = {}  # names add() was given, until hooked
        cuda_params = [p for layer in self._layers for p in layer.params if p.is_cuda]
        self._cuda_device: torch.device | None = cuda_params[0].device if cuda_params else None
        if not self._layers:
            warn(
                "tdbg: the model has no parameters: only loss, learning rate and timings are shown"
            )

    def _make_server(
        self, run_info: RunInfo, opts: ProbeOptions, record: str | os.PathLike[str] | None
    ) -> ProbeServer:
        """The probe thread's side: the socket, the recording, history and alert rules."""
        # Fixed at watch(): asked again on sampled steps, so not recounted there.
        frozen = [i for i, layer in enumerate(self._layers) if not layer.trainable]
        names = [layer.name for layer in self._layers]
        numels = [layer.numel for layer in self._layers]
        recorder = None
        if record is not None:
            from tdbg.probe.serving.recorder import Recorder

            recorder = Recorder(record, run_info, names, numels)
        several = len(self._models) > 1
        return ProbeServer(
            run_info,
            names,
            numels,
            rank(),
            self._stats,
            self._count_error,
            directory=opts.directory,
            frozen=frozen,
            on_grad_device_time=self._on_grad_device_time,
            on_costs=self._on_costs,
            recorder=recorder,
            layer_models=self._layer_models if several else None,
            layer_types=[layer.module_type for layer in self._layers],
            layer_facts=layer_facts(self._layers, [opt for _, _, opt in self._optimizers]),
        )

    def _make_sampler(
        self, optimizers: list[tuple[str, torch.optim.Optimizer]], opts: ProbeOptions
    ) -> StepSampler:
        """The training thread's side: what each step measures, handed to the server."""
        sampler = StepSampler(
            self._layers,
            optimizers,
            self._cuda_device,
            self._server.handoff,
            grad_every=opts.grad_every,
            overhead_budget=float(opts.overhead_budget),
            count_error=self._count_error,
            skip_nonfinite=bool(opts.skip_nonfinite),
        )
        return sampler

    def _make_dives(
        self, run_info: RunInfo, unavailable: dict[str, str], opts: ProbeOptions
    ) -> tuple[DiveRunner, CommandDesk]:
        """Deep dives on the first model and optimizer, and the desk that takes their commands."""
        first_model = self._models[0][1]
        first_optimizer = self._optimizers[0][2] if self._optimizers else None
        dives = DiveRunner(
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
        desk = CommandDesk(dives, unavailable, None)
        self._server.take_commands(desk, bool(opts.nan_hunt))
        return dives, desk

    def _make_hooks(self, opts: ProbeOptions) -> PhaseHooks:
        """The hooks on the models and optimizers that feed the sampler."""
        hooks = PhaseHooks(
            [module for _, module in self._models],
            [opt for _, _, opt in self._optimizers],
            self._cuda_device,
            self._sampler,
            self._count_error,
        )
        # The latest forward's inputs are kept (a reference) where re-running a non-finite step's
        # forward can name the module that overflowed: with the guard, or on the CPU, where
        # the norms are read without a sync.
        hooks.capture_inputs = bool(opts.skip_nonfinite) or self._cuda_device is None
        self._server.nan_origin.reruns_forward = hooks.capture_inputs
        self._sampler.captured = lambda: hooks.last_inputs
        self._sampler.phases = hooks
        return hooks

    def _begin(
        self, opts: ProbeOptions, record: str | os.PathLike[str] | None, desk: CommandDesk
    ) -> None:
        """Attach to the loop and start serving (and recording)."""
        if self.total_steps is None and self._optimizers:
            # A scan of the heap (tens of ms): on the probe's worker thread, once, not here.
            opts_only = [opt for _, _, opt in self._optimizers]
            self._server.submit_work(lambda: self._adopt_schedule(opts_only))
        self._note_watched()
        taps.attach(self._sampler)
        if self._cuda_device is not None:
            # The out-of-memory post-mortem: nothing runs until an allocation fails.
            self._oom = OomWitness(self._oom_view, self._server.side_alerts.append)
            oom.attach(self._oom)
            self._oom_stacks = opts.wants_oom_stacks and oom.record_stacks()
        elif opts.wants_oom_stacks:
            warn("tdbg: oom_stacks needs CUDA: this run has none, no allocation stacks recorded")
        script_tap.install()  # torch.jit.script(model) works watched, as it does unwatched
        self._created = time.monotonic()
        if opts.serve or record is not None:
            # A rank of a job that mp.spawn started is expected to serve its own: not said.
            child = multiprocessing.parent_process() is not None
            if opts.serve and child and not place():
                warn("tdbg: watching from a multiprocessing child: serving its own socket")
            if self._server.start(listen=opts.serve):
                self._after_start(desk, opts.activations_every)
                kind = console.mode(opts.console)
                if kind is not None:
                    self._console = console.capture(kind)
        _live.add(self)

    def _oom_view(self) -> tuple[int, str, list[tuple[int, int, str, str]]]:
        """At an out-of-memory error: the step, where in it, and the tensors the probe names."""
        self._sampler.settle()  # a lean step's readings into the timeline read here
        hooks = self._hooks
        timeline = hooks.timeline
        if hooks.updating or timeline.optimizer_start is not None:
            phase = "in the optimizer step"
        elif timeline.forward_end is not None:
            phase = "in the backward"
        elif timeline.forward_start is not None:
            phase = "in the forward"
        else:
            phase = "between steps: loading data, evaluating, or the loop's own code"
        layers = [(layer.name, layer.params) for layer in self._layers]
        optimizers = [(name, opt) for _, name, opt in self._optimizers]
        return self._sampler.step_count, phase, list(oom.tensor_owners(layers, optimizers))

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
    def clients(self) -> tuple[Connection, ...]:
        """The clients attached now, as the probe thread last left them (a copy). Internal, for
        tests and diagnostics: which readers the probe serves, and how far behind each is."""
        return tuple(self._server.clients)

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

    def _on_costs(self, costs: list[tuple[int, float, float, bool]]) -> None:
        """From the probe thread, once a tick: its steps' costs for the interval's averages."""
        self._sampler.fold_costs(costs)

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
        step through a watched model's forward (the mean micro-batch loss when the script
        divides by the accumulation steps; see docs/usage.md for backwards aside), the
        closure's loss for ``optimizer.step(closure)``, the first optimizer's with several. A
        loss passed is shown as passed, except the very tensor backpropagated last when the
        update had several micro-batches (one of them, not the update's): then the update's,
        with a note. The micro-batches of the update are counted either way.

        ``samples`` / ``tokens``: how many this step processed, for samples/s and tokens/s.
        """
        lean = self._lean
        # A CPU run's lean step in the steady state (lean.py): handed over from its record in
        # one call below; the checks and bookkeeping before it are for the other steps.
        straight = (
            lean.on
            and lean.device_loss is None
            and lean.thread == _thread_id()
            and not self._disabled
            and not self._sampler.layout_dirty
        )
        if not straight:
            if self._disabled:
                if self._hooks.handles and not self.closed:
                    # Switched off by the circuit breaker: remove the hooks here, at a step
                    # boundary, never from inside a hook while torch iterates over them.
                    self._hooks.remove()
                    taps.detach(self._sampler)
                    self._sampler.forget_step()  # nothing of the loop's held on
                    self._lean.forget()  # its last batch neither
                    self._dives.close("the probe switched itself off")
                    self._release_console()  # nobody takes the lines any more
                return
            ident = _thread_id()
            if self._server.training_thread != ident:
                self._server.training_thread = ident  # where a stall's stack is read
                self._hooks.training_thread = ident  # whose forwards without grad are the loop's
                self._sampler.lean.thread = ident  # where a lean step's record is settled from
            if self._sampler.layout_dirty:
                try:
                    self._relayout()  # rare: kept out of the per-step cost the interval goes by
                except Exception as exc:
                    self._count_error(exc)
        sampler = self._sampler
        count = sampler.step_count
        t0 = perf()  # from here: this call is the probe's cost (its step time starts here too)
        try:
            if not straight:
                sampler.step(loss, samples, tokens, self._hooks, t0)
            elif not sampler.hand_lean_cpu_step(loss, samples, tokens, self._hooks, t0):
                # Not a lean step after all: the whole way from its record (settled here, so
                # StepSampler.step does not ask hand_lean_cpu_step again).
                sampler.settle()
                sampler.step(loss, samples, tokens, self._hooks, t0)
        except Exception as exc:
            self._count_error(exc)
            with contextlib.suppress(Exception):
                sampler.forget_step()  # the failed step's tensors are not held on
            sampler.step_failed(count, t0)  # (plain stores: it does not raise)
        if self._dives.busy:  # the one flag read per step while no command is armed
            try:
                self._dives.at_boundary(sampler.step_count - 1)
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
            caller = caller_names()
            if model is not None:
                taken = {name for name, _ in self._models}
                for name, module in named(model, nn.Module, "model", "model", caller):
                    if any(m is module for _, m in self._models):
                        continue
                    while name in taken:
                        name += "_"
                    taken.add(name)
                    self._models.append((name, module))
                    self._prefixes.append(f"{name}.")
                self.models = [name for name, _ in self._models]
            if optimizer is not None:
                for name, opt in named(optimizer, torch.optim.Optimizer, "o", "", caller):
                    self._sampler.new_optimizers.append(weakref.ref(opt))
                    if name:
                        self._optimizer_names[id(opt)] = name
            self._relayout()
        except Exception as exc:
            self._count_error(exc)

    def _adopt_schedule(self, optimizers: list[torch.optim.Optimizer]) -> None:
        total = schedule_length(optimizers)
        if total is not None and self.total_steps is None:
            self.total_steps = total

    def note_backward(self, loss: Any, inside_step: bool = False) -> None:
        """A scalar backpropagated before this probe's taps existed (``tdbg run`` starts the
        probe at the first backward): counted into the step as if the taps had seen it.
        ``inside_step``: it came from the closure of an ``optimizer.step(closure)`` already
        running (its pre-hook came before the probe did)."""
        try:
            self._sampler.settle()  # (a lean step, if one is under way: lean.py)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                if inside_step:
                    self._sampler.on_optimizer_pre(0)
                # Read after its backward (once: the taps read the later ones before theirs).
                self._sampler.on_backward(loss, taps.host_value(loss))
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

    def note_evaluation(self) -> None:
        """An evaluation of the model begins between two steps (for frameworks and loops whose
        validation may not call the watched module itself: Lightning's). Its time, up to
        :meth:`note_evaluation_end` (or the end of the last forward without grad), is the
        step's no-grad phase, not a wait on data. A forward of a watched model without grad
        marks its start by itself."""
        self._tell_hooks(self._hooks.mark_no_grad)

    def note_evaluation_end(self) -> None:
        """An evaluation between two steps has ended, metrics included (its forwards' ends are
        marked by themselves; work after the last of them, such as computing metrics, is
        marked here): what follows up to the step's forward (the next batch) is data again."""
        self._tell_hooks(self._hooks.end_no_grad)

    def _tell_hooks(self, event: Callable[[], None]) -> None:
        """A mark the loop or a framework gives the phase hooks: never raises into the loop."""
        if self._disabled:
            return
        try:
            event()
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
            self._sampler.forget_step()  # the loop's last scalar (and its graph) not held on
            # Nor its last batch: a wrapper another put over the probe's forward outlives it.
            self._lean.forget()
            if os.getpid() == self._pid:
                self._dives.close()  # the profiler stopped, hooks removed, anomaly mode off
            self._hooks.remove()
            if self._oom_stacks and os.getpid() == self._pid:
                self._oom_stacks = False
                oom.stop_stacks()  # what this probe turned on, and only that
            if os.getpid() == self._pid:
                self._release_console()
                self._server.stop()
        except Exception as exc:  # closing must never raise into the caller (or atexit)
            warn(f"tdbg: error while closing the probe: {exc}")
        _live.discard(self)

    def _release_console(self) -> None:
        """The last lines printed reach the final tick; stdout and stderr are given back when no
        other probe (nor ``tdbg run``) holds the capture."""
        held, self._console = self._console, None
        if held is not None:
            console.release(held)

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

    def _stats(self) -> ProbeStats:
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
        sampler.settle()  # a lean step so far, counted with the layers it ran on (lean.py)
        sampler.layout_dirty = False
        index_of = {layer.name: i for i, layer in enumerate(self._layers)}
        layers = list(self._layers)
        layer_models = list(self._layer_models)
        since = list(self._layer_since)
        gone_at = dict(self._gone_at)
        # The step whose row is read with the layers as they are now: this one, unless some of
        # its gradients were read already (an optimizer pre-hook ran before the change was
        # seen, at this step's probe.step()): then the next.
        first_step = sampler.step_count + (1 if sampler.sampled_this_step() else 0)
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
                    since.append(first_step)
                else:
                    if not layers[i].params:
                        since[i] = first_step  # gone, and back: no norms in between
                        gone_at.pop(i, None)
                    layers[i] = layer  # the same name, maybe new parameters: follow them
        gone = [i for i in range(len(layers)) if i not in present]
        for i in gone:
            gone_at.setdefault(i, first_step)
        for i in gone:
            layers[i] = Layer(layers[i].name, (), layers[i].module_type)
        current = {id(p) for layer in layers for p in layer.params}
        arrived = [o for o in (ref() for ref in sampler.new_optimizers) if o is not None]
        for ref in sampler.unplaced_optimizers:
            # First seen before these layers were read (a new head's optimizer): now it may be.
            late = ref()
            if late is not None and all(late is not o for o in arrived):
                if any(id(p) in current for g in late.param_groups for p in g["params"]):
                    arrived.append(late)
        sampler.unplaced_optimizers = []
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
        caller = caller_names() if arrived else {}
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
        self._layer_since, self._gone_at = since, gone_at
        sampler.rebuild(layers, optimizers)
        self._note_watched()
        self._server.relayout(
            [layer.name for layer in layers],
            [layer.numel for layer in layers],
            layer_models if len(self._models) > 1 else None,
            [name for name, _ in self._models],
            gone,
            [watched_optimizer(name, opt) for _, name, opt in optimizers],
            [layer.module_type for layer in layers],
            since,
            [gone_at[i] for i in gone],
            # Frozen now (a backbone frozen with its head replaced): a zero norm is expected.
            [i for i, layer in enumerate(layers) if layer.params and not layer.trainable],
            layer_facts(layers, [opt for _, _, opt in optimizers]),
        )

    def _after_fork_in_child(self) -> None:
        self._disabled = True
        self.closed = True
        taps.detach(self._sampler)
        self._dives.forget()
        self._hooks.remove()
        self._server.abandon_after_fork()


@with_options
def watch(model: Models, optimizer: Optimizers | None = None, **options: Any) -> Probe:
    """Start watching ``model`` (and ``optimizer``); returns at once with a serving Probe.

    ``overhead_budget``: the share of step time gradient statistics may cost (default 1 %);
    ``grad_every=k`` samples them every k steps instead (1 = every step). In a multiprocessing
    child (DataLoader workers with spawn) the probe is inert: it never starts a second server.

    Deep dives: ``nan_hunt`` hunts the first non-finite module automatically after the run's
    first non-finite alert (False: only when asked); ``anomaly_check_nan`` lets a client turn on
    anomaly mode with NaN checks, which raise inside the training loop; ``activations_every=k``
    gathers per-module activation statistics every k steps from the start.

    ``oom_stacks=True`` (or ``$TDBG_OOM_STACKS=1``) has the CUDA allocator keep each live
    allocation's Python stack, so that a CUDA out-of-memory post-mortem names the code that
    allocated its largest blocks (a stack capture on every allocation: measure it with
    ``benchmarks/gpu_cost.py``); without CUDA it is said once and ignored.

    ``record=PATH`` (or ``$TDBG_RECORD`` in the main process) appends the probe's stream to a
    crash-safe recording for ``tdbg-tui replay PATH`` / ``tdbg dump PATH`` (see
    :mod:`tdbg.probe.serving.recorder`); with ``serve=False`` it records without a socket. The first
    watch() that uses ``$TDBG_RECORD`` removes it from ``os.environ``: subprocesses started
    afterwards do not inherit it and record nothing unless given ``record=``.

    ``console`` (None: ``$TDBG_CONSOLE``, on unless ``0``): what the process writes to
    ``sys.stdout`` and ``sys.stderr`` is kept for the TUI's console screen (``j``), the recording
    and ``tdbg dump`` while the probe serves or records; each write reaches the real stream first,
    exactly as without tdbg, so a crash's last lines are never held back
    (:mod:`tdbg.probe.console_stream`). ``console="fd"`` (``TDBG_CONSOLE=fd``) tees fds 1 and 2
    instead, C-level writes and subprocesses too, at the risk of losing what is written just
    before a fatal signal or ``os._exit()`` (:mod:`tdbg.probe.console_tee`); ``False``: nothing.
    """
    modules = _modules_of(model)
    for module in modules:
        ref = _by_model.get(module)
        previous = ref() if ref is not None else None
        if previous is not None and not previous.closed:
            warn("tdbg.watch: this model was already watched; closing the earlier probe")
            previous.close()
    probe = Probe(model, optimizer, **options)
    for module in modules:
        _by_model[module] = weakref.ref(probe)
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
