"""The probe's socket server against real clients, rude ones included."""

from __future__ import annotations

import faulthandler
import io
import json
import multiprocessing
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import Loop, Reader, wait_until
from torch import nn
from waiting import TIMEOUT

import tdbg
from tdbg.connect import runtime
from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.probe.serving import clients, connection, server
from tdbg.protocol import framing, messages
from tdbg.protocol.framing import MAX_INBOUND_FRAME, MAX_OUTBOUND_FRAME, Decoder, ErrorCode
from tdbg.protocol.stall import DEFAULT_STALL_RULE, StallRule

REPO = Path(__file__).resolve().parents[2]


class Raw:
    """A hand-driven client socket: send exact bytes, read and decode what comes back."""

    def __init__(self, path: str, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect(path)
        self.decoder = Decoder(MAX_OUTBOUND_FRAME)
        self.messages: list[dict] = []
        self.eof = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def handshake(self) -> None:
        self.send(messages.hello("raw"))
        self.read_until(lambda: any(m["type"] == "synced" for m in self.messages))

    def message(self, mtype: str, mid: int, **args: object) -> None:
        self.send(framing.pack(messages.client_message(mtype, mid, **args), MAX_INBOUND_FRAME))

    def read_until(self, condition, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("condition not met before the deadline")
            if self.eof:
                raise AssertionError(f"closed early; got {[m['type'] for m in self.messages]}")
            self.sock.settimeout(min(left, 0.2))
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.eof = True
                continue
            self.messages.extend(self.decoder.feed(chunk))

    def read_to_eof(self, timeout: float = TIMEOUT) -> None:
        try:
            self.read_until(lambda: self.eof, timeout)
        except AssertionError:
            if not self.eof:
                raise

    def of(self, mtype: str) -> list[dict]:
        return [m for m in self.messages if m["type"] == mtype]

    def close(self) -> None:
        self.sock.close()


def serving(loop: Loop, **kwargs: object) -> tuple[tdbg.Probe, str]:
    probe = tdbg.watch(loop.model, loop.opt, **kwargs)
    assert probe.socket_path is not None
    return probe, probe.socket_path


def shrink_send_buffer(probe: tdbg.Probe) -> None:
    """Make the kernel absorb ~4 KiB instead of ~200 KiB for each attached client, so a
    stalled client backs up into the probe's own buffer within a few steps."""
    for conn in list(probe.clients):
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def tdbg_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tdbg-")]


# --- fan-out and client limits --------------------------------------------------------------


def test_several_clients_get_the_same_steps(runtime_dir: Path) -> None:
    loop = Loop()
    probe, path = serving(loop, grad_every=1)
    readers = [Reader(path) for _ in range(3)]
    loop.run(25, probe)
    for r in readers:
        r.wait(lambda r: len(r.records()) >= 25)
    first = readers[0].records()
    assert [x.loss for x in first] == loop.losses
    for r in readers[1:]:
        recs = r.records()
        assert [x.step for x in recs] == [x.step for x in first]
        assert [x.loss for x in recs] == [x.loss for x in first]
        assert [x.grad_norms for x in recs] == [x.grad_norms for x in first]
    assert len(tdbg_threads()) <= 2  # selector-based, no thread per client
    for r in readers:
        r.close()


def test_a_ninth_client_gets_busy(runtime_dir: Path) -> None:
    loop = Loop()
    probe, path = serving(loop)
    readers = [Reader(path) for _ in range(clients.MAX_CLIENTS)]
    assert len(tdbg_threads()) <= 2  # still two with a full house
    with pytest.raises(ConnectError, match="refused.*8 clients"):
        ProbeClient.connect(path)
    raw = Raw(path)
    raw.read_to_eof()
    (err,) = raw.of("error")
    assert err["code"] == ErrorCode.BUSY
    raw.close()
    # the eight keep being served, and a slot frees when one leaves
    loop.run(3, probe)
    for r in readers:
        r.wait(lambda r: len(r.records()) >= 3)
    readers[0].close()
    wait_until(lambda: len(probe.clients) < clients.MAX_CLIENTS)
    late = Reader(path)
    late.wait(lambda r: len(r.records()) >= 3)
    for r in [late, *readers[1:]]:
        r.close()


def test_client_killed_mid_frame_does_not_disturb_others(runtime_dir: Path) -> None:
    loop = Loop()
    probe, path = serving(loop)
    healthy = Reader(path)
    script = textwrap.dedent(
        f"""
        import socket, sys, time
        from tdbg.protocol import framing, messages
        s = socket.socket(socket.AF_UNIX)
        s.connect({path!r})
        s.sendall(messages.hello("victim"))
        frame = framing.pack(messages.client_message("ping", 1), framing.MAX_INBOUND_FRAME)
        s.sendall(frame[:5])  # half a frame
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        wait_until(lambda: len(probe.clients) == 2, what="victim attached")
        loop.run(5, probe)
        child.send_signal(signal.SIGKILL)
        child.wait(TIMEOUT)
        loop.run(5, probe)
        healthy.wait(lambda r: len(r.records()) >= 10)
        assert [x.loss for x in healthy.records()] == loop.losses
        wait_until(lambda: len(probe.clients) == 1, what="victim dropped")
        assert probe.errors == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        healthy.close()


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow-consumer limits small enough to reach in a second (semantics kept)."""
    monkeypatch.setattr(connection, "HARD_LIMIT", 256 << 10)
    monkeypatch.setattr(connection, "SOFT_LIMIT", 64 << 10)
    monkeypatch.setattr(connection, "SOFT_LIMIT_SECONDS", 0.3)


def wide_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Many tiny layers: each sampled step carries a long row of per-layer norms."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(100)])
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def test_a_stalled_client_never_blocks_training_and_is_dropped(
    runtime_dir: Path, small_limits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that stops reading while the loop runs flat out: every step returns (a
    blocked send would hang it), the probe's buffer for it stays bounded, it is dropped as a
    slow consumer, and a healthy client beside it gets every step. What it costs the training
    thread in time is benchmarks/slow_client.py's figure, not a test's."""
    monkeypatch.setattr(connection, "HARD_LIMIT", 48 << 10)
    monkeypatch.setattr(connection, "SOFT_LIMIT", 16 << 10)
    model, opt = wide_model()
    probe = tdbg.watch(model, opt, grad_every=1)
    path = probe.socket_path
    assert path is not None
    healthy = Reader(path)
    stalled = Raw(path, rcvbuf=4096)
    stalled.handshake()  # then never reads again
    shrink_send_buffer(probe)
    x = torch.randn(4, 2)
    max_queued = 0
    n = 0

    def step_until_dropped() -> bool:
        nonlocal n, max_queued
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
        n += 1
        conns = [c for c in probe.clients if c.peer_pid == os.getpid()]
        max_queued = max([max_queued] + [len(c.outbuf) for c in conns])
        return n >= 20 and len(probe.clients) == 1  # the stalled one is gone

    wait_until(step_until_dropped, what="the stalled client dropped")
    # bounded: the hard limit plus at most one tick's worth of frames
    assert 0 < max_queued <= connection.HARD_LIMIT + (256 << 10)
    healthy.wait(lambda r: len(r.records()) >= n)
    assert [r.step for r in healthy.records()] == list(range(n))
    stalled.read_to_eof()  # what it gets is a clean prefix of frames, then the close
    assert stalled.eof
    healthy.close()
    stalled.close()


def test_training_goes_on_with_a_stalled_client_attached(runtime_dir: Path) -> None:
    """A client that never reads, under the limits: the loop's steps all reach a healthy
    client, and the stalled one stays attached (it is dropped for what it holds unread, never
    for being slow alone). The step rate beside it is benchmarks/slow_client.py's figure."""
    loop = Loop()
    probe, path = serving(loop, grad_every=1)
    stalled = Raw(path, rcvbuf=4096)
    stalled.handshake()  # then never reads again
    healthy = Reader(path)
    loop.run(300, probe)
    healthy.wait(lambda r: len(r.records()) >= 300, what="all 300 steps at the healthy client")
    assert [r.step for r in healthy.records()] == list(range(300))
    assert len(probe.clients) == 2  # both still attached
    healthy.close()
    stalled.close()


# --- handshake and framing ------------------------------------------------------------------


def test_a_wrong_preamble_closes_the_connection(runtime_dir: Path) -> None:
    loop = Loop()
    probe, path = serving(loop)
    raw = Raw(path)
    raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    raw.read_to_eof()
    assert raw.eof
    assert not raw.of("welcome")
    raw.close()
    reader = Reader(path)  # the probe still serves
    loop.run(1, probe)
    reader.wait(lambda r: r.records())
    reader.close()


def test_no_hello_by_the_handshake_deadline_closes(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "HANDSHAKE_SECONDS", 0.3)
    _, path = serving(Loop())
    silent = Raw(path)
    preamble_only = Raw(path)
    preamble_only.send(framing.preamble())
    for raw in (silent, preamble_only):
        raw.read_to_eof()  # closed at HANDSHAKE_SECONDS: no need of the 30 s ceiling
        assert raw.eof and not raw.of("welcome")
        raw.close()


def test_the_handshake_deadline_is_not_too_eager(runtime_dir: Path) -> None:
    _, path = serving(Loop())
    raw = Raw(path)
    raw.send(framing.preamble())
    raw.sock.settimeout(0.5)  # well inside 5 s: still open, nothing sent but the preamble
    data = b""
    with pytest.raises(TimeoutError):
        while True:
            chunk = raw.sock.recv(100)
            assert chunk, "closed before the handshake deadline"
            data += chunk
    assert data == framing.preamble()
    raw.close()


def test_a_frame_started_and_never_finished_is_closed(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "FRAME_SECONDS", 0.3)
    _, path = serving(Loop())
    raw = Raw(path)
    raw.handshake()
    raw.send(b"\x00\x00")  # the first bytes of a frame, then nothing
    raw.read_to_eof()
    assert raw.eof
    raw.close()


def test_an_unsupported_protocol_version_gets_an_error_then_close(runtime_dir: Path) -> None:
    _, path = serving(Loop())
    raw = Raw(path)
    raw.send(messages.hello("future", proto_min=7, proto_max=9))
    raw.read_to_eof()
    assert raw.eof
    assert [m["type"] for m in raw.messages] == ["error"]
    assert raw.messages[0]["code"] == ErrorCode.UNSUPPORTED_VERSION
    assert "1-1" in raw.messages[0]["message"]
    raw.close()


def test_an_overlapping_version_range_gets_welcome(runtime_dir: Path) -> None:
    _, path = serving(Loop())
    raw = Raw(path)
    raw.send(messages.hello("newer", proto_min=1, proto_max=5))
    raw.read_until(lambda: bool(raw.of("welcome")))
    assert raw.of("welcome")[0]["proto"] == 1
    # The probe announces the stall rule its own ``stalled`` alert follows.
    assert StallRule.from_wire(raw.of("welcome")[0]["run"]["stall"]) == DEFAULT_STALL_RULE
    assert raw.decoder.peer_versions == (framing.PROTO_MIN, framing.PROTO_MAX)
    raw.close()


def test_first_message_must_be_hello(runtime_dir: Path) -> None:
    _, path = serving(Loop())
    raw = Raw(path)
    raw.send(framing.preamble())
    raw.message("ping", 3)
    raw.read_to_eof()
    assert [m["type"] for m in raw.messages] == ["error"]
    assert raw.messages[0]["code"] == ErrorCode.BAD_MESSAGE and raw.messages[0]["id"] == 3
    raw.close()


def test_an_invalid_message_gets_an_error_and_the_connection_stays_open(runtime_dir: Path) -> None:
    _, path = serving(Loop())
    raw = Raw(path)
    raw.handshake()
    raw.message("rm_rf", 5)
    raw.message("ping", 6, extra="x")
    raw.message("ping", 7)
    raw.read_until(lambda: bool(raw.of("pong")))
    errors = raw.of("error")
    assert [(e["code"], e["id"]) for e in errors] == [
        (ErrorCode.UNKNOWN_COMMAND, 5),
        (ErrorCode.BAD_MESSAGE, 6),
    ]
    assert raw.of("pong") == [{"type": "pong", "id": 7}]
    raw.close()


def test_an_undecodable_frame_gets_an_error_then_close(runtime_dir: Path) -> None:
    loop = Loop()
    probe, path = serving(loop)
    raw = Raw(path)
    raw.handshake()
    raw.send(b"\x00\x00\x00\x04\xc1\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    raw.read_to_eof()
    assert raw.eof
    assert raw.of("error")[-1]["code"] == ErrorCode.BAD_MESSAGE
    raw.close()
    oversized = Raw(path)
    oversized.handshake()
    oversized.send((MAX_INBOUND_FRAME + 1).to_bytes(4, "big"))  # no payload follows
    oversized.read_to_eof()
    assert oversized.of("error")[-1]["code"] == ErrorCode.BAD_FRAME
    oversized.close()
    assert probe.errors == 0


def test_too_many_errors_close_the_connection(runtime_dir: Path) -> None:
    _, path = serving(Loop())
    raw = Raw(path)
    raw.handshake()
    for i in range(connection.ERRORS_PER_MINUTE + 1):
        raw.message("nope", i)
    raw.read_to_eof()
    assert raw.eof
    assert len(raw.of("error")) == connection.ERRORS_PER_MINUTE + 1
    raw.close()


def test_more_than_twenty_commands_a_second_are_rate_limited(runtime_dir: Path) -> None:
    _, path = serving(Loop())
    raw = Raw(path)
    raw.handshake()
    raw.send(
        b"".join(
            framing.pack(messages.client_message("ping", i), MAX_INBOUND_FRAME)
            for i in range(1, 81)
        )
    )
    raw.read_until(lambda: len(raw.of("pong")) + len(raw.of("error")) >= 80)
    limited = [e for e in raw.of("error") if e["code"] == ErrorCode.RATE_LIMITED]
    pongs = raw.of("pong")
    # burst of 40 (plus what refills while the 80 arrive), the rest refused
    assert 40 <= len(pongs) <= 50, len(pongs)
    assert len(limited) == 80 - len(pongs)
    assert not raw.eof  # rate limiting is not a disconnect
    raw.message("ping", 999)
    raw.read_until(lambda: any(m.get("id") == 999 for m in raw.messages))
    raw.close()


# --- the runtime directory and files ----------------------------------------------------------


def test_the_runtime_dir_socket_and_metadata_are_private_to_the_user(
    monkeypatch: pytest.MonkeyPatch, runtime_dir: Path
) -> None:
    fresh = runtime_dir / "made-by-probe"
    monkeypatch.setenv("TDBG_RUNTIME_DIR", str(fresh))
    umask = os.umask(0o022)
    os.umask(umask)
    probe = tdbg.watch(nn.Linear(2, 2), name="modes")
    sock = Path(probe.socket_path)  # type: ignore[arg-type]
    assert os.umask(umask) == umask  # never changed
    assert sock.parent == fresh
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    meta_path = sock.with_suffix(".json")
    assert stat.S_IMODE(os.lstat(meta_path).st_mode) == 0o600
    meta = json.loads(meta_path.read_text())
    assert meta["pid"] == os.getpid() and meta["socket"] == str(sock)
    assert meta["name"] == "modes" and meta["proto_max"] == framing.PROTO_MAX
    assert sock.name == f"0-{os.getpid()}.sock"  # named <rank>-<pid>.sock
    assert len(os.fsencode(sock)) <= runtime.MAX_SOCKET_PATH
    probe.close()


def test_the_socket_name_carries_the_rank(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    probe = tdbg.watch(nn.Linear(2, 2))
    assert Path(probe.socket_path).name == f"3-{os.getpid()}.sock"  # type: ignore[arg-type]


def test_a_runtime_dir_too_long_for_a_socket_path_falls_back_to_a_short_one(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = runtime_dir / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    os.chmod(deep.parent, 0o700)
    probe = tdbg.watch(nn.Linear(2, 2), directory=deep)
    path = probe.socket_path
    assert path is not None
    assert len(os.fsencode(path)) <= runtime.MAX_SOCKET_PATH
    assert Path(path).parent == runtime.short_fallback_dir()
    probe.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("kind", ["mode-0755", "symlink"])
def test_an_unsafe_runtime_dir_means_no_serving_but_training_goes_on(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_log: io.StringIO, kind: str
) -> None:
    target = runtime_dir / "real"
    target.mkdir(mode=0o700)
    if kind == "mode-0755":
        os.chmod(target, 0o755)
        unsafe = target
    else:
        unsafe = runtime_dir / "link"
        unsafe.symlink_to(target)
    monkeypatch.setenv("TDBG_RUNTIME_DIR", str(unsafe))
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    loop.run(5, probe)
    assert probe.socket_path is None
    assert probe.steps == 5 and probe.errors == 0
    assert os.listdir(target) == []
    lines = probe_log.getvalue().splitlines()
    assert len(lines) == 1 and "not serving" in lines[0], lines
    assert tdbg_threads() == []
    probe.close()


def proc_net(name: str) -> list[list[str]]:
    with open(f"/proc/net/{name}") as f:
        return [line.split() for line in f.readlines()[1:]]


def own_socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


@pytest.mark.skipif(not os.path.exists("/proc/net/unix"), reason="Linux /proc needed")
def test_the_probe_listens_only_on_a_pathname_unix_socket(runtime_dir: Path) -> None:
    def tcp_listeners() -> set[tuple[str, str]]:
        out = set()
        for name in ("tcp", "tcp6"):
            if os.path.exists(f"/proc/net/{name}"):
                out |= {(row[1], row[9]) for row in proc_net(name) if row[3] == "0A"}
        return out

    before = tcp_listeners()
    loop = Loop()
    probe, path = serving(loop)
    reader = Reader(path)
    loop.run(3, probe)
    reader.wait(lambda r: len(r.records()) >= 3)
    ours = own_socket_inodes()
    # New listeners of this process only: the machine's others (another xdist worker's sshd or
    # torchrun store, another checkout's suite) come and go meanwhile.
    assert {(local, inode) for local, inode in tcp_listeners() - before if inode in ours} == set()
    tcp_inodes = {row[9] for n in ("tcp", "tcp6", "udp", "udp6") for row in proc_net(n)}
    assert not (ours & tcp_inodes), "the probe opened an inet socket"
    unix = {row[6]: (row[7] if len(row) > 7 else "") for row in proc_net("unix")}
    our_unix_paths = [unix[i] for i in ours if i in unix]
    assert path in our_unix_paths
    assert not any(p.startswith("@") for p in our_unix_paths), our_unix_paths
    assert not any("tdbg" in p for p in unix.values() if p.startswith("@"))
    reader.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_another_uid_is_refused_before_a_byte(runtime_dir: Path, probe_log: io.StringIO) -> None:
    _, path = serving(Loop())
    os.chmod(runtime_dir, 0o711)  # let the other uid reach the socket (the test's doing)
    os.chmod(path, 0o666)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, connect, report what arrived
        try:
            os.close(r)
            faulthandler.dump_traceback_later(20, exit=True)  # never hang the suite
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(3.0)
            s.connect(path)
            data = s.recv(100)  # an accepted peer would get the preamble at once
            os.write(w, b"EOF" if data == b"" else b"DATA:" + data)
        except BaseException as exc:
            os.write(w, f"EXC:{exc!r}".encode())
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        result = f.read()
    os.chmod(runtime_dir, 0o700)
    assert result in (b"EOF", b"EXC:ConnectionResetError(104, 'Connection reset by peer')")
    wait_until(lambda: "refused a connection from uid 65534" in probe_log.getvalue())


def test_a_stale_socket_of_our_name_is_replaced(runtime_dir: Path) -> None:
    stale = runtime_dir / f"0-{os.getpid()}.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens: ECONNREFUSED
    assert not runtime.probe_socket(stale)
    probe = tdbg.watch(nn.Linear(2, 2))
    assert probe.socket_path == str(stale)
    assert runtime.probe_socket(stale)  # bound anew (the inode number may well be reused)
    reader = Reader(stale)
    reader.wait(lambda r: r.of("synced"))
    reader.close()


def test_a_live_socket_of_our_name_is_left_alone(runtime_dir: Path) -> None:
    taken = runtime_dir / f"0-{os.getpid()}.sock"
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(taken))
    other.listen(1)
    try:
        probe = tdbg.watch(nn.Linear(2, 2))
        assert probe.socket_path == str(runtime_dir / f"0-{os.getpid()}-1.sock")
        probe.close()
        assert taken.exists()  # not ours: never unlinked
    finally:
        other.close()


def test_a_file_in_our_sockets_place_is_refused(runtime_dir: Path, probe_log: io.StringIO) -> None:
    squatter = runtime_dir / f"0-{os.getpid()}.sock"
    squatter.write_text("precious")
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    loop.run(2, probe)
    assert probe.socket_path is None
    assert squatter.read_text() == "precious"
    assert "not a socket" in probe_log.getvalue()


def test_discovery_hides_and_cleans_up_dead_runs(runtime_dir: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale_sock = runtime_dir / f"0-{dead.pid}.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale_sock))
    s.close()
    stale_meta = stale_sock.with_suffix(".json")
    runtime.write_private_json(
        stale_meta, {"pid": dead.pid, "socket": str(stale_sock), "start_time": 1.0}
    )
    (runtime_dir / f"0-{dead.pid}.sock.lock").touch()
    probe = tdbg.watch(nn.Linear(2, 2), name="alive")
    runs = runtime.discover(runtime_dir)
    assert [r.name for r in runs] == ["alive"]
    assert runs[0].pid == os.getpid() and str(runs[0].socket) == probe.socket_path
    assert not stale_sock.exists() and not stale_meta.exists()
    assert sorted(os.listdir(runtime_dir)) == sorted(
        p.name for p in (Path(probe.socket_path), Path(probe.socket_path).with_suffix(".json"))
    ) + [Path(probe.socket_path).name + ".lock"]
    probe.close()
    assert runtime.discover(runtime_dir) == []


def test_a_removed_socket_is_detected_and_rebound(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_log: io.StringIO
) -> None:
    monkeypatch.setattr(server, "INODE_CHECK_SECONDS", 0.1)
    loop = Loop()
    probe, path = serving(loop)
    os.unlink(path)
    wait_until(lambda: os.path.exists(path), what="socket rebound")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    wait_until(lambda: Path(path).with_suffix(".json").exists(), what="metadata rewritten")
    assert "removed or replaced" in probe_log.getvalue()
    reader = Reader(path)
    loop.run(3, probe)
    reader.wait(lambda r: len(r.records()) >= 3)
    reader.close()
    probe.close()
    assert os.listdir(runtime_dir) == []


def test_a_socket_replaced_by_someone_else_is_not_unlinked(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "INODE_CHECK_SECONDS", 0.1)
    loop = Loop()
    probe, path = serving(loop)
    # Replaced in one rename: an unlink, then a write, left a moment in which the probe (its
    # check every 0.1 s) could bind its socket there anew, and the write then failed (ENXIO).
    other = Path(path).with_name("someone-else.tmp")
    other.write_text("someone else's file")
    os.replace(other, path)
    wait_until(lambda: not probe._server.endpoint.listener, what="probe gave up the name")
    loop.run(3, probe)  # training unaffected
    probe.close()
    assert Path(path).read_text() == "someone else's file"  # not ours, not removed


def test_a_file_that_got_the_freed_socket_s_inode_number_is_not_ours(runtime_dir: Path) -> None:
    """Some file systems hand a freed inode's number to the next file at once (ext4 here): a file
    put where the probe's socket was, after it was removed and the probe closed it to bind
    anew, may carry the socket's old number. It is not the probe's, and closing the probe
    leaves it (the race of the test above, made certain: the probe's check compared the inode
    number alone, and unlinked the file)."""
    from tdbg.probe.serving.endpoint import Endpoint

    endpoint = Endpoint(0, {"name": "inode-reuse"}, runtime_dir)  # type: ignore[typeddict-item]
    endpoint.open()
    assert endpoint.still_ours()
    path = endpoint.path
    assert path is not None
    old_number = os.stat(path).st_ino
    os.unlink(path)  # removed: the probe closes its socket (freeing the inode) to bind anew
    endpoint.close()
    # Someone's file there before the new bind (which then refuses), with the socket's old
    # inode number: made in the same directory until the file system hands that number out.
    for attempt in range(50):
        candidate = runtime_dir / f"someone-{attempt}"
        candidate.write_text("someone else's file")
        if os.stat(candidate).st_ino == old_number:
            candidate.rename(path)
            break
    else:
        pytest.skip("this file system does not hand out a freed inode number at once")
    assert not endpoint.still_ours()
    endpoint.close()  # probe.close()
    assert path.read_text() == "someone else's file"
    for leftover in runtime_dir.iterdir():
        leftover.unlink()


# --- lifecycle --------------------------------------------------------------------------------


def test_close_does_not_wait_for_a_stalled_client(runtime_dir: Path, small_limits: None) -> None:
    """close() with a client that never reads and a full kernel buffer: it returns (waiting
    for that client would hang it), and the socket, the metadata and the threads are gone."""
    model, opt = wide_model()
    probe = tdbg.watch(model, opt, grad_every=1)
    path = probe.socket_path
    assert path is not None
    stalled = Raw(path, rcvbuf=4096)
    stalled.handshake()
    shrink_send_buffer(probe)
    x = torch.randn(4, 2)
    conn = probe.clients[0]

    def step() -> bool:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
        return False  # one step more: the condition after `or` decides

    # bytes left over after a flush: the kernel's buffer is full
    wait_until(lambda: step() or conn.outbuf, what="the stalled client backed up")
    probe.close()
    assert not os.path.exists(path)
    assert os.listdir(runtime_dir) == []
    wait_until(lambda: not tdbg_threads(), what="threads gone")
    stalled.close()


def test_clients_get_a_bye_on_close(runtime_dir: Path) -> None:
    loop = Loop()
    probe, path = serving(loop)
    reader = Reader(path)
    loop.run(3, probe)
    reader.wait(lambda r: len(r.records()) >= 3)
    probe.close()
    reader.wait(lambda r: r.ended)
    assert reader.messages[-1] == {"type": "bye", "reason": "shutdown"}


def test_a_forked_childs_probe_is_inert(runtime_dir: Path) -> None:
    loop = Loop()
    probe, path = serving(loop)
    loop.run(2, probe)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(r)
            faulthandler.dump_traceback_later(20, exit=True)  # never hang the suite
            # (no backward here: torch's autograd itself deadlocks in a forked child once the
            # parent has run backward; the forward hooks and probe.step are what matter)
            with torch.no_grad():
                loop.model(loop.x)
            for i in range(3):
                probe.step(float(i))  # steps in the child are no-ops
            checks = [
                probe.closed,
                probe.socket_path is None,
                probe.steps == 2,
                len(loop.model._forward_hooks) == 0,
                not tdbg_threads(),
                os.path.exists(path),
            ]
            probe.close()
            tdbg.probe.watch._close_all()  # what atexit would run
            checks.append(os.path.exists(path))  # the parent's files untouched
            os.write(w, json.dumps(checks).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        checks = json.loads(f.read())
    assert os.waitstatus_to_exitcode(status) == 0
    assert checks == [True] * 7
    assert os.path.exists(path) and not probe.closed
    reader = Reader(path)  # the parent still serves
    loop.run(3, probe)
    reader.wait(lambda r: len(r.records()) >= 5)
    assert [x.loss for x in reader.records()] == loop.losses
    reader.close()


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i) / 16)
        return x, x.sum(dim=0, keepdim=True)


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_dataloader_workers_neither_serve_nor_disturb_the_probe(
    runtime_dir: Path, context: str
) -> None:
    """Two epochs: forked workers are made anew each epoch; spawned ones (each imports torch,
    seconds apiece on a busy machine) are started once and kept."""
    loop = Loop()
    probe, path = serving(loop)
    reader = Reader(path)
    loader = torch.utils.data.DataLoader(
        Squares(),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context(context),
        persistent_workers=context == "spawn",
        timeout=60,
    )
    n = 0
    for _ in range(2):
        for x, y in loader:
            assert loop.opt is not None
            loop.opt.zero_grad()
            loss = ((loop.model(x) - y) ** 2).mean()
            loss.backward()
            loop.opt.step()
            probe.step(loss)
            n += 1
    assert n == 8
    reader.wait(lambda r: len(r.records()) >= n)
    socks = [p for p in os.listdir(runtime_dir) if p.endswith(".sock")]
    assert socks == [Path(path).name]
    assert len(probe.clients) == 1
    reader.close()


def test_a_client_that_never_reads_is_dropped_with_a_goodbye_that_says_why(
    runtime_dir: Path, small_limits: None
) -> None:
    """Unread data over the soft limit and nothing taken for SOFT_LIMIT_SECONDS: dropped, and
    what it reads afterwards is complete frames, then the bye with the reason (not megabytes
    of stale steps first, cut off mid-frame)."""
    model, opt = wide_model()
    probe = tdbg.watch(model, opt, grad_every=1)
    path = probe.socket_path
    assert path is not None
    stalled = Raw(path, rcvbuf=4096)
    stalled.handshake()  # then never reads again
    shrink_send_buffer(probe)
    x = torch.randn(4, 2)
    n = 0

    def step() -> bool:
        nonlocal n
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        probe.step()
        n += 1
        return False  # one step more: the condition after `or` decides

    wait_until(
        lambda: step() or not any(c.peer_pid == os.getpid() for c in probe.clients),
        30.0,
        "the stalled client dropped",
    )
    stalled.read_to_eof()
    byes = stalled.of("bye")
    assert byes and byes[-1]["reason"] == "slow_consumer"
    assert stalled.messages[-1]["type"] == "bye"
    unread = sum(len(framing.pack(m)) for m in stalled.messages if m["type"] == "steps")
    assert unread < 4 * connection.HARD_LIMIT  # the queue was cut, not delivered
    stalled.close()


def test_tdbg_dump_says_why_the_probe_dropped_it(runtime_dir: Path, small_limits: None) -> None:
    """The real ``tdbg dump`` with its stdout unread (a pipe nobody drains): it stops reading
    the socket, the probe drops it, and once its output is read it ends with the reason — as
    its last event and as one line on stderr — not a bare ``disconnected``."""
    model, opt = wide_model()
    probe = tdbg.watch(model, opt, grad_every=1)
    path = probe.socket_path
    assert path is not None
    x = torch.randn(4, 2)

    def step() -> bool:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        probe.step()
        return False  # one step more: the condition after `or` decides

    def attached() -> bool:
        return any(c.peer_pid == dump.pid for c in probe.clients)

    dump = subprocess.Popen(
        [sys.executable, "-m", "tdbg.cli", "dump", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: step() or attached(), what="tdbg dump attached")
        shrink_send_buffer(probe)
        wait_until(lambda: step() or not attached(), what="the stalled tdbg dump dropped")
        out, err = dump.communicate(timeout=TIMEOUT)
    finally:
        if dump.poll() is None:
            dump.kill()
            dump.communicate()
    assert dump.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"type": "end", "reason": "slow_consumer"}
    assert err == (
        "tdbg: the probe dropped this client: it read too slowly (over 1 MiB unread for 10 s); "
        "the run goes on\n"
    )


async def test_the_tui_header_says_why_the_probe_dropped_it(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real app on a real probe whose hard limit is 0 bytes: every client is a slow
    consumer at its first live frame (the TUI itself reads too fast to be one). The header
    says why the run ended for it. No run is discoverable where it looks for a restart, so
    it stays on that verdict instead of reattaching."""
    from waiting import wait_for

    from tdbg.tui.app import make_app, screen_text
    from tdbg.tui.sources.base import SocketSource

    monkeypatch.setattr(connection, "HARD_LIMIT", 0)
    loop = Loop()
    probe, path = serving(loop)
    nowhere = tmp_path / "no-runs"
    nowhere.mkdir(mode=0o700)
    app = make_app(SocketSource(path=path, directory=nowhere))
    async with app.run_test(size=(160, 48)) as pilot:
        header = app.query_one("RunHeader")

        def step_until_ended() -> bool:
            if header.has_class("-ended"):
                return True
            loop.step(probe)
            return False

        await wait_for(pilot, step_until_ended, what="the TUI dropped and its header ended")
        await wait_for(
            pilot,
            lambda: "ended: dropped: this viewer read too slowly" in screen_text(app),
            what="the reason, in words, in the header",
        )


def test_a_waiting_client_that_never_attaches_holds_an_ending_run_only_so_long(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client waiting for a run here (its note: tdbg dump or tdbg-tui with no TARGET) holds a
    run that ends before it attached, so that it still gets it (tests/e2e/test_short_runs.py);
    one that never looks holds it LINGER_SECONDS at most: the run closes all the same."""
    monkeypatch.setattr(server, "LINGER_SECONDS", 1.0)
    waiter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (runtime_dir / f"{waiter.pid}{runtime.WAITING_SUFFIX}").touch()
    try:
        assert runtime.waiting_pids(runtime_dir) == {waiter.pid}
        loop = Loop()
        probe, path = serving(loop)
        loop.run(3, probe)
        closing = threading.Thread(target=probe.close)
        closing.start()
        closing.join(TIMEOUT)
        assert not closing.is_alive()
        assert not os.path.exists(path) and runtime.discover(runtime_dir) == []
    finally:
        waiter.kill()
        waiter.wait()
    assert runtime.waiting_pids(runtime_dir) == set()  # a dead client's note is cleared
