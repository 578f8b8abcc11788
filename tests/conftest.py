"""Shared fixtures: a private runtime directory per test, and no probe outliving its test."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import signal
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# The suite mirrors the package (tests/probe, tests/tui, ...) without __init__ files: pytest puts
# each test's own folder on sys.path as it collects it, and this puts them all there first, so a
# test that borrows another folder's helper (the TUI's replay tests record as the recording
# tests do) imports it whichever subset runs.
_TESTS = Path(__file__).resolve().parent
sys.path[1:1] = [str(d) for d in sorted(_TESTS.iterdir()) if any(d.glob("test_*.py"))]

from waiting import TIMEOUT, wait_until  # noqa: E402

# The console capture (on by default: watch() tees sys.stdout and sys.stderr; TDBG_CONSOLE=fd tees
# fds 1 and 2) would tee pytest's own capture, which pytest swaps under it at each test: the
# suite's in-process probes leave it off; the console tests run theirs in subprocesses with the
# variable unset, as users do (tests/probe/test_console*.py, tests/tui/test_tui_console_live.py).
os.environ["TDBG_CONSOLE"] = "0"

if TYPE_CHECKING:
    import torch

    from tdbg.probe.watch import Probe
    from tdbg.protocol.messages import RunInfo


_RUNTIME = pytest.StashKey[Path]()  # this process's default runtime directory


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes seconds (spawned interpreters); -m 'not slow'")
    # Started in the background by a shell without job control (`make test &` in a script, some
    # CI runners), this process inherits SIGINT ignored, and so would every tdbg it starts:
    # Python keeps an inherited SIG_IGN, so the Ctrl-C tests' SIGINT would do nothing. With a
    # handler here, the children start with the default (a handler is reset at exec, SIG_IGN
    # is not).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # An xdist worker starts with COLUMNS=80 and LINES=24 in its environment (no terminal's):
    # the CLI's tables and the children's terminal sizes would read them, as a serial run's
    # never do (tests/probe/test_console.py gives its script a 91x33 pty).
    if hasattr(config, "workerinput"):
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)
    # A default runtime directory of this process's own (each xdist worker's, and the children
    # it starts inherit it): a test that serves or discovers runs without its runtime_dir never
    # sees another worker's runs, nor another checkout's suite, in the shared /tmp/tdbg-<uid>.
    # Tests that need a fresh one still take runtime_dir.
    runtime = Path(tempfile.mkdtemp(prefix="tdbg-s-", dir="/tmp"))
    os.chmod(runtime, 0o700)
    os.environ["TDBG_RUNTIME_DIR"] = str(runtime)
    config.stash[_RUNTIME] = runtime


def pytest_unconfigure(config: pytest.Config) -> None:
    runtime = config.stash.get(_RUNTIME, None)
    if runtime is not None:
        shutil.rmtree(runtime, ignore_errors=True)


# Whole modules of end-to-end tests (sshd, tmux, real frameworks, demo jobs in subprocesses):
# `make test-fast` leaves them out; `make test` and CI run everything.
SLOW_MODULES = frozenset(
    {
        "test_ssh",
        "test_e2e_tmux",
        "test_e2e_journey",
        "test_integrations_lightning",
        "test_integrations_huggingface",
        "test_integrations_accelerate",
        "test_zero_code",
        "test_tui_live",
        "test_console",
        "test_tui_console_live",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # an xdist worker: say where a unit misses a sharer
        for module, names in session_fixture_users(items).items():
            if module not in ONE_UNIT:
                warnings.warn(
                    f"{module} reads the session's {', '.join(names)}: list it in conftest's "
                    "ONE_UNIT, or each xdist worker that draws it starts the fixture again",
                    stacklevel=1,
                )


# Under pytest-xdist (`make test`: -n 2 --dist loadfile) a test file is one unit
# of work, run whole by one worker in its order, so that a module-scoped fixture (a demo job, an
# sshd) starts once, as in a serial run. These files also read one session-scoped fixture (the
# straggler job: a 3-rank torchrun job, ~20 s): one unit together, so that it runs once too.
ONE_UNIT = {
    module: "straggler_job"
    for module in (
        "tests/cli/test_report.py",
        "tests/e2e/test_job_scenarios.py",
        "tests/model/test_recordings.py",
        "tests/probe/test_zero_code.py",
    )
}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without the plugin
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the files of :data:`ONE_UNIT` one unit each group."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSharing(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return ONE_UNIT.get(module, module)

    return LoadFileSharing(config, log)


def session_fixture_users(items: list[pytest.Item]) -> dict[str, list[str]]:
    """Each test file whose tests take a session-scoped fixture of the suite's own (not
    pytest's or a plugin's), with those fixtures' names."""
    users: dict[str, list[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for name in info.names_closure:
            definitions = info.name2fixturedefs.get(name, ())
            fixture = definitions[-1] if definitions else None  # a module's own overrides
            if fixture is not None and fixture.scope == "session" and _ours(fixture.func):
                names = users.setdefault(item.nodeid.split("::", 1)[0], [])
                if name not in names:
                    names.append(name)
    return users


def _ours(func: Callable[..., Any]) -> bool:
    """Whether a fixture function is defined under tests/ (not pytest's or a plugin's)."""
    code = getattr(func, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(_TESTS)


@contextlib.contextmanager
def fresh_runtime_dir() -> Iterator[Path]:
    """A fresh 0700 directory under /tmp (short, so socket paths stay under 100 bytes), removed
    afterwards: where a test's runs put their sockets (TDBG_RUNTIME_DIR)."""
    path = Path(tempfile.mkdtemp(prefix="tdbg-t-", dir="/tmp"))
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A :func:`fresh_runtime_dir`, also exported as TDBG_RUNTIME_DIR."""
    with fresh_runtime_dir() as path:
        monkeypatch.setenv("TDBG_RUNTIME_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def sshd() -> Iterator[Any]:
    """A real sshd on 127.0.0.1 (tests/sshd.py) for a module's ssh:// tests; skipped where
    there is no sshd (tests that fake ssh still run)."""
    import sshd as sshd_helper

    if not sshd_helper.available():
        pytest.skip("no /usr/sbin/sshd or ssh here")
    with sshd_helper.running_sshd() as server:
        yield server


@pytest.fixture(scope="session")
def straggler_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    """The recordings of one 3-rank gloo job under `tdbg run --record --grad-every 1`, 40 steps,
    rank 1 waiting 40 ms for each batch, rank 2 changing a layer's gradient after the
    all-reduce: run once for the session and read by every test that needs such a job (a
    torchrun job takes 15-25 s on a busy 2-core machine)."""
    from processes import recorded_torchrun_job

    directory = tmp_path_factory.mktemp("straggler-job")
    with fresh_runtime_dir() as sockets:
        yield recorded_torchrun_job(
            directory,
            3,
            40,
            DDP_SLOW_RANK="1",
            DDP_DIVERGE_RANK="2",
            TDBG_RUNTIME_DIR=str(sockets),
        )


@pytest.fixture
def private_dir() -> Iterator[Path]:
    """A fresh 0700 directory under /tmp, removed afterwards (artifact tests' base directory)."""
    path = Path(tempfile.mkdtemp(prefix="tdbg-p-", dir="/tmp"))
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def handed_over(probe: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every step ``probe`` hands its thread from now on (its PendingStep, as the thread builds
    it), kept in the list returned: the thread drains its inbox at each tick, so a test cannot
    read it there."""
    from collections import deque

    sent: list[Any] = []
    server = probe._server

    from tdbg.probe.training.pending import usual_step

    class Recording(deque):
        def append(self, pending: Any) -> None:
            # A usual CPU step is handed over as its values; the probe thread builds it.
            built = usual_step(pending) if isinstance(pending, tuple) else pending
            sent.append(built)
            super().append(pending)

    # Swapped while nothing waits in it (right after watch()): a step the probe thread is
    # taking from the old deque meanwhile would be taken twice.
    assert not server.inbox, "handed_over: call it before the first step"
    recording = Recording(maxlen=server.inbox.maxlen)
    monkeypatch.setattr(server.handoff, "steps", recording)  # where the training side appends
    monkeypatch.setattr(server, "inbox", recording)  # where the probe thread takes them
    return sent


def linear_at(model: torch.nn.Sequential, index: int) -> torch.nn.Linear:
    """The Linear layer at ``model[index]``, typed as one."""
    from torch import nn

    layer = model[index]
    assert isinstance(layer, nn.Linear), f"model[{index}] is {type(layer).__name__}"
    return layer


def run_info(name: str = "unit", pid: int = 1, rank: int = 0) -> RunInfo:
    """A whole RunInfo for a run that never was (what a unit test's part is told it serves)."""
    return {
        "name": name,
        "pid": pid,
        "rank": rank,
        "host": "test-host",
        "argv": ["train.py"],
        "start_time": 0.0,
        "cwd": "/",
        "torch": "",
        "device": "cpu",
        "commands": {},
    }


def dive_context(model: Any, errors: list[BaseException] | None = None) -> Any:
    """A DiveContext on a CPU model whose worker runs each analysis at once, in the calling
    thread, with no artifacts directory."""
    from collections import deque

    from tdbg.probe.dives.base import DiveContext

    return DiveContext(
        model=model,
        optimizer=None,
        cuda_device=None,
        run_info=run_info(),
        artifacts=lambda: None,
        submit=lambda fn: fn(),
        side_alerts=deque(),
        on_error=errors.append if errors is not None else None,
    )


@pytest.fixture(autouse=True)
def _private_settings(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A config directory of the test's own (XDG_CONFIG_HOME): the viewer's settings neither
    come from the developer's ~/.config/tdbg (a saved theme would change every snapshot) nor
    go there, and no test sees what another one saved."""
    config = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    return config


@pytest.fixture(autouse=True)
def _close_probes() -> Iterator[None]:
    """Close every probe a test left open (only if the probe was ever imported: the protocol
    tests must not pull torch in)."""
    yield
    watch = sys.modules.get("tdbg.probe.watch")
    if watch is not None:
        watch._close_all()


class Loop:
    """A tiny real training loop on CPU; remembers each step's loss and reference norms."""

    def __init__(self, seed: int = 0, optimizer: bool = True, width: int = 16) -> None:
        import torch
        from torch import nn

        torch.manual_seed(seed)
        self.torch = torch
        self.model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05) if optimizer else None
        self.x, self.y = torch.randn(32, 4), torch.randn(32, 1)
        self.losses: list[float] = []
        self.norms: list[tuple[float, list[float]]] = []

    @property
    def optimizer(self) -> torch.optim.SGD:
        """The loop's optimizer (a Loop made with one)."""
        assert self.opt is not None, "Loop(optimizer=False) has no optimizer"
        return self.opt

    def loss(self) -> Any:
        """The model's loss on the loop's batch (a tensor with its graph)."""
        return ((self.model(self.x) - self.y) ** 2).mean()

    def step(self, probe: object = None, reference: bool = False) -> float:
        from norm_oracle import reference_norms

        from tdbg.probe.training.gradients import find_layers

        self.model.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        if reference:
            self.norms.append(reference_norms(find_layers(self.model)))
        if self.opt is not None:
            self.opt.step()
        else:
            with self.torch.no_grad():
                for p in self.model.parameters():
                    assert p.grad is not None
                    p.sub_(0.05 * p.grad)
        if probe is not None:
            probe.step(loss)  # type: ignore[attr-defined]
        value = loss.item()
        self.losses.append(value)
        return value

    def run(self, n: int, probe: object = None, reference: bool = False) -> None:
        for _ in range(n):
            self.step(probe, reference)


class Reader:
    """A real client on a background thread, collecting every message the probe sends."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import threading

        from tdbg.connect.client import ProbeClient

        self.client = ProbeClient.connect(path)
        self.messages: list[dict] = []
        self.ended = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.client.messages():
                self.messages.append(message)
        except OSError:
            pass  # closed by close() before the first read
        finally:
            self.ended = True

    def of(self, mtype: str) -> list[dict]:
        return [m for m in list(self.messages) if m["type"] == mtype]

    def records(self, history: bool | None = None) -> list:
        from tdbg.protocol.steps import unpack_steps

        return [
            r
            for m in self.of("steps")
            if history is None or bool(m.get("history")) == history
            for r in unpack_steps(m)
        ]

    def wait(
        self, condition: Callable[[Reader], object], timeout: float = TIMEOUT, what: str = ""
    ) -> None:
        wait_until(lambda: condition(self), timeout, what or "a condition on the messages read")

    def settle(self) -> None:
        """Wait until everything the probe had sent before now has been read: a ping's pong
        is queued behind it. "No alert came" is then an event, not a guess at a delay."""
        mid = self.client.send("ping")
        self.wait(lambda r: any(m.get("id") == mid for m in r.of("pong")), what="the pong")

    def close(self) -> None:
        import socket

        with contextlib.suppress(OSError):
            self.client.sock.shutdown(socket.SHUT_RDWR)
        self.client.close()
        self._thread.join(2.0)


def reader_on(probe: Probe) -> Reader:
    """A :class:`Reader` on ``probe``'s socket (the probe must be serving)."""
    path = probe.socket_path
    assert path is not None, f"{probe!r} is not serving: no socket to read"
    return Reader(path)


OpenReader = Callable[["Probe"], Reader]


@pytest.fixture
def probe_reader() -> Iterator[OpenReader]:
    """Opens a :class:`Reader` on a probe's socket (``reader = probe_reader(probe)``) and closes
    every reader it opened after the test, passed or failed (closing one twice is harmless)."""
    readers: list[Reader] = []

    def open_reader(probe: Probe) -> Reader:
        reader = reader_on(probe)
        readers.append(reader)
        return reader

    yield open_reader
    for reader in readers:
        reader.close()


def inject_fault(
    monkeypatch: pytest.MonkeyPatch, probe: Probe, point: str, replacement: Callable[..., Any]
) -> None:
    """Make one of ``probe``'s declared fault points (tdbg.probe.faults.POINTS) call
    ``replacement`` until the test ends."""
    from tdbg.probe import faults

    for owner, attribute in faults.targets(probe, point):
        monkeypatch.setattr(owner, attribute, replacement)


@pytest.fixture
def probe_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """What the probe logs (its stderr handler), with the once-a-minute memory cleared."""
    from tdbg.probe import log

    buffer = io.StringIO()
    monkeypatch.setattr(log, "_last", {})
    for handler in log.logger.handlers:
        if type(handler) is logging.StreamHandler:  # the probe's own, not pytest's capture
            monkeypatch.setattr(handler, "stream", buffer)
    yield buffer
