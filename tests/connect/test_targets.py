"""What a TARGET names: resolve() over every kind, every error's one wording, the bridge's exit
codes for them, and the CLI and the TUI printing the same line for the same bad TARGET."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import run_info
from waiting import TIMEOUT

from tdbg.cli import main as cli
from tdbg.connect.bridge_contract import ERROR_PREFIX, EXIT_ERROR, EXIT_NO_RUN, EXIT_SEVERAL
from tdbg.connect.runtime import RunEntry, write_private_json
from tdbg.connect.sshurl import SshTarget
from tdbg.connect.target_errors import TargetError
from tdbg.connect.targets import (
    Discover,
    Job,
    LocalSocket,
    Recording,
    Remote,
    attach,
    resolve,
    resolve_nodes,
    wait_for_run,
)

HINT = "several targets must all be ssh:// URLs (one per node); a local run is attached alone"


class Runs:
    """Real runs as discovery sees them: a listening Unix socket and its metadata .json, owned
    by a live pid (this process, or its parent for a second pid)."""

    def __init__(self) -> None:
        self.servers: list[socket.socket] = []

    def add(self, directory: Path, name: str, pid: int, rank: int = 0, **meta: Any) -> RunEntry:
        sock_path = directory / f"{rank}-{pid}.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(sock_path))
        server.listen(1)
        self.servers.append(server)
        meta.update(name=name, pid=pid, rank=rank, socket=str(sock_path))
        meta["start_time"] = time.time() + len(self.servers)  # discovery sorts on it
        write_private_json(directory / f"{rank}-{pid}.json", meta)
        return RunEntry(sock_path, meta)

    def close(self) -> None:
        for server in self.servers:
            server.close()


@pytest.fixture
def runs() -> Iterator[Runs]:
    made = Runs()
    yield made
    made.close()


def private(path: Path) -> Path:
    path.mkdir()
    os.chmod(path, 0o700)
    return path


def a_recording(path: Path) -> Path:
    """A real recording, as the probe's recorder writes one (no steps: still a valid file)."""
    from tdbg.probe.serving.recorder import Recorder

    info = run_info(name="rec")
    info["host"] = "h"
    rec = Recorder(path, info, ["w"], [1])
    assert rec.open()
    rec.close()
    return path


def test_resolve_names_every_kind(runtime_dir: Path, runs: Runs, tmp_path: Path) -> None:
    mlp = runs.add(runtime_dir, "mlp", os.getpid())
    one = private(tmp_path / "one")
    elsewhere = runs.add(one, "other", os.getppid())
    bare = tmp_path / "bare.sock"  # a socket with no metadata beside it
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(bare))
    runs.servers.append(server)
    rec = a_recording(tmp_path / "run.tdbgrec")
    table: list[tuple[str | None, object]] = [
        (None, Discover()),
        (str(mlp.socket), LocalSocket(mlp.socket, mlp)),
        (str(runtime_dir / f"0-{os.getpid()}.json"), LocalSocket(mlp.socket, mlp)),
        (str(runtime_dir), LocalSocket(mlp.socket, mlp)),
        (str(one), LocalSocket(elsewhere.socket, elsewhere)),
        ("mlp", LocalSocket(mlp.socket, mlp)),  # a run's name, in the runtime directory
        (str(os.getpid()), LocalSocket(mlp.socket, mlp)),  # a run's pid, there too
        (str(bare), LocalSocket(bare, None)),
        (str(rec), Recording(rec)),
        ("ssh://me@box:2222/tmp/x.sock", Remote(SshTarget("box", "me", 2222, "/tmp/x.sock"))),
        ("SSH://box", Remote(SshTarget("box"))),
    ]
    for text, expected in table:
        assert resolve(text) == expected, text


def test_a_name_the_ranks_of_one_job_share_names_the_job(runtime_dir: Path, runs: Runs) -> None:
    """torchrun starts every rank of a script under one name: that name means the job (as
    ``--job JOB``); two jobs, or a job's rank and another run, under one name stay ambiguous."""
    ranks = [
        runs.add(runtime_dir, "train", os.getpid(), rank, job="jobA", world_size=2)
        for rank in (0, 1)
    ]
    assert resolve("train") == Job("jobA", tuple(ranks))
    with pytest.raises(TargetError) as caught:
        attach(resolve("train"), text="train")  # a command that serves no job names the ranks
    assert str(caught.value).startswith("2 runs named train, name one: ")

    runs.add(runtime_dir, "shared", os.getppid(), 0, job="jobB", world_size=1)
    runs.add(runtime_dir, "shared", os.getppid(), 2, job="jobC", world_size=1)
    runs.add(runtime_dir, "mixed", os.getpid(), 3, job="jobD", world_size=1)
    runs.add(runtime_dir, "mixed", os.getppid(), 4)  # a single run, no job
    for name in ("shared", "mixed"):
        with pytest.raises(TargetError) as caught:
            resolve(name)
        assert str(caught.value).startswith(f"2 runs named {name}, name one: "), caught.value
        assert caught.value.reason == "several" and "\n" not in str(caught.value)


