"""``tdbg summary``: what a real run trains, read from its recording and live, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import OpenReader
from torch import nn

import tdbg
from tdbg.cli.main import run


class Tower(nn.Module):
    """A frozen embedding backbone, a bf16 block, tied input/output weights and a side layer
    no optimizer updates: every mark and column of the summary has something to show."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.embed.weight.requires_grad_(False)
        self.block = nn.Linear(8, 8)
        self.low = nn.Linear(8, 8).to(torch.bfloat16)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.embed.weight  # tied: one parameter, counted once
        self.side = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(self.embed(tokens)))
        h = self.low(h.to(torch.bfloat16)).float()
        return self.out(h + self.side(h))


def _train(probe: tdbg.Probe, model: Tower, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        tokens = torch.randint(0, 10, (4, 3))
        loss = model(tokens).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss)


def _tower() -> tuple[Tower, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tower()
    # The side layer gets gradients but no optimizer: it never changes.
    params = [*model.block.parameters(), *model.low.parameters()]
    return model, torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def test_a_recording_s_summary_names_every_layer_and_what_to_look_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt = _tower()
    path = tmp_path / "tower.tdbg"
    probe = tdbg.watch(model, opt, serve=False, record=path, name="tower")
    _train(probe, model, opt, 5)
    probe.close()

    assert run(["summary", "--json", str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    layers = {row["name"]: row for row in got["layers"]}
    assert list(layers) == ["embed", "block", "low", "side"]  # "out" owns the tied weight
    assert layers["embed"]["trainable"] == 0 and layers["embed"]["marks"] == ["frozen"]
    assert layers["embed"]["params"] == 80 and layers["embed"]["type"] == "Embedding"
    assert layers["low"]["dtype"] == "bfloat16" and layers["low"]["bytes"] == 72 * 2
    assert layers["block"]["bytes"] == 72 * 4 and layers["block"]["optimizer"] == "opt"
    assert layers["side"]["optimizer"] is None and layers["side"]["marks"] == ["no optimizer"]
    assert got["params"] == 80 + 72 * 3 and got["trainable"] == 72 * 3 and got["frozen"] == 80
    assert got["by_dtype"] == {"float32": 80 + 72 * 2, "bfloat16": 72}
    assert got["optimizers"] == [{"name": "opt", "type": "AdamW", "groups": 1}]

    assert run(["summary", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("296 parameters in 4 layers (model): 216 trainable, 80 frozen")
    assert "by dtype: float32 224, bfloat16 72" in text
    table = text.split("\n\n")[1].splitlines()
    assert table[0].split() == [
        "layer", "type", "params", "trainable", "dtype", "device", "bytes", "optimizer"
    ]  # fmt: skip
    assert table[4].split()[:4] == ["side", "Linear", "72", "yes"] and table[4].endswith("none")
    assert "To look at:\n  embed: frozen\n  side: no optimizer\n" in text

    # The same columns reach tdbg dump's hello.
    assert run(["dump", str(path)]) == 0
    hello = json.loads(capsys.readouterr().out.splitlines()[0])
    assert hello["types"] == ["Embedding", "Linear", "Linear", "Linear"]
    assert hello["optimizer"] == [-1, 0, 0, -1] and hello["trainable"] == [0, 72, 72, 72]


def test_a_layer_whose_group_s_learning_rate_is_zero_is_marked_in_a_short_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two optimizers, the second with two param groups, one of them at a learning rate of 0:
    marked from the latest step's learning rates, before any update ratio is sampled, and the
    alert names the layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    groups: list[dict[str, Any]] = [
        {"params": model[2].parameters(), "lr": 1e-3},
        {"params": model[4].parameters(), "lr": 0.0},
    ]
    second = torch.optim.AdamW(groups)
    path = tmp_path / "two.tdbg"
    probe = tdbg.watch(model, [first, second], serve=False, record=path, grad_every=1000)
    for _ in range(5):
        loss = model(torch.randn(4, 4)).pow(2).mean()
        first.zero_grad()
        second.zero_grad()
        loss.backward()
        first.step()
        second.step()
        probe.step(loss)
    probe.close()

    assert run(["dump", str(path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["lr_group"] == [0, 1, 2]  # the second optimizer's groups follow the first's
    # One sampled update (step 0): too few ratios to say "not learning"; the LR tells.
    assert len([m for m in lines if m["type"] == "updates"]) <= 1
    (stopped,) = [m for m in lines if m["type"] == "alert" and m["kind"] == "lr_zero"]
    assert stopped["layers"] == ["4"] and stopped["message"].endswith("layer 4 learns nothing")

    assert run(["summary", "--json", str(path)]) == 0
    layers = {r["name"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    assert layers["4"]["marks"] == ["learning rate 0"]
    assert layers["0"]["marks"] == [] and layers["2"]["marks"] == []


def test_a_live_run_s_summary_follows_a_layer_replaced_mid_run(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str], probe_reader: OpenReader
) -> None:
    model, opt = _tower()
    probe = tdbg.watch(model, opt, name="live-tower")
    reader = probe_reader(probe)
    _train(probe, model, opt, 3)
    model.side = nn.Linear(8, 8).to(torch.float64)  # replaced: new parameters, new dtype
    model.side.requires_grad_(False)
    _train_side_free(probe, model, opt, 3)
    reader.wait(lambda r: len(r.records()) >= 6)
    assert run(["summary", "--json"]) == 0  # the only run here
    got = json.loads(capsys.readouterr().out)
    side = next(row for row in got["layers"] if row["name"] == "side")
    assert side["dtype"] == "float64" and side["marks"] == ["frozen"]
    reader.close()
    probe.close()


def _train_side_free(probe: tdbg.Probe, model: Tower, opt: torch.optim.Optimizer, n: int) -> None:
    """Steps where the float64 side layer is run apart (its dtype is not the block's)."""
    for _ in range(n):
        tokens = torch.randint(0, 10, (4, 3))
        h = torch.tanh(model.block(model.embed(tokens)))
        h = model.low(h.to(torch.bfloat16)).float()
        side = model.side(h.double()).float()
        loss = model.out(h + side).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss)


def test_bad_targets_get_one_line_and_exit_2(
    runtime_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "junk.tdbg"
    junk.write_bytes(b"\x00" * 64)
    for argv in (["summary", str(junk)], ["summary", str(tmp_path / "absent.tdbg")], ["summary"]):
        assert run(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("tdbg: error:") and len(err.strip().splitlines()) == 1, argv
