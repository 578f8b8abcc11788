"""Activation histograms from the activation-statistics dive: known outputs land in known bins,
on real loops (a ReLU's zeros, a saturated tanh's mass near 1, a large output counted with a
stride, a shared module's calls added)."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch
from conftest import dive_context
from torch import nn

import tdbg
from tdbg.probe.dives.activations import ActivationsDive
from tdbg.probe.training.histograms import LAYER_ELEMENTS, sample_stride
from tdbg.protocol.messages.histograms import BIN_EDGES, N_BINS, ZERO_BIN, bin_labels
from tdbg.protocol.messages.results import Activations
from tdbg.recording.reader import Recording


def reference_bins(x: torch.Tensor) -> list[int]:
    """The slow way: each |x| placed by a search of the bins' edges, in float64."""
    m = x.detach().double().abs().flatten()
    finite = torch.isfinite(m)
    edges = torch.tensor(BIN_EDGES, dtype=torch.float64)
    codes = 1 + torch.searchsorted(edges, m, right=True)  # <1e-8 -> 1, >=1e3 -> 24
    codes = torch.where(m == 0, 0, codes)
    codes = torch.where(finite, codes, N_BINS - 1)
    return torch.bincount(codes, minlength=N_BINS).tolist()


def share(counts: tuple[int, ...] | list[int], label: str) -> float:
    return counts[bin_labels().index(label)] / sum(counts)


def one_sample(model: nn.Module, x: torch.Tensor) -> Activations:
    ctx = dive_context(model)
    dive = ActivationsDive(ctx, 1, {"every": 5, "enabled": True}, "manual")
    dive.start(0)
    model(x)
    dive.boundary(1)
    dive.cancelled(2, "off")
    [message] = [e for e in ctx.events if e["type"] == "activations"]
    read = Activations.from_wire(message)
    assert read is not None
    return read


def test_each_modules_histogram_equals_a_slow_reference() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4), nn.Tanh())
    x = torch.randn(16, 8)
    sample = one_sample(model, x)
    with torch.no_grad():
        outputs = [model[0](x)]
        for module in list(model)[1:]:
            outputs.append(module(outputs[-1]))
    assert sample.names == ("0", "1", "2", "3")
    assert sample.hist_stride == (1, 1, 1, 1)
    for name, counts, output in zip(sample.names, sample.hist, outputs, strict=True):
        assert counts is not None
        assert list(counts) == reference_bins(output), name
        assert sum(counts) == output.numel()
    relu = sample.hist[1]
    assert relu is not None
    assert relu[ZERO_BIN] / sum(relu) == sample.zero_frac[1]  # the exact count, both ways


def test_a_large_output_is_counted_with_an_odd_stride() -> None:
    model = nn.Sequential(nn.Linear(4, 256), nn.ReLU())
    x = torch.randn(64, 4)  # 16,384 elements: over LAYER_ELEMENTS
    sample = one_sample(model, x)
    n = 64 * 256
    stride = sample_stride(n)
    assert stride > 1 and stride % 2 == 1 and math.ceil(n / stride) <= LAYER_ELEMENTS
    assert sample.hist_stride == (stride, stride)
    for counts in sample.hist:
        assert counts is not None and sum(counts) == math.ceil(n / stride)
    # An odd stride visits every one of the 256 columns, so the sampled zero share (dead and
    # live units alike) stays close to the exact one.
    relu = sample.hist[1]
    assert relu is not None
    assert abs(relu[ZERO_BIN] / sum(relu) - sample.zero_frac[1]) < 0.05


def test_a_shared_modules_calls_add_up() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.act = nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.lin(self.act(x)))

    torch.manual_seed(3)
    model = Twice()
    x = torch.randn(5, 6)
    sample = one_sample(model, x)
    with torch.no_grad():
        first = model.act(x)
        second = model.act(model.lin(first))
    act = sample.names.index("act")
    expected = [a + b for a, b in zip(reference_bins(first), reference_bins(second), strict=True)]
    assert list(sample.hist[act] or ()) == expected


def test_a_real_loop_shows_relu_zeros_and_a_saturated_tanh(tmp_path: Path) -> None:
    """Through watch(activations_every=...) into a recording: a ReLU over symmetric inputs has
    about half its outputs exactly zero; a tanh fed large inputs has its mass at 1 and just
    under; a tanh fed small ones has none there."""
    torch.manual_seed(4)
    loud = nn.Linear(64, 64)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), loud, nn.Tanh())
    calm = nn.Linear(64, 64)
    with torch.no_grad():
        loud.weight.mul_(100.0)  # pre-activations in the tens: tanh saturates
        calm.weight.mul_(1e-3)
    net = nn.Sequential(model, calm, nn.Tanh())
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    path = tmp_path / "run.tdbg"
    probe = tdbg.watch(net, opt, serve=False, record=path, activations_every=2)
    x = torch.randn(32, 16)
    for _ in range(6):
        opt.zero_grad()
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        probe.step(loss)
    probe.close()
    samples = [
        a
        for m in Recording(path).messages()
        if m.get("type") == "activations" and (a := Activations.from_wire(m)) is not None
    ]
    assert len(samples) >= 2
    last = samples[-1]
    assert last.names == ("0.0", "0.1", "0.2", "0.3", "1", "2")
    by_name = {name: counts for name, counts in zip(last.names, last.hist, strict=True)}
    relu, hot, cold = by_name["0.1"], by_name["0.3"], by_name["2"]
    assert relu is not None and hot is not None and cold is not None
    assert 0.35 < relu[ZERO_BIN] / sum(relu) < 0.65
    # Saturated: |tanh| in [10^-0.5, 1), most of it rounded to exactly 1.0 in float32.
    assert share(hot, "3e-1") + share(hot, "1e0") > 0.9 and share(hot, "1e0") > 0.5
    assert share(cold, "3e-1") + share(cold, "1e0") == 0.0 and share(cold, "0") < 0.5


def test_samples_still_being_counted_when_the_run_ends_reach_the_recording(
    tmp_path: Path,
) -> None:
    """A short run on a busy machine: the probe's worker thread has not yet counted any sample
    when close() comes. Held here until the probe stops, so that every sample's counting is still
    queued then: each one reaches the recording all the same."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    path = tmp_path / "run.tdbg"
    probe = tdbg.watch(model, serve=False, record=path, activations_every=2)
    server = probe._server
    held = threading.Event()

    def busy_worker() -> None:  # the worker thread gets no CPU until the run has ended
        held.set()
        server._stop.wait(60)

    server.submit_work(busy_worker)
    assert held.wait(60)
    for _ in range(9):
        probe.step(model(torch.randn(16, 4)).sum())
    probe.close()
    steps = [m["step"] for m in Recording(path).messages() if m.get("type") == "activations"]
    # Armed at the first boundary (step 0 recorded), then every second step: of nine, four.
    assert steps == [1, 3, 5, 7]
