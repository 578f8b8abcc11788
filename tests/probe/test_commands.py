"""Deep-dive commands over a real socket: schemas, refusals, jobs, anomaly mode, audit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop, OpenReader, reader_on, wait_until
from torch import nn

import tdbg
from tdbg.protocol.framing import ErrorCode, ProtocolError
from tdbg.protocol.messages import COMMANDS, validate_client_message


def _msg(mtype: str, **args: Any) -> dict[str, Any]:
    return {"type": mtype, "id": 7, "args": args}


# --- schemas --------------------------------------------------------------------


def test_every_command_has_defaults_filled_in() -> None:
    for name, schema in COMMANDS.items():
        if name == "cancel":
            continue
        args = validate_client_message(_msg(name))["args"]
        assert set(args) == set(schema)


@pytest.mark.parametrize(
    ("mtype", "args", "fragment"),
    [
        ("profile", {"steps": 0}, "profile.steps must be an integer 1-200"),
        ("profile", {"steps": 201}, "1-200"),
        ("profile", {"steps": 2.0}, "integer"),
        ("profile", {"steps": True}, "integer"),
        ("profile", {"max_seconds": 121}, "max_seconds"),
        ("profile", {"with_stack": 1}, "true or false"),
        ("profile", {"path": "/etc/passwd"}, "unknown field"),
        ("profile", {"module": "os"}, "unknown field"),
        ("snapshot", {"max_entries": 100_001}, "max_entries"),
        ("nan_hunt", {"steps": -1}, "nan_hunt.steps"),
        ("anomaly", {"steps": 51}, "anomaly.steps"),
        ("activations", {"every": "10"}, "activations.every"),
        ("cancel", {}, "cancel.job is required"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(
    mtype: str, args: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ProtocolError, match=fragment) as info:
        validate_client_message(_msg(mtype, **args))
    assert info.value.code == ErrorCode.BAD_MESSAGE


def test_unknown_command_is_unknown_command() -> None:
    with pytest.raises(ProtocolError) as info:
        validate_client_message(_msg("exec", code="print(1)"))
    assert info.value.code == ErrorCode.UNKNOWN_COMMAND


# --- over the socket ----------------------------------------------------------------------------


class Session:
    """A probe on a real loop plus a real client that sends commands."""

    def __init__(self, **watch: Any) -> None:
        self.loop = Loop()
        self.probe = tdbg.watch(self.loop.model, self.loop.opt, **watch)
        assert self.probe.socket_path is not None
        self.reader = reader_on(self.probe)
        self.reader.wait(lambda r: r.of("synced"))

    def send(self, mtype: str, **args: Any) -> int:
        return self.reader.client.send(mtype, **args)

    def answer(self, mid: int) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for m in list(self.reader.messages):
                if m["type"] in ("ack", "error") and m.get("id") == mid:
                    return m
            return None

        wait_until(found, what=f"an answer to command {mid}")
        answer = found()
        assert answer is not None
        return answer

    def jobs(self, job: int) -> list[dict[str, Any]]:
        return [m for m in self.reader.of("job") if m["job"] == job]

    def run_until(self, condition: Any) -> None:
        """Step the loop until ``condition()`` holds: as many steps as the probe thread needs,
        not a fixed count that a busy machine's slower probe thread could outlast."""

        def holds_or_step() -> bool:
            if condition():
                return True
            self.loop.step(self.probe)
            return False

        wait_until(holds_or_step, what="while the loop ran")

    def final(self, job: int) -> dict[str, Any]:
        self.run_until(
            lambda: any(e["state"] in ("done", "failed", "cancelled") for e in self.jobs(job))
        )
        return self.jobs(job)[-1]

    def close(self) -> None:
        self.reader.close()
        self.probe.close()


@pytest.fixture
def session(runtime_dir: Path) -> Any:
    s = Session()
    yield s
    s.close()


def _hook_count(model: nn.Module) -> int:
    total = 0
    for m in model.modules():
        total += len(m._forward_hooks) + len(m._forward_pre_hooks)
        total += len(m._backward_hooks) + len(m._backward_pre_hooks)
        for p in m.parameters(recurse=False):
            total += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
            total += len(getattr(p, "_backward_hooks", None) or {})
    return total


def test_an_unknown_command_gets_an_error_and_the_connection_stays_open(session: Session) -> None:
    mid = session.send("format_disk")
    assert session.answer(mid)["code"] == ErrorCode.UNKNOWN_COMMAND
    pid = session.send("ping")
    wait_until(lambda: any(m.get("id") == pid for m in session.reader.of("pong")))


