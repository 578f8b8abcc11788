"""NVML faked at the library boundary (the `pynvml` module): the one thing that cannot run here."""

from __future__ import annotations

import types
from typing import Any


class NVMLError(Exception):
    """As nvidia-ml-py raises them: the NVML return code in ``value``."""

    def __init__(self, message: str, value: int = 999) -> None:
        super().__init__(message)
        self.value = value


def fake_pynvml(
    gpus: int = 2,
    broken: set[str] | None = None,
    init_error: str = "",
    memory_v2: bool | str = False,
) -> Any:
    """A stand-in for nvidia-ml-py with the calls the probe makes and NVML's units;
    ``memory_v2``: it has version 2 of the memory info ("missing": the driver does not;
    "flaky": it fails once, for a passing reason)."""
    broken = broken or set()
    mod = types.ModuleType("pynvml")
    mod.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    mod.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]

    def call(name: str, value: Any) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            if name in broken:
                raise NVMLError(f"{name}: Not Supported")
            return value(*args, **kwargs) if callable(value) else value

        setattr(mod, name, fn)

    def init() -> None:
        if init_error:
            raise NVMLError(init_error)

    mod.nvmlInit = init  # type: ignore[attr-defined]
    call("nvmlDeviceGetCount", gpus)
    call("nvmlDeviceGetHandleByIndex", lambda i: f"handle{i}")
    call("nvmlDeviceGetName", lambda h: b"NVIDIA H100 80GB HBM3")
    call("nvmlDeviceGetUtilizationRates", lambda h: types.SimpleNamespace(gpu=87, memory=40))
    call("nvmlDeviceGetMemoryInfo", lambda h: types.SimpleNamespace(used=30 << 30, total=80 << 30))
    if memory_v2:
        # Version 2 as a recent driver answers it: version 1's used counts reserved memory too.
        mod.nvmlMemory_v2 = 0x02000028  # type: ignore[attr-defined]

        failed: list[bool] = []

        def memory(h: Any, version: int | None = None) -> Any:
            if version is None:
                return types.SimpleNamespace(used=30 << 30, total=80 << 30)
            if memory_v2 == "missing":
                raise NVMLError("Function Not Found", 13)
            if memory_v2 == "flaky" and not failed:
                failed.append(True)
                raise NVMLError("Unknown Error", 999)
            return types.SimpleNamespace(used=(30 << 30) - (600 << 20), total=80 << 30)

        call("nvmlDeviceGetMemoryInfo", memory)
    call("nvmlDeviceGetTemperature", lambda h, sensor: 71)
    call("nvmlDeviceGetPowerUsage", lambda h: 412_500)  # milliwatts
    call("nvmlDeviceGetEnforcedPowerLimit", lambda h: 700_000)
    call("nvmlDeviceGetClockInfo", lambda h, clock: 1980)
    return mod