def test_every_error_has_one_wording(runtime_dir: Path, runs: Runs, tmp_path: Path) -> None:
    empty = private(tmp_path / "empty")
    two = private(tmp_path / "two")
    a = runs.add(two, "mlp", os.getpid())
    b = runs.add(two, "mlp", os.getppid())
    runs.add(runtime_dir, "twin", os.getpid(), rank=0)
    runs.add(runtime_dir, "twin", os.getppid(), rank=1)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    broken = tmp_path / "run.json"
    broken.write_text("{not json")
    no_socket = tmp_path / "meta.json"
    no_socket.write_text('{"pid": 1}')
    missing = tmp_path / "nope.sock"
    table = [
        ("", "TARGET is empty", "invalid"),
        ("  ", "TARGET is empty", "invalid"),
        (str(missing), f"no such socket, metadata file, directory or run: {missing}", "missing"),
        ("nosuchrun", "no such socket, metadata file, directory or run: nosuchrun", "missing"),
        ("99999999", "no such socket, metadata file, directory or run: 99999999", "missing"),
        (str(empty), f"no tdbg run found in {empty} (start one with tdbg.watch)", "no_run"),
        (
            str(two),
            f"2 runs in {two}, name one: {a.socket} (mlp, pid {a.pid}); "
            f"{b.socket} (mlp, pid {b.pid})",
            "several",
        ),
        ("twin", "2 runs named twin, name one: ", "several"),
        (str(broken), f"{broken} is not a tdbg run metadata file (", "invalid"),
        (str(no_socket), f"{no_socket} is not a tdbg run metadata file ('socket')", "invalid"),
        (str(text), f"{text} is not a tdbg recording, nor a probe's socket", "invalid"),
        (
            "ssh://me:pw@box",
            "ssh URL must not contain a password (use keys or an agent)",
            "invalid",
        ),
        (
            "ssh://-oProxyCommand=x",
            "ssh URL host must not start with '-' ('-oProxyCommand=x')",
            "invalid",
        ),
    ]
    for target, message, reason in table:
        with pytest.raises(TargetError) as caught:
            resolve(target)
        assert str(caught.value).startswith(message), (target, str(caught.value))
        assert "\n" not in str(caught.value)
        assert caught.value.reason == reason, target


