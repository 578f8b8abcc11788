"""The deep-dive subcommands (profile, snapshot, nan-hunt, anomaly, activations) and their events
in `tdbg dump`: formatting and translation with messages shaped as the wire contract says, the
client's command/ack helper over a socket pair, and end to end against real demo jobs."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import fresh_runtime_dir, wait_until
from demo_job import demo_job
from test_cli import TDBG, events, run_cli
from waiting import TIMEOUT

from tdbg.cli import dives as dive_commands
from tdbg.cli import dump as dump_events
from tdbg.cli import main as cli
from tdbg.cli import report
from tdbg.connect.client import CommandRefused, CommandTimeout, ProbeClient
from tdbg.protocol.framing import MAX_INBOUND_FRAME, MAX_OUTBOUND_FRAME, Decoder, pack

# --- messages as /tmp/spec.md (the wire contract) shapes them ---------------------------------

PROFILE_ARGS = {
    "steps": 3,
    "max_seconds": 30.0,
    "record_shapes": False,
    "profile_memory": False,
    "with_stack": False,
}


def job_msg(state: str, job: int = 7, command: str = "profile", **extra: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "type": "job",
        "job": job,
        "command": command,
        "state": state,
        "step": 120 if state != "armed" else None,
        "done": {"armed": 0, "running": 2}.get(state, 3),
        "total": 3,
        "message": "",
        "args": dict(PROFILE_ARGS),
        "time": 1700000000.5,
        "result": None,
    }
    msg.update(extra)
    return msg


def row(name: str, self_cpu: float, cpu_total: float, **extra: Any) -> dict[str, Any]:
    out = {
        "name": name,
        "calls": 6,
        "self_cpu": self_cpu,
        "cpu_total": cpu_total,
        "self_device": 0.0,
        "device_total": 0.0,
        "cpu_memory": 0,
        "device_memory": 0,
    }
    out.update(extra)
    return out


def profile_result(device: bool = False) -> dict[str, Any]:
    rows = [
        row("aten::addmm", 600.0, 900.0, cpu_memory=4096, self_device=300.0, device_total=350.0),
        row("aten::linear", 50.0, 1000.0, self_device=0.0, device_total=350.0),
        row("[memory]", 350.0, 350.0, cpu_memory=-2048, self_device=700.0, device_total=700.0),
    ]
    return {
        "rows": rows,
        "sort": "device_total" if device else "cpu_total",
        "device": device,
        "steps": [118, 120],
        "wall_seconds": 0.042,
        "total_self_cpu": 1000.0,
        "total_self_device": 1000.0 if device else 0.0,
        "trace": {"path": "/tmp/run/trace-step118.json", "size": 123456, "sha256": "ab" * 32},
        "truncated": False,
    }


NAN_FOUND = {
    "found": True,
    "phase": "forward",
    "module": "body.2",
    "module_type": "Residual",
    "step": 80,
    "nonfinite": 8192,
    "numel": 8192,
    "input_min": -2.5,
    "input_max": float("nan"),
    "input_nonfinite": False,
    "params_nonfinite": 0,
    "steps_checked": 1,
    "trigger": "manual",
}


# --- dump events -----------------------------------------------------------------------------


def test_job_event_carries_progress_not_result() -> None:
    msg = job_msg("done", result=profile_result(), history=True)
    event = dump_events.job_event(msg)
    assert event == {
        "type": "job",
        "job": 7,
        "command": "profile",
        "state": "done",
        "step": 120,
        "done": 3,
        "total": 3,
        "message": "",
        "args": PROFILE_ARGS,
        "time": 1700000000.5,
        "history": True,
    }
    json.dumps(event, allow_nan=False)


def test_result_event_is_typed_by_command() -> None:
    assert dump_events.result_event(job_msg("running")) is None
    assert dump_events.result_event(job_msg("failed", message="profiler failed")) is None
    event = dump_events.result_event(job_msg("done", result=profile_result()))
    assert event is not None
    assert event["type"] == "profile" and event["job"] == 7 and event["step"] == 120
    assert event["rows"][0]["name"] == "aten::addmm"
    assert event["trace"]["path"] == "/tmp/run/trace-step118.json"
    assert event["steps"] == [118, 120] and event["sort"] == "cpu_total"
    assert "history" not in event

    hunt = dump_events.result_event(job_msg("done", command="nan_hunt", result=NAN_FOUND))
    assert hunt is not None
    assert hunt["type"] == "nan_hunt" and hunt["module"] == "body.2"
    assert hunt["step"] == 80  # the step it was found at, not the job message's
    assert hunt["input_max"] == "nan"  # non-finite numbers as dump writes them
    json.dumps(hunt, allow_nan=False)

    anomaly = dump_events.result_event(
        job_msg("done", command="anomaly", result={"steps": 3, "check_nan": False, "errors": 0})
    )
    assert anomaly == {
        "type": "anomaly",
        "job": 7,
        "step": 120,
        "time": 1700000000.5,
        "steps": 3,
        "check_nan": False,
        "errors": 0,
    }


def test_activations_event_per_layer() -> None:
    msg = {
        "type": "activations",
        "step": 40,
        "names": ["body.0", "body.1"],
        "types": ["Linear", "ReLU"],
        "mean": [0.1, float("nan")],
        "std": [1.0, 0.5],
        "min": [-3.0, 0.0],
        "max": [3.0, float("inf")],
        "zero_frac": [0.0, 0.5],
        "nonfinite": [0, 12],
    }
    event = dump_events.activations_event(msg)
    assert event == {
        "type": "activations",
        "step": 40,
        "layers": {
            "body.0": {
                "type": "Linear",
                "mean": 0.1,
                "std": 1.0,
                "min": -3.0,
                "max": 3.0,
                "zero_frac": 0.0,
                "nonfinite": 0,
            },
            "body.1": {
                "type": "ReLU",
                "mean": "nan",
                "std": 0.5,
                "min": 0.0,
                "max": "inf",
                "zero_frac": 0.5,
                "nonfinite": 12,
            },
        },
    }
    json.dumps(event, allow_nan=False)


class ScriptedClient:
    """Just what dump_events reads from a client: run info and a list of messages."""

    def __init__(self, msgs: list[dict[str, Any]]) -> None:
        self.run = {"name": "t", "device": "cpu", "commands": {"snapshot": "needs CUDA"}}
        self.welcome = {"proto": 1, "server_version": "x", "run": self.run}
        self._msgs = msgs
        self.peer_closed = False

    def messages(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        yield from self._msgs
        self._msgs = []
        self.peer_closed = True


def test_dump_stream_translates_jobs_and_skips_acks() -> None:
    acts = {"type": "activations", "step": 5, "names": ["a"], "types": ["Linear"]}
    acts.update({k: [0.0] for k in ("mean", "std", "min", "max", "zero_frac")})
    acts["nonfinite"] = [0]
    msgs = [
        {"type": "layers", "names": ["a"], "numel": [3]},
        job_msg("done", job=1, command="anomaly", history=True, result={"errors": 0}),
        {"type": "synced"},
        {"type": "ack", "id": 3, "command": "profile", "job": 7, "message": ""},
        job_msg("armed"),
        job_msg("running"),
        job_msg("analysing"),
        job_msg("done", result=profile_result()),
        acts,
        {"type": "bye", "reason": "shutdown"},
    ]
    client: Any = ScriptedClient(msgs)
    evs = list(dump_events.dump_events(client, None))
    types = [e["type"] for e in evs]
    assert types == [
        "hello",
        "job",
        "anomaly",
        "synced",
        "job",
        "job",
        "job",
        "job",
        "profile",
        "activations",
        "end",
    ]
    assert evs[0]["run"]["commands"] == {"snapshot": "needs CUDA"}
    assert evs[1]["history"] is True and evs[2]["history"] is True
    assert [e["state"] for e in evs if e["type"] == "job"][1:] == [
        "armed",
        "running",
        "analysing",
        "done",
    ]
    for e in evs:
        json.dumps(e, allow_nan=False)


# --- result formatting ---------------------------------------------------------------------


def test_profile_rows_share_and_sort() -> None:
    result = profile_result()
    rows = report.profile_rows(result)
    assert [r["name"] for r in rows] == ["aten::addmm", "aten::linear", "[memory]"]
    assert [r["share"] for r in rows] == pytest.approx([0.6, 0.05, 0.35])
    by_self = report.profile_rows(result, "self_cpu")
    assert [r["name"] for r in by_self] == ["aten::addmm", "[memory]", "aten::linear"]
    assert [r["name"] for r in report.profile_rows(result, "name")][0] == "[memory]"
    assert [r["name"] for r in report.profile_rows(result, "cpu_memory")][-1] == "[memory]"
    device = report.profile_rows(profile_result(device=True), "share")
    assert [r["name"] for r in device] == ["[memory]", "aten::addmm", "aten::linear"]
    assert device[0]["share"] == pytest.approx(0.7)


def test_print_profile_cpu_run() -> None:
    out = io.StringIO()
    report.print_profile(profile_result(), out, None, 2)
    text = out.getvalue()
    assert "aten::addmm" in text and "aten::linear" in text
    assert "[memory]" not in text  # --rows 2
    assert "1 more ops (--rows)" in text
    assert "self device" not in text and "CPU-only run" in text
    assert "60.0" in text and "900µs" in text and "4 KiB" in text  # tdbg.format's spelling
    assert "trace: /tmp/run/trace-step118.json (121 KiB)" in text
    assert "steps 118-120" in text and "sorted by cpu_total" in text


def test_print_profile_device_run_sorted_by_share() -> None:
    out = io.StringIO()
    report.print_profile(profile_result(device=True), out, "share", 20)
    text = out.getvalue()
    assert "self device" in text and "device total" in text and "device mem" in text
    assert "[memory]" in text and "-2 KiB" in text  # markup-free; memory freed keeps its sign
    assert text.index("[memory]") < text.index("aten::addmm") < text.index("aten::linear")
    assert "70.0" in text


def test_print_profile_without_trace() -> None:
    result = dict(profile_result(), trace=None, rows=[], truncated=True)
    out = io.StringIO()
    report.print_profile(result, out)
    assert "trace: none written" in out.getvalue()
    assert "top 100 ops only" in out.getvalue()


def test_print_snapshot() -> None:
    result = {
        "file": {"path": "/tmp/run/snapshot-step200.pickle", "size": 2048, "sha256": "0" * 64},
        "steps": [200, 202],
        "top": [
            {"site": "model.py:12 forward", "bytes": 64 * 1024 * 1024, "count": 3},
            {"site": "optim.py:90 step", "bytes": 1024, "count": 1},
        ],
        "active_bytes": 1 << 30,
        "reserved_bytes": 2 << 30,
    }
    out = io.StringIO()
    report.print_snapshot(result, out, limit=1)
    text = out.getvalue()
    assert "snapshot: /tmp/run/snapshot-step200.pickle (2 KiB)" in text
    assert "active 1 GiB, reserved 2 GiB" in text
    assert "model.py:12 forward" in text and "64 MiB" in text
    assert "optim.py:90" not in text


def test_format_nan_hunt() -> None:
    text = report.format_nan_hunt(NAN_FOUND)
    assert text.startswith("first non-finite forward value: body.2 (Residual) at step 80\n")
    assert "8192 of 8192" in text and "-2.5 / NaN" in text
    assert "inputs already non-finite: no" in text
    root = report.format_nan_hunt(
        dict(NAN_FOUND, module="", phase="backward", input_nonfinite=True)
    )
    assert "backward value: the root model" in root and "already non-finite: yes" in root
    none = dict(NAN_FOUND, found=False, phase=None, module=None, step=None, steps_checked=4)
    assert report.format_nan_hunt(none) == "no non-finite value in 4 steps\n"
    assert report.format_nan_hunt(dict(none, steps_checked=1)) == "no non-finite value in 1 step\n"


def test_format_anomaly_with_tracebacks() -> None:
    alert = {
        "type": "alert",
        "kind": "anomaly",
        "severity": "error",
        "step": 9,
        "time": 1.0,
        "message": 'backward error in MulBackward0; forward call:\n  File "m.py", line 3\n',
        "layers": [],
    }
    text = report.format_anomaly({"steps": 3, "check_nan": False, "errors": 1}, [alert])
    assert text.startswith("anomaly mode done: 3 steps, check_nan off, 1 backward error\n")
    assert "--- step 9: error\nbackward error in MulBackward0" in text
    assert report.format_anomaly({"steps": 2, "check_nan": True, "errors": 0}, []) == (
        "anomaly mode done: 2 steps, check_nan on, 0 backward errors\n"
    )


def test_print_activations() -> None:
    event = {
        "type": "activations",
        "step": 40,
        "layers": {
            "body.1": {
                "type": "ReLU",
                "mean": 0.25,
                "std": 0.5,
                "min": 0.0,
                "max": "inf",
                "zero_frac": 0.5,
                "nonfinite": 3,
            }
        },
    }
    out = io.StringIO()
    report.print_activations(event, out)
    text = out.getvalue()
    assert "activations at step 40" in text
    assert "body.1" in text and "ReLU" in text and "50.0" in text and "inf" in text


def test_progress_lines() -> None:
    armed = job_msg("armed", message="anomaly mode is global and slow")
    assert report.progress_line(armed) == "profile job 7: armed, waiting for the next step boundary"
    assert report.progress_line(job_msg("running")) == "profile job 7: running 2/3 (step 120)"
    assert report.progress_line(job_msg("analysing")) == "profile job 7: analysing"
    failed = job_msg("failed", message="the profiler is in use")
    assert report.progress_line(failed) == "profile job 7: failed: the profiler is in use"
    forever = job_msg("running", command="activations", total=None, done=4)
    assert report.progress_line(forever) == "activations job 7: running 4 steps (step 120)"


# --- the client's command helper and the job watch, over a socket pair ----------------------


class Peer:
    """The far end of a socket pair: reads client frames, writes probe frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = Decoder(MAX_INBOUND_FRAME, expect_preamble=False)
        self.sock.settimeout(5)

    def send(self, *msgs: dict[str, Any]) -> None:
        self.sock.sendall(b"".join(pack(m) for m in msgs))

    def read(self) -> dict[str, Any]:
        while True:
            got = self.decoder.feed(self.sock.recv(65536))
            if got:
                assert len(got) == 1, got
                return got[0]


