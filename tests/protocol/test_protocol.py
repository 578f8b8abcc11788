"""The sans-IO wire: frames, the decoder, the client-message schema, negotiation, step batches."""

from __future__ import annotations

import math
import pickle
import struct
from typing import Any

import msgpack
import pytest

from tdbg.protocol import framing, messages, steps
from tdbg.protocol.framing import (
    FRAME_HEADER,
    MAGIC,
    MAX_INBOUND_FRAME,
    MAX_OUTBOUND_FRAME,
    Decoder,
    ErrorCode,
    ProtocolError,
    negotiate,
    pack,
    preamble,
)
from tdbg.protocol.messages import client_message, validate_client_message
from tdbg.protocol.messages.results import MAX_PROFILE_ROWS, ProfileResult, ProfileRow
from tdbg.protocol.steps import StepRecord, pack_steps, unpack_steps

RUN = {
    "name": "t",
    "pid": 1,
    "rank": 0,
    "host": "h",
    "argv": ["a"],
    "start_time": 1.5,
    "socket": "/tmp/x.sock",
    "proto_min": 1,
    "proto_max": 1,
}

# One example of every message type documented in protocol.py, both directions.
CLIENT_MESSAGES = [
    client_message("hello", 0, proto_min=1, proto_max=1, client_version="tdbg 0.1.0"),
    client_message("ping", 7),
    client_message("bye", 8),
]
SERVER_MESSAGES: list[dict[str, Any]] = [
    {"type": "welcome", "proto": 1, "server_version": "0.1.0", "run": RUN},
    {"type": "layers", "names": ["fc1", "fc2"], "numel": [40, 9]},
    pack_steps(
        [StepRecord(step=0, time=1.0, loss=0.5, lr=[0.1], grad_total=1.0, grad_norms=[0.6, 0.8])],
        2,
    ),
    {
        "type": "alert",
        "kind": "nonfinite_loss",
        "severity": "error",
        "step": 3,
        "time": 2.0,
        "message": "loss is nan at step 3",
        "layers": [],
        "history": False,
    },
    {"type": "system", "time": 1.0, "host": {"rss": 1}, "cuda": [], "gpus": [], "missing": ["x"]},
    {
        "type": "probe",
        "time": 1.0,
        "cost_fraction": None,
        "grad_interval": 1,
        "overhead_budget": 0.01,
        "errors": 0,
        "last_error": None,
        "dropped": 0,
        "clients": 1,
        "steps_seen": 5,
    },
    {"type": "synced"},
    {"type": "pong", "id": 7},
    {"type": "error", "code": ErrorCode.BUSY, "id": 0, "message": "busy"},
    {"type": "bye", "reason": "shutdown"},
]
ALL_MESSAGES: list[dict[str, Any]] = [*CLIENT_MESSAGES, *SERVER_MESSAGES]


def stream(messages: list[dict], max_frame: int = MAX_OUTBOUND_FRAME) -> bytes:
    return preamble() + b"".join(pack(m, max_frame) for m in messages)


def frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_all(data: bytes, max_frame: int = MAX_INBOUND_FRAME) -> list[dict]:
    return Decoder(max_frame).feed(data)


# --- frames and the decoder ----------------------------------------------------------------


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda m: m["type"])
def test_every_message_type_round_trips(message: dict) -> None:
    decoder = Decoder(MAX_OUTBOUND_FRAME)
    assert decoder.feed(stream([message])) == [message]
    assert decoder.peer_versions == (framing.PROTO_MIN, framing.PROTO_MAX)
    assert not decoder.mid_frame


@pytest.mark.parametrize("message", CLIENT_MESSAGES, ids=lambda m: m["type"])
def test_client_messages_pass_the_schema(message: dict) -> None:
    decoded = decode_all(stream([message], MAX_INBOUND_FRAME))
    assert validate_client_message(decoded[0]) == message


def test_one_byte_at_a_time_yields_the_same_messages() -> None:
    data = stream(ALL_MESSAGES)
    boundaries = {len(preamble())}
    for m in ALL_MESSAGES:
        boundaries.add(max(boundaries) + len(pack(m)))
    decoder = Decoder(MAX_OUTBOUND_FRAME)
    out: list[dict] = []
    for i in range(len(data)):
        out.extend(decoder.feed(data[i : i + 1]))
        # mid_frame is false exactly at the preamble's and each frame's end
        assert decoder.mid_frame == (i + 1 not in boundaries), i
    assert out == ALL_MESSAGES
    assert not decoder.mid_frame


