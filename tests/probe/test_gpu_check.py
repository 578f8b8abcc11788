"""benchmarks/gpu_check.py (`make gpu-check`) on a machine without CUDA: it says so, names what
it would check, and exits 0 — the path CI runs; the GPU path needs a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from waiting import TIMEOUT

GPU_CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_without_cuda_it_says_so_and_exits_0() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine with one
    out = subprocess.run(
        [sys.executable, str(GPU_CHECK)], capture_output=True, text=True, timeout=TIMEOUT, env=env
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "gpu-check: no CUDA device on this machine: nothing to check (exit 0)"
    would = lines[1].removeprefix("gpu-check: on a CUDA machine it runs ").split(", ")
    assert would == [
        "no_sync_added",
        "demos_on_the_gpu",
        "lightning_on_the_gpu",
        "huggingface_on_the_gpu",
        "norms_right",
        "lone_loss",
        "rewritten_loss",
        "loss_on_streams",
        "figures_and_dives",
        "activation_histograms",
        "out_of_memory",
        "out_of_memory_stacks",
        "cost",
    ]
    assert len(lines) == 2 and "Traceback" not in out.stderr
