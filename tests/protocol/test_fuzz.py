"""Fuzzing the frame reader, decoder and schema: only ProtocolError may ever escape, and random
bytes on a live probe's socket never kill the probe. About 15 s in all."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import msgpack
from conftest import Reader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdbg.connect.client import ProbeClient
from tdbg.protocol import messages
from tdbg.protocol.framing import MAX_INBOUND_FRAME, Decoder, ProtocolError, pack, preamble
from tdbg.protocol.messages import (
    COMMANDS,
    read_error,
    validate_client_message,
)
from tdbg.protocol.messages.console import ConsoleLines
from tdbg.protocol.messages.jobs import Ack, Job
from tdbg.protocol.messages.reports import ProbeHealth, System
from tdbg.protocol.messages.results import Activations, ProfileResult, result_from_wire

FUZZ = settings(
    deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow], database=None
)
FUZZ_STRUCTURES = settings(FUZZ, max_examples=250)  # recursive values: slower to generate

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=12) | st.binary(max_size=4), inner, max_size=6)
    ),
    max_leaves=40,
)
client_types = st.sampled_from([*messages.CLIENT_TYPES, "nope", ""])
client_messages = st.fixed_dictionaries(
    {"type": client_types | values, "id": values, "args": values},
    optional={"extra": values},
) | st.fixed_dictionaries(
    {
        "type": st.just("hello"),
        "id": st.integers(-5, 2**32),
        "args": st.fixed_dictionaries(
            {"proto_min": values, "proto_max": values}, optional={"client_version": values}
        ),
    }
)


def packb(value: object) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None  # hypothesis made something msgpack itself cannot encode


def drive(data: bytes, cuts: list[int]) -> list[dict]:
    """Feed ``data`` in the pieces ``cuts`` makes, validating every message that comes out."""
    decoder = Decoder(MAX_INBOUND_FRAME)
    out = []
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    try:
        for a, b in zip(bounds, bounds[1:], strict=False):
            for message in decoder.feed(data[a:b]):
                assert isinstance(message, dict) and isinstance(message["type"], str)
                try:
                    out.append(validate_client_message(message))
                except ProtocolError:
                    pass
    except ProtocolError:
        pass
    return out


@FUZZ
@given(st.binary(max_size=512), st.lists(st.integers(0, 600), max_size=8))
def test_random_bytes(data: bytes, cuts: list[int]) -> None:
    drive(data, cuts)
    drive(preamble() + data, cuts)  # past the magic too


@FUZZ
@given(st.lists(st.binary(min_size=1, max_size=200), max_size=6), st.binary(max_size=8))
def test_random_frames(payloads: list[bytes], tail: bytes) -> None:
    data = preamble() + b"".join(struct.pack(">I", len(p)) + p for p in payloads) + tail
    drive(data, [3, 11, 50])


@FUZZ_STRUCTURES
@given(values)
def test_random_msgpack_structures(value: object) -> None:
    payload = packb(value)
    if payload is None or len(payload) > MAX_INBOUND_FRAME:
        return
    drive(preamble() + struct.pack(">I", len(payload)) + payload, [9, 13])


@FUZZ_STRUCTURES
@given(client_messages, st.lists(st.integers(0, 300), max_size=4))
def test_random_client_messages(message: dict, cuts: list[int]) -> None:
    payload = packb(message)
    if payload is None or len(payload) > MAX_INBOUND_FRAME:
        return
    for accepted in drive(preamble() + struct.pack(">I", len(payload)) + payload, cuts):
        # what the schema lets through is exactly the documented shape
        assert set(accepted) == {"type", "id", "args"}
        assert accepted["type"] in messages.CLIENT_TYPES
        assert set(accepted["args"]) <= messages.CLIENT_TYPES[accepted["type"]]
        assert isinstance(accepted["id"], int) and 0 <= accepted["id"] < 2**31


@FUZZ
@given(st.binary(min_size=1, max_size=300))
def test_mutated_valid_stream(noise: bytes) -> None:
    """A valid hello stream with bytes overwritten at a position chosen by the noise."""
    good = bytearray(messages.hello("fuzz") + pack(messages.client_message("ping", 1)))
    pos = noise[0] % len(good)
    good[pos : pos + len(noise) - 1] = noise[1:]
    drive(bytes(good), [pos, pos + 3])


@settings(
    deadline=None,
    max_examples=40,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.binary(min_size=1, max_size=2048), min_size=1, max_size=4), st.booleans())
def test_random_bytes_never_kill_a_live_probe(
    runtime_dir: Path, chunks: list[bytes], after_hello: bool
) -> None:
    import tdbg  # the probe side imports torch: only this test needs it

    probe = _shared_probe(runtime_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    sock.connect(probe.socket_path)
    try:
        if after_hello:
            sock.sendall(messages.hello("fuzz"))
        for chunk in chunks:
            sock.sendall(chunk)
    except OSError:
        pass  # the probe may close on us mid-way: that is its right
    finally:
        sock.close()
    assert isinstance(probe, tdbg.Probe)
    assert probe._server.serving and probe.errors == 0
    assert all(t.is_alive() for t in probe._server._threads)
    assert probe.socket_path is not None
    client = ProbeClient.connect(probe.socket_path)  # a proper client is still served
    assert client.welcome["run"]["name"] == "fuzzed"
    client.close()


_probe_cache: dict[str, object] = {}


def _shared_probe(runtime_dir: Path):
    """One probe for all examples of the live fuzz test (hypothesis reuses the fixture)."""
    from torch import nn

    import tdbg

    key = str(runtime_dir)
    if key not in _probe_cache:
        _probe_cache.clear()
        _probe_cache[key] = tdbg.watch(nn.Linear(2, 2), name="fuzzed", directory=runtime_dir)
    return _probe_cache[key]


def test_probe_still_serves_a_proper_client_after_fuzzing(runtime_dir: Path) -> None:
    """Run after the live fuzz test in the same module: a fresh probe, garbage from many
    connections at once, then a normal client."""
    from torch import nn

    import tdbg

    probe = tdbg.watch(nn.Linear(2, 2), name="after-fuzz")
    path = probe.socket_path
    assert path is not None
    junk = [
        b"\xff" * 100,
        b"TDBG\x00\x01\x00\x01" + b"\xff\xff\xff\xff",
        messages.hello("x") + b"\x00\x00\x00\x05\xc1\xc1",
        messages.hello("x") + pack({"type": "ping", "id": -1, "args": {}}) * 50,
        b"TDBG",
    ]
    socks = []
    for data in junk:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        try:
            s.sendall(data)
        except OSError:
            pass
        socks.append(s)
    reader = Reader(path)
    for i in range(3):
        probe.step(float(i))
    reader.wait(lambda r: len(r.records()) >= 3)
    assert [r.loss for r in reader.records()] == [0.0, 1.0, 2.0]
    assert probe.errors == 0
    for s in socks:
        s.close()
    reader.close()


RESULT_KEYS = (
    "rows steps trace sort device wall_seconds total_self_cpu total_self_device truncated file top "
    "active_bytes reserved_bytes history_owner found phase module module_type nonfinite numel "
    "input_min input_max input_nonfinite params_nonfinite steps_checked trigger check_nan errors "
    "name calls self_cpu cpu_total path size site bytes count"
).split()
result_like = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(RESULT_KEYS) | st.text(max_size=4), inner, max_size=8)
    ),
    max_leaves=30,
)


def _typed(value: object, number: bool = False) -> bool:
    """Every leaf a reader hands on is None, a bool, a number, a str, or a list/map of those."""
    if value is None or isinstance(value, bool | int | float | str):
        return not (number and isinstance(value, str))
    if isinstance(value, list):
        return all(_typed(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _typed(v) for k, v in value.items())
    return False


ROW_KEYS = ("name", "calls", "self_cpu", "cpu_total", "self_device", "device_total")
profile_like = st.fixed_dictionaries(
    {"rows": st.lists(st.dictionaries(st.sampled_from(ROW_KEYS), scalars) | scalars, max_size=4)},
    optional={k: scalars for k in ("steps", "trace", "sort", "device", "wall_seconds")},
)


def _numbers(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


@FUZZ_STRUCTURES
@given(command=st.just("profile"), result=profile_like)
def test_profile_reader_types_every_row(command: str, result: dict[str, object]) -> None:
    read = result_from_wire(command, result)
    assert isinstance(read, ProfileResult)
    for row in read.rows:
        assert isinstance(row.name, str)
        assert all(_numbers(getattr(row, k)) for k in ROW_KEYS[1:])
    assert _numbers(read.wall_seconds) and isinstance(read.device, bool)


@FUZZ_STRUCTURES
@given(
    command=st.sampled_from([*COMMANDS, "?"]),
    result=result_like,
    message=st.dictionaries(
        st.sampled_from(["job", "command", "state", "step", "done", "total", "args", "id"])
        | st.text(max_size=4),
        result_like,
        max_size=8,
    ),
)
def test_readers_never_raise_and_hand_on_only_typed_values(
    command: str, result: object, message: dict[str, object]
) -> None:
    """A hostile probe's result or message reads as a typed value (bad figures as None, bad
    entries dropped), never an exception and never a value of a type the definition lacks."""
    read = result_from_wire(command, result)
    assert read is None or _typed(read.to_wire())
    job = Job.from_wire(dict(message, result=result, command=command))
    assert job is None or (isinstance(job.job, int) and _typed(job.to_wire()["result"]))
    out = read_error(message)
    assert out is None or isinstance(out, dict)
    for report in (System, ProbeHealth):
        assert _typed(report.from_wire(message).to_wire(), number=False)
    for kind in (Ack, Activations, ConsoleLines):
        typed = kind.from_wire(message)
        assert typed is None or _typed(typed.to_wire(), number=False)
    lines = ConsoleLines.from_wire(dict(message, seq=3, text=result, stream=result, open=result))
    assert lines is not None and len(lines.texts) == len(lines.streams)
    assert all(isinstance(t, str) for t in lines.texts) and set(lines.streams) <= {1, 2}
    acts = Activations.from_wire(dict(message, names=["a", "b"], mean=result))
    assert acts is not None and len(acts.mean) == 2
