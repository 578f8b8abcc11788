"""``tdbg run``: start a training script with the probe preloaded, without editing it.

The launcher never imports torch: it prepends ``tdbg/probe/zero_code/preload`` (a
``sitecustomize``) to the child's PYTHONPATH, starts the child, forwards signals to it and exits
with its code. The child does the rest (:mod:`tdbg.probe.zero_code.autowatch`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from tdbg.cli.args import positive_int
from tdbg.cli.errors import CliError
from tdbg.model.unwatched import UNWATCHED_AFTER, unwatched

# The preload lives with the probe it starts; found by path so the launcher never imports the probe.
PRELOAD_DIR = Path(__file__).resolve().parent.parent / "probe" / "zero_code" / "preload"
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
SI_KERNEL = 0x80  # Linux si_code of a signal the kernel sent: a terminal's ^C, ^\ or hangup
PYTHON = re.compile(r"python[0-9.]*$")

DESCRIPTION = (
    "Run a training script with the tdbg probe preloaded, without editing it: the probe finds "
    "the model, the optimizer and the loss as the script trains, and serves them as watch() "
    "does (attach with tdbg-tui or tdbg dump). Arguments, exit code, stdout/stderr and signals "
    "pass through."
)
EPILOG = (
    "Forms: tdbg run [options] -- python train.py ARGS; tdbg run [options] train.py ARGS (this "
    "interpreter); tdbg run [options] -m module ARGS. Exit status: the script's own, 128+N when "
    "it was killed by signal N, 2 when it cannot be started."
)


def add_run_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``tdbg run`` on the subparsers of the ``tdbg`` parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="run a training script with the probe preloaded (no code change)",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    p.add_argument("--name", help="the run's name in the TUI (default: the script's name)")
    p.add_argument(
        "--record", metavar="PATH", help="record the probe's stream to PATH (sets TDBG_RECORD)"
    )
    p.add_argument(
        "--grad-every",
        type=positive_int,
        metavar="K",
        help="gradient norms every K steps (default: automatic, within a 1 %% budget)",
    )
    p.add_argument(
        "--oom-stacks",
        action="store_true",
        help=(
            "have the CUDA allocator keep each allocation's Python stack, so that an "
            "out-of-memory post-mortem names the code behind its largest blocks (sets "
            "TDBG_OOM_STACKS=1; costs a stack capture per allocation)"
        ),
    )
    # REMAINDER on -m: everything after the module is the module's, options included.
    p.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        metavar="MODULE ARGS",
        help="MODULE [ARGS]: run a module with this interpreter, as python -m does",
    )
    p.add_argument(
        "child",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ARGS",
        help="python train.py ARGS, or train.py ARGS (run with this interpreter)",
    )
    p.set_defaults(func=cmd_run)
    return p


def child_argv(module: list[str] | None, command: list[str]) -> tuple[str, list[str]]:
    """(executable path, argv) of the child, or CliError naming what cannot be started."""
    if module is not None:
        # argparse stops -m's REMAINDER at a "--" and hands the rest to `command`, "--" included.
        words = module + command
        if not words:
            raise CliError("-m: name a module, e.g. tdbg run -m mypkg.train")
        _check_module_name(words[0])
        _check_module(words[0])
        return sys.executable, [sys.executable, "-m", *words]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise CliError("nothing to run; e.g. tdbg run -- python train.py ARGS, or -m module")
    first = command[0]
    if not first.strip():
        raise CliError("the command is empty; e.g. tdbg run -- python train.py ARGS")
    if first == "-m":
        return child_argv(command[1:], [])
    if first.startswith("-"):
        raise CliError(f"unknown option {first} (the command goes after --)")
    if first.endswith(".py") or (os.path.isfile(first) and not os.access(first, os.X_OK)):
        _check_script(first)
        return sys.executable, [sys.executable, *command]
    executable = shutil.which(first)
    if executable is None:
        raise CliError(f"command not found: {first}")
    if PYTHON.match(os.path.basename(first)) and len(command) > 1:
        script = command[1]
        if script == "-m":  # another interpreter's path: its module is not looked for here
            _check_module_name(command[2] if len(command) > 2 else "")
        elif not script.startswith("-"):
            _check_script(script)
    return executable, command


def _check_module_name(name: str) -> None:
    """``-m NAME`` must be a module name python -m can run: not empty, not relative, no empty
    part (python's own refusal would come from the child, exit 1, as a traceback-like line)."""
    if not name.strip():
        raise CliError("-m: the module name is empty; e.g. tdbg run -m mypkg.train")
    if name.startswith("."):
        raise CliError(f"-m: relative module names are not supported: {name}")
    if "" in name.split(".") or name != name.strip():
        raise CliError(f"-m: not a module name: {name!r}")


def _check_module(name: str) -> None:
    """The top-level package of ``-m NAME`` must exist where python -m will look: the current
    directory first, then this interpreter's path (nothing is imported to find out)."""
    from importlib.machinery import PathFinder

    top = name.split(".", 1)[0]
    if not top or top in sys.builtin_module_names:
        return
    if PathFinder.find_spec(top, [os.getcwd(), *sys.path[1:]]) is None:
        raise CliError(f"no module named {top}")


def _check_script(path: str) -> None:
    if not path.strip():
        raise CliError("the script's path is empty; e.g. tdbg run -- python train.py ARGS")
    if not os.path.exists(path):
        raise CliError(f"no such script: {path}")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "__main__.py")):
        raise CliError(f"{path} is a directory without __main__.py")


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """The child's environment: the preload first on PYTHONPATH, the probe's settings."""
    env = dict(os.environ)
    previous = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(PRELOAD_DIR) + (os.pathsep + previous if previous else "")
    env["TDBG_AUTOWATCH"] = "1"  # the child takes it out of its environment (autowatch.install)
    # PyTorch's flight recorder (the last collectives of each process group): read by a rank's
    # probe only when it stalls, to say which collective it waits in. Left alone if set; when
    # tdbg turns it on, the ranks also destroy their group before their interpreter ends
    # (tdbg/probe/zero_code/group_end.py: with it, a collective left in flight aborted more).
    if "TORCH_FR_BUFFER_SIZE" not in env:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
        env["TDBG_FLIGHT_RECORDER"] = "1"
    if args.name is not None:
        if not args.name.strip():
            raise CliError("--name is empty")
        env["TDBG_NAME"] = args.name
    if args.grad_every is not None:
        env["TDBG_GRAD_EVERY"] = str(args.grad_every)
    if getattr(args, "oom_stacks", False):
        env["TDBG_OOM_STACKS"] = "1"  # read by watch() in each process it starts in
    if args.record:
        record = Path(args.record).expanduser().absolute()  # the child may chdir
        if not record.parent.is_dir():
            raise CliError(f"--record: no such directory: {record.parent}")
        if record.is_dir():
            raise CliError(f"--record: {record} is a directory")
        env["TDBG_RECORD"] = str(record)
    return env