@pytest.fixture
def pair() -> Iterator[tuple[ProbeClient, Peer]]:
    a, b = socket.socketpair()
    client = ProbeClient(a, {"run": {"name": "t"}}, Decoder(MAX_OUTBOUND_FRAME, False), [])
    yield client, Peer(b)
    a.close()
    b.close()


def test_command_returns_ack_and_keeps_other_messages(pair: tuple[ProbeClient, Peer]) -> None:
    client, peer = pair
    peer.send({"type": "synced"})
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(ack=client.command("profile", steps=3)))
    thread.start()
    sent = peer.read()
    assert sent == {"type": "profile", "id": sent["id"], "args": {"steps": 3}}
    armed = job_msg("armed", job=4)
    peer.send(armed, {"type": "probe", "jobs": [4]})  # job progress may overtake the ack
    peer.send({"type": "ack", "id": sent["id"], "command": "profile", "job": 4, "message": ""})
    peer.send(job_msg("running", job=4))
    thread.join(TIMEOUT)
    assert box["ack"]["job"] == 4
    got = []
    for msg in client.messages(timeout=0.2):
        got.append(msg["type"] if msg["type"] != "job" else msg["state"])
    assert got == ["synced", "armed", "probe", "running"]


def test_command_refused_carries_the_code(pair: tuple[ProbeClient, Peer]) -> None:
    client, peer = pair
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            client.command("snapshot")
        except CommandRefused as exc:
            box["exc"] = exc

    thread = threading.Thread(target=go)
    thread.start()
    mid = peer.read()["id"]
    peer.send({"type": "error", "id": mid + 1, "code": "BUSY", "message": "not ours"})
    peer.send({"type": "error", "id": mid, "code": "UNAVAILABLE", "message": "needs CUDA"})
    thread.join(TIMEOUT)
    exc = box["exc"]
    assert exc.code == "UNAVAILABLE" and str(exc) == "needs CUDA" and exc.command == "snapshot"
    assert [m["code"] for m in client.messages(timeout=0.1)] == ["BUSY"]


