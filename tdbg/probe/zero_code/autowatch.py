"""Zero-code bootstrap for ``tdbg run``: finds the model, optimizer and loss, then calls watch()."""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tdbg.probe.zero_code.group_end import ENV_RECORDER, end_group, end_group_at_exit
from tdbg.probe.zero_code.launchers import (
    ENV_LAUNCHER,
    another_rank,
    child_launcher,
    launcher_name,
    spawn_job,
    spawned_record,
    started_by,
)

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

    import torch
    from torch import nn

    from tdbg.probe.watch import Probe

ENV_ACTIVE = "TDBG_AUTOWATCH"  # "1": set by `tdbg run` for the process it starts
ENV_NAME = "TDBG_NAME"
ENV_GRAD_EVERY = "TDBG_GRAD_EVERY"
ENV_RECORD = "TDBG_RECORD"  # read by watch() itself; removed once this process's probe has it
ENV_REPORT = (
    "TDBG_RUN_REPORT"  # `tdbg run`'s directory where each watched process says where it sits
)
PRELOAD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preload")
MAX_MISSES = 10  # backward calls reaching no module's parameters before giving up
DISCOVERY_STEPS = 20  # steps after the start during which more models/optimizers are looked for


def _warn(message: str) -> None:
    # Before the probe exists its logger is not loaded: stderr directly, never stdout.
    try:
        sys.stderr.write(f"tdbg: warning: {message}\n")
        sys.stderr.flush()
    except Exception:
        pass


def install() -> None:
    """Called by the preloaded sitecustomize: arm a hook that waits for ``import torch``.

    Nothing heavy is imported here: a process that never imports torch (a helper interpreter,
    a tool) pays for one meta-path lookup per import and nothing else.
    """
    if os.environ.get(ENV_ACTIVE) != "1":
        return
    launcher = launcher_name()
    if launcher is not None:
        # `tdbg run -- torchrun ...`: the launcher trains nothing; it keeps the settings in its
        # environment so that every rank it starts (each a torchelastic worker) watches itself,
        # and says who started them (the outermost launcher: accelerate's runs torchrun's).
        os.environ.setdefault(ENV_LAUNCHER, launcher)
        return
    # This process is the one `tdbg run` started: it takes the settings meant for it, and the
    # processes the script starts (`subprocess.run([sys.executable, "eval.py"])`, spawned
    # workers, a child handed the preload anyway) never see them, so they stay inert.
    global _config, _owner
    _config = _read_config()
    _owner = os.getpid()  # a raw os.fork() before `import torch` is not the owner either
    for var in (ENV_ACTIVE, ENV_NAME, ENV_GRAD_EVERY, ENV_REPORT, ENV_LAUNCHER, ENV_RECORDER):
        os.environ.pop(var, None)
    from tdbg.probe import console

    kind = console.mode()
    if kind is not None:
        # From the start, before the script's imports: their warnings are the console's too.
        console.capture(kind, pin=True)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "optim"):
        _activate(torch)
    else:
        sys.meta_path.insert(0, _TorchFinder())


class _TorchFinder:
    """A meta-path finder that finds nothing itself: when ``torch`` is imported, it runs
    :func:`_activate` after torch's own import. (Not an ``importlib.abc`` subclass: that module
    pulls in importlib.resources, tempfile and shutil, ~10 ms at every start-up.)"""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once: every later import skips this finder
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if loader is None or exec_module is None:
            return spec

        def exec_then_activate(module: ModuleType) -> None:
            try:
                del loader.exec_module  # back to the class's own
            except AttributeError:
                pass
            exec_module(module)  # torch's own import: its errors are the script's to see
            _activate(module)

        try:
            # An attribute on this one loader instance (torch's own file loader), not its class.
            loader.exec_module = exec_then_activate
        except (AttributeError, TypeError) as exc:
            _warn(
                f"tdbg run cannot follow the import of torch ({exc}); the script runs unmonitored"
            )
        return spec


def _activate(torch: ModuleType) -> None:
    """torch is imported: claim the probe for this process and install the discovery hooks."""
    try:
        import multiprocessing  # torch imported it already: free here, not at start-up

        # only the process `tdbg run` started; forked children (the finder is inherited
        # with the memory) never claim the probe.
        if os.getpid() != _owner or multiprocessing.parent_process() is not None:
            return
        _claim(torch)
    except Exception as exc:
        _warn(f"tdbg run could not install its hooks ({exc}); the script runs unmonitored")


