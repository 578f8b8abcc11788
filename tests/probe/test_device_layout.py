"""A GPU run's gradient pass, as far as it runs on the CPU: norms stacked into one tensor, the
weights' norms read in every pass, the non-finite check left to the probe thread.

On a GPU the pass hands the step's single device-to-host copy one stacked tensor instead of the
CPU's tuple of 0-d norms, and code that treated it like the tuple broke every GPU run (found on
an H200: "Boolean value of Tensor with more than one value is ambiguous", the breaker tripped
after 100 steps). The ``device_layout`` fixture makes :class:`GradientStats` take that path on
the CPU, so CI runs it; the CUDA-only parts (events, pinned copies, no added sync) are proven
by ``benchmarks/gpu_check.py`` on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import OpenReader, Reader
from norm_oracle import reference_norms
from test_gradients import Mixed, backward
from test_real_loops import K, _data, _first_error, _model, _nan_run, _norms

import tdbg
from tdbg.probe.training.gradients import GradientStats, GradSample, find_layers


@pytest.fixture
def device_layout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    make_plan, compute = GradientStats._make_plan, GradientStats.compute

    def plan_as_on_a_device(self: GradientStats, grads: Any, key: Any) -> None:
        make_plan(self, grads, key)
        self._on_host = self._plain = False

    def compute_as_on_a_device(self: GradientStats, weights: bool = False) -> GradSample:
        return compute(self, True)  # a device run reads the weights in every pass

    monkeypatch.setattr(GradientStats, "_make_plan", plan_as_on_a_device)
    monkeypatch.setattr(GradientStats, "compute", compute_as_on_a_device)
    yield


def test_a_stacked_pass_is_not_checked_on_the_training_thread() -> None:
    """Checking a device pass would need a sync: host_nonfinite says no, whatever it holds."""
    index = torch.tensor([0, 1, 1])
    for values in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, math.nan, 3.0])):
        assert GradSample(values, index, 2, []).host_nonfinite() is False
    assert GradSample(torch.zeros(0), index[:0], 2, []).host_nonfinite() is False
    assert GradSample([torch.tensor(math.inf)], index[:1], 1, []).host_nonfinite() is True


def test_stacked_norms_of_mixed_dtypes_match_the_reference(device_layout: None) -> None:
    """Two dtype groups: each stacked, then one tensor for the copy, gradients then weights."""
    torch.manual_seed(6)
    model = Mixed()
    backward(model, torch.randn(6, 4))
    layers = find_layers(model)
    sample = GradientStats(layers).compute()
    assert isinstance(sample.values, torch.Tensor) and sample.weights
    norms, total = sample.layer_norms()
    ref_total, ref_layers = reference_norms(layers)
    assert total == pytest.approx(ref_total, rel=1e-5)
    assert list(norms) == pytest.approx(ref_layers, rel=1e-5)
    assert sample.weight_nonfinite() == []
    with torch.no_grad():
        model.a.bias[0] = math.nan
    assert GradientStats(layers).compute().weight_nonfinite() == [0]


def test_a_run_with_stacked_passes_reports_true_norms_and_metrics(
    runtime_dir: Path, device_layout: None, probe_reader: OpenReader
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    truth = []
    for step in range(6):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        truth.append((loss.item(), _norms(list(model.parameters()))))
        opt.step()
        probe.step(loss)
        tdbg.log(half_loss=loss.detach() / 2, step_number=step)

    def halves(r: Reader) -> list[float]:
        return [p[2] for m in r.of("metrics") for p in m["points"] if p[1] == "half_loss"]

    reader.wait(lambda r: len(r.records()) >= 6 and len(halves(r)) >= 6)
    reader.settle()
    for record, (loss, total) in zip(reader.records(), truth, strict=True):
        assert record.loss == pytest.approx(loss, rel=1e-6)
        assert record.grad_total == pytest.approx(total, rel=1e-5)
    assert halves(reader) == pytest.approx([loss / 2 for loss, _ in truth], rel=1e-6)
    assert probe.errors == 0, probe.last_error
    reader.close()
    probe.close()


@pytest.mark.parametrize(
    ("scenario", "module"), [("weights", "fc2"), ("backward", "bad")], ids=["weights", "backward"]
)
def test_the_first_alert_names_where_a_nan_began_from_stacked_passes(
    runtime_dir: Path, device_layout: None, scenario: str, module: str
) -> None:
    """Every step measured: the weights' norms in each pass name a weight turned NaN, the
    gradients' a backward that made Inf, at step K, with no internal error on the way."""
    probe, reader, train = _nan_run(scenario, 1)
    for step in range(12):
        train(step)
    first = _first_error(reader)
    assert first["step"] == K and first["layers"] == [module], first["message"]
    assert probe.errors == 0, probe.last_error
    reader.close()
    probe.close()