def test_uneven_chunks_yield_the_same_messages() -> None:
    data = stream(ALL_MESSAGES)
    for size in (2, 3, 7, 64, 1000, len(data)):
        decoder = Decoder(MAX_OUTBOUND_FRAME)
        out = []
        for i in range(0, len(data), size):
            out.extend(decoder.feed(data[i : i + size]))
        assert out == ALL_MESSAGES, size


def test_hello_is_preamble_plus_one_frame() -> None:
    data = messages.hello("tdbg test")
    assert data[:4] == MAGIC
    (msg,) = decode_all(data)
    assert validate_client_message(msg)["args"]["client_version"] == "tdbg test"


def test_unknown_fields_of_mixed_key_types_are_a_protocol_error() -> None:
    # Found by test_fuzz: a str and a bytes key (both unknown) could not be sorted, and the
    # TypeError reached the connection instead of the client's error reply.
    message = {"type": "ping", "id": 1, "args": {"zz": 1, b"\x00": 2, 3: 4}}
    with pytest.raises(ProtocolError, match=r"unknown field\(s\) for ping: .*'zz'"):
        validate_client_message(message)


@pytest.mark.parametrize("bad", [b"X", b"TDBX", b"HTTP/1.1", b"GET / HTTP/1.1\r\n\r\n"])
def test_garbage_magic_is_rejected_at_once(bad: bytes) -> None:
    with pytest.raises(ProtocolError, match="bad magic"):
        Decoder(MAX_INBOUND_FRAME).feed(bad)


def test_zero_length_frame_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="zero-length"):
        decode_all(preamble() + FRAME_HEADER.pack(0))


