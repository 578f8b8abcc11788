"""Ends a rank's process group before its interpreter, where `tdbg run` turned on the recorder."""

from __future__ import annotations

import sys

# "1": `tdbg run` turned PyTorch's flight recorder on for the job (TORCH_FR_BUFFER_SIZE was not
# set). Kept by launchers for their ranks, handed on to the ranks a watched process starts.
ENV_RECORDER = "TDBG_FLIGHT_RECORDER"

# Why: a rank that ends with its process group still initialised leaves the group to the
# interpreter's end, and a collective still in flight there (one not waited for) holds a Gloo
# worker thread while the interpreter finalises: the rank aborts ("terminate called without an
# active exception", SIGABRT, the job exits 1). PyTorch's own, without tdbg too, but the flight
# recorder `tdbg run` turns on for hangs made it twice as likely (6 of 8 runs against 3 of 8:
# docs/distributed.md, "At exit"). Destroyed while the interpreter is whole, as PyTorch asks
# scripts to, no run aborted.


def end_group() -> None:
    """Destroy the default process group if it is still initialised; never raises."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def end_group_at_exit() -> None:
    """atexit: :func:`end_group`, unless an uncaught exception ends the process: the other
    ranks may then be inside a collective with this one, and destroying the group could wait
    for them (the interpreter's end is left as it would be without tdbg)."""
    if getattr(sys, "last_value", None) is None:
        end_group()
