"""ssh:// targets end to end: a real sshd on 127.0.0.1, a real demo training job, the real CLI
and the real TUI under its Pilot; the bridge's byte pump (guarantees: ssh) and one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import sshd as sshd_helper
from conftest import wait_until
from demo_job import demo_job
from waiting import TIMEOUT, until

from tdbg.connect.runtime import write_private_json
from tdbg.connect.ssh import LIST_TIMEOUT
from tdbg.protocol.framing import MAGIC

pytestmark = pytest.mark.slow

TDBG = [sys.executable, "-m", "tdbg.cli"]
REMOTE_TDBG = str(Path(sys.executable).parent / "tdbg")  # the venv is not on sshd's PATH
DEMO = ("--delay", "0.01", "--width", "32", "--depth", "3")
SSHD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def remote(server: sshd_helper.Sshd, key: Path | None = None) -> list[str]:
    return [*server.client_options(key), "--remote-tdbg", REMOTE_TDBG]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TDBG, *args], capture_output=True, text=True, timeout=90, env=env or dict(os.environ)
    )


def one_line_error(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr)
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("tdbg: error: "), out.stderr
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr
    return out.stderr


@contextlib.contextmanager
def fake_run(directory: Path, name: str = "fake", preamble: tuple[int, int] | None = None):
    """A listening socket plus metadata that discovery lists as a live run. With ``preamble``,
    it answers every connection with a probe preamble of those protocol versions."""
    path = directory / f"0-{os.getpid()}-{name}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(4)
    meta = {"name": name, "pid": os.getpid(), "rank": 0, "start_time": time.time()}
    write_private_json(path.with_suffix(".json"), dict(meta, socket=str(path)))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                assert preamble is not None
                conn.sendall(struct.pack(">4sHH", MAGIC, *preamble))
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(100)

    thread = threading.Thread(target=serve, daemon=True)
    if preamble is not None:
        thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join(1) if preamble is not None else None
        server.close()
        for p in (path, path.with_suffix(".json")):
            with contextlib.suppress(OSError):
                p.unlink()


# --- the CLI through ssh ---------------------------------------------------------------------


def test_dump_and_profile_over_ssh(sshd: sshd_helper.Sshd, runtime_dir: Path) -> None:
    with demo_job("mlp", *DEMO, runtime=runtime_dir) as (proc, entry):
        out = cli("dump", sshd.url(str(runtime_dir)), "--count", "30", *remote(sshd))
        assert out.returncode == 0, out.stderr
        events = [json.loads(line) for line in out.stdout.splitlines()]
        assert events[0]["type"] == "hello" and events[0]["run"]["pid"] == proc.pid
        steps = [e["step"] for e in events if e["type"] == "step"]
        assert len(steps) == 30 and steps == list(range(steps[0], steps[0] + 30))

        # The socket itself in the URL, and a deep dive through the same channel.
        url = sshd.url(str(entry.socket))
        out = cli("profile", url, "--steps", "2", "--json", "--timeout", "60", *remote(sshd))
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        names = " ".join(str(row.get("name")) for row in result["rows"])
        assert "addmm" in names or "linear" in names, names
        assert result["trace"]  # its path on the remote host
        # ssh and the bridge are gone once the command returns: nothing left behind.
        wait_until(lambda: not _bridges(entry.socket), what="remote bridges to exit")


def _bridges(sock: Path) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"bridge" in cmd and str(sock).encode() in cmd:
                    pids.append(int(pid))
    return pids


def test_one_line_errors(sshd: sshd_helper.Sshd, runtime_dir: Path, tmp_path: Path) -> None:
    url = sshd.url(str(runtime_dir))
    # Nothing runs there yet.
    one_line_error(cli("dump", url, *remote(sshd)), "no tdbg run on", str(runtime_dir))
    # A key the server does not know.
    one_line_error(
        cli("dump", url, *remote(sshd, sshd.other_key)), "authentication failed", "Permission"
    )
    # Nothing listens on that port.
    closed = f"ssh://{sshd.user}@127.0.0.1:{sshd_helper.free_port()}"
    one_line_error(cli("nan-hunt", closed, *remote(sshd)), "connection refused")
    # Without --remote-tdbg the session's PATH has no tdbg (the venv is not on it).
    missing = "tdbg" if shutil.which("tdbg", path=SSHD_PATH) is None else "tdbg-not-there"
    options = [*sshd.client_options(), "--remote-tdbg", missing]
    if missing == "tdbg":
        options = sshd.client_options()  # exactly as a user would type it
    one_line_error(cli("dump", url, *options), "tdbg not found on", "--remote-tdbg PATH")
    # URLs refused before ssh ever starts (guarantees: ssh).
    one_line_error(cli("dump", "ssh://-oProxyCommand=touch%20/tmp/x"), "start with '-'")
    one_line_error(cli("anomaly", "ssh://me:pw@127.0.0.1"), "password")
    one_line_error(cli("dump", "ssh://127.0.0.1:99999"), "out of range")
    # No ssh client at all.
    empty = tmp_path / "bin"
    empty.mkdir()
    one_line_error(cli("dump", url, env=dict(os.environ, PATH=str(empty))), "ssh not found")


def test_several_runs_and_version_mismatch(sshd: sshd_helper.Sshd, runtime_dir: Path) -> None:
    with fake_run(runtime_dir, "first"), fake_run(runtime_dir, "second", (7, 9)) as odd:
        err = one_line_error(
            cli("dump", sshd.url(str(runtime_dir)), *remote(sshd)),
            "several runs on",
            "first",
            "second",
        )
        assert sshd.url("/SOCKET-PATH") in err
        # Picking the one that speaks another protocol names both versions.
        one_line_error(
            cli("dump", sshd.url(str(odd)), *remote(sshd)),
            "protocol version mismatch",
            "speaks tdbg protocol 7-9",
            "speaks 1",
        )


def test_ls_lists_the_runs_of_ssh_nodes(sshd: sshd_helper.Sshd, runtime_dir: Path) -> None:
    with fake_run(runtime_dir, "first"), fake_run(runtime_dir, "second"):
        out = cli("ls", sshd.url(str(runtime_dir)), *remote(sshd))
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines) == 2 and all(line.startswith("root@127.0.0.1") for line in lines)
        assert {line.split()[1] for line in lines} == {"first", "second"}
        out = cli("ls", "--json", sshd.url(str(runtime_dir)), *remote(sshd))
        runs = [json.loads(line) for line in out.stdout.splitlines()]
        assert sorted(r["name"] for r in runs) == ["first", "second"]
        assert all(r["socket"].startswith(str(runtime_dir)) and r["node"] for r in runs)
    out = cli("ls", sshd.url(str(runtime_dir)), *remote(sshd))
    assert out.returncode == 0 and "no tdbg runs in" in out.stdout
    one_line_error(cli("ls", "/tmp"), "tdbg ls lists this machine, or ssh:// nodes")


def test_bridge_list_and_pump(runtime_dir: Path) -> None:
    """``tdbg bridge`` locally: --list answers JSON; the pump honours half-close and exits
    within 1 s of either side closing (guarantees: ssh), without parsing what it carries."""
    listing = cli("bridge", "--list", "--runtime-dir", str(runtime_dir))
    data = json.loads(listing.stdout)
    assert data["runs"] == [] and data["protocol"] == [1, 1] and data["tdbg"]

    path = runtime_dir / "echo.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(10)
    for closer in ("client", "server"):
        bridge = subprocess.Popen(
            [*TDBG, "bridge", "--socket", str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert bridge.stdin and bridge.stdout
        conn, _ = server.accept()
        conn.settimeout(10)
        garbage = b"\x00\xffnot a frame at all"
        bridge.stdin.write(garbage)
        bridge.stdin.flush()
        assert conn.recv(100) == garbage  # passed through untouched
        if closer == "client":
            bridge.stdin.close()  # our side is done writing...
            assert conn.recv(100) == b""  # ...the probe sees EOF (half-close)...
            conn.sendall(b"late reply")  # ...and can still answer.
            assert bridge.stdout.read(10) == b"late reply"
        else:
            conn.sendall(b"bye")
            conn.close()
            assert bridge.stdout.read() == b"bye"
        # It exits by itself once one side has closed (it lingers under a second by design; the
        # figure is a benchmark's to measure, not a test's): a pump that hung would time out here.
        bridge.wait(30)
        conn.close()
        for stream in (bridge.stdin, bridge.stdout, bridge.stderr):
            if stream and not stream.closed:
                stream.close()
    server.close()


# --- the TUI through ssh ---------------------------------------------------------------------


async def test_tui_over_ssh_survives_a_dropped_connection(
    sshd: sshd_helper.Sshd, runtime_dir: Path
) -> None:
    from tdbg.tui.app import make_app, screen_text
    from tdbg.tui.sources.remote import remote_source

    with demo_job("mlp", *DEMO, runtime=runtime_dir) as (proc, _):
        source = remote_source(
            [sshd.url(str(runtime_dir))], sshd.client_options()[1::2], REMOTE_TDBG
        )
        source.backoff_cap = 1.0  # retry quickly once sshd is back
        app = make_app(source)
        async with app.run_test(size=(160, 48)):
            await until(lambda: app.state.n_steps > 20, what="steps through ssh")
            await until(lambda: f"pid {proc.pid}" in screen_text(app), what="the run on screen")
            # The network goes: no new connection is accepted, and the live one dies.
            sshd.stop_listener()
            try:
                before = app.state.n_steps
                ssh = source.client.ssh  # type: ignore[union-attr]
                os.kill(ssh.pid, signal.SIGKILL)
                await until(lambda: app.state.connection == "reconnecting", what="reconnecting")
                await until(lambda: "reconnecting" in screen_text(app), what="reconnecting shown")
                assert app.state.n_steps >= before  # what was seen stays on screen meanwhile
            finally:
                sshd.start()  # even after a failure: the module's other tests share this sshd
            await until(lambda: app.state.connection == "live", what="live again")
            await until(lambda: app.state.n_steps > before + 20, what="steps after reconnecting")
            steps = [int(s) for s in app.state.steps.values]
            assert steps[0] == 0 and steps == list(range(steps[0], steps[0] + len(steps)))
            assert source.reconnects == 1 and app.state.run.get("pid") == proc.pid
            await until(lambda: "reconnected" in _notifications(app), what="notice")


async def test_tui_over_ssh_follows_a_restarted_run(
    sshd: sshd_helper.Sshd, runtime_dir: Path
) -> None:
    from tdbg.tui.app import make_app
    from tdbg.tui.sources.remote import remote_source

    # The first run trains until the TUI has attached and seen it live, then ends cleanly (a
    # fixed step count could end before a slow ssh attach on a busy machine).
    with demo_job("mlp", *DEMO, runtime=runtime_dir) as (first, _):
        url = sshd.url(str(runtime_dir))
        source = remote_source([url], sshd.client_options()[1::2], REMOTE_TDBG)
        source.backoff_cap = 1.0
        app = make_app(source)
        async with app.run_test(size=(160, 48)):
            await until(lambda: app.state.n_steps > 5, what="the first run's steps")
            os.killpg(first.pid, signal.SIGTERM)  # the demo closes its probe and exits 0
            await until(lambda: app.state.connection == "ended", what="the first run's end")
            last = app.state.last_step
            assert last is not None and app.state.n_steps == last + 1  # every step, none lost
            with demo_job("mlp", *DEMO, runtime=runtime_dir) as (second, _):
                await until(lambda: app.state.run.get("pid") == second.pid, what="the restart")
                await until(lambda: app.state.connection == "live", what="live on the new run")
                await until(lambda: app.state.n_steps > 5, what="the new run's steps")
                assert int(app.state.steps.values[0]) == 0 and first.pid != second.pid
                assert source.reconnects == 0


def _notifications(app) -> str:
    return " ".join(app.notices)


async def test_tui_lists_runs_of_several_nodes(sshd: sshd_helper.Sshd, runtime_dir: Path) -> None:
    from tdbg.tui.app import make_app, screen_text
    from tdbg.tui.screens.picker import RunPickerScreen
    from tdbg.tui.sources.remote import RemoteRunEntry, remote_source

    other = Path(tempfile.mkdtemp(prefix="tdbg-n2-", dir="/tmp"))
    os.chmod(other, 0o700)
    node_a = sshd.url(str(runtime_dir))
    node_b = f"ssh://{sshd.user}@localhost:{sshd.port}{other}"  # a second "node"
    try:
        with demo_job("mlp", *DEMO, runtime=runtime_dir) as (proc, _), fake_run(other, "elsewhere"):
            dead = f"ssh://{sshd.user}@127.0.0.1:{sshd_helper.free_port()}"  # a node that is down
            targets = [node_a, node_b, dead]
            source = remote_source(targets, sshd.client_options()[1::2], REMOTE_TDBG)
            app = make_app(source)
            async with app.run_test(size=(160, 48)) as pilot:
                await until(lambda: isinstance(app.screen, RunPickerScreen), what="the picker")
                await until(lambda: "connection refused" in _notifications(app), what="warn")
                picker = app.screen
                assert isinstance(picker, RunPickerScreen)
                entries = picker.entries
                assert len(entries) == 2 and all(isinstance(e, RemoteRunEntry) for e in entries)
                shown = (f"127.0.0.1:{sshd.port}", f"localhost:{sshd.port}", "elsewhere", "mlp")
                await until(
                    lambda: all(s in screen_text(app) for s in shown),
                    what=f"{shown} on the picker",
                    pilot=pilot,
                )
                mine = next(i for i, e in enumerate(entries) if e.pid == proc.pid)
                for _ in range(mine):
                    await pilot.press("down")
                await pilot.press("enter")
                await until(lambda: app.state.n_steps > 5, what="steps from the chosen run")
                assert app.state.run.get("pid") == proc.pid
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_tui_errors_before_the_screen(sshd: sshd_helper.Sshd, runtime_dir: Path) -> None:
    """``tdbg-tui ssh://...`` with nothing to show fails on one line, exit 2, no screen."""
    code = "import sys; from tdbg.cli.main import tui_main; sys.exit(tui_main())"
    for args, needle in (
        ([sshd.url(str(runtime_dir)), *remote(sshd)], "no tdbg run on"),
        (["--host", "ssh://bad host"], "invalid host"),
        (["ssh://h1", "/tmp/local.sock"], "must all be ssh:// URLs"),
    ):
        out = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("tdbg-tui: error: ") and out.stderr.count("\n") == 1
        assert needle in out.stderr, out.stderr


