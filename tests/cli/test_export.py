"""`tdbg export`: a real run's series as TensorBoard event files that TensorBoard's own reader
reads back exactly, and as CSV; a live run followed to its end; bad directories refused."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import Loop
from test_cli import TDBG
from test_report import _nan_recording
from waiting import wait_until

import tdbg
from tdbg.cli.main import run


def _dumped(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run([*TDBG, "dump", str(path)], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def _same(a: Any, b: Any) -> bool:
    a = float(a) if isinstance(a, str) else a  # the dump spells non-finite numbers
    return (math.isnan(a) and math.isnan(b)) if isinstance(a, float) and math.isnan(a) else a == b


def test_tensorboard_reads_back_every_value_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    path = tmp_path / "nan.tdbg"
    _nan_recording(path)
    out = tmp_path / "tb"
    assert run(["export", str(path), "--to", "tensorboard", str(out)]) == 0
    assert "12 steps" in capsys.readouterr().out
    acc = EventAccumulator(str(out), size_guidance={"tensors": 0})
    acc.Reload()

    def series(tag: str) -> dict[int, float]:
        return {e.step: tensor_util.make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)}

    steps = [e for e in _dumped(path) if e["type"] == "step"]
    checks = {
        "loss": [e["loss"] for e in steps],
        "lr/group0": [e["lr"][0] for e in steps],
        "grad_norm/total": [e["grad_norm"] for e in steps],
        "grad_norm/layer/0": [e["grad_norms"]["0"] for e in steps],
        "step/step_time": [e["step_time"] for e in steps],
    }
    for tag, want in checks.items():
        got = series(tag)
        known = {e["step"]: w for w, e in zip(want, steps, strict=True) if w is not None}
        assert sorted(got) == sorted(known), tag  # every value the run measured, no other
        assert all(_same(w, got[step]) for step, w in known.items()), tag
    assert math.isnan(series("loss")[8]) and series("loss")[0] == steps[0]["loss"]
    assert "alerts/text_summary" in acc.Tags()["tensors"]  # the alerts, as text


def test_csv_has_one_file_per_series(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nan.tdbg"
    _nan_recording(path)
    out = tmp_path / "csv"
    assert run(["export", str(path), "--to", "csv", str(out)]) == 0
    capsys.readouterr()
    names = {p.name for p in out.iterdir()}
    assert {"loss.csv", "lr.group0.csv", "grad_norm.total.csv", "alerts.csv"} <= names
    assert "grad_norm.layer.0.csv" in names and "step.data_time.csv" in names
    with (out / "loss.csv").open() as f:
        rows = list(csv.DictReader(f))
    steps = [e for e in _dumped(path) if e["type"] == "step"]
    assert [int(r["step"]) for r in rows] == [e["step"] for e in steps]
    assert all(_same(e["loss"], float(r["value"])) for r, e in zip(rows, steps, strict=True))
    with (out / "alerts.csv").open() as f:
        kinds = [r["kind"] for r in csv.DictReader(f)]
    assert "nonfinite_loss" in kinds


def test_a_live_run_followed_to_its_end(runtime_dir: Path, tmp_path: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="live")
    loop.run(5, probe)
    out = tmp_path / "live"
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir))
    proc = subprocess.Popen(
        [*TDBG, "export", str(probe.socket_path), "--follow", "--to", "csv", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: (out / "loss.csv").exists(), 60, "the export attached")
    loop.run(15, probe)
    probe.close()
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "20 steps" in stdout
    with (out / "loss.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(20))


def test_a_directory_with_other_files_is_refused_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nan.tdbg"
    _nan_recording(path)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep me")
    assert run(["export", str(path), "--to", "csv", str(busy)]) == 2
    assert "holds other files" in capsys.readouterr().err
    assert run(["export", str(path), "--to", "csv", str(busy), "--force"]) == 0
    assert (busy / "mine.txt").read_text() == "keep me" and (busy / "loss.csv").exists()
    capsys.readouterr()
    for args in (["--to", "parquet", str(tmp_path / "x")], ["--to", "csv", str(path)]):
        assert run(["export", str(path), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tdbg: error:") and len(err.strip().splitlines()) == 1


def test_many_series_stay_under_the_file_limit_and_names_stay_apart(tmp_path: Path) -> None:
    from tdbg.cli import export

    writer = export.CsvWriter(tmp_path)
    export.OPEN_FILES, before = 4, export.OPEN_FILES
    try:
        for step in range(3):
            for k in range(10):  # ten series through four open files
                writer.scalar(f"grad_norm/layer/l{k}", step, 1.0, float(k + step))
        writer.scalar("metric/a/b", 0, None, 1.0)
        writer.scalar("metric/a.b", 0, None, 2.0)  # the same file name once spelled safely
    finally:
        export.OPEN_FILES = before
        writer.close()
    with (tmp_path / "grad_norm.layer.l7.csv").open() as f:
        assert [r["value"] for r in csv.DictReader(f)] == ["7.0", "8.0", "9.0"]
    assert (tmp_path / "metric.a.b.csv").read_text().splitlines()[1].endswith(",1.0")
    assert (tmp_path / "metric.a.b-2.csv").read_text().splitlines()[1].endswith(",2.0")


def test_a_bad_target_leaves_no_directory_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never"
    assert run(["export", str(tmp_path / "nothing.tdbg"), "--to", "csv", str(out)]) == 2
    assert not out.exists() and capsys.readouterr().err.startswith("tdbg: error:")