def test_command_times_out_or_sees_the_probe_close(pair: tuple[ProbeClient, Peer]) -> None:
    client, peer = pair
    with pytest.raises(CommandTimeout, match="no answer to nan_hunt within 0.2 s"):
        client.command("nan_hunt", timeout=0.2)
    peer.send({"type": "bye", "reason": "shutdown"})
    peer.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(CommandTimeout, match="closed the connection before answering anomaly"):
        client.command("anomaly", timeout=5)
    assert [m["type"] for m in client.messages(timeout=0.1)] == ["bye"]
    peer.sock.close()
    with pytest.raises(CommandTimeout, match="closed the connection before answering profile"):
        client.command("profile", timeout=5)


def test_messages_stopped_early_loses_nothing(pair: tuple[ProbeClient, Peer]) -> None:
    client, peer = pair
    peer.send(*({"type": "probe", "n": i} for i in range(5)))
    seen = []
    for msg in client.messages(timeout=0.5):
        seen.append(msg["n"])
        if len(seen) == 2:
            break
    seen += [m["n"] for m in client.messages(timeout=0.1)]
    assert seen == [0, 1, 2, 3, 4]


def start_watch(
    client: ProbeClient, peer: Peer, timeout: float, job: int = 4
) -> dive_commands.JobWatch:
    watch = dive_commands.JobWatch(client, "profile", timeout)
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(ack=watch.start(steps=3)))
    thread.start()
    mid = peer.read()["id"]
    peer.send({"type": "ack", "id": mid, "command": "profile", "job": job, "message": ""})
    thread.join(TIMEOUT)
    assert box["ack"]["job"] == job and watch.job == job
    return watch


