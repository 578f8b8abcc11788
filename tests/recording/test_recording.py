"""Recordings: the probe records what a live client gets, a SIGKILLed run stays readable up to its
last flush, damaged files load up to the damage, and the size stays within its stated bound."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import Loop, OpenReader, Reader, inject_fault, wait_until
from test_cli import events, run_cli

from tdbg.probe.serving import recorder as recorder_module
from tdbg.probe.serving.recorder import Bounds, Recorder, temp_path
from tdbg.protocol.framing import pack
from tdbg.protocol.steps import pack_steps, unpack_steps
from tdbg.recording.compaction import keep_newest
from tdbg.recording.reader import FILE_HEADER, Recording, RecordingError
from tdbg.tui.sources.synthetic import RUN, layer_names, step_records

ALERT_STEPS = (50, 120, 150)


def synthetic_recording(
    path: Path, steps: int = 200, n_layers: int = 6, batch: int = 10, bye: bool = True
) -> Recorder:
    """A recording written by the real Recorder from synthetic batches: one flush per batch,
    alerts at ALERT_STEPS (150: the loss turns NaN), a probe report per batch and a NaN-hunt
    job that finishes one step after the NaN."""
    rec = Recorder(path, RUN, layer_names(n_layers), [100] * n_layers)
    assert rec.open()
    for start in range(0, steps, batch):
        msg = pack_steps(step_records(start, batch, n_layers, nan_at=150), n_layers)
        rec.add_steps(msg, pack(msg))
        for s in range(start, start + batch):
            if s in ALERT_STEPS:
                kind = "nonfinite_loss" if s == 150 else "loss_spike"
                alert = {"type": "alert", "kind": kind, "severity": "warning", "step": s}
                alert.update(time=0.0, message=f"alert at step {s}", layers=[])
                rec.add(pack(alert))
            if s == 151:
                rec.add(pack(nan_hunt_job(s)))
        probe = {"type": "probe", "time": 0.0, "grad_interval": 1, "errors": 0, "dropped": 0}
        rec.add_thinned("probe", pack(dict(probe, clients=start)))
        rec.flush()
    if bye:
        rec.close()
    else:
        rec.abandon()
    return rec


def nan_hunt_job(step: int) -> dict[str, Any]:
    result = {"found": True, "module": "blocks.0.attn", "module_type": "Linear"}
    result.update(phase="forward", step=step - 1, steps_checked=1)
    return {
        "type": "job",
        "job": 1,
        "command": "nan_hunt",
        "state": "done",
        "step": step,
        "done": 1,
        "total": 1,
        "message": "",
        "args": {"steps": 1},
        "time": 0.0,
        "result": result,
    }


def same(a: list[Any], b: list[Any]) -> bool:
    """Step records equal field by field, NaN equal to NaN (repr spells both ``nan``)."""
    return [repr(r) for r in a] == [repr(r) for r in b]


def recorded_steps(path: Path) -> tuple[Recording, list[Any]]:
    rec = Recording(path)
    records = [r for m in rec.messages() if m["type"] == "steps" for r in unpack_steps(m)]
    return rec, records


# --- recording a real training loop -------------------------------------------------------


def test_recording_equals_what_a_live_client_got(
    runtime_dir: Path, tmp_path: Path, probe_reader: OpenReader
) -> None:
    import tdbg

    loop = Loop()
    path = tmp_path / "run.tdbgrec"
    probe = tdbg.watch(loop.model, loop.opt, grad_every=2, record=path)
    assert probe.socket_path is not None
    reader = probe_reader(probe)
    reader.wait(lambda r: r.of("synced"))
    loop.run(60, probe)
    reader.wait(lambda r: len(r.records()) == 60)
    probe.close()
    reader.wait(lambda r: r.ended)
    reader.close()

    assert probe.recording_path == str(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    rec, records = recorded_steps(path)
    assert rec.stopped is None and rec.ended and rec.end_note is None
    live = reader.records()
    assert [r.step for r in records] == [r.step for r in live] == list(range(60))
    assert [r.loss for r in records] == [r.loss for r in live]
    assert [r.loss for r in records] == pytest.approx(loop.losses, rel=1e-6)
    assert [r.grad_norms for r in records] == [r.grad_norms for r in live]
    assert sum(r.grad_norms is not None for r in records) == 30
    layers = [m for m in Recording(path).messages() if m["type"] == "layers"]
    assert layers[0]["names"] == reader.of("layers")[0]["names"] == ["0", "2"]
    assert rec.run["pid"] == os.getpid() and rec.proto == 1
    assert {m["type"] for m in Recording(path).messages()} >= {"layers", "steps", "probe", "bye"}


def test_records_without_serving_and_never_appends_to_an_existing_file(
    runtime_dir: Path, tmp_path: Path, probe_log: Any
) -> None:
    import tdbg

    path = tmp_path / "run.tdbgrec"
    path.write_bytes(b"someone else's file")
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path)
    loop.run(5, probe)
    probe.close()
    assert probe.socket_path is None
    assert list(runtime_dir.glob("*.sock")) == []
    assert path.read_bytes() == b"someone else's file"  # untouched
    assert probe.recording_path == str(tmp_path / "run.1.tdbgrec")
    _, records = recorded_steps(tmp_path / "run.1.tdbgrec")
    assert [r.step for r in records] == list(range(5))
    assert "recording to" in probe_log.getvalue() and "run.1.tdbgrec" in probe_log.getvalue()


def test_symlink_is_refused_and_training_goes_on(
    runtime_dir: Path, tmp_path: Path, probe_log: Any
) -> None:
    import tdbg

    target = tmp_path / "elsewhere"
    target.write_text("precious")
    link = tmp_path / "run.tdbgrec"
    link.symlink_to(target)
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, record=link)
    loop.run(5, probe)
    wait_until(lambda: "recording stopped" in probe_log.getvalue(), what="the warning")
    assert probe.recording_path is None and probe.steps == 5 and probe.errors == 0
    probe.close()
    assert target.read_text() == "precious"
    assert "symbolic link" in probe_log.getvalue()


def test_write_error_warns_once_and_stops_recording(
    runtime_dir: Path, tmp_path: Path, probe_log: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tdbg

    real_write = os.write
    state = {"full": False}

    def write(fd: int, data: Any) -> int:
        if state["full"]:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(recorder_module.os, "write", write)
    path = tmp_path / "run.tdbgrec"
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, record=path)
    loop.run(10, probe)
    wait_until(lambda: _last_step(path) == 9, what="10 steps")
    state["full"] = True
    loop.run(40, probe)
    wait_until(lambda: "recording stopped" in probe_log.getvalue(), what="the warning")
    loop.run(10, probe)
    probe.close()
    assert probe.steps == 60 and probe.errors == 0
    assert probe_log.getvalue().count("recording stopped") == 1
    assert "No space left on device" in probe_log.getvalue()
    rec, records = recorded_steps(path)
    assert [r.step for r in records] == list(range(len(records))) and len(records) >= 10
    assert not rec.ended and rec.stopped is None  # readable up to the last good flush


def _reading(path: Path) -> Recording | None:
    """A recording being written, to poll; None before it exists or has its header (the probe
    thread creates the file, then writes the header)."""
    try:
        return Recording(path)
    except RecordingError:
        return None


def _last_step(path: Path) -> int | None:
    rec = _reading(path)
    if rec is None:
        return None
    for _ in rec.messages():
        pass
    return rec.last_step


def test_env_var_records_only_in_the_main_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import multiprocessing

    import tdbg

    monkeypatch.setenv("TDBG_RECORD", str(tmp_path / "env.tdbgrec"))
    # As in a spawned child, which inherits TDBG_* from its parent: it must stay inert.
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    model = Loop().model
    probe = tdbg.watch(model, serve=False)
    assert probe.recording_path is None
    probe.close()
    explicit = tdbg.watch(model, serve=False, record=tmp_path / "explicit")
    wait_until(lambda: explicit.recording_path is not None, what="the explicit recording")
    assert explicit.recording_path == str(tmp_path / "explicit")
    explicit.close()
    with pytest.raises(TypeError, match="record must be a file path"):
        tdbg.watch(model, serve=False, record=42)
    assert not (tmp_path / "env.tdbgrec").exists()


def test_env_var_is_claimed_so_plain_subprocesses_do_not_record(
    monkeypatch: pytest.MonkeyPatch, runtime_dir: Path, tmp_path: Path
) -> None:
    """An evaluation script started with subprocess must not write ``env.1.tdbgrec``."""
    import tdbg

    path = tmp_path / "env.tdbgrec"
    monkeypatch.setenv("TDBG_RECORD", str(path))
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False)
    assert "TDBG_RECORD" not in os.environ  # claimed by this process's probe
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('TDBG_RECORD'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.stdout.strip() == "None"
    loop.run(3, probe)
    probe.close()
    assert probe.recording_path == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.tdbgrec"]
    second = tdbg.watch(Loop(seed=1).model, serve=False)  # a later watch() has nothing to claim
    assert second.recording_path is None
    second.close()


def test_activations_every_works_in_record_only_mode(runtime_dir: Path, tmp_path: Path) -> None:
    import tdbg

    path = tmp_path / "acts.tdbgrec"
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path, activations_every=2)
    assert probe.socket_path is None
    for _ in range(200):
        loop.run(2, probe)
        if _has(path, "activations"):
            break
    probe.close()
    assert _has(path, "activations"), "activations_every was ignored without a socket"


def _has(path: Path, mtype: str) -> bool:
    rec = _reading(path)
    return rec is not None and any(m.get("type") == mtype for m in rec.messages())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crashing_probe_loop_still_writes_the_end_marker(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tdbg
    from tdbg.probe.serving.server import ProbeServer

    path = tmp_path / "crash.tdbgrec"
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path)
    loop.run(5, probe)
    wait_until(lambda: _last_step(path) == 4, what="5 steps recorded")
    server = probe._server
    assert isinstance(server, ProbeServer)

    def crash(now: float) -> None:
        raise MemoryError("the loop dies")

    def reraise(exc: BaseException) -> None:
        raise exc  # an error handler that fails too: the loop itself dies

    inject_fault(monkeypatch, probe, "server_tick", crash)
    inject_fault(monkeypatch, probe, "server_error", reraise)
    server.wake()
    wait_until(lambda: not server._threads[0].is_alive(), what="the probe thread to die")
    rec = Recording(path)
    for _ in rec.messages():
        pass
    assert rec.ended and rec.end_note is None and rec.last_step == 4
    probe.close()


KILLED_JOB = textwrap.dedent(
    """
    import sys, time, torch
    from torch import nn
    import tdbg

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    probe = tdbg.watch(model, opt, grad_every=1)
    for step in range(10**9):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        probe.step(loss)
        print(step, time.time(), repr(loss.item()), flush=True)
        time.sleep(0.004)
    """
)


def record_until_killed(path: Path, runtime_dir: Path, steps: int) -> list[list[str]]:
    """Run KILLED_JOB recording to ``path`` (TDBG_RECORD) until the file holds ``steps`` steps,
    SIGKILL it, and return what it printed: ``[step, time, loss]`` per step it reached."""
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir), TDBG_RECORD=str(path))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_JOB],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: (_last_step(path) or 0) >= steps, 60, f"{steps} steps")
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return [line.split() for line in out.splitlines() if len(line.split()) == 3]


@pytest.mark.slow
def test_sigkill_mid_run_leaves_a_recording_up_to_the_last_flush(
    runtime_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "killed.tdbgrec"
    printed = record_until_killed(path, runtime_dir, 150)
    reached = int(printed[-1][0])

    dump = run_cli("dump", str(path), runtime=runtime_dir)
    assert dump.returncode == 0, dump.stderr
    evs = events(dump.stdout)
    assert evs[0]["type"] == "hello" and evs[0]["recording"] == str(path)
    steps = [e for e in evs if e["type"] == "step"]
    assert [e["step"] for e in steps] == list(range(len(steps)))
    assert evs[-1] == {"type": "end", "reason": "killed"}
    assert "without the run's end marker" in dump.stderr and "Traceback" not in dump.stderr
    last = steps[-1]
    # Everything on disk before the kill survives it (the kill came once the file held step
    # 150): a lost flush would end the dump earlier. How much a kill loses in time (the last
    # flush interval) is the recorder's bound, not something a loaded machine can time.
    assert 150 <= last["step"] <= reached
    assert math.isfinite(last["loss"])


# --- damaged files ------------------------------------------------------------------------


def test_truncated_files_load_up_to_the_cut(tmp_path: Path) -> None:
    good = tmp_path / "good.tdbgrec"
    synthetic_recording(good)
    data = good.read_bytes()
    _, full = recorded_steps(good)
    assert len(full) == 200
    cut = tmp_path / "cut.tdbgrec"
    offsets = sorted(
        {*range(FILE_HEADER.size + 1, len(data), max(1, len(data) // 37)), len(data) - 1}
    )
    first = FILE_HEADER.size
    header_end = first + 4 + int.from_bytes(data[first : first + 4], "big")
    for offset in offsets:
        cut.write_bytes(data[:offset])
        if offset < header_end:
            with pytest.raises(RecordingError, match="damaged recording header"):
                Recording(cut)
            continue
        rec, records = recorded_steps(cut)
        assert same(records, full[: len(records)]), offset  # a prefix, never a wrong value
        assert rec.stopped is not None or not rec.ended
        assert rec.cut_short and not rec.damaged, offset  # a cut is a kill, never damage
        note = rec.end_note or ""
        assert "truncated at byte" in note or "without the run's end marker" in note, note
        if rec.stopped:
            assert f"after step {rec.last_step}" in rec.stopped or "after no step" in rec.stopped
    # A cut mid-file through the CLI: the steps before it, the place on stderr, exit 0.
    cut.write_bytes(data[: len(data) // 2 + 3])
    dump = run_cli("dump", str(cut), runtime=tmp_path)
    assert dump.returncode == 0
    assert (
        dump.stderr.startswith("tdbg: recording truncated at byte")
        and "Traceback" not in dump.stderr
    )
    assert dump.stderr.count("\n") == 1
    # Cut short, no checksum broken: a kill, not damage.
    assert events(dump.stdout)[-1] == {"type": "end", "reason": "killed"}


def test_flipped_bytes_stop_the_load_at_the_damaged_block(tmp_path: Path) -> None:
    good = tmp_path / "good.tdbgrec"
    synthetic_recording(good)
    data = good.read_bytes()
    _, full = recorded_steps(good)
    bad = tmp_path / "bad.tdbgrec"
    first_frame = FILE_HEADER.size
    header_frame_end = first_frame + 4 + int.from_bytes(data[first_frame : first_frame + 4], "big")
    for offset in range(header_frame_end + 1, len(data), max(1, len(data) // 29)):
        flipped = bytearray(data)
        flipped[offset] ^= 0x5A
        bad.write_bytes(bytes(flipped))
        rec, records = recorded_steps(bad)
        assert same(records, full[: len(records)]), offset
        assert len(records) < len(full) or offset > len(data) - 64, offset
        assert rec.stopped is not None, offset
        assert "corrupt at byte" in rec.stopped or "truncated at byte" in rec.stopped
        if "corrupt at byte" in rec.stopped:
            assert rec.damaged and not rec.cut_short


def test_damaged_header_and_not_a_recording_are_one_line_exit_2(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    good = tmp_path / "good.tdbgrec"
    synthetic_recording(good)
    header_only = tmp_path / "header.tdbgrec"
    header_only.write_bytes(good.read_bytes()[: FILE_HEADER.size + 5])
    with pytest.raises(RecordingError, match="not a tdbg recording"):
        Recording(text)
    for target, expected in (
        (text, "is not a tdbg recording"),
        (header_only, "damaged recording header"),
    ):
        dump = run_cli("dump", str(target), runtime=tmp_path)
        assert dump.returncode == 2 and dump.stdout == ""
        assert dump.stderr.startswith("tdbg: error: ") and expected in dump.stderr
        assert dump.stderr.count("\n") == 1
        tui = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from tdbg.cli.main import tui_main; sys.exit(tui_main())",
            ]
            + ["replay", str(target)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert tui.returncode == 2 and tui.stderr.startswith("tdbg-tui: error: ")
        assert expected in tui.stderr and tui.stderr.count("\n") == 1
    missing = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tdbg.cli.main import tui_main; sys.exit(tui_main())",
        ]
        + ["replay", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "tdbg-tui: error: cannot read" in missing.stderr


def test_dump_of_a_recording_matches_the_live_event_shapes(tmp_path: Path) -> None:
    path = tmp_path / "syn.tdbgrec"
    synthetic_recording(path)
    dump = run_cli("dump", str(path), "--count", "5", runtime=tmp_path)
    assert dump.returncode == 0 and dump.stderr == ""
    evs = events(dump.stdout)
    assert evs[0]["type"] == "hello" and evs[0]["layers"] == layer_names(6)
    assert evs[0]["run"]["name"] == "synthetic" and evs[0]["recorded"] > 0
    assert [e["step"] for e in evs if e["type"] == "step"] == [0, 1, 2, 3, 4]
    full = events(run_cli("dump", str(path), runtime=tmp_path).stdout)
    assert [e["step"] for e in full if e["type"] == "alert"] == list(ALERT_STEPS)
    assert any(e["type"] == "nan_hunt" and e["module"] == "blocks.0.attn" for e in full)
    assert full[-1] == {"type": "end", "reason": "shutdown"}
    assert all(json.dumps(e) for e in full)


# --- the size bound -----------------------------------------------------------------------


def test_keep_newest_keeps_the_newest_in_full_and_thins_older_more() -> None:
    assert keep_newest(10, 10) is None
    mask = keep_newest(10_000, 1000)
    assert mask is not None and sum(mask) <= 1000
    kept = [i for i, k in enumerate(mask) if k]
    assert kept[-300:] == list(range(10_000 - 300, 10_000))  # the newest: every item
    gaps = [b - a for a, b in zip(kept, kept[1:], strict=False)]
    assert gaps == sorted(gaps, reverse=True) and gaps[0] > 8  # sparser the older
    assert keep_newest(5, 0) == bytearray(5)
    assert sum(keep_newest(3, 1) or b"") == 1


LONG_BOUNDS = Bounds(
    grads=256 << 10,
    activations=8 << 10,
    system=8 << 10,
    probe=8 << 10,
    compact_at=256 << 10,
    max_growth=512 << 10,
)


def long_run(
    path: Path, steps: int, n_layers: int = 50, batch: int = 100, bounds: Bounds = LONG_BOUNDS
) -> tuple[Recorder, list[int]]:
    """A long run through the real Recorder with compactions inline; returns the recorder and
    the file size after every flush."""
    rec = Recorder(path, RUN, layer_names(n_layers), [1] * n_layers, bounds)
    assert rec.open()
    sizes = []
    for start in range(0, steps, batch):
        msg = pack_steps(step_records(start, batch, n_layers), n_layers)
        rec.add_steps(msg, pack(msg))
        report = {"time": float(start), "clients": start, "padding": "x" * 200}
        rec.add_thinned("probe", pack(dict(report, type="probe")))
        rec.add_thinned("system", pack(dict(report, type="system")))
        rec.add_thinned("activations", pack(dict(report, type="activations", step=start)))
        if start % 2000 == 0:
            alert = {"type": "alert", "kind": "loss_spike", "severity": "warning", "step": start}
            rec.add(pack(dict(alert, time=0.0, message="spike", layers=[])))
        rec.flush()
        rec.maybe_flush()
        sizes.append(path.stat().st_size)
    return rec, sizes


def test_size_bound_holds_for_a_long_run_and_the_end_stays_in_full(tmp_path: Path) -> None:
    n_layers, steps, batch = 50, 20_000, 100
    path = tmp_path / "long.tdbgrec"
    rec, sizes = long_run(path, steps, n_layers, batch)
    rec.close()
    assert rec.compactions >= 3 and rec.failed is None
    assert list(tmp_path.iterdir()) == [path]  # no temp file left
    # The stated bound: max(compact_at, C + min(C, max_growth)) + one flush, where C (the size
    # after a compaction) <= what is never thinned + the budgets.
    per_row = 8 + 4 * n_layers
    scalars_only = sum(
        len(pack(pack_steps(step_records(s, batch, n_layers, grad_every=10**9), n_layers)))
        for s in range(0, steps, batch)
    )
    alerts = (steps // 2000) * 120
    marks = (steps // batch + 1) * 80
    budgets = sum(LONG_BOUNDS.budgets().values()) + per_row + 3 * 300
    never_thinned = 4096 + scalars_only + alerts + marks
    one_flush = batch * per_row + scalars_only // (steps // batch) + 3 * 300 + 80
    c_max = never_thinned + budgets
    bound = LONG_BOUNDS.threshold(c_max) + one_flush
    assert max(sizes) <= bound, (max(sizes), bound)
    without_thinning = scalars_only + steps * per_row
    assert path.stat().st_size - scalars_only < (without_thinning - scalars_only) / 5

    loaded, records = recorded_steps(path)
    assert loaded.ended and loaded.stopped is None
    assert [r.step for r in records] == list(range(steps))  # every step's scalars kept
    assert all(r.loss is not None for r in records)
    with_rows = [r.step for r in records if r.grad_norms is not None]
    # The end of the run (where a crash is) at full resolution; old rows thinned, more so the
    # older they are.
    assert with_rows[-500:] == list(range(steps - 500, steps))
    old = [s for s in with_rows if s < steps // 4]
    assert 0 < len(old) < steps // 4 // 8
    gaps = [b - a for a, b in zip(with_rows, with_rows[1:], strict=False)]
    assert gaps == sorted(gaps, reverse=True) and max(gaps) > 8
    assert [r.grad_norms for r in records[-3:]] == [
        r.grad_norms
        for r in unpack_steps(pack_steps(step_records(steps - batch, batch, n_layers), n_layers))
    ][-3:]
    messages = list(Recording(path).messages())
    assert [m["step"] for m in messages if m["type"] == "alert"] == list(range(0, steps, 2000))
    # Both 1 Hz report kinds survive thinning, each within its own budget (one shared budget
    # kept only one of the alternating kinds).
    for kind in ("probe", "system", "activations"):
        clients = [m["clients"] for m in messages if m["type"] == kind]
        assert clients[-20:] == list(range(steps - 20 * batch, steps, batch)), kind
        assert 0 < sum(c < steps // 2 for c in clients) < steps // batch // 2 // 4, kind
    dump = run_cli("dump", str(path), runtime=tmp_path)
    assert dump.returncode == 0 and dump.stderr == ""
    evs = events(dump.stdout)
    assert [e["step"] for e in evs if e["type"] == "step"] == list(range(steps))
    assert evs[-1] == {"type": "end", "reason": "shutdown"}


def test_compaction_keeps_what_is_appended_meanwhile_and_a_kill_keeps_the_old_file(
    tmp_path: Path,
) -> None:
    n_layers = 8
    path = tmp_path / "c.tdbgrec"
    bounds = Bounds(grads=4 << 10, compact_at=10**12)  # compactions only when asked
    queued: list[Any] = []
    rec = Recorder(path, RUN, layer_names(n_layers), [1] * n_layers, bounds, queued.append)
    assert rec.open()

    def steps(start: int, n: int) -> None:
        msg = pack_steps(step_records(start, n, n_layers), n_layers)
        rec.add_steps(msg, pack(msg))
        rec.flush()

    steps(0, 500)
    rec.compact()
    assert len(queued) == 1 and temp_path(path).exists()
    steps(500, 100)  # appended to the old file while the worker rewrites it
    before = path.read_bytes()
    # A kill now (the compaction never finished): the old file is whole and readable.
    killed = tmp_path / "killed.tdbgrec"
    killed.write_bytes(before)
    _, records = recorded_steps(killed)
    assert [r.step for r in records] == list(range(600))
    assert all(r.grad_norms is not None for r in records)

    queued.pop()()  # the worker's rewrite
    rec.maybe_flush()  # back on the probe thread: copy the tail, rename over
    assert rec.compactions == 1 and not temp_path(path).exists()
    steps(600, 10)
    rec.close()
    loaded, records = recorded_steps(path)
    assert loaded.ended and loaded.stopped is None
    assert [r.step for r in records] == list(range(610))
    rows = [r.step for r in records if r.grad_norms is not None]
    assert rows[-110:] == list(range(500, 610)) and len(rows) < 300
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_temp_file_left_by_a_killed_compaction_is_removed_by_the_next_run(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.tdbgrec"
    synthetic_recording(path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".run.tdbgrec.{dead.pid}.compacting"
    stale.write_bytes(b"half a compaction")
    alive = tmp_path / f".run.tdbgrec.{os.getpid()}.compacting"
    alive.write_bytes(b"a compaction in flight")
    rec = Recorder(path, RUN, layer_names(2), [1, 1])
    assert rec.open() and rec.path == tmp_path / "run.1.tdbgrec"
    rec.close()
    assert not stale.exists() and alive.exists()
    _, records = recorded_steps(path)  # the old recording untouched
    assert len(records) == 200


def test_recording_while_a_client_reads_keeps_live_frames_unchanged(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe_reader: OpenReader
) -> None:
    """Thinning applies to the file only, by compactions on the sampler thread: a live client
    still gets every sampled row, and the file keeps every step."""
    import tdbg

    tiny = Bounds(grads=2 << 10, compact_at=16 << 10, max_growth=16 << 10)
    monkeypatch.setattr(recorder_module, "DEFAULT_BOUNDS", tiny)
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1, record=tmp_path / "r.tdbgrec")
    recorder = probe._server.recorder
    assert isinstance(recorder, Recorder) and recorder.bounds == tiny
    assert probe.socket_path is not None
    reader = probe_reader(probe)
    reader.wait(lambda r: r.of("synced"))
    for burst in range(1, 9):
        loop.run(40, probe)

        # The probe thread has written this burst (clients and the recorder get the same
        # frames) before the next: eight separate writes, each able to trigger a compaction.
        def written(r: Reader, n: int = 40 * burst) -> bool:
            return len(r.records()) == n

        reader.wait(written)
    probe.close()
    reader.close()
    assert recorder.compactions >= 1, recorder.written
    assert all(r.grad_norms is not None for r in reader.records())
    _, records = recorded_steps(tmp_path / "r.tdbgrec")
    assert [r.step for r in records] == list(range(320))
    kept = [r.step for r in records if r.grad_norms is not None]
    assert 319 in kept and len(kept) < 320
    assert [p.name for p in tmp_path.iterdir()] == ["r.tdbgrec"]


def test_deep_dive_commands_on_a_recording_or_a_plain_file_say_why_not(tmp_path: Path) -> None:
    # A recording is history: asking it to profile must say so, not "connection refused".
    rec = tmp_path / "run.tdbgrec"
    synthetic_recording(rec)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    for target, expected in (
        (rec, "is a recording: a recording cannot run commands"),
        (text, "is not a tdbg recording, nor a probe's socket"),
    ):
        for command in ("profile", "nan-hunt", "activations"):
            result = run_cli(command, str(target), runtime=tmp_path)
            assert result.returncode == 2 and result.stdout == ""
            assert result.stderr.startswith("tdbg: error: ") and expected in result.stderr
            assert result.stderr.count("\n") == 1


def test_a_leftover_temp_with_our_own_pid_does_not_block_compaction(tmp_path: Path) -> None:
    # Containers give the training process the same pid run after run: a temp file a killed
    # run left under our pid must not make every compaction of this run fail.
    rec = Recorder(tmp_path / "again.tdbgrec", RUN, layer_names(2), [1, 1])
    assert rec.open()
    stale = tmp_path / f".again.tdbgrec.{os.getpid()}.compacting"
    stale.write_bytes(b"left by a killed run with our pid")
    rec.compact()
    assert rec.compactions == 1 and not stale.exists()
    rec.close()
    _, records = recorded_steps(tmp_path / "again.tdbgrec")
    assert records == []  # a compacted file with no steps is still a valid recording