def cmd_run(args: argparse.Namespace, out: TextIO) -> int:
    executable, argv = child_argv(args.module, args.child)
    if not (PRELOAD_DIR / "sitecustomize.py").is_file():
        raise CliError(f"the preload is missing from this install ({PRELOAD_DIR})")
    env = child_env(args)
    coverage = Coverage()
    env["TDBG_RUN_REPORT"] = coverage.directory
    try:
        if hasattr(signal, "sigtimedwait"):
            return _run_forwarding(executable, argv, env, coverage.tick)
        return _run_with_handlers(executable, argv, env)  # macOS: no sigtimedwait
    finally:
        coverage.finish()


class Coverage:
    """What the job's processes said they watch, so that a rank left unwatched, or a run where
    no model was found, is said once on stderr rather than silently.

    Each process the preload arms writes a small file in a private directory (``TDBG_RUN_REPORT``):
    ``PID.armed`` (torch imported), ``PID.watched`` (its probe started: rank, world size, job,
    local world size), ``PID.unwatched`` (it gave up and said so). Read here about once a second
    while the job runs, and at its end; removed with the directory at the end."""

    GRACE = UNWATCHED_AFTER  # s after the first rank's probe: the others start theirs too

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="tdbg-run-")  # mode 0700
        # `srun tdbg run ...`: this tdbg run is one task of a job, and sees only its own ranks.
        self.inside = any(os.environ.get(v) for v in ("RANK", "SLURM_PROCID"))
        self.first: float | None = None
        self.said = False
        self.last_read = 0.0

    def _read(self) -> dict[str, list[dict[str, Any]]]:
        import json

        found: dict[str, list[dict[str, Any]]] = {"armed": [], "watched": [], "unwatched": []}
        try:
            names = os.listdir(self.directory)
        except OSError:
            return found
        for name in names:
            kind = name.rpartition(".")[2]
            if kind not in found:
                continue
            try:
                with open(os.path.join(self.directory, name)) as f:
                    found[kind].append(json.load(f))
            except (OSError, ValueError):
                continue
        return found

    def tick(self) -> None:
        now = time.monotonic()
        if self.said or now - self.last_read < 1.0:
            return
        self.last_read = now
        found = self._read()
        if not any(w.get("world_size", 0) > 1 for w in found["watched"]):
            return
        if self.first is None:
            self.first = now
        if now - self.first >= self.GRACE:
            self._say_missing(found["watched"])

    def finish(self) -> None:
        try:
            found = self._read()
            if not self.said:
                if found["watched"]:
                    self._say_missing(found["watched"])
                elif found["armed"] and not found["unwatched"]:
                    self._say(
                        "tdbg run: no model was found (no backward reached a module's "
                        "parameters): nothing was watched"
                    )
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _say_missing(self, watched: list[dict[str, Any]]) -> None:
        for line in missing_ranks(watched, self.inside):
            self._say(line)

    def _say(self, line: str) -> None:
        self.said = True
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def missing_ranks(watched: list[dict[str, Any]], inside: bool = False) -> list[str]:
    """One line per job of which fewer ranks are watched (on this machine) than it has, in the
    words the job screen says it: ``rank 1 of 2 is not watched: started by mp.spawn``.
    ``inside``: this tdbg run is itself one task of the job (srun tdbg run): it expects only the
    ranks a launcher it runs starts (LOCAL_WORLD_SIZE), else one."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for info in watched:
        if isinstance(info.get("world_size"), int) and info["world_size"] > 1:
            jobs.setdefault(str(info.get("job") or "?"), []).append(info)
    lines = []
    for job, ranks in sorted(jobs.items()):
        world = max(r["world_size"] for r in ranks)
        seen = {r["rank"] for r in ranks if isinstance(r.get("rank"), int)}
        launcher = next((r["launcher"] for r in ranks if r.get("launcher")), None)
        local = max((r.get("local_world") or 0) for r in ranks)
        if not local:
            local = 1 if inside else max((r.get("tasks_per_node") or 0) for r in ranks)
        expected = local if 0 < local < world else world
        if len(seen) >= expected:
            continue
        if expected == world:
            line = unwatched([r for r in range(world) if r not in seen], world, launcher)
        else:  # one node of a bigger job: its local ranks
            local_seen = {r.get("local_rank") for r in ranks}
            absent = [r for r in range(expected) if r not in local_seen]
            if len(absent) != expected - len(seen):  # local ranks not said: which is unknown
                absent = list(range(len(seen), expected))
            line = unwatched(absent, expected, launcher, "local rank")
        lines.append(f"tdbg run: {line} (job {job}; docs/distributed.md#launchers)")
    return lines


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


# Python ignores SIGPIPE and SIGXFSZ for itself; the child gets the defaults, as subprocess
# gives them (restore_signals).
_RESTORED = tuple(getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, n))


def _run_forwarding(executable: str, argv: list[str], env: dict[str, str], tick: Any = None) -> int:
    """Start the child with the forwarded signals blocked here and waited for synchronously.

    ``sigtimedwait`` tells who sent a signal: one the terminal sent to the foreground process
    group (``si_code`` SI_KERNEL: ^C, ^\\, hangup) already reached the child, which shares our
    group, so only signals sent to this process alone are forwarded — the child never gets a
    ^C twice.
    """
    waited = (*FORWARDED, signal.SIGCHLD)
    previous_chld = signal.signal(signal.SIGCHLD, lambda *_: None)  # never discarded
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        try:
            pid = os.posix_spawn(executable, argv, env, setsigmask=old_mask, setsigdef=_RESTORED)
        except OSError as exc:
            raise CliError(f"cannot start {argv[0]}: {exc.strerror}") from None
        while True:
            info = signal.sigtimedwait(waited, 1.0)
            if tick is not None:
                try:
                    tick()
                except Exception:  # telling what is watched never stops the job
                    pass
            if info is None or info.si_signo == signal.SIGCHLD:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    return _exit_code(status)
                continue
            if info.si_code == SI_KERNEL:
                continue
            try:
                os.kill(pid, info.si_signo)
            except ProcessLookupError:
                pass  # exited meanwhile: the next SIGCHLD reaps it
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGCHLD, previous_chld)


def _run_with_handlers(executable: str, argv: list[str], env: dict[str, str]) -> int:
    """Fallback without ``sigtimedwait``: forward by handlers; ^C and ^\\ from the terminal
    reach the child directly, so those two are ignored here rather than sent twice."""
    try:
        pid = os.posix_spawn(executable, argv, env, setsigdef=_RESTORED)
    except OSError as exc:
        raise CliError(f"cannot start {argv[0]}: {exc.strerror}") from None

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    previous = {}
    for sig in FORWARDED:
        ignore = sig in (signal.SIGINT, signal.SIGQUIT)
        previous[sig] = signal.signal(sig, signal.SIG_IGN if ignore else forward)
    try:
        _, status = os.waitpid(pid, 0)  # retried after each handler (PEP 475)
        return _exit_code(status)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