def _claim(torch: ModuleType) -> None:
    """This process is watched: discovery hooks, and the ranks it starts watched too."""
    global _auto
    _auto = AutoWatch(torch, _config)
    _auto.install()
    _follow_ranks(torch)
    from tdbg.probe import run_info

    # Asked when a probe starts (this one, or the script's own watch()): Lightning, which names
    # its rank 0's launcher, is imported by then.
    run_info.started_by = _started_by
    if _config.get("recorder") and not _config.get("spawned"):
        import atexit  # a spawned rank's group ends with its function (SpawnedRank)

        atexit.register(end_group_at_exit)  # see group_end: the rank must not abort at its end
    report("armed")


def _started_by() -> str | None:
    return started_by(_config)


def report(kind: str, **fields: Any) -> None:
    """Tell `tdbg run` (its report directory, when it gave one) what this process is: ``armed``
    (torch imported, looking for a model), ``watched`` (a probe runs: rank, world size, job),
    ``unwatched`` (gave up: no model). One small file per process and kind, written once;
    never raises."""
    directory = _config.get("report")
    if not directory:
        return
    try:
        import json

        path = os.path.join(directory, f"{os.getpid()}.{kind}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(dict(fields, pid=os.getpid()), out)
    except Exception:
        pass


def _follow_ranks(torch: ModuleType) -> None:
    """The ranks this process starts are watched as it is: those torch.multiprocessing starts
    (mp.spawn, start_processes: their function is wrapped, see :class:`SpawnedRank`), and the
    subprocesses started with another rank than this process's own (Lightning's launcher
    re-runs the script with LOCAL_RANK=1; a launcher script of one's own): they get the preload
    and the settings. Other children (DataLoader workers, an evaluation script, compile
    workers) stay inert. Both wrappers run when a process starts, never on a training step."""
    spawn_module = sys.modules.get("torch.multiprocessing.spawn")
    original_start = getattr(spawn_module, "start_processes", None)
    if spawn_module is not None and original_start is not None:

        @functools.wraps(original_start)
        def start_processes(fn: Any, args: Any = (), nprocs: int = 1, *rest: Any, **kw: Any) -> Any:
            try:
                config = dict(_config, launcher=child_launcher("mp.spawn"))
                wrapped = SpawnedRank(fn, nprocs, config, spawn_job())
            except Exception:
                wrapped = fn
            return original_start(wrapped, args, nprocs, *rest, **kw)

        spawn_module.start_processes = start_processes  # type: ignore[attr-defined]
        package = sys.modules.get("torch.multiprocessing")
        if getattr(package, "start_processes", None) is original_start:
            package.start_processes = start_processes  # type: ignore[union-attr]

    import subprocess

    original_init = subprocess.Popen.__init__

    @functools.wraps(original_init)
    def popen_init(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        env = kwargs.get("env")
        if env is not None:
            try:
                if not env.get(ENV_ACTIVE) and another_rank(env):  # not handed on by the script
                    kwargs["env"] = _rank_env(env)
            except Exception:
                pass
        original_init(popen, args, *rest, **kwargs)

    subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign,assignment]


def _rank_env(env: Any) -> dict[str, str]:
    """A rank's environment: the preload first on its PYTHONPATH, tdbg run's settings."""
    out = dict(env)
    previous = out.get("PYTHONPATH")
    out["PYTHONPATH"] = PRELOAD_DIR + (os.pathsep + previous if previous else "")
    out[ENV_ACTIVE] = "1"
    for var, key in ((ENV_NAME, "name"), (ENV_REPORT, "report"), (ENV_RECORD, "record")):
        if _config.get(key):
            out[var] = str(_config[key])
    if _config.get("grad_every"):
        out[ENV_GRAD_EVERY] = str(_config["grad_every"])
    out[ENV_LAUNCHER] = child_launcher("the script")
    if _config.get("recorder"):
        out[ENV_RECORDER] = "1"
    return out


def _report_watched() -> None:
    """Say to `tdbg run` where this process's probe sits in the job (never raises)."""
    try:
        from tdbg.probe import run_info

        local = run_info._env_int("LOCAL_WORLD_SIZE")
        if _config.get("spawned"):
            local = run_info._spawned.get("world_size")
        fields: dict[str, Any] = {"rank": run_info.rank(), **run_info.place()}
        per_node = run_info._env_int("SLURM_NTASKS_PER_NODE")
        launcher = started_by(_config)
        report("watched", local_world=local, tasks_per_node=per_node, launcher=launcher, **fields)
    except Exception:
        pass


class SpawnedRank:
    """A rank's function as torch.multiprocessing starts it under `tdbg run`: in the child, it
    claims the probe for that process (watched from its first backward, as the process `tdbg
    run` started is), then runs the function. Pickled by reference to this class: the child
    imports tdbg from the sys.path multiprocessing hands it."""

    def __init__(self, fn: Any, nprocs: int, config: dict[str, Any], job: str) -> None:
        self.fn = fn
        self.nprocs = nprocs
        self.config = dict(config)
        self.job = job

    def __call__(self, index: int, *args: Any) -> Any:
        try:
            self._claim(index)
        except Exception as exc:
            _warn(f"tdbg run cannot watch rank {index} ({exc}); it runs unmonitored")
        try:
            returned = self.fn(index, *args)
        finally:
            # A forked rank ends in os._exit(): no atexit, so the probe closes here (its
            # recording's last steps written, its socket removed), within its 1 s budget.
            auto = _auto
            probe = auto.probe if auto is not None and auto.pid == os.getpid() else None
            if probe is not None:
                try:
                    probe.close()
                except Exception:
                    pass
        if self.config.get("recorder"):  # returned (not raised): see group_end
            end_group()
        return returned

    def _claim(self, index: int) -> None:
        global _config, _owner, _auto
        import torch

        from tdbg.probe import run_info

        run_info.set_spawned(index, int(self.nprocs), self.job)
        if _auto is not None:  # forked from a watched process: its copy goes first
            _auto.shutdown()
            _auto = None
        _config = dict(self.config, spawned=True)
        _owner = os.getpid()
        _claim(torch)


def _read_config() -> dict[str, Any]:
    grad_every: int | None = None
    text = os.environ.get(ENV_GRAD_EVERY)
    if text:
        try:
            grad_every = max(1, int(text))
        except ValueError:
            _warn(f"{ENV_GRAD_EVERY}={text!r} is not an integer: gradient sampling is automatic")
    return {
        "name": os.environ.get(ENV_NAME) or None,
        "grad_every": grad_every,
        "record": os.environ.get(ENV_RECORD) or None,  # for the ranks this process starts
        "report": os.environ.get(ENV_REPORT) or None,
        "launcher": os.environ.get(ENV_LAUNCHER) or None,  # what started this process
        "recorder": os.environ.get(ENV_RECORDER) == "1",  # tdbg run turned the recorder on
    }


_auto: AutoWatch | None = None
_owner: int | None = None  # the pid that ran install(): the only one that may claim the probe
_config: dict[str, Any] = {
    "name": None,
    "grad_every": None,
    "record": None,
    "report": None,
    "launcher": None,
    "recorder": False,
}


class AutoWatch:
    """Discovers what a script trains and drives a :class:`~tdbg.probe.watch.Probe` for it.

    Until the first backward of a scalar that reaches a module's parameters: a global module
    forward pre-hook notes the modules called, a wrapper of ``Optimizer.__init__`` notes the
    optimizers created, global optimizer step hooks note whether a step is running (LBFGS
    evaluates its closure inside ``step()``). At that backward the root module is the outermost
    module called whose parameters received gradients (the one a user would pass to
    ``watch()``), its optimizer the one holding most of those parameters; then every global
    hook is removed and ``watch(model, optimizer)`` starts — before the first optimizer step,
    so steps are numbered as in a script that calls ``watch()`` itself.

    From then on the cost per step is one wrapper around ``torch.autograd.backward`` (remember
    the scalar, detached: no sync; with AMP, one around ``GradScaler.scale`` that maps the scaled
    tensor back to the loss) and one optimizer step pre- and post-hook; the post-hook
    calls ``probe.step(loss)``. Without an optimizer (manual updates), ``probe.step(loss)``
    follows each backward of a scalar.
    """

    def __init__(self, torch: Any, config: dict[str, Any]) -> None:
        self.torch = torch
        self.config = config
        self.pid = os.getpid()
        self.off = False
        self._dead = False  # failed: remove everything at the next safe point
        self.probe: Probe | None = None
        self.model: nn.Module | None = None
        self.models: list[Any] = []  # every model watched (a GAN's two)
        self.optimizer: torch.optim.Optimizer | None = None
        self._seen: dict[int, weakref.ref[nn.Module]] = {}
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._global: list[Any] = []  # RemovableHandles of the global discovery hooks
        self._own: list[Any] = []  # the watched optimizers' step hooks
        self._watched: list[Any] = []  # the optimizers watched, in the order they were found
        self._stepped: set[int] = set()  # ids of those that stepped in the current round
        self._discovering = False  # after the start: a second model or optimizer may show up
        self._in_step = False
        # The probe watches the model and its optimizer: its own taps see every backward from
        # then on, and this wrapper has nothing left to do (it ran after each one, where the
        # loop's caches are cold: a detach there cost microseconds a step).
        self._settled = False
        self._loss: Any = None  # the last scalar backpropagated outside optimizer.step()
        self._closure_loss: Any = None  # the first one inside it (what step(closure) returns)
        self._misses = 0
        # AMP: (weakref to what GradScaler.scale() last returned, the loss it was given).
        self._scaled: tuple[weakref.ref[Any], Any] | None = None
        self._scaled_many: Any = None  # taps.ScaledLosses, made at the first scale()
        # An update before any backward of a scalar (torch.autograd.grad): the model and
        # optimizer to watch from that optimizer's next update, weakly.
        self._pending: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None
        self._backward_seen = False  # any backward at all (one with a gradient argument too)
        # What this replaced in torch, by name: (owner, attribute, its wrapper, the original).
        self._patches: dict[str, tuple[Any, str, Any, Any]] = {}
        # The DataLoader started last before the probe exists (a weak reference, its dataset's
        # id): the probe starts at the first backward, after the first pass over the data
        # began, which its own tap cannot see (that pass is epoch 0, not epoch "unknown" with
        # the next pass called 0).
        self._last_loader: tuple[weakref.ref[Any], int] | None = None

    def _scaled_losses(self) -> Any:
        """GradScaler's scaled tensors and their losses, for a backward of several at once."""
        if self._scaled_many is None:
            from tdbg.probe.training.taps import ScaledLosses

            self._scaled_many = ScaledLosses()
        return self._scaled_many

    # --- installation and removal -------------------------------------------------------------
    def install(self) -> None:
        torch = self.torch
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optimizer_mod

        self._global.append(module_mod.register_module_forward_pre_hook(self._on_forward))
        self._global.append(optimizer_mod.register_optimizer_step_pre_hook(self._on_step_pre))
        self._global.append(optimizer_mod.register_optimizer_step_post_hook(self._on_step_post))

        original_init = torch.optim.Optimizer.__init__
        optimizers = self._optimizers

        @functools.wraps(original_init)
        def optimizer_init(opt: Any, *args: Any, **kwargs: Any) -> None:
            original_init(opt, *args, **kwargs)
            try:
                optimizers.add(opt)
                if self.probe is not None and self.optimizer is None:
                    self._late_optimizer(opt)
            except Exception:
                pass

        self._patch("init", torch.optim.Optimizer, "__init__", optimizer_init, original_init)

        # Tensor.backward() calls torch.autograd.backward(): one wrapper sees both spellings.
        original_backward = torch.autograd.backward

        @functools.wraps(original_backward)
        def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
            out = original_backward(tensors, grad_tensors, *args, **kwargs)
            if not self.off:
                if not self._settled:  # once the probe watches, its own taps see backwards
                    self._backward_seen = True
                    if grad_tensors is None:
                        self._after_backward(tensors)
            elif self._dead:
                self._dead = False
                try:
                    self.shutdown()
                except Exception:
                    pass
            return out

        self._patch("backward", torch.autograd, "backward", backward, original_backward)
        self._wrap_scale()
        self._wrap_loader_iter()
        os.register_at_fork(after_in_child=self._after_fork)

    def _wrap_scale(self) -> None:
        """AMP: ``scaler.scale(loss).backward()`` backpropagates loss × scale (65536 by default,
        changed by ``scaler.update()``). The wrapper remembers which tensor ``scale()`` returned
        for which loss, so the loss reported is the script's own. One wrapper on the base class:
        ``torch.cuda.amp.GradScaler`` and ``torch.cpu.amp.GradScaler`` subclass it without
        overriding ``scale``."""
        amp = getattr(self.torch, "amp", None)
        scaler_class = getattr(amp, "GradScaler", None)
        original_scale = getattr(scaler_class, "scale", None)
        if scaler_class is None or original_scale is None:
            return

        @functools.wraps(original_scale)
        def scale(scaler: Any, outputs: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_scale(scaler, outputs, *args, **kwargs)
            if not self.off and out is not outputs:
                try:
                    if isinstance(outputs, self.torch.Tensor):
                        self._scaled = (weakref.ref(out), outputs.detach())  # a view: no sync
                    if not self._settled:  # the probe's taps keep their own since
                        self._scaled_losses().note(outputs, out)  # for backward([a, b])
                except Exception:
                    self._scaled = None
            return out

        self._patch("scale", scaler_class, "scale", scale, original_scale)

    def _wrap_loader_iter(self) -> None:
        """Note the DataLoader started last, until the probe starts (one call per pass)."""
        from torch.utils.data import DataLoader

        original_iter = DataLoader.__iter__

        @functools.wraps(original_iter)
        def loader_iter(loader: Any) -> Any:
            if not self.off and self.probe is None:
                try:  # weakly: a script that never backpropagates keeps nothing alive
                    dataset = id(getattr(loader, "dataset", None))
                    self._last_loader = (weakref.ref(loader), dataset)
                except TypeError:
                    pass
            return original_iter(loader)

        self._patch("loader_iter", DataLoader, "__iter__", loader_iter, original_iter)

    def _restore_loader_iter(self) -> tuple[weakref.ref[Any], int] | None:
        """Put DataLoader.__iter__ back (before the probe's own tap wraps it); returns what it
        noted of the loader started last meanwhile (a weak reference, its dataset's id)."""
        self._unpatch("loader_iter")
        last, self._last_loader = self._last_loader, None
        return last

    def _patch(self, key: str, owner: Any, name: str, wrapper: Any, original: Any) -> None:
        setattr(owner, name, wrapper)
        self._patches[key] = (owner, name, wrapper, original)

    def _unpatch(self, key: str) -> None:
        """Put back what ``key`` replaced, unless something wrapped it since (a script's own
        ``watch()``: its taps wrap torch.autograd.backward, GradScaler.scale and
        DataLoader.__iter__ over these). Then this wrapper stays in their chain, passing
        calls through (``self.off``), and theirs stays too."""
        patch = self._patches.pop(key, None)
        if patch is None:
            return
        owner, name, wrapper, original = patch
        if getattr(owner, name, None) is wrapper:
            setattr(owner, name, original)

    def _remove_global(self) -> None:
        """The discovery hooks go once the probe exists: none is left early-returning."""
        for handle in self._global:
            handle.remove()
        self._global.clear()
        self._seen.clear()

    def _restore_init(self) -> None:
        self._unpatch("init")

    def shutdown(self) -> None:
        """Remove everything this installed; the probe (if any) closes at exit as usual."""
        self.off = True
        self._remove_global()
        for handle in self._own:
            handle.remove()
        self._own.clear()
        self._restore_init()
        self._restore_loader_iter()
        self._unpatch("backward")
        self._unpatch("scale")
        self._scaled = None

    def _after_fork(self) -> None:
        # A forked child (DataLoader worker) never starts or feeds a probe: one flag, no
        # dict changes (the fork may have happened inside a hook's iteration).
        self.off = True

    def _fail(self, exc: BaseException) -> None:
        # Called from inside hooks, maybe while torch iterates over them: only a flag here; the
        # hooks are removed at the next backward (see install()), outside any hook dispatch.
        self.off = True
        self._dead = True
        _warn(f"tdbg run: internal error, monitoring stops (training continues): {exc!r}")

    # --- discovery hooks ------------------------------------------------------------------------
    def _on_forward(self, module: Any, args: Any) -> None:
        if self.off:
            return
        key = id(module)
        ref = self._seen.get(key)
        if ref is not None:
            if ref() is module:
                return
            # A module freed since (a throwaway model) whose address this one reuses: this one
            # is new, and goes last, in the order of first calls.
            del self._seen[key]
        try:
            self._seen[key] = weakref.ref(module)
        except TypeError:
            pass

    def _on_step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_step = True
        self._closure_loss = None
        try:
            self._optimizers.add(optimizer)
            if self.off:
                return
            if self._discovering and self.probe is not None:
                self._maybe_add(optimizer)
            elif self.probe is None and os.getpid() == self.pid:
                if self._pending is None:
                    self._note_update_without_backward(optimizer)
                elif self._pending[1]() is optimizer:
                    self._start_pending()
        except Exception as exc:
            self._fail(exc)

    def _note_update_without_backward(self, optimizer: Any) -> None:
        """An update before any backward of a scalar: a loop that takes its gradients with
        ``torch.autograd.grad`` (or ``torch.func``) and sets ``.grad`` itself. If a called
        module has gradients and this optimizer holds its parameters, that is the model: the
        probe starts at the same optimizer's next update, in this same global pre-hook, so the
        second update is step 0 (its own step hooks, registered then, run for it). Starting
        here would add the taps' global pre-hook while torch iterates them (a RuntimeError in
        the script's step): they are installed at this update's end (``_on_step_post``).
        Not at a forward: it may be inside ``torch.func.functional_call`` (stand-ins for the
        parameters) or inside a graph dynamo traces. Without gradients (an update before
        training starts, LBFGS before its closure) it waits, as before, for a backward."""
        model, chosen = self._choose()
        if model is None or chosen is not optimizer:
            return
        self._pending = (weakref.ref(model), weakref.ref(optimizer))

    def _start_pending(self) -> None:
        """The second update without backward: watch what the first showed. Inside torch's
        loop over the global step pre-hooks: nothing here may add or remove one."""
        from tdbg.probe.training import taps

        if not taps.installed():
            return  # the last update raised before its end installed them: at the next one
        pending, self._pending = self._pending, None
        if pending is None:
            return
        model, optimizer = pending[0](), pending[1]()
        if model is None or optimizer is None:
            return
        if self._script_watches():
            # Its own probe is the run's. Removing the global hooks now would change the
            # dict torch iterates: they stay, inert (off), and go at a later backward if any.
            os.environ.pop(ENV_RECORD, None)
            self.off = True
            self._dead = True
            _report_watched()
            return
        self._start((model, optimizer))
        if self.probe is None:
            return
        how = "backward(gradient)" if self._backward_seen else "torch.autograd.grad?"
        self.probe._sampler.report_once(  # on stderr and as an alert
            "no-backward",
            f"the model is updated without a backward() of its loss ({how}): tdbg run shows "
            "its gradients and learning rates, not its loss; call tdbg.watch(model, optimizer) "
            "and probe.step(loss) in the script to see it",
        )

    def _on_step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_step = False
        self._closure_loss = None
        if self._pending is not None and not self.off:
            try:
                # The probe's taps add a global step pre-hook: added now (torch is iterating
                # the post-hooks), not while the next update's pre-hooks are being iterated.
                from tdbg.probe.training import taps

                taps.install_early()
            except Exception as exc:
                self._fail(exc)

    # --- loss capture and steps ------------------------------------------------------------------
    def _after_backward(self, tensors: Any) -> None:
        try:
            tensor = tensors
            if not isinstance(tensor, self.torch.Tensor):
                if not isinstance(tensor, list | tuple) or not tensor:
                    return
                if len(tensor) > 1:
                    from tdbg.probe.training.taps import summed_scalars

                    # backward([a, b]) of a multi-task loop: one backward of their sum (of
                    # the losses GradScaler scaled, where it did).
                    scaled = self._scaled_losses()
                    tensor = summed_scalars(tensor, scaled.unscaled)
                    scaled.clear()
                    self._scaled = None
                else:
                    tensor = tensor[0]
                if not isinstance(tensor, self.torch.Tensor):
                    return
            if tensor.numel() != 1:
                return  # backward(gradient) of a non-scalar: not a loss
            scaled = self._scaled
            if scaled is not None and scaled[0]() is tensor:
                self._scaled = None
                loss = scaled[1]  # GradScaler.scale()'s input: the loss before scaling
            else:
                loss = tensor.detach()  # a view: no copy, no sync
            if self._in_step:
                if self._closure_loss is None:
                    self._closure_loss = loss
            else:
                self._loss = loss
            probe = self.probe
            if probe is None:
                if os.getpid() != self.pid:
                    self.off = True
                    return
                self._start()
                probe = self.probe
                if probe is None:
                    return
                # The probe's own backward tap starts after this backward: hand it this one.
                probe.note_backward(loss, inside_step=self._in_step and self.optimizer is not None)
            if self.optimizer is None:
                self._loss = None
                probe.step(loss)
        except Exception as exc:
            self._fail(exc)

    def _on_own_step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_step = True
        self._closure_loss = None

    def _on_own_step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.off or self.probe is None:
            return
        try:
            self._in_step = False
            self._closure_loss = None
            self._loss = None
            # One step per round: when every watched optimizer has stepped (a GAN's D then G).
            self._stepped.add(id(optimizer))
            if not all(id(o) in self._stepped for o in self._watched):
                return
            self._stepped.clear()
            # The probe saw what was backpropagated for this update (its taps): the sum over
            # accumulated micro-batches, or the closure's loss.
            self.probe.step()
            if self._discovering and self.probe.steps >= DISCOVERY_STEPS:
                # Before torch iterates the global post hooks: removing them now is safe.
                self._discovering = False
                self._remove_global()
        except Exception as exc:
            self._fail(exc)

    # --- choosing the model and starting the probe -----------------------------------------------
    def _script_watches(self) -> bool:
        """The script called ``tdbg.watch()`` itself: a live probe that is not this one's."""
        watching = sys.modules.get("tdbg.probe.watch")
        return watching is not None and any(not p.closed for p in list(watching._live))

    def _start(self, chosen: tuple[Any, Any] | None = None) -> None:
        self._pending = None  # a backward came first after all: that start is this one
        if self._script_watches():
            # The script calls watch() itself: its probe is the run's; a second one on the same
            # model would close it.
            os.environ.pop(ENV_RECORD, None)  # its probe has read it (see below)
            self.shutdown()
            _report_watched()
            return
        model, optimizer = chosen if chosen is not None else self._choose()
        if model is None:
            self._misses += 1
            if self._misses >= MAX_MISSES:
                _warn(
                    "tdbg run: no module called with torch.nn.Module.__call__ received gradients "
                    f"in {MAX_MISSES} backward calls; the script runs unmonitored"
                )
                report("unwatched")
                self.shutdown()
            return
        import tdbg

        if optimizer is None:
            self._remove_global()
        else:
            # Kept for a few steps: a second model and optimizer (a GAN) show up at their first
            # step; then removed, so that a long run pays nothing for discovery.
            self._discovering = True
            self._restore_init()  # an optimizer mode probe needs no later optimizers
        self.model, self.optimizer = model, optimizer
        self.models = [model]
        loader = self._restore_loader_iter()
        try:
            self.probe = tdbg.watch(
                model,
                optimizer,
                name=self.config["name"],
                grad_every=self.config["grad_every"],
                record=spawned_record(self.config),
            )
            _report_watched()
        finally:
            # The recording is this process's: a script's child that calls watch() itself must
            # not write a second one (watch() reads TDBG_RECORD, which children inherit).
            os.environ.pop(ENV_RECORD, None)
        if loader is not None:
            # As if the probe's tap had seen that pass start: its first step adopts it.
            self.probe._sampler.loader_started(*loader)
        if optimizer is not None:
            # Registered after the probe's own hooks: at each step the probe has read the
            # gradients (its pre-hook) and timed the optimizer (its post-hook) before step().
            self._hook_optimizer(optimizer)
            self._settled = self.probe is not None
            if self.probe is not None:
                self.probe._sampler.optimizer_seen = self._on_new_optimizer

    def _on_new_optimizer(self, optimizer: Any) -> None:
        """The probe's tap saw an optimizer it does not watch, at its first step. After the
        discovery steps one that trains the watched model (fine-tuning's new head, a second
        phase's optimizer) is followed by the probe, but tdbg run counts steps at the updates
        of the optimizers it found, which may never step again: say so, once, rather than
        let the run look stalled."""
        if self.off or self._discovering or self.probe is None:
            return  # while discovering, the global step hooks find a second model's
        try:
            if any(o is optimizer for o in self._watched) or not self._trains_a_model(optimizer):
                return
            found = ", ".join(type(o).__name__ for o in self._watched)
            self.probe._sampler.report_once(
                "late-optimizer",
                f"a new {type(optimizer).__name__} trains the watched model at step "
                f"{self.probe.steps} (after tdbg run's first {DISCOVERY_STEPS} steps): tdbg run "
                f"counts steps at the updates of the {found} it found, and they stop if that "
                "no longer steps; call tdbg.watch(model, optimizer) in the script to follow a "
                "new optimizer",
            )
        except Exception:  # a warning's failure must not stop monitoring
            pass

    def _hook_optimizer(self, optimizer: Any) -> None:
        from tdbg.probe.training.hook_refs import WeakHook

        self._watched.append(optimizer)
        self._own.append(optimizer.register_step_pre_hook(WeakHook(self._on_own_step_pre)))
        self._own.append(optimizer.register_step_post_hook(WeakHook(self._on_own_step_post)))

    def _maybe_add(self, optimizer: Any) -> None:
        """An optimizer stepping that is not watched: if it updates another called model (the
        generator of a GAN), watch both. Runs in torch's global pre-step hook, before the
        optimizer's own hooks are iterated: hooking it here takes effect for this very step."""
        if any(o is optimizer for o in self._watched) or self.probe is None:
            return
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        watched = {id(p) for m in self._models() for p in m.parameters()}
        if not held or held & watched:
            return  # a replacement of a watched one: the probe follows that itself
        model = self._owner_of(held)
        if model is None:
            return
        self.probe.add(model, optimizer)
        self.models.append(model)
        # The round so far counts as done for the others: the step ends after this one.
        self._stepped = {id(o) for o in self._watched}
        self._hook_optimizer(optimizer)

    def _models(self) -> list[Any]:
        return list(self.models)

    def _owner_of(self, held: set[int]) -> Any:
        """The outermost module called whose parameters ``held`` holds most of."""
        modules = [m for ref in self._seen.values() if (m := ref()) is not None]
        inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
        best, most = None, 0
        for module in modules:
            if id(module) in inner:
                continue
            count = sum(1 for p in module.parameters() if id(p) in held)
            if count > most:
                best, most = module, count
        return best

    def _choose(self) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
        """The outermost module called whose parameters got gradients, and its optimizer."""
        modules = [m for ref in self._seen.values() if (m := ref()) is not None]
        inner: set[int] = set()
        for module in modules:
            for sub in module.modules():
                if sub is not module:
                    inner.add(id(sub))
        best: nn.Module | None = None
        best_key = (0, 0)
        for module in modules:
            if id(module) in inner:
                continue
            params = list(module.parameters())  # deduplicated: shared weights count once
            with_grad = sum(1 for p in params if p.grad is not None)
            key = (with_grad, len(params))
            if with_grad and key > best_key:  # ties: the first called
                best, best_key = module, key
        if best is None:
            return None, None
        ids = {id(p) for p in best.parameters()}
        optimizer = None
        most = 0
        for opt in list(self._optimizers):
            held = sum(1 for g in opt.param_groups for p in g["params"] if id(p) in ids)
            if held > most:
                optimizer, most = opt, held
        return best, optimizer

    def _trains_a_model(self, optimizer: Any) -> bool:
        """``optimizer`` holds a parameter of a watched model."""
        ids = {id(p) for m in self._models() for p in m.parameters()}
        return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])

    def _late_optimizer(self, optimizer: Any) -> None:
        """An optimizer created after the probe started without one: say so, once."""
        if self._trains_a_model(optimizer):
            _warn(
                "tdbg run: an optimizer of the model was created after its first backward; "
                "the run is shown as manual updates (a step per backward, no learning rate)"
            )
            self._restore_init()