def test_misbehaving_remote_tdbg(sshd: sshd_helper.Sshd, tmp_path: Path) -> None:
    """A remote 'tdbg' that hangs, or chatters on stdout, ends in one line, ssh stopped."""
    from tdbg.connect.ssh import RemoteError, RemoteOptions, connect
    from tdbg.connect.sshurl import parse_ssh_url

    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    chatty = tmp_path / "chatty.sh"
    chatty.write_text("#!/bin/sh\necho 'Welcome to the cluster!'\nexec sleep 30\n")
    for script in (hang, chatty):
        script.chmod(0o755)
    target = parse_ssh_url(sshd.url())
    # The hang waits its whole timeout, so a short one; the chatter is refused on its first
    # bytes, so a ceiling a loaded machine's ssh login always meets (3 s may not be).
    for script, needle, timeout in (
        (hang, "no answer from a tdbg probe", 3.0),
        (chatty, "not a tdbg probe", TIMEOUT),
    ):
        opts = RemoteOptions(tuple(sshd.client_options()[1::2]), remote_tdbg=str(script))
        with pytest.raises(RemoteError, match=needle) as err:
            connect(target, opts, timeout=timeout)
        assert "\n" not in str(err.value)

        def stopped(path: Path = script) -> bool:
            return not _running(str(path))

        wait_until(stopped, what=f"{script.name} stopped")


