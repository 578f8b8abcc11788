"""Activation histograms after the run: dump's events, export's series and a replay's cursor,
read from a real run's recording."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from small_runs import record_small_run
from torch import nn

from tdbg.cli.main import run
from tdbg.model.timeline import Timeline
from tdbg.protocol.messages.histograms import N_BINS, bin_labels
from tdbg.recording.reader import Recording


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    """A real run sampling its activations every 3 steps: a ReLU whose inputs are all
    negative (every output exactly zero) beside a Linear."""
    torch.manual_seed(0)
    first = nn.Linear(4, 8)
    with torch.no_grad():
        first.weight.zero_()
        first.bias.fill_(-1.0)
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return record_small_run(model, opt, tmp_path / "run.tdbg", 9, activations_every=3)


def test_dump_prints_each_module_s_histogram(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["dump", str(recording)]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    samples = [e for e in events if e["type"] == "activations"]
    assert len(samples) >= 2
    sample = samples[-1]
    assert sample["bins"] == list(bin_labels())
    relu, linear = sample["layers"]["1"], sample["layers"]["0"]
    assert relu["hist"] == [16 * 8] + [0] * (N_BINS - 1) and relu["hist_stride"] == 1
    # The first Linear's outputs are its bias, -1: all in the bin [1, 3).
    assert linear["hist"][bin_labels().index("1e0")] == 16 * 8 and linear["zero_frac"] == 0.0


def test_export_writes_each_module_s_statistics_and_histogram(
    recording: Path, tmp_path: Path
) -> None:
    out = tmp_path / "csv"
    assert run(["export", str(recording), "--to", "csv", str(out)]) == 0
    with (out / "activation_zero_frac.module.1.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 2 and {float(r["value"]) for r in rows} == {1.0}
    with (out / "activation_max.module.0.csv").open() as f:
        assert {float(r["value"]) for r in csv.DictReader(f)} == {-1.0}
    with (out / "activation_hist.module.1.csv").open() as f:
        hists = list(csv.DictReader(f))
    assert len(hists) == len(rows) and {r["0"] for r in hists} == {str(16 * 8)}


def test_a_replay_s_cursor_shows_the_samples_up_to_it(recording: Path) -> None:
    timeline = Timeline(Recording(recording))
    full = timeline.full.distributions
    assert full.modules() == ["0", "1", "2"]
    steps = [c.step for c in full.outputs("1")]
    assert len(steps) >= 2
    early = timeline.state_at(timeline.index_of(steps[0])).distributions
    assert [c.step for c in early.outputs("1")] == steps[:1]
    assert early.outputs("1")[0].counts[0] == 16 * 8
