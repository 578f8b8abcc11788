"""The frozen message types: every one round-trips through to_wire/from_wire and msgpack, reads a
malformed figure as None, and still reads the older shapes a recording may hold."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

from tdbg.protocol.messages.alert import STUCK_AT, Alert
from tdbg.protocol.messages.commands import COMMANDS, default_args
from tdbg.protocol.messages.jobs import FINAL_STATES, JOB_STATES, Ack, Job
from tdbg.protocol.messages.results import (
    Activations,
    AllocationSite,
    AnomalyResult,
    FileInfo,
    NanHuntResult,
    NoResult,
    ProfileResult,
    ProfileRow,
    SnapshotResult,
)
from tdbg.protocol.messages.run import RunInfo
from tdbg.protocol.stall import DEFAULT_STALL_RULE, StallRule

TRACE = FileInfo("/tmp/run/profile-steps1-5.json", 1234, "ab" * 32)
ROW = ProfileRow("aten::mm", 5, 10.0, 20.0, 4.0, 8.0, 1024, 2048)
PROFILE = ProfileResult.of_ops(
    [ROW, ProfileRow("aten::add", 3, 2.0, 2.5, None, None, None, None)],
    device=True,
    steps=(1, 5),
    wall_seconds=0.25,
    trace=TRACE,
)
SNAPSHOT = SnapshotResult(
    top=(AllocationSite("train.py:12 in forward", 4096, 2),),
    active_bytes=4096,
    reserved_bytes=8192,
    file=FileInfo("/tmp/run/snapshot.pickle", 99, ""),
    steps=(3, 4),
    history_owner="script",
)
HUNT = NanHuntResult(
    found=True,
    phase="forward",
    module="body.1",
    module_type="Linear",
    step=7,
    nonfinite=12,
    numel=4096,
    input_min=-1.5,
    input_max=2.0,
    steps_checked=1,
    trigger="auto",
)
ANOMALY = AnomalyResult(10, True, 2)
ACTIVATIONS = Activations(
    step=20,
    names=("fc", "act"),
    types=("Linear", "ReLU"),
    mean=(0.1, 0.0),
    std=(1.0, 0.5),
    min=(-2.0, 0.0),
    max=(2.0, math.inf),
    zero_frac=(0.0, 0.5),
    nonfinite=(0, 3),
)
ALERT = Alert(
    "stalled",
    "error",
    9,
    100.5,
    f"no step for 12 s after step 9{STUCK_AT}loader.py:12 in __next__",
    (),
    where="loader.py:12 in __next__",
    stack=("train.py:40 in main", "loader.py:12 in __next__"),
    collective={"seq": 4, "op": "allreduce", "group": ["default"]},
)
JOB_ALERT = Alert(
    "straggler",
    "warning",
    30,
    1.0,
    "rank 2 holds the others up",
    ("fc",),
    ranks=(2,),
    cleared=True,
    phase="input wait",
    slower_by=0.04,
    stacks={"1": "train.py:40"},
)

RESULTS: list[Any] = [PROFILE, SNAPSHOT, HUNT, ANOMALY, NoResult()]
MESSAGES: list[Any] = [
    *RESULTS,
    TRACE,
    ROW,
    ACTIVATIONS,
    ALERT,
    JOB_ALERT,
    Ack(7, "anomaly", 3, "anomaly mode is global"),
    Job(3, "profile", "done", 5, 10.0, done=5, total=5, args={"steps": 5}, result=PROFILE),
    Job(4, "nan_hunt", "done", 7, 11.0, done=1, total=1, result=HUNT, history=True),
    Job(5, "activations", "running", None, 12.0, trigger="auto"),
]


def _through_msgpack(value: dict[str, Any]) -> Any:
    return msgpack.unpackb(msgpack.packb(value), raw=False, strict_map_key=False)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_type_round_trips_through_the_wire_and_msgpack(message: Any) -> None:
    wire = message.to_wire()
    again = type(message).from_wire(_through_msgpack(wire))
    if isinstance(message, Activations):  # inf and NaN do not compare as equal values do
        assert again is not None and again.to_wire().keys() == wire.keys()
        assert again.max[1] == math.inf and again.names == message.names
        return
    if isinstance(message, Job):
        again = Job.from_wire(_through_msgpack(wire))
    assert again == message
    assert again.to_wire() == wire  # and the bytes it would send again are the same


def test_the_wire_keys_keep_their_order_so_a_recording_re_sent_is_the_same_bytes() -> None:
    assert list(PROFILE.to_wire()) == [
        "rows",
        "sort",
        "device",
        "total_self_cpu",
        "total_self_device",
        "truncated",
        "steps",
        "wall_seconds",
        "trace",
    ]
    assert list(SNAPSHOT.to_wire())[:3] == ["file", "steps", "history_owner"]
    job = Job(1, "profile", "armed", None, 1.0).to_wire()
    assert list(job) == [
        "type",
        "job",
        "command",
        "state",
        "step",
        "done",
        "total",
        "message",
        "args",
        "trigger",
        "time",
        "result",
    ]
    assert list(ALERT.to_wire())[:7] == [
        "type",
        "kind",
        "severity",
        "step",
        "time",
        "message",
        "layers",
    ]
    # ints stay ints (a count is not sent as a float)
    assert _through_msgpack(ACTIVATIONS.to_wire())["nonfinite"] == [0, 3]


@pytest.mark.parametrize(
    ("kind", "field", "bad"),
    [
        (ProfileResult, "wall_seconds", "soon"),
        (ProfileResult, "total_self_cpu", [1]),
        (ProfileRow, "calls", "five"),
        (ProfileRow, "self_cpu", True),
        (SnapshotResult, "active_bytes", {"n": 1}),
        (NanHuntResult, "step", "seven"),
        (NanHuntResult, "input_min", None),
        (AnomalyResult, "errors", "many"),
        (FileInfo, "size", "big"),
        (Alert, "step", "nine"),
        (Alert, "time", "noon"),
        (Job, "step", 1.5e400),
        (Job, "total", "all"),
    ],
)
def test_a_malformed_figure_reads_as_none(kind: Any, field: str, bad: object) -> None:
    good = {
        ProfileResult: PROFILE,
        ProfileRow: ROW,
        SnapshotResult: SNAPSHOT,
        NanHuntResult: HUNT,
        AnomalyResult: ANOMALY,
        FileInfo: TRACE,
        Alert: ALERT,
        Job: MESSAGES[-3],
    }[kind]
    read = kind.from_wire(dict(good.to_wire(), **{field: bad}))
    assert read is not None and getattr(read, field) is None


def test_what_is_not_a_message_reads_as_none() -> None:
    for kind in (ProfileResult, SnapshotResult, NanHuntResult, AnomalyResult, Alert, NoResult):
        assert kind.from_wire("garbage") is None and kind.from_wire(None) is None
    assert Job.from_wire({"command": "profile"}) is None  # no job number
    assert Ack.from_wire({"job": 3}) is None  # no id: answers nothing
    assert FileInfo.from_wire({"size": 3}) is None  # no path
    assert Activations.from_wire({}) is None
    # A malformed row or site is dropped; the rest of the result reads.
    profile = ProfileResult.from_wire({"rows": [ROW.to_wire(), "junk", 3], "device": False})
    assert profile is not None and profile.rows == (ROW,) and profile.sort == "cpu_total"
    snapshot = SnapshotResult.from_wire({"top": [None, {"site": "a.py:1", "bytes": "x"}]})
    assert snapshot is not None and snapshot.top == (AllocationSite("a.py:1", None, None),)


def test_older_shapes_still_read() -> None:
    # A stall from a probe before ``where`` was a field: the place is read from the prose.
    old = {
        "type": "alert",
        "kind": "stalled",
        "severity": "error",
        "step": 19,
        "time": 5.0,
        "message": f"no step for 3600 s after step 19{STUCK_AT}loader.py:1",
        "layers": [],
    }
    alert = Alert.from_wire(old)
    assert alert is not None and alert.where == "loader.py:1"
    assert alert.headline == "no step for 3600 s after step 19"
    assert alert.stack == () and alert.collective is None and alert.ranks is None
    # A new one carries it as a field; the prose keeps it for people and older readers.
    assert ALERT.headline == "no step for 12 s after step 9"
    plain = Alert.from_wire(dict(old, message="loss is nan at step 3"))
    assert plain is not None and plain.where is None and plain.headline == "loss is nan at step 3"
    # A job message without its command (a later message of the job) reads its result by the
    # command an earlier one named; results without ``steps`` or ``trace`` read as unknown.
    later = Job.from_wire({"job": 3, "state": "done", "result": {"found": True}}, "nan_hunt")
    assert later is not None and isinstance(later.result, NanHuntResult) and later.result.found
    bare = ProfileResult.from_wire({"rows": []})
    assert bare is not None and bare.steps is None and bare.trace is None
    assert bare.wall_seconds is None and bare.share(ROW) is None
    # Activations from a reader that found no counts: NaN, as long as the names.
    acts = Activations.from_wire({"names": ["a", "b"], "mean": [1.0]})
    assert acts is not None and acts.types == ("", "") and math.isnan(acts.mean[1])


def test_the_share_is_self_time_over_every_op() -> None:
    assert PROFILE.share_column == "self_device"
    assert PROFILE.share(ROW) == pytest.approx(4.0 / 4.0)
    cpu = ProfileResult.of_ops([ROW, ROW], device=False)
    assert cpu.share(ROW) == pytest.approx(10.0 / 20.0)


def test_job_states_and_command_defaults_have_one_owner() -> None:
    assert FINAL_STATES == {"done", "failed", "cancelled"} and FINAL_STATES <= set(JOB_STATES)
    assert default_args("anomaly") == {"steps": 10, "check_nan": False}
    assert default_args("nan_hunt") == {"steps": COMMANDS["nan_hunt"]["steps"].default}


def test_the_run_info_announces_the_stall_rule() -> None:
    run: RunInfo = {
        "name": "r",
        "pid": 1,
        "rank": 0,
        "host": "h",
        "argv": [],
        "start_time": 0.0,
        "cwd": "/",
        "torch": "2",
        "device": "cpu",
        "commands": {},
        "stall": DEFAULT_STALL_RULE.to_wire(),
    }
    assert StallRule.from_wire(_through_msgpack(dict(run))["stall"]) == DEFAULT_STALL_RULE


def test_the_system_and_probe_reports_round_trip_and_read_malformed_figures_as_none() -> None:
    from tdbg.protocol.messages.reports import CudaStats, GpuStats, HostStats, ProbeHealth, System

    system = System(
        12.5,
        HostStats(rss=1 << 30, cpu_percent=101.5, ram_used=8 << 30, ram_total=64 << 30),
        (CudaStats(0, "H200", 1, 2, 3, 0, 0),),
        (GpuStats(0, "NVIDIA H200", 97.0, 5, 10, 60.0, 500.0, 700.0, 1980),),
        ("nothing",),
    )
    wire = msgpack.unpackb(msgpack.packb(system.to_wire()))
    assert list(wire) == ["type", "time", "host", "cuda", "gpus", "missing"]  # the old order
    assert System.from_wire(wire) == system
    probe = ProbeHealth(time=1.0, clients=2, cost_fraction=0.01, total_steps=100)
    assert ProbeHealth.from_wire(msgpack.unpackb(msgpack.packb(probe.to_wire()))) == probe
    served = ProbeHealth(time=1.0, takes_commands=True, activations_every=None, jobs=(4, 5))
    assert ProbeHealth.from_wire(served.to_wire()) == served
    assert "jobs" not in probe.to_wire() and served.to_wire()["jobs"] == [4, 5]
    bad = System.from_wire(
        {"time": "x", "host": [1], "cuda": [{"index": "0", "peak": 1.5e300}, 7], "gpus": None}
    )
    assert bad.time is None and bad.host == HostStats() and bad.gpus == ()
    assert bad.cuda == (CudaStats(index=None, peak=int(1.5e300)),)
    odd = ProbeHealth.from_wire({"disabled": "yes", "total_steps": -3, "jobs": ["a", 2]})
    assert (odd.disabled, odd.total_steps, odd.jobs, odd.takes_commands) == (
        False,
        None,
        (2,),
        True,
    )