def _running(needle: str) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
    return False


# --- a fake ssh: slow links and interrupted listings, without sshd -------------------------

# Stands in for ``ssh ... host tdbg bridge``: a probe on stdin/stdout whose every answer comes
# DELAY s late, as over a slow link; it writes its pid first, and leaves when stdin closes.
SLOW_PROBE = """\
import os, sys, time
from tdbg.protocol.framing import pack, preamble
open({pidfile!r}, "w").write(str(os.getpid()))
out = sys.stdout.buffer
time.sleep({delay})
out.write(preamble()); out.flush()
os.read(0, 65536)  # the hello
time.sleep({delay})
out.write(pack({{"type": "welcome", "proto": 1, "server_version": "fake",
                 "run": {{"name": "slow", "pid": os.getpid()}}}})); out.flush()
while os.read(0, 65536):
    pass
"""

# An ssh that never answers (a host that takes its time): ``tdbg bridge --list`` hangs.
SILENT_SSH = "#!/bin/sh\necho $$ >> {pidfile}\nexec sleep 60\n"


def _fake(directory: Path, text: str, name: str = "ssh") -> Path:
    script = directory / name
    script.write_text(text)
    script.chmod(0o755)
    return script


def _pids(pidfile: Path) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(w) for w in pidfile.read_text().split()]
    return []


