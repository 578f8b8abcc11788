"""Memory and device figures: torch.cuda allocator stats, NVML per GPU, host stats via psutil."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import psutil

from tdbg.protocol.messages.reports import CudaStats, GpuStats, HostStats, System


class NvmlReader:
    """Per-GPU figures from NVML; says why when NVML cannot be used (no driver, no GPU)."""

    def __init__(self) -> None:
        self.problem: str | None = None
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._memory_v2: bool | None = None  # whether nvmlDeviceGetMemoryInfo_v2 works here
        try:
            import pynvml  # from the nvidia-ml-py distribution

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
            if not self._handles:
                self.problem = "GPU: NVML found no GPU"
        except ImportError:
            self.problem = "GPU: pynvml not installed (pip install nvidia-ml-py)"
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.problem = f"GPU: NVML not available ({_one_line(exc)})"

    def read(self) -> list[GpuStats]:
        if self._nvml is None:
            return []
        nv = self._nvml
        gpus: list[GpuStats] = []
        for index, handle in enumerate(self._handles):
            name = _try(lambda h=handle: _text(nv.nvmlDeviceGetName(h)))
            util = _try(lambda h=handle: nv.nvmlDeviceGetUtilizationRates(h))
            mem = self._memory(handle)
            temp = _try(lambda h=handle: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            power = _try(lambda h=handle: nv.nvmlDeviceGetPowerUsage(h))
            limit = _try(lambda h=handle: nv.nvmlDeviceGetEnforcedPowerLimit(h))
            clock = _try(lambda h=handle: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
            gpus.append(
                GpuStats(
                    index=index,
                    name=name,
                    util=None if util is None else float(util.gpu),
                    mem_used=None if mem is None else int(mem.used),
                    mem_total=None if mem is None else int(mem.total),
                    temp=None if temp is None else float(temp),
                    power=None if power is None else power / 1000.0,  # mW -> W
                    power_limit=None if limit is None else limit / 1000.0,
                    sm_clock=None if clock is None else int(clock),
                )
            )
        return gpus

    def _memory(self, handle: Any) -> Any:
        """Memory info as nvidia-smi shows it. Since driver R510 the first version's ``used``
        also counts memory the driver reserves (~600 MiB more on an H200, seen against
        nvidia-smi): version 2 leaves it out. Where the driver or the binding has no version 2
        the first is used, and version 2 is not asked again; any other failure costs only that
        reading."""
        nv = self._nvml
        version = getattr(nv, "nvmlMemory_v2", None)
        if version is not None and self._memory_v2 is not False:
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(handle, version=version)
            except Exception as exc:
                if self._memory_v2 is None and _no_such_call(nv, exc):
                    self._memory_v2 = False
            else:
                self._memory_v2 = True
                return mem
        return _try(lambda: nv.nvmlDeviceGetMemoryInfo(handle))


def _no_such_call(nv: Any, exc: Exception) -> bool:
    """``exc`` says the call itself is missing here (not supported, not in this driver, a
    struct version it does not know, a binding without the argument), not a passing failure."""
    if isinstance(exc, TypeError):
        return True
    missing = {
        getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3),
        getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),
        getattr(nv, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25),
    }
    return getattr(exc, "value", None) in missing


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def cuda_allocator_stats() -> tuple[list[CudaStats], str | None]:
    """Allocator figures per CUDA device in use; host-side bookkeeping only, no device sync."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return [], "CUDA: not available in this process"
    if not torch.cuda.is_initialized():
        return [], "CUDA: not in use by this run"
    out: list[CudaStats] = []
    for index in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(index)
        if not stats:
            continue
        out.append(
            CudaStats(
                index=index,
                name=torch.cuda.get_device_name(index),
                allocated=int(stats.get("allocated_bytes.all.current", 0)),
                reserved=int(stats.get("reserved_bytes.all.current", 0)),
                peak=int(stats.get("allocated_bytes.all.peak", 0)),
                retries=int(stats.get("num_alloc_retries", 0)),
                ooms=int(stats.get("num_ooms", 0)),
            )
        )
    return out, None


class SystemSampler:
    """Builds the ``system`` message: host, CUDA allocator and NVML figures, and what is missing."""

    def __init__(self) -> None:
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)  # prime: the first call always returns 0.0
        self._nvml: NvmlReader | None = None

    def sample(self) -> System:
        if self._nvml is None:
            self._nvml = NvmlReader()  # lazily, in the probe's thread: nvmlInit can take 100s of ms
        missing: list[str] = []
        ram = psutil.virtual_memory()
        host = HostStats(
            rss=int(self._process.memory_info().rss),
            cpu_percent=float(self._process.cpu_percent(None)),
            ram_used=int(ram.total - ram.available),
            ram_total=int(ram.total),
        )
        cuda, why = cuda_allocator_stats()
        if why:
            missing.append(why)
        gpus = self._nvml.read()
        if self._nvml.problem:
            missing.append(self._nvml.problem)
        return System(time.time(), host, tuple(cuda), tuple(gpus), tuple(missing))