def test_watch_follows_only_its_job(pair: tuple[ProbeClient, Peer]) -> None:
    client, peer = pair
    watch = start_watch(client, peer, 5.0)
    lines: list[str] = []
    watch.progress = lines.append
    peer.send(
        job_msg("done", job=4, history=True, result={}),  # a replayed namesake is not ours
        job_msg("armed", job=4),
        job_msg("done", job=3, result={}),
        job_msg("running", job=4),
        job_msg("running", job=4),
        job_msg("done", job=4, result=profile_result()),
    )
    final = watch.wait()
    assert final is not None and final["result"]["rows"][0]["name"] == "aten::addmm"
    assert lines == [
        "profile job 4: armed, waiting for the next step boundary",
        "profile job 4: running 2/3 (step 120)",
        "profile job 4: done",
    ]


def test_watch_timeout_while_armed_cancels(pair: tuple[ProbeClient, Peer]) -> None:
    client, peer = pair
    watch = start_watch(client, peer, 0.5)
    peer.send(job_msg("armed", job=4))

    def answer_cancel() -> None:
        cancel = peer.read()
        assert cancel["type"] == "cancel" and cancel["args"] == {"job": 4}
        peer.send({"type": "ack", "id": cancel["id"], "command": "cancel", "job": 4})

    thread = threading.Thread(target=answer_cancel)
    thread.start()
    with pytest.raises(cli.CliError, match=r"did not reach a step boundary within 0.5 s"):
        watch.wait()
    thread.join(TIMEOUT)
    assert not thread.is_alive()