def _alive(pid: int) -> bool:
    """Running (a zombie, or a pid gone, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_attach_over_a_slow_link(tmp_path: Path) -> None:
    """A probe whose answers take 0.5 s each (longer than the preamble peek's 0.25 s slices)
    still attaches: the peek's short socket timeout must not leak into the handshake."""
    from tdbg.connect.ssh import RemoteOptions, connect
    from tdbg.connect.sshurl import parse_ssh_url

    pidfile = tmp_path / "pid"
    code = SLOW_PROBE.format(pidfile=str(pidfile), delay=0.5)
    ssh = _fake(tmp_path, f"#!{sys.executable}\n{code}")
    client = connect(parse_ssh_url("ssh://slow-host"), RemoteOptions(ssh=str(ssh)), timeout=TIMEOUT)
    try:
        assert client.welcome["server_version"] == "fake"
        assert client.run["name"] == "slow" and client.run["node"] == "slow-host"
        assert client.sock.gettimeout() is None  # blocking again after the handshake
    finally:
        client.close()
    pid = _pids(pidfile)[0]
    wait_until(lambda: not _alive(pid), what="the fake ssh stopped after close()")


def test_ctrl_c_while_listing_runs_exits_at_once(tmp_path: Path) -> None:
    """``tdbg-tui ssh://...`` interrupted while ssh is still listing runs exits within about
    2 s (not when ssh gives up), and leaves no ssh behind: ssh runs in its own session, so
    the terminal's SIGINT never reaches it, and tdbg must stop it."""
    pidfile = tmp_path / "pids"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, SILENT_SSH.format(pidfile=pidfile))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    code = "import sys; from tdbg.cli.main import tui_main; sys.exit(tui_main())"
    tui = subprocess.Popen(
        [sys.executable, "-c", code, "ssh://node-a", "ssh://node-b"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: len(_pids(pidfile)) == 2, 30, "both nodes being listed")
        interrupted = time.monotonic()
        tui.send_signal(signal.SIGINT)
        _, err = tui.communicate(timeout=30)
        took = time.monotonic() - interrupted
    finally:
        if tui.poll() is None:
            tui.kill()
            tui.wait()
    # The silent ssh would hold a listing for LIST_TIMEOUT (60 s): exiting well before that is
    # the Ctrl-C at work. A generous bound, so a busy machine cannot fail it.
    assert took < LIST_TIMEOUT / 3, f"tdbg-tui exited {took:.1f} s after Ctrl-C"
    assert tui.returncode == 130, err.decode()
    for pid in _pids(pidfile):

        def gone(p: int = pid) -> bool:
            return not _alive(p)

        wait_until(gone, what=f"fake ssh {pid} stopped")


def test_stopping_a_remote_source_ends_its_listing(tmp_path: Path) -> None:
    """RemoteSource.stop() (the UI closing) while ssh is still listing runs: open() returns
    long before the listing's timeout, and the ssh processes are gone."""
    from tdbg.connect.client import ConnectError
    from tdbg.connect.ssh import RemoteOptions
    from tdbg.connect.sshurl import parse_ssh_url
    from tdbg.tui.sources.remote import RemoteSource

    pidfile = tmp_path / "pids"
    ssh = _fake(tmp_path, SILENT_SSH.format(pidfile=pidfile))
    targets = [parse_ssh_url("ssh://node-a"), parse_ssh_url("ssh://node-b")]
    source = RemoteSource(targets, RemoteOptions(ssh=str(ssh)))
    outcome: list[BaseException | None] = []

    def open_it() -> None:
        try:
            source.open(lambda message: None)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=open_it, daemon=True)
    worker.start()
    wait_until(lambda: len(_pids(pidfile)) == 2, 30, "both nodes being listed")
    stopped = time.monotonic()
    source.stop()
    worker.join(LIST_TIMEOUT)
    took = time.monotonic() - stopped
    # Well before the listing's own LIST_TIMEOUT (60 s): stop() ended it, not the timeout.
    assert not worker.is_alive() and took < LIST_TIMEOUT / 3, (
        f"open() returned {took:.1f} s after stop()"
    )
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectError), outcome
    for pid in _pids(pidfile):

        def gone(p: int = pid) -> bool:
            return not _alive(p)

        wait_until(gone, what=f"fake ssh {pid} stopped")


