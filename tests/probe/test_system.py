"""Memory and GPU figures. No GPU here: NVML is faked at the library boundary (the `pynvml`
module), the one thing that cannot run on this machine; everything above it is real."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import Loop, OpenReader
from fake_nvml import fake_pynvml

import tdbg
from tdbg.probe.serving.system import NvmlReader, SystemSampler


def test_nvml_figures_in_the_documented_units(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=2))
    report = SystemSampler().sample()
    assert [g.index for g in report.gpus] == [0, 1]
    msg = report.to_wire()  # as it goes on the wire, and as docs/dump.md spells it
    gpu = msg["gpus"][0]
    assert gpu == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "util": 87.0,
        "mem_used": 30 << 30,
        "mem_total": 80 << 30,
        "temp": 71.0,
        "power": 412.5,
        "power_limit": 700.0,
        "sm_clock": 1980,
    }
    assert not [m for m in msg["missing"] if m.startswith("GPU")]
    assert msg["host"]["rss"] > 0 and msg["host"]["ram_total"] >= msg["host"]["ram_used"] > 0


def test_one_unsupported_nvml_call_costs_only_that_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"}
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=1, broken=broken))
    gpu = SystemSampler().sample().gpus[0]
    assert gpu.power is None and gpu.temp is None
    assert gpu.util == 87.0 and gpu.mem_used == 30 << 30


def test_memory_used_is_nvidia_smi_s_without_the_driver_s_reserve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Version 2 of the memory info where the driver has it (what nvidia-smi shows: version 1
    counted ~600 MiB of reserved memory as used on an H200); version 1 where it does not."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=1, memory_v2=True))
    sampler = SystemSampler()
    for _ in range(2):
        assert sampler.sample().gpus[0].mem_used == (30 << 30) - (600 << 20)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=1, memory_v2="missing"))
    sampler = SystemSampler()
    for _ in range(2):
        assert sampler.sample().gpus[0].mem_used == 30 << 30
    # A passing failure costs that one reading (version 1's figure), not version 2 for good.
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=1, memory_v2="flaky"))
    sampler = SystemSampler()
    used = [sampler.sample().gpus[0].mem_used for _ in range(3)]
    assert used == [30 << 30, (30 << 30) - (600 << 20), (30 << 30) - (600 << 20)]


def test_no_driver_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error="Driver Not Loaded"))
    reader = NvmlReader()
    assert reader.read() == []
    assert reader.problem == "GPU: NVML not available (Driver Not Loaded)"


def test_no_pynvml_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    reader = NvmlReader()
    assert reader.problem is not None and "pip install nvidia-ml-py" in reader.problem


def test_gpu_figures_reach_a_client(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_reader: OpenReader
) -> None:
    """The real probe thread samples (faked) NVML and serves it next to host figures."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=1))
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    assert probe.socket_path
    reader = probe_reader(probe)
    loop.run(3, probe)
    reader.wait(lambda r: any(m["gpus"] for m in r.of("system")))
    system = next(m for m in reader.of("system") if m["gpus"])
    assert system["gpus"][0]["power"] == 412.5
    assert "CUDA: not available in this process" in system["missing"]
    reader.close()