def test_watch_failed_job_and_ended_run(pair: tuple[ProbeClient, Peer]) -> None:
    client, peer = pair
    watch = start_watch(client, peer, 5.0)
    peer.send(job_msg("failed", job=4, message="the profiler is already in use"))
    with pytest.raises(
        dive_commands.JobFailed, match="profile job 4 failed: the profiler is already"
    ):
        watch.wait()
    watch = start_watch(client, peer, 5.0, job=5)
    peer.send(job_msg("running", job=5), job_msg("cancelled", job=5, message="the run ended"))
    peer.send({"type": "bye", "reason": "shutdown"})
    with pytest.raises(cli.CliError, match="the run ended before profile job 5 finished"):
        watch.wait()


def test_watch_run_closes_mid_job(pair: tuple[ProbeClient, Peer]) -> None:
    client, peer = pair
    watch = start_watch(client, peer, 5.0)
    peer.send(job_msg("running", job=4))
    peer.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(cli.CliError, match=r"the run ended before profile job 4 .*running"):
        watch.wait()


# --- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["profile", "--steps", "0"], "argument --steps: must be an integer 1-200"),
        (["profile", "--steps", "x"], "argument --steps: must be an integer 1-200"),
        (["profile", "--max-seconds", "500"], "argument --max-seconds: must be a number 1-120"),
        (["profile", "--sort", "speed"], "argument --sort: must be one of name, calls"),
        (["profile", "--timeout", "0"], "argument --timeout: must be a number > 0"),
        (["nan-hunt", "--steps", "101"], "must be an integer 1-100"),
        (["snapshot", "--max-entries", "5"], "must be an integer 1000-100000"),
        (["anomaly", "--steps", "51"], "must be an integer 1-50"),
        (["activations", "--every", "3", "--off"], "not allowed with argument --every"),
    ],
)
def test_bad_arguments_one_line_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.run(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert err.startswith(f"tdbg {argv[0]}: error: ")


def test_options_follow_the_command_schema(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The deep dives' options are the protocol's schema: change a bound, a default or a help
    text there and the CLI's validation and --help follow."""
    from tdbg.protocol.messages import COMMANDS, Field

    def help_of(command: str) -> str:
        with pytest.raises(SystemExit):
            cli.run([command, "--help"])
        return " ".join(capsys.readouterr().out.split())

    monkeypatch.setitem(COMMANDS["profile"], "steps", Field(int, 7, 2, 9, "ops to count", "M"))
    assert cli.build_parser().parse_args(["profile"]).steps == 7
    with pytest.raises(SystemExit):
        cli.run(["profile", "--steps", "10"])
    assert "argument --steps: must be an integer 2-9" in capsys.readouterr().err
    text = help_of("profile")
    assert "--steps M" in text and "ops to count, 2-9 (default 7)" in text
    # Every argument of every dive has its option (activations' enabled=false is --off).
    for command, schema in COMMANDS.items():
        if command == "cancel":
            continue
        text = help_of(command.replace("_", "-"))
        for name, spec in schema.items():
            if spec.kind is bool and spec.default:
                continue
            assert f"--{name.replace('_', '-')}" in text and spec.help in text, (command, name)


def test_no_run_one_line_exit_2(runtime_dir: Path) -> None:
    out = run_cli("profile", "--steps", "3", runtime=runtime_dir)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "no tdbg run found" in out.stderr


def test_cli_imports_no_torch_textual_or_rich() -> None:
    code = "import tdbg.cli.main, sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    roots = {m.split(".")[0] for m in json.loads(out.stdout)}
    assert not roots & {"torch", "textual", "rich"}


# --- end to end: real demo jobs, real probe, real CLI ---------------------------------------


MLP = ("mlp", "--delay", "0.01", "--width", "64", "--depth", "4")


def cli_env(runtime: Path) -> dict[str, str]:
    return dict(os.environ, TDBG_RUNTIME_DIR=str(runtime))


@pytest.fixture(scope="module")
def mlp_job() -> Iterator[tuple[Path, Path]]:
    """One MLP demo trained until the module is done: (its runtime directory, its socket).
    The deep-dive tests below each run their dives to the end on it (a demo job takes seconds
    to start: torch's import)."""
    with fresh_runtime_dir() as runtime, demo_job(*MLP, runtime=runtime) as (_, entry):
        yield runtime, entry.socket


@pytest.mark.slow
def test_profile_prints_top_ops_and_a_json_trace(mlp_job: tuple[Path, Path]) -> None:
    runtime, sock = mlp_job
    out = run_cli("profile", str(sock), "--steps", "3", runtime=runtime)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no progress when stderr is not a terminal
    text = out.stdout
    assert re.search(r"aten::(addmm|linear|mm)\b", text), text
    assert "op" in text and "self CPU" in text and "share %" in text
    match = re.search(r"^trace: (\S+) \(", text, re.M)
    assert match, text
    trace = Path(match.group(1))
    assert trace.is_file()
    assert json.loads(trace.read_text())  # Chrome/Perfetto trace: JSON

    # --json: the result as one object; a second profile is allowed once the first is done.
    out = run_cli("profile", str(sock), "--steps", "2", "--json", runtime=runtime)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    names = [r["name"] for r in result["rows"]]
    assert any(n in names for n in ("aten::addmm", "aten::linear", "aten::mm")), names
    assert result["device"] is False and result["sort"] == "cpu_total"
    totals = [r["cpu_total"] for r in result["rows"]]
    assert totals == sorted(totals, reverse=True)
    assert result["steps"][1] - result["steps"][0] == 1


@pytest.mark.slow
def test_snapshot_on_a_cpu_run_is_refused_naming_cuda(mlp_job: tuple[Path, Path]) -> None:
    runtime, sock = mlp_job
    out = run_cli("snapshot", str(sock), runtime=runtime)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "CUDA" in out.stderr, out.stderr
    assert out.stderr.startswith("tdbg: error: snapshot refused: ")


# A small MLP trained until killed. Its layer body.2 outputs NaN from the step at which the file
# argv[1] (the trigger) exists; that step goes to argv[2]. Once a NaN hunt has hooked its modules
# and no trigger is there yet, it says so (argv[3]) and waits: the hunt watches at most 100 steps,
# so a loop that ran on would race the test's trigger (the old fixed step 80 raced the arming).
NAN_HUNT_SCRIPT = """
import os, sys, time
import torch
from torch import nn
import tdbg

trigger, poisoned_at, hunted = sys.argv[1:4]
torch.manual_seed(0)
model = nn.Sequential()
model.add_module("body", nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()))
model.add_module("head", nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
probe = tdbg.watch(model, opt, name="nanhunt", grad_every=1)
x, y = torch.randn(64, 8), torch.randn(64, 1)
poison = [False]
layer = model.body[2]
layer.register_forward_hook(lambda m, i, out: out * float("nan") if poison[0] else None)
for step in range(10**9):
    while not os.path.exists(trigger) and len(layer._forward_hooks) > 1:  # the hunt's hook
        if not os.path.exists(hunted):
            open(hunted, "w").close()
        time.sleep(0.01)
    if not poison[0] and os.path.exists(trigger):
        poison[0] = True
        with open(poisoned_at, "w") as f:
            f.write(str(step))
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    probe.step(loss)
"""


@pytest.mark.slow
def test_nan_hunt_names_the_module(runtime_dir: Path, tmp_path: Path) -> None:
    """The NaN comes after the hunt is armed because the test makes it so: it pulls the
    trigger once the training script reports the hunt's hooks on its modules."""
    script = tmp_path / "train.py"
    script.write_text(NAN_HUNT_SCRIPT)
    trigger, poisoned_at, hunted = (
        tmp_path / "trigger",
        tmp_path / "poisoned_at",
        tmp_path / "hunted",
    )
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir))
    job = subprocess.Popen(
        [sys.executable, str(script), str(trigger), str(poisoned_at), str(hunted)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    hunt = None
    try:
        # A torch import on a busy machine: the 60 s a demo job gets (tests/demo_job.py).
        wait_until(
            lambda: job.poll() is not None or list(runtime_dir.glob("*.sock")), 60, "the run"
        )
        assert job.poll() is None, job.communicate()[1]
        hunt = subprocess.Popen(
            [*TDBG, "nan-hunt", "--steps", "100"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(hunted.exists, what="the hunt's hooks on the training script's modules")
        trigger.touch()
        out, err = hunt.communicate(timeout=TIMEOUT)
    finally:
        for proc in (hunt, job):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert hunt is not None and hunt.returncode == 0, err
    step = int(poisoned_at.read_text())
    first = out.splitlines()[0]
    assert first.startswith("first non-finite forward value: body.2 ("), out
    assert f"at step {step}" in first, out
    assert "inputs already non-finite: no" in out


@pytest.mark.slow
def test_anomaly_finishes(mlp_job: tuple[Path, Path]) -> None:
    runtime, sock = mlp_job
    out = run_cli("anomaly", str(sock), "--steps", "3", runtime=runtime)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "anomaly mode done: 3 steps, check_nan off, 0 backward errors\n"
    assert "anomaly mode is global and slow" in out.stderr  # the ack's warning
    refused = run_cli("anomaly", str(sock), "--check-nan", runtime=runtime)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("tdbg: error: anomaly refused: ")


@pytest.mark.slow
def test_activations_on_show_and_off(mlp_job: tuple[Path, Path]) -> None:
    runtime, sock_path = mlp_job
    sock = str(sock_path)
    out = run_cli("activations", sock, "--every", "2", "--show", runtime=runtime)
    assert out.returncode == 0, out.stderr
    assert "activations at step" in out.stdout and "body.0" in out.stdout, out.stdout
    out = run_cli("activations", sock, "--every", "3", "--show", "--json", runtime=runtime)
    assert out.returncode == 0, out.stderr
    event = json.loads(out.stdout)
    assert event["type"] == "activations" and event["layers"]
    assert all(0.0 <= v["zero_frac"] <= 1.0 for v in event["layers"].values())
    off = run_cli("activations", sock, "--off", runtime=runtime)
    assert off.returncode == 0 and off.stdout == "activation statistics off\n", off.stderr


@pytest.mark.slow
def test_dump_shows_another_clients_profile(mlp_job: tuple[Path, Path]) -> None:
    runtime, sock = mlp_job
    dump = subprocess.Popen(
        [*TDBG, "dump", str(sock), "--timeout", "100"],
        env=cli_env(runtime),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert dump.stdout is not None
    try:
        seen: list[dict[str, Any]] = []

        def read_until(etype: str, since: int = 0) -> None:
            deadline = time.monotonic() + TIMEOUT
            while not any(e["type"] == etype for e in seen[since:]):
                line = dump.stdout.readline() if dump.stdout else ""
                assert line and time.monotonic() < deadline, f"no {etype} event: {seen[-3:]}"
                seen.extend(events(line))

        read_until("synced")  # dump is attached; now another client profiles
        # The shared job's history (before "synced") holds other tests' dives: only what
        # comes after is this profile's.
        since = next(i for i, e in enumerate(seen) if e["type"] == "synced") + 1
        out = run_cli("profile", str(sock), "--steps", "2", runtime=runtime)
        assert out.returncode == 0, out.stderr
        read_until("profile", since)
    finally:
        dump.terminate()
        dump.wait(TIMEOUT)
        dump.stdout.close()
    live = seen[since:]
    jobs = [e for e in live if e["type"] == "job" and e["command"] == "profile"]
    assert [j["state"] for j in jobs][0] == "armed" and jobs[-1]["state"] == "done"
    assert {"running", "analysing"} <= {j["state"] for j in jobs}
    profile = next(e for e in live if e["type"] == "profile")
    assert profile["job"] == jobs[-1]["job"]
    assert profile["rows"] and profile["trace"]["path"] in out.stdout
    assert not any(e["type"] in ("ack", "error") for e in live)


@pytest.mark.slow
def test_stalled_run_times_out_then_ctrl_c_and_ending_run(runtime_dir: Path) -> None:
    # A step a minute: no step boundary comes while this test runs.
    with demo_job("mlp", "--delay", "60", runtime=runtime_dir) as (proc, entry):
        sock = str(entry.socket)
        out = run_cli("profile", sock, "--timeout", "1.5", runtime=runtime_dir)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.count("\n") == 1, out.stderr
        assert "the run did not reach a step boundary within 1.5 s" in out.stderr

        # Ctrl-C while waiting: the job is cancelled, exit 130.
        waiting = subprocess.Popen(
            [*TDBG, "nan-hunt", sock, "--progress"],
            env=cli_env(runtime_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert waiting.stderr is not None
        line = waiting.stderr.readline()
        armed = re.search(r"nan_hunt job (\d+): armed, waiting for the next step boundary", line)
        assert armed, line
        job = int(armed.group(1))
        waiting.send_signal(signal.SIGINT)
        _, err = waiting.communicate(timeout=TIMEOUT)
        assert waiting.returncode == 130, err
        assert f"interrupted: nan_hunt job {job} cancelled" in err
        assert "Traceback" not in err

        # The run ends while a job waits for its step: one line, exit 2.
        late = subprocess.Popen(
            [*TDBG, "anomaly", sock, "--progress"],
            env=cli_env(runtime_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert late.stderr is not None
        stream = late.stderr
        wait_until(lambda: "armed" in stream.readline(), what="anomaly armed")
        os.killpg(proc.pid, signal.SIGTERM)  # the demo closes its probe and exits
        _, err = late.communicate(timeout=TIMEOUT)
    assert late.returncode == 2, err
    assert err.count("\n") == 1 and "the run ended before anomaly job" in err, err


def test_nan_hunt_report_points_to_the_first_alert_when_weights_are_poisoned() -> None:
    assert "earlier optimizer step" not in report.format_nan_hunt(NAN_FOUND)
    text = report.format_nan_hunt(dict(NAN_FOUND, params_nonfinite=16640))
    assert "non-finite parameters:  16640" in text
    assert "earlier optimizer step spread the NaN" in text