def test_ls_checks_every_argument_before_any_ssh_and_goes_on_past_a_dead_node(
    sshd: sshd_helper.Sshd, runtime_dir: Path
) -> None:
    one_line_error(cli("ls", sshd.url(), "not-ssh"), "'not-ssh'", "ssh:// nodes")
    dead = f"ssh://root@127.0.0.1:{sshd_helper.free_port()}"
    with fake_run(runtime_dir, "alive"):
        out = cli("ls", dead, sshd.url(str(runtime_dir)), *remote(sshd))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("tdbg: error: ") and "refused" in out.stderr
    assert "alive" in out.stdout  # the node that answers is listed all the same


def test_empty_targets_are_usage_errors() -> None:
    for argv in (["dump", ""], ["profile", ""], ["tui", ""], ["tui", "replay", ""]):
        out = cli(*argv)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (argv, out.stderr)
        assert "is empty" in out.stderr and "Traceback" not in out.stderr


GONE_SSH = """#!/bin/sh
echo "$*" >> {log}
case "$*" in
  *--list*) echo '{{"tdbg":"0","protocol":[1,1],"host":"node","runtime_dir":"/tmp","runs":[]}}'
            exit 0;;
esac
echo "tdbg bridge: error: no such socket, metadata file, directory or run: /tmp/r/0-5.sock" >&2
exit 3
"""