def test_bad_arguments_are_refused_over_the_wire(session: Session) -> None:
    mid = session.send("profile", steps=1000)
    answer = session.answer(mid)
    assert answer["code"] == ErrorCode.BAD_MESSAGE
    assert "profile.steps" in answer["message"]


def test_snapshot_on_a_cpu_run_is_unavailable_and_says_why(session: Session) -> None:
    assert "snapshot" in session.reader.client.run["commands"]
    answer = session.answer(session.send("snapshot"))
    assert answer["code"] == ErrorCode.UNAVAILABLE
    assert "CUDA" in answer["message"]


def test_anomaly_check_nan_needs_the_scripts_consent(session: Session) -> None:
    answer = session.answer(session.send("anomaly", check_nan=True))
    assert answer["code"] == ErrorCode.UNAVAILABLE
    assert "anomaly_check_nan=True" in answer["message"]


def test_a_read_only_probe_refuses_mutating_commands(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDBG_READONLY", "1")
    s = Session()
    try:
        for command in ("profile", "nan_hunt", "anomaly", "activations"):
            assert s.answer(s.send(command))["code"] == ErrorCode.READ_ONLY
    finally:
        s.close()


def test_anomaly_mode_runs_n_steps_then_switches_itself_off(session: Session) -> None:
    hooks_before = _hook_count(session.loop.model)
    session.loop.run(2, session.probe)
    ack = session.answer(session.send("anomaly", steps=3))
    assert ack["type"] == "ack" and "global and slow" in ack["message"]
    wait_until(lambda: session.jobs(ack["job"]), what="the armed event")
    assert session.jobs(ack["job"])[0]["state"] == "armed"
    assert not torch.is_anomaly_enabled()  # nothing changes before a step boundary
    session.loop.step(session.probe)
    assert torch.is_anomaly_enabled()
    assert not torch.is_anomaly_check_nan_enabled()
    final = session.final(ack["job"])
    assert final["state"] == "done", final
    assert final["result"] == {"steps": 3, "check_nan": False, "errors": 0}
    assert not torch.is_anomaly_enabled()
    states = [e["state"] for e in session.jobs(ack["job"])]
    assert states[0] == "armed" and states[-1] == "done" and "running" in states
    assert _hook_count(session.loop.model) == hooks_before


def test_a_second_job_of_the_same_kind_is_busy(session: Session) -> None:
    first = session.answer(session.send("anomaly", steps=5))
    assert first["type"] == "ack"
    second = session.answer(session.send("anomaly", steps=5))
    assert second["code"] == ErrorCode.BUSY and f"job {first['job']}" in second["message"]
    session.final(first["job"])
    third = session.answer(session.send("anomaly", steps=1))
    assert third["type"] == "ack"  # free again once the first is done
    session.final(third["job"])


def test_cancel_stops_a_job_and_unknown_jobs_are_refused(session: Session) -> None:
    ack = session.answer(session.send("anomaly", steps=50))
    session.loop.run(2, session.probe)
    assert torch.is_anomaly_enabled()
    cancel = session.answer(session.send("cancel", job=ack["job"]))
    assert cancel["type"] == "ack"
    final = session.final(ack["job"])
    assert final["state"] == "cancelled"
    assert not torch.is_anomaly_enabled()
    assert session.answer(session.send("cancel", job=999))["code"] == ErrorCode.BAD_MESSAGE


def test_anomaly_reports_a_backward_error_naming_the_forward_line(session: Session) -> None:
    import warnings

    original = warnings.showwarning
    ack = session.answer(session.send("anomaly", steps=2))
    session.loop.step(session.probe)  # the boundary that turns it on
    x = torch.randn(8, requires_grad=True)
    y = x.sigmoid()
    y.mul_(2)  # in-place on a tensor sigmoid's backward needs: backward will fail
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    session.probe.step(float(y.sum()))
    alerts: list[dict[str, Any]] = []

    def anomaly_alert() -> bool:
        alerts[:] = [a for a in session.reader.of("alert") if a["kind"] == "anomaly"]
        return bool(alerts)

    wait_until(anomaly_alert, what="an anomaly alert")
    assert "SigmoidBackward0" in alerts[0]["message"]
    assert "test_commands.py" in alerts[0]["message"]  # the forward call's own file and line
    final = session.final(ack["job"])
    assert final["result"]["errors"] == 1
    assert not torch.is_anomaly_enabled()
    assert warnings.showwarning is original  # the user's warning machinery is as it was


def test_close_mid_job_releases_everything(runtime_dir: Path) -> None:
    s = Session()
    ack = s.answer(s.send("anomaly", steps=50))
    s.loop.run(2, s.probe)
    assert torch.is_anomaly_enabled()
    s.probe.close()
    assert not torch.is_anomaly_enabled()
    s.reader.close()
    assert ack["type"] == "ack"


def test_finished_jobs_are_replayed_to_a_late_client(
    session: Session, probe_reader: OpenReader
) -> None:
    ack = session.answer(session.send("anomaly", steps=1))
    session.final(ack["job"])
    late = probe_reader(session.probe)
    try:
        late.wait(lambda r: r.of("synced"))
        replayed = [m for m in late.of("job") if m["job"] == ack["job"]]
        assert replayed and replayed[-1]["state"] == "done" and replayed[-1]["history"] is True
    finally:
        late.close()


def test_commands_are_audit_logged(session: Session, runtime_dir: Path) -> None:
    ack = session.answer(session.send("anomaly", steps=1))
    session.answer(session.send("anomaly", steps=1))  # busy: refused, logged too
    lines = [json.loads(line) for line in (runtime_dir / "audit.jsonl").read_text().splitlines()]
    assert [e["command"] for e in lines] == ["anomaly", "anomaly"]
    assert lines[0]["result"] == f"accepted as job {ack['job']}"
    assert lines[1]["result"].startswith("refused BUSY")
    import os

    assert lines[0]["peer_uid"] == os.geteuid() and lines[0]["peer_pid"] == os.getpid()
    assert lines[0]["args"] == {"steps": 1, "check_nan": False}
    assert (runtime_dir / "audit.jsonl").stat().st_mode & 0o777 == 0o600


def test_nothing_armed_costs_one_flag(session: Session) -> None:
    session.loop.run(3, session.probe)
    assert session.probe._dives.busy is False
    assert not session.probe._dives.active


def test_refused_commands_never_reach_the_training_thread(session: Session) -> None:
    """A refusal is decided on the server thread: the loop's per-step work is unchanged (the
    step-time ratio under a flood of refusals is measured in benchmarks/deep_dives.py)."""
    ids = [session.send("snapshot") for _ in range(5)]
    ids += [session.send("profile", steps=0) for _ in range(5)]
    ids += [session.send("no_such_command") for _ in range(5)]
    for mid in ids:
        assert session.answer(mid)["type"] == "error"
    assert not session.probe._dives.busy and not session.probe._dives.intents
    session.loop.run(3, session.probe)
    assert not session.reader.of("job")


def test_a_refusal_flood_is_folded_in_the_audit_log_and_the_log_rotates(
    session: Session, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_reader: OpenReader
) -> None:
    """Reconnecting to retry gets neither a fresh rate limit nor an unbounded audit log."""
    from tdbg.probe.serving import commands

    first = session.answer(session.send("anomaly", steps=1))
    assert first["type"] == "ack"
    refused = [session.answer(session.send("anomaly", steps=1)) for _ in range(30)]
    assert all(r["type"] == "error" for r in refused)
    log = runtime_dir / "audit.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 1 + commands.AUDIT_REFUSALS_PER_MINUTE  # the other 10: counted
    # The rate limit is the peer's, not the connection's: a new connection does not reset it.
    again = probe_reader(session.probe)
    again.wait(lambda r: r.of("synced"))
    ids = [again.client.send("ping") for _ in range(60)]
    again.wait(lambda r: len(r.of("pong")) + len(r.of("error")) >= 60)
    limited = [m for m in again.of("error") if m["code"] == "RATE_LIMITED"]
    assert limited and len(again.of("pong")) < len(ids)
    again.close()
    # Past its size limit the log rotates: one older file, the current one small again.
    monkeypatch.setattr(commands, "AUDIT_MAX_BYTES", log.stat().st_size)
    desk = session.probe._server.desk  # the server thread's own entry point, from another peer
    assert desk is not None
    with pytest.raises(commands.Refused):
        desk.submit("cancel", {"job": 999}, (1, 0), "manual")
    assert (runtime_dir / "audit.jsonl.1").exists()
    assert len(log.read_text().splitlines()) == 1