def test_oversized_length_is_rejected_before_the_payload() -> None:
    decoder = Decoder(MAX_INBOUND_FRAME)
    # Only the header: the decoder must refuse without waiting for (or buffering) the payload.
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(preamble() + FRAME_HEADER.pack(MAX_INBOUND_FRAME + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        Decoder(MAX_INBOUND_FRAME).feed(preamble() + FRAME_HEADER.pack(0xFFFFFFFF))


def test_largest_allowed_inbound_frame_is_accepted() -> None:
    filler = "x" * (MAX_INBOUND_FRAME - 64)
    payload = msgpack.packb({"type": "ping", "pad": filler})
    payload += b"\xc0" * 0  # keep it a single object
    assert len(payload) <= MAX_INBOUND_FRAME
    (msg,) = decode_all(preamble() + frame(payload))
    assert msg["pad"] == filler


def test_pack_refuses_a_frame_over_the_cap() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        pack({"type": "x", "blob": b"\0" * 200}, max_frame=100)


def test_truncated_frame_gives_no_message_and_mid_frame() -> None:
    data = stream([client_message("ping", 1)], MAX_INBOUND_FRAME)
    decoder = Decoder(MAX_INBOUND_FRAME)
    assert decoder.feed(data[:-1]) == []
    assert decoder.mid_frame
    assert decoder.feed(data[-1:]) == [client_message("ping", 1)]
    assert not decoder.mid_frame


def test_truncated_header_and_preamble_are_mid_frame() -> None:
    decoder = Decoder(MAX_INBOUND_FRAME)
    assert decoder.feed(preamble()[:5]) == []
    assert decoder.mid_frame
    assert decoder.feed(preamble()[5:] + b"\0\0") == []
    assert decoder.mid_frame


@pytest.mark.parametrize("value", [[1, 2], "ping", 3, None, {"no_type": 1}, {"type": 5}], ids=repr)
def test_non_map_or_typeless_payload_is_rejected(value: object) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_all(preamble() + frame(msgpack.packb(value)))
    assert info.value.code == ErrorCode.BAD_MESSAGE


def test_msgpack_ext_type_is_rejected() -> None:
    payload = msgpack.packb({"type": "ping", "x": msgpack.ExtType(5, b"boom")})
    with pytest.raises(ProtocolError, match="ext type"):
        decode_all(preamble() + frame(payload))


def test_msgpack_timestamp_ext_is_rejected() -> None:
    # -1 is msgpack's built-in timestamp ext: it must not turn into an object either.
    payload = b"\x81\xa4type\xd6\xff\x00\x00\x00\x01"
    with pytest.raises(ProtocolError):
        decode_all(preamble() + frame(payload))


def test_invalid_utf8_is_rejected() -> None:
    # fixmap(1) {"type": <str of 2 bytes that are not UTF-8>}
    payload = b"\x81\xa4type\xa2\xff\xfe"
    with pytest.raises(ProtocolError) as info:
        decode_all(preamble() + frame(payload))
    assert info.value.code == ErrorCode.BAD_MESSAGE


def test_non_string_map_key_is_rejected() -> None:
    payload = msgpack.packb({1: "x", "type": "ping"})
    with pytest.raises(ProtocolError):
        decode_all(preamble() + frame(payload))


def test_trailing_bytes_in_a_payload_are_rejected() -> None:
    payload = msgpack.packb({"type": "ping"}) + b"\x01"
    with pytest.raises(ProtocolError):
        decode_all(preamble() + frame(payload))


def test_length_claims_more_than_the_payload_holds() -> None:
    # The msgpack str header claims 100 bytes; the frame holds 3: bounded by the frame length.
    payload = b"\x81\xa4type\xd9\x64abc"
    with pytest.raises(ProtocolError):
        decode_all(preamble() + frame(payload))


def test_decoding_never_touches_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """no pickle on any path that handles client or probe data."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used on the wire")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    data = stream(ALL_MESSAGES)
    decoder = Decoder(MAX_OUTBOUND_FRAME)
    out = [m for i in range(0, len(data), 5) for m in decoder.feed(data[i : i + 5])]
    assert out == ALL_MESSAGES
    steps = next(m for m in out if m["type"] == "steps")
    assert unpack_steps(steps)[0].grad_norms == pytest.approx([0.6, 0.8])
    # even a pickle stream inside a frame is just a bad payload, never unpickled
    with pytest.raises(ProtocolError):
        decode_all(preamble() + frame(pickle.dumps({"type": "ping"})))


# --- the client-message schema ----------------------------------------------------------------


def nest(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"type": "shutdown", "id": 1, "args": {}}, ErrorCode.UNKNOWN_COMMAND),
        ({"type": "ping", "id": 1, "args": {"x": 1}}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": 1, "args": {}, "extra": 1}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": 1}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "args": {}}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": 1, "args": []}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": -1, "args": {}}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": 2**31, "args": {}}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": True, "args": {}}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": 1.0, "args": {}}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": "1", "args": {}}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping", "id": None, "args": {}}, ErrorCode.BAD_MESSAGE),
        ({"type": "hello", "id": 0, "args": {"proto_min": 1}}, ErrorCode.BAD_MESSAGE),
        (
            {"type": "hello", "id": 0, "args": {"proto_min": -1, "proto_max": 1}},
            ErrorCode.BAD_MESSAGE,
        ),
        (
            {"type": "hello", "id": 0, "args": {"proto_min": 1, "proto_max": 70000}},
            ErrorCode.BAD_MESSAGE,
        ),
        (
            {"type": "hello", "id": 0, "args": {"proto_min": True, "proto_max": 1}},
            ErrorCode.BAD_MESSAGE,
        ),
        (
            {
                "type": "hello",
                "id": 0,
                "args": {"proto_min": 1, "proto_max": 1, "client_version": 3},
            },
            ErrorCode.BAD_MESSAGE,
        ),
        ({"type": "ping", "id": 2**64 - 1, "args": {}}, ErrorCode.BAD_MESSAGE),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_schema_rejects(message: dict, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_client_message(message)
    assert info.value.code == code


def hello_with(version: object) -> dict:
    return {
        "type": "hello",
        "id": 0,
        "args": {"proto_min": 1, "proto_max": 1, "client_version": version},
    }


def test_schema_depth_limit() -> None:
    # message (1) > args (2) > client_version value (3): depth-8 leaves fit, deeper ones do not.
    ok = {"type": "ping", "id": 1, "args": {}}
    validate_client_message(ok)
    with pytest.raises(ProtocolError, match="deep"):
        validate_client_message(hello_with(nest(8)))
    # the same nesting one level shallower passes the depth check (and fails only on type)
    with pytest.raises(ProtocolError, match="client_version"):
        validate_client_message(hello_with(nest(5)))


def test_schema_string_limit() -> None:
    validate_client_message(hello_with("v" * messages.MAX_STRING))
    with pytest.raises(ProtocolError, match="string too long"):
        validate_client_message(hello_with("v" * (messages.MAX_STRING + 1)))
    with pytest.raises(ProtocolError, match="string too long"):
        validate_client_message(hello_with(b"v" * (messages.MAX_STRING + 1)))


def test_schema_array_limit() -> None:
    with pytest.raises(ProtocolError, match="client_version"):
        validate_client_message(hello_with([0] * messages.MAX_ARRAY))
    with pytest.raises(ProtocolError, match="array too long"):
        validate_client_message(hello_with([0] * (messages.MAX_ARRAY + 1)))
    big_map = {f"k{i}": 0 for i in range(messages.MAX_ARRAY + 1)}
    with pytest.raises(ProtocolError, match="map too large"):
        validate_client_message(hello_with(big_map))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_schema_rejects_non_finite_numbers(value: float) -> None:
    with pytest.raises(ProtocolError, match="non-finite"):
        validate_client_message(hello_with(value))
    # and the same over the wire (msgpack float64 NaN)
    data = preamble() + pack(hello_with(value), MAX_INBOUND_FRAME)
    (msg,) = decode_all(data)
    with pytest.raises(ProtocolError, match="non-finite"):
        validate_client_message(msg)


def test_schema_rejects_huge_integers_from_the_wire() -> None:
    payload = msgpack.packb({"type": "ping", "id": 1, "args": {}, "n": 2**64 - 1})
    (msg,) = decode_all(preamble() + frame(payload))
    with pytest.raises(ProtocolError):
        validate_client_message(msg)


def test_schema_accepts_hello_without_client_version() -> None:
    msg = {"type": "hello", "id": 0, "args": {"proto_min": 1, "proto_max": 2}}
    assert validate_client_message(msg) is msg


# --- negotiation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client", "server", "expected"),
    [((1, 1), (1, 1), 1), ((1, 5), (1, 3), 3), ((2, 4), (1, 9), 4), ((3, 3), (1, 3), 3)],
)
def test_negotiate_overlap(client: tuple, server: tuple, expected: int) -> None:
    assert negotiate(client, server) == expected
    assert negotiate(server, client) == expected  # symmetric


@pytest.mark.parametrize(
    ("client", "server"), [((2, 3), (1, 1)), ((1, 1), (2, 3)), ((5, 1), (1, 9))]
)
def test_negotiate_no_overlap(client: tuple, server: tuple) -> None:
    with pytest.raises(ProtocolError) as info:
        negotiate(client, server)
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION


def test_preamble_layout() -> None:
    assert preamble(2, 7) == MAGIC + struct.pack(">HH", 2, 7)
    decoder = Decoder(MAX_INBOUND_FRAME)
    assert decoder.feed(preamble(2, 7)) == []
    assert decoder.peer_versions == (2, 7)


# --- step batches --------------------------------------------------------------------------


def records() -> list[StepRecord]:
    return [
        StepRecord(step=0, time=10.0, loss=2.5, lr=[0.1, 0.01], step_time=0.5, samples=32.0),
        StepRecord(
            step=1,
            time=10.5,
            loss=math.nan,
            lr=[0.2],
            grad_total=5.0,
            grad_norms=[3.0, 4.0, 0.0],
            tokens=1000.0,
        ),
        StepRecord(step=2, time=11.0, loss=None, lr=[], forward_time=0.1, backward_time=0.2),
        StepRecord(
            step=7,
            time=12.0,
            loss=-1e30,
            lr=[0.0, 1e-8, 3.0],
            grad_total=math.inf,
            grad_norms=[math.inf, math.nan, 1.5],
            optimizer_time=0.01,
            probe_time=1e-5,
            data_time=0.3,
        ),
    ]


def same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_steps_round_trip_through_the_wire() -> None:
    original = records()
    msg = pack_steps(original, 3, history=True)
    assert msg["lr_groups"] == 3
    (wire,) = decode_all(stream([msg]), MAX_OUTBOUND_FRAME)
    assert wire["history"] is True
    back = unpack_steps(wire)
    assert len(back) == len(original)
    for a, b in zip(original, back, strict=True):
        assert a.step == b.step
        assert same(a.loss, b.loss)
        assert a.lr == b.lr  # NaN padding of shorter groups removed again
        for name in steps.F64_COLUMNS:
            assert same(getattr(a, name), getattr(b, name)), name
        assert (a.grad_norms is None) == (b.grad_norms is None)
        if a.grad_norms is not None:
            assert b.grad_norms is not None
            assert all(same(x, y) for x, y in zip(a.grad_norms, b.grad_norms, strict=True))
            assert same(a.grad_total, b.grad_total)
        else:
            assert b.grad_total is None
    assert math.isnan(back[1].loss)  # type: ignore[arg-type]
    assert back[2].loss is None


def test_steps_with_no_records_and_no_layers() -> None:
    assert unpack_steps(pack_steps([], 0)) == []
    recs = [StepRecord(step=i, time=float(i), loss=float(i)) for i in range(3)]
    back = unpack_steps(pack_steps(recs, 0))
    assert [r.loss for r in back] == [0.0, 1.0, 2.0]
    assert all(r.lr == [] and r.grad_norms is None for r in back)


def test_pack_steps_refuses_a_row_wider_than_the_layers_and_pads_a_shorter_one() -> None:
    with pytest.raises(ValueError, match="grad norms"):
        pack_steps([StepRecord(step=0, time=0.0, grad_total=1.0, grad_norms=[1.0, 2.0, 3.0])], 2)
    # A row from before layers were added (the list only grows): NaN for the new ones.
    msg = pack_steps([StepRecord(step=0, time=0.0, grad_total=1.0, grad_norms=[1.0])], 2)
    norms = unpack_steps(msg)[0].grad_norms
    assert norms is not None and norms[0] == 1.0 and norms[1] != norms[1]


@pytest.mark.parametrize("column", ["step", "flags", "loss", "lr", "grad_norms", "grad_total"])
def test_unpack_steps_rejects_inconsistent_columns(column: str) -> None:
    msg = pack_steps(records(), 3)
    msg[column] = msg[column][:-1] if column != "flags" else msg[column] + b"\0"
    with pytest.raises(ProtocolError):
        unpack_steps(msg)


def test_unpack_steps_rejects_missing_and_mistyped_fields() -> None:
    msg = pack_steps(records(), 3)
    del msg["time"]
    with pytest.raises(ProtocolError):
        unpack_steps(msg)
    msg = pack_steps(records(), 3)
    msg["n"] = "four"
    with pytest.raises(ProtocolError):
        unpack_steps(msg)


def test_unreadable_lr_is_kept_in_its_param_group() -> None:
    """A NaN lr (a GPU tensor lr the probe will not sync to read) keeps group indices stable."""
    from tdbg.protocol.steps import StepRecord, pack_steps, unpack_steps

    nan = float("nan")
    recs = [
        StepRecord(step=0, time=0.0, lr=[nan, 0.1]),
        StepRecord(step=1, time=0.0, lr=[0.2]),
        StepRecord(step=2, time=0.0, lr=[]),
    ]
    out = unpack_steps(pack_steps(recs, 0))
    assert len(out[0].lr) == 2 and math.isnan(out[0].lr[0]) and out[0].lr[1] == 0.1
    assert out[1].lr == [0.2] and out[2].lr == []


def test_concat_steps_equals_packing_the_records_together() -> None:
    from tdbg.protocol.steps import StepRecord, concat_steps, pack_steps, unpack_steps

    def rec(i: int, grads: bool) -> StepRecord:
        return StepRecord(
            step=i,
            time=float(i),
            loss=1.0 / (i + 1),
            lr=[0.1, 0.2],
            grad_total=5.0 if grads else None,
            grad_norms=[3.0, 4.0] if grads else None,
        )

    a = [rec(0, True), rec(1, False)]
    b = [rec(2, False), rec(3, True), rec(4, True)]
    joined = concat_steps([pack_steps(a, 2), pack_steps(b, 2)])
    assert joined is not None
    together = pack_steps(a + b, 2)
    assert joined == together  # byte for byte, every column (NaN != NaN would hide nothing)
    assert [r.step for r in unpack_steps(joined)] == [0, 1, 2, 3, 4]
    other = pack_steps([StepRecord(step=5, time=5.0, lr=[0.1])], 2)  # one param group only
    assert concat_steps([pack_steps(a, 2), other]) is None


def test_last_step_reads_the_last_row_only() -> None:
    records = [StepRecord(step=s, time=0.0) for s in (5, 9, -3, 2**40)]
    assert steps.last_step(steps.pack_steps(records, 0)) == 2**40
    assert steps.last_step(steps.pack_steps([], 0)) is None
    assert steps.last_step({"type": "steps", "n": 2, "step": b"\x00"}) is None  # cut short
    assert steps.last_step({"type": "steps"}) is None


def test_step_columns_agree_with_unpack() -> None:
    records = [
        StepRecord(step=0, time=1.0, loss=2.0, lr=[0.1], grad_total=3.0, grad_norms=[1.0, 2.0]),
        StepRecord(step=1, time=2.0, lr=[0.1, 0.2]),
    ]
    c = steps.step_columns(steps.pack_steps(records, 2))
    assert (c.n, c.n_layers, c.lr_groups) == (2, 2, 2)
    assert list(c.step) == [0, 1] and list(c.lr_n) == [1, 2] and c.has_grads == [True, False]
    assert list(c.grad_norms) == [1.0, 2.0] and list(c.grad_total) == [3.0]
    bad = dict(steps.pack_steps(records, 2), lr_n=b"\x01")
    with pytest.raises(framing.ProtocolError, match="column sizes disagree"):
        steps.step_columns(bad)


# --- the builders the probe and the synthetic source share --------------------------------------


def op(name: str, cpu_total: float, device_total: float = 0.0) -> ProfileRow:
    return ProfileRow(name, 1, cpu_total / 2, cpu_total, device_total / 2, device_total, 0, 0)


def test_profile_table_sorts_by_the_run_s_own_total_and_keeps_totals_over_every_op() -> None:
    rows = [op("a", 10.0, 300.0), op("b", 30.0, 100.0), op("c", 20.0, 200.0), op("d", 30.0)]
    cpu = ProfileResult.of_ops(rows, device=False)
    assert [r.name for r in cpu.rows] == ["b", "d", "c", "a"]  # ties: by name
    assert (cpu.sort, cpu.device, cpu.truncated) == ("cpu_total", False, False)
    device = ProfileResult.of_ops(rows, device=True)
    assert [r.name for r in device.rows] == ["a", "c", "b", "d"]
    assert device.sort == "device_total"
    many = [op(f"op{i:03d}", float(i)) for i in range(MAX_PROFILE_ROWS + 5)]
    cut = ProfileResult.of_ops(many, device=False, steps=(1, 2), wall_seconds=1.0)
    assert len(cut.rows) == MAX_PROFILE_ROWS and cut.truncated
    # A row's share is its self time over every op's, the ops cut from the table included.
    assert cut.total_self_cpu == round(sum(r.self_cpu or 0.0 for r in many), 3)
    assert cut.share(cut.rows[0]) == (cut.rows[0].self_cpu or 0.0) / cut.total_self_cpu
    assert ProfileResult.from_wire(cut.to_wire()) == cut


def test_layers_message_sends_its_optional_fields_only_when_they_say_something() -> None:
    plain = messages.layers_message(["a", "b"], [3, 4])
    assert plain == {"type": "layers", "names": ["a", "b"], "numel": [3, 4]}
    assert messages.layers_message(["a"], [3], gone=[]) == {
        "type": "layers",
        "names": ["a"],
        "numel": [3],
    }
    several = messages.layers_message(["a", "b"], [3, 4], model=[0, 1], models=["G", "D"], gone=[1])
    assert several["model"] == [0, 1] and several["models"] == ["G", "D"]
    assert several["gone"] == [1]