def test_a_dropped_run_that_ended_meanwhile_is_watched_for_a_restart(tmp_path: Path) -> None:
    """After a drop, the bridge saying "no run there" (its exit code, not its wording) makes the
    source stop reconnecting and list the node for a restarted run instead."""
    from tdbg.connect.ssh import RemoteOptions
    from tdbg.connect.sshurl import parse_ssh_url
    from tdbg.tui.sources.remote import RemoteSource

    log = tmp_path / "calls"
    ssh = _fake(tmp_path, GONE_SSH.format(log=log))
    source = RemoteSource([parse_ssh_url("ssh://node")], RemoteOptions(ssh=str(ssh)))
    source.remote = parse_ssh_url("ssh://node/tmp/r/0-5.sock")
    source.run = {"name": "mlp", "pid": 5, "start_time": 1.0}
    source.end_reason = "connection lost"
    source.backoff_start = source.backoff_cap = 0.05
    worker = threading.Thread(target=source.reattach, args=(lambda message: None,))
    worker.start()

    def calls() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    try:
        wait_until(lambda: any("--list" in c for c in calls()), 30, "the node listed")
        first = calls()[0]
        assert "--list" not in first and "--socket /tmp/r/0-5.sock" in first
    finally:
        source.stop()
        worker.join(LIST_TIMEOUT)
    assert not worker.is_alive()