def test_errors_of_nodes_waiting_and_recordings(runtime_dir: Path, tmp_path: Path) -> None:
    assert resolve_nodes(["ssh://a", "ssh://me@b:22"], HINT) == [
        SshTarget("a"),
        SshTarget("b", "me", 22),
    ]
    with pytest.raises(TargetError, match=rf"^'/tmp/local.sock': {re.escape(HINT)}$"):
        resolve_nodes(["ssh://a", "/tmp/local.sock"], HINT)
    with pytest.raises(TargetError, match="^ssh URL has no host$"):
        resolve_nodes(["ssh://"], HINT)
    with pytest.raises(TargetError) as caught:
        wait_for_run(wait=0)
    assert str(caught.value) == f"no tdbg run found in {runtime_dir} (start one with tdbg.watch)"
    rec = a_recording(tmp_path / "r.tdbgrec")
    with pytest.raises(TargetError) as caught:
        attach(resolve(str(rec)), text="r.tdbgrec")
    assert str(caught.value) == (
        "r.tdbgrec is a recording: a recording cannot run commands "
        "(tdbg dump and tdbg-tui replay read it)"
    )
    assert caught.value.reason == "recording"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--socket", "/nonexistent/x.sock"], EXIT_NO_RUN, "no such socket, metadata file"),
        ([], EXIT_NO_RUN, "no tdbg run found in "),
        (["--socket", "TWO"], EXIT_SEVERAL, "2 runs in "),
        (["--socket", "TEXT"], EXIT_ERROR, "is not a tdbg recording, nor a probe's socket"),
    ],
)
def test_the_bridge_says_the_same_with_its_exit_codes(
    args: list[str],
    code: int,
    message: str,
    runtime_dir: Path,
    runs: Runs,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The local end of ssh:// reads the reason from the bridge's exit code (no run there is
    what lets a dropped TUI watch for a restart instead of retrying)."""
    two = private(tmp_path / "two")
    runs.add(two, "a", os.getpid())
    runs.add(two, "b", os.getppid())
    text = tmp_path / "notes.txt"
    text.write_text("x")
    args = [{"TWO": str(two), "TEXT": str(text)}.get(a, a) for a in args]
    assert cli.run(["bridge", *args]) == code
    err = capsys.readouterr().err
    assert err.startswith(ERROR_PREFIX) and message in err and err.count("\n") == 1, err


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tdbg.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def _tui(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "import sys; from tdbg.cli.main import tui_main; sys.exit(tui_main())"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_the_cli_and_the_tui_say_the_same_line(runtime_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir))
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    broken = tmp_path / "run.json"
    broken.write_text("{not json")
    empty = private(tmp_path / "empty")
    cut = tmp_path / "cut.tdbgrec"  # a recording cut inside its header: the replay's error
    cut.write_bytes(a_recording(tmp_path / "whole.tdbgrec").read_bytes()[:12])
    bad = [str(tmp_path / "nope.sock"), "nosuchrun", str(text), str(broken), str(empty)]
    bad += ["ssh://me:pw@box", "", str(cut)]
    for target in bad:
        said = []
        for run, prog in ((_cli, "tdbg dump" if not target else "tdbg"), (_tui, "tdbg-tui")):
            out = run(*(["dump"] if run is _cli else []), target, env=env)
            assert out.returncode == 2, (target, out.stderr)
            assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
            assert out.stderr.startswith(f"{prog}: error: "), out.stderr
            said.append(out.stderr.removeprefix(f"{prog}: error: "))
        assert said[0].replace("tdbg dump", "tdbg-tui") == said[1], target


def test_connect_imports_no_cli_tui_or_torch() -> None:
    code = (
        "import sys, json, tdbg.connect.targets, tdbg.connect.ssh, tdbg.connect.bridge_contract, "
        "tdbg.connect.client, tdbg.connect.runtime, tdbg.connect.sshurl; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if m == "torch" or m.startswith(("torch.", "tdbg.cli", "tdbg.tui"))]
    assert bad == []


def test_a_fifo_or_a_device_is_named_for_what_it_is(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TargetError, match="is a FIFO, not a run's socket"):
        resolve(str(fifo))
    with pytest.raises(TargetError, match="/dev/zero is a device"):
        resolve("/dev/zero")


def test_tdbg_run_of_a_missing_module_is_one_line_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tdbg.cli", "run", "-m", "no_such_module_here"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "tdbg: error: no module named no_such_module_here"


def _as_another_user(argv: list[str]) -> list[str]:
    """``argv`` run by someone the directory made by ``_unsearchable`` shuts out. Root passes
    every permission check, so as root the command keeps uid 0 but loses the two capabilities
    that bypass them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): a real permission check, with the
    interpreter under /root still readable (as ``nobody`` it would not even start)."""
    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no way to be refused a directory")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", *argv]


def _unsearchable(parent: Path) -> Path:
    """A directory the user of ``_as_another_user`` may not search: another user's 0700
    directory (as root), or one of ours with mode 000."""
    theirs = parent / "theirs"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
        os.chmod(theirs, 0o700)
    else:
        os.chmod(theirs, 0)
    return theirs


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "tdbg.cli", "dump"],
        [sys.executable, "-m", "tdbg.cli", "profile"],
        [
            sys.executable,
            "-c",
            "import sys; from tdbg.cli.main import tui_main; sys.exit(tui_main())",
        ],
    ],
    ids=["tdbg dump", "tdbg profile", "tdbg-tui"],
)
def test_a_target_in_a_directory_we_may_not_search_is_one_line_and_exit_2(
    runtime_dir: Path, tmp_path: Path, argv: list[str]
) -> None:
    """Another user's runtime directory: one line saying so, exit 2 (was: a PermissionError
    traceback and exit 1)."""
    theirs = _unsearchable(tmp_path)
    target = str(theirs / "0-1.sock")
    try:
        out = subprocess.run(
            _as_another_user([*argv, target]),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir)),
        )
    finally:
        os.chmod(theirs, 0o700)  # ours again (mode 000), so pytest can remove it
    prog = "tdbg-tui" if "-c" in argv else "tdbg"
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"{prog}: error: cannot look at {target}: Permission denied\n"


def test_a_fifo_or_a_device_given_to_tdbg_dump_is_one_line_and_exit_2(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """Not "Connection refused": what the file is, and that it is not a run's socket."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir))
    for target, kind in ((str(fifo), "a FIFO"), ("/dev/zero", "a device")):
        out = _cli("dump", target, env=env)
        assert out.returncode == 2, out.stderr
        said = f"tdbg: error: {target} is {kind}, not a run's socket or a recording\n"
        assert out.stderr == said
