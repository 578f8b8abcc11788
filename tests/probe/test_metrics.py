"""tdbg.log takes bad input the tdbg way: each value read on its own (a complex, an int past
float's range, a value that raises are reported and dropped, the call's other values kept), and
thousands of bad names cost a handful of reports, not one each."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import Loop, OpenReader

import tdbg
from tdbg.probe.training.metrics import MetricsDesk


class Reports:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, key: str, message: str) -> None:
        self.calls.append((key, message))


def logged(values: dict[Any, Any]) -> tuple[dict[str, float], Reports]:
    reports = Reports()
    desk = MetricsDesk(reports)
    desk.log(3, values)
    points = {name: value for pending in desk.inbox for _, name, value in pending.resolve() or []}
    return points, reports


class Raises:
    def __float__(self) -> float:
        raise RuntimeError("no")


def test_each_value_is_read_on_its_own_and_the_others_are_kept() -> None:
    points, reports = logged(
        {
            "cplx": torch.tensor(1 + 2j),
            "big": 10**400,
            "pycplx": 1 + 2j,
            "npcplx": np.complex64(1 + 1j),
            "raises": Raises(),
            "ok": 1.5,
            "int": 7,
            "flag": True,
            "np32": np.float32(2.5),
            "arr": np.array([4.0]),
            "frac": Fraction(1, 4),
            "t64": torch.tensor(0.125, dtype=torch.float64),
            "nan": float("nan"),
        }
    )
    assert points == {
        "ok": 1.5,
        "int": 7.0,
        "flag": 1.0,
        "np32": 2.5,
        "arr": 4.0,
        "frac": 0.25,
        "t64": 0.125,
        "nan": points["nan"],
    }
    assert math.isnan(points["nan"])  # recorded: the probe thread alerts on it
    keys = [key for key, _ in reports.calls]
    assert keys == [
        "metric-complex:cplx",
        "metric-overflow:big",
        "metric-complex:pycplx",
        "metric-complex:npcplx",
        "metric-type:raises",
    ]
    messages = dict(reports.calls)
    assert "complex, not a real number" in messages["metric-complex:cplx"]
    assert "past the range of a float" in messages["metric-overflow:big"]
    assert len(messages["metric-overflow:big"]) < 200  # not 400 digits


def test_bad_values_in_a_live_run_are_no_probe_errors(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    loop.run(1, probe)
    for _ in range(3):  # the same problems again: reported once
        tdbg.log(big=10**400, cplx=torch.tensor(1 + 2j), good=2.0)
    loop.run(1, probe)
    # The last step, not the first metrics: the probe thread may tick between two log calls.
    # A step goes out with everything logged before it, so settle() then proves the rest.
    reader.wait(lambda r: len(r.records()) >= 2)
    reader.settle()
    points = [tuple(p) for m in reader.of("metrics") for p in m["points"]]
    assert [p[1:] for p in points] == [("good", 2.0)] * 3
    assert probe.errors == 0, probe.last_error
    messages = [a["message"] for a in reader.of("alert")]
    assert sum("big=" in m for m in messages) == 1 and sum("cplx=" in m for m in messages) == 1
    reader.close()
    probe.close()


def test_samples_and_tokens_that_are_not_counts_are_reported_once_not_recorded(
    runtime_dir: Path,
    probe_reader: OpenReader,
) -> None:
    """samples= and tokens= are counts: a string, a negative number, NaN or a tensor of several
    values is reported once (one line, one alert) and the step records none, never a negative
    throughput; a good count beside it is recorded."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    bad: list[dict[str, Any]] = [
        {"samples": "x", "tokens": 64},
        {"samples": 32, "tokens": -5},
        {"samples": float("nan"), "tokens": torch.ones(3)},
        {"samples": "x", "tokens": -5},  # the same problems again: no new report
    ]
    for counts in bad:
        loop.step()
        probe.step(samples=counts["samples"], tokens=counts["tokens"])
    reader.wait(lambda r: len(r.records()) >= len(bad))
    reader.settle()
    records = reader.records()[-len(bad) :]
    assert [r.samples for r in records][1] == 32.0
    assert all(math.isnan(r.samples) for i, r in enumerate(records) if i != 1)
    assert records[0].tokens == 64.0
    assert all(math.isnan(r.tokens) for r in records[1:])
    reports = [a["message"] for a in reader.of("alert") if a["kind"] == "probe_error"]
    assert len(reports) == 2, reports  # one per kind of count: bounded, not one per step
    assert "probe.step(samples='x'): not a count" in reports[0]
    assert "probe.step(tokens=-5): not a count" in reports[1]
    assert probe.errors == 0
    reader.close()
    probe.close()


def test_thousands_of_bad_names_are_folded_into_a_count(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    loop.run(1, probe)
    for i in range(3):
        tdbg.log(**{f"u{i}_{j}": object() for j in range(1000)})
    tdbg.log(**{f"bad{j}": 1 + 1j for j in range(50)})
    loop.run(1, probe)
    reader.wait(lambda r: len(r.records()) >= 2)
    reader.settle()
    # Each report is one stderr line and one alert: 3 names of each kind in full, then counts
    # at 1, 10, 100, 1000 (of 2997 more) and at 1, 10 (of 47 more).
    lines = [a["message"] for a in reader.of("alert") if a["kind"] == "probe_error"]
    assert len(lines) == 3 + 4 + 3 + 2, lines
    assert "1000 more tdbg.log values that are not numbers (dropped" in lines[6]
    assert lines[-1].startswith("10 more complex tdbg.log values")
    assert len(probe._sampler._reported["metric-type"]) == 3  # bounded, whatever the names
    assert probe.errors == 0
    reader.close()
    probe.close()


def test_many_non_finite_metrics_are_alerted_as_a_count(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    loop.run(1, probe)
    tdbg.log(**{f"m{j}": float("nan") for j in range(100)})
    loop.run(1, probe)
    reader.wait(lambda r: any(m["points"] for m in r.of("metrics")))
    reader.settle()
    alerts = [a["message"] for a in reader.of("alert") if a["kind"] == "nonfinite_metric"]
    # 8 one by one, then at 16, 32 and 64 names
    assert len(alerts) == 8 + 3, alerts
    assert alerts[-1].startswith("64 metrics have gone non-finite")
    points = [p for m in reader.of("metrics") for p in m["points"]]
    assert len(points) == 100  # every value is still recorded
    reader.close()
    probe.close()
