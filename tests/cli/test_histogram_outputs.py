"""Histograms after the run: dump's events, export's series, and a replay's cursor, read from a
real run's recording."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from small_runs import record_small_run
from torch import nn

from tdbg.cli.main import run
from tdbg.model.timeline import Timeline
from tdbg.probe.training import histograms
from tdbg.protocol.messages.histograms import N_BINS, bin_labels
from tdbg.recording.reader import Recording


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real run whose first layer's weights are 0.25 and never change (lr 0), every sampled
    step's histograms counted."""
    monkeypatch.setattr(histograms, "HISTOGRAM_SHARE", 1e9)
    torch.manual_seed(0)
    first, last = nn.Linear(4, 8), nn.Linear(8, 1)
    model = nn.Sequential(first, nn.Tanh(), last)
    with torch.no_grad():
        first.weight.fill_(0.25)
        first.bias.zero_()
    groups: list[dict[str, Any]] = [
        {"params": list(first.parameters()), "lr": 0.0},
        {"params": list(last.parameters())},
    ]
    opt = torch.optim.SGD(groups, lr=0.1)
    return record_small_run(model, opt, tmp_path / "run.tdbg", 10, grad_every=2)


def test_dump_prints_each_counted_step_by_layer_name(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["dump", str(recording)]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    counted = [e for e in events if e["type"] == "histograms"]
    assert [e["step"] for e in counted] == [0, 2, 4, 6, 8]
    first = counted[0]
    assert first["bins"] == list(bin_labels())
    layer = first["layers"]["0"]
    weights = layer["weights"]
    assert len(weights) == N_BINS and weights[bin_labels().index("1e-1")] == 32
    assert weights[0] == 8 and layer["weight_max"] == 0.25 and layer["stride"] == 1
    assert sum(layer["grads"]) == 40


def test_export_writes_each_layer_s_max_and_zero_share(recording: Path, tmp_path: Path) -> None:
    out = tmp_path / "csv"
    assert run(["export", str(recording), "--to", "csv", str(out)]) == 0
    with (out / "weight_max.layer.0.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6, 8]
    assert {float(r["value"]) for r in rows} == {0.25}
    with (out / "weight_zero_frac.layer.0.csv").open() as f:
        assert {float(r["value"]) for r in csv.DictReader(f)} == {0.2}
    assert (out / "grad_max.layer.2.csv").exists()


def test_a_replay_s_cursor_shows_the_histograms_up_to_it(recording: Path) -> None:
    timeline = Timeline(Recording(recording))
    assert [c.step for c in timeline.full.distributions.series(0, "weights")] == [0, 2, 4, 6, 8]
    at = timeline.state_at(timeline.index_of(5))
    assert [c.step for c in at.distributions.series(0, "grads")] == [0, 2, 4]


def test_export_writes_each_histogram_whole(recording: Path, tmp_path: Path) -> None:
    """CSV: a row of counts per counted step, the bins by their labels; TensorBoard: a
    histogram of log10|x| per counted step, the exact zeros at -9 and below 1e-8 at -8."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "csv"
    assert run(["export", str(recording), "--to", "csv", str(out)]) == 0
    with (out / "weight_hist.layer.0.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6, 8]
    assert list(rows[0]) == ["step", *bin_labels()]
    assert rows[0]["1e-1"] == "32" and rows[0]["0"] == "8"  # 0.25 each, and the zero bias

    tb = tmp_path / "tb"
    assert run(["export", str(recording), "--to", "tensorboard", str(tb)]) == 0
    acc = EventAccumulator(str(tb), size_guidance={"histograms": 0})
    acc.Reload()
    assert "weight_hist/layer/0" in acc.Tags()["histograms"]
    events = acc.Histograms("weight_hist/layer/0")
    assert [e.step for e in events] == [0, 2, 4, 6, 8]
    value = events[0].histogram_value
    assert value.num == 40
    limits, counts = list(value.bucket_limit), list(value.bucket)
    assert counts[limits.index(-9.0)] == 8  # exact zeros
    assert counts[limits.index(-0.5)] == 32  # 0.25: the bucket (-1, -0.5]
