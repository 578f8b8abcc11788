"""A layer that stopped learning, as the after-the-run commands tell it: report, summary, export."""

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
from tdbg.probe.training import update_ratio


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real run whose middle layer's learning rate is 0, every step's ratios measured."""
    monkeypatch.setattr(update_ratio, "RATIO_SHARE", 1e9)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    groups: list[dict[str, Any]] = [
        {"params": [*model[0].parameters(), *model[4].parameters()]},
        {"params": model[2].parameters(), "lr": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0)
    return record_small_run(model, opt, tmp_path / "stuck.tdbg", 10, grad_every=1)


def test_report_summary_and_export_name_the_layer_that_stopped_learning(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["report", "--json", str(recording)]) == 0
    verdicts = json.loads(capsys.readouterr().out)["verdicts"]
    stuck = [v for v in verdicts if v["headline"].startswith("layers that stopped learning")]
    assert len(stuck) == 1 and stuck[0]["level"] == "warn" and "layers: 2" in stuck[0]["evidence"]

    assert run(["summary", "--json", str(recording)]) == 0
    layers = {r["name"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    # Its group's learning rate says so from the start; its ratios, after enough samples.
    assert layers["2"]["marks"] == ["learning rate 0", "not learning"]
    assert layers["0"]["marks"] == [] and layers["4"]["marks"] == []

    out = tmp_path / "csv"
    assert run(["export", str(recording), "--to", "csv", str(out)]) == 0
    capsys.readouterr()
    with (out / "update_ratio.layer.2.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10 and {float(r["value"]) for r in rows} == {0.0}
    with (out / "update_ratio.layer.0.csv").open() as f:
        assert all(float(r["value"]) > 0 for r in csv.DictReader(f))
