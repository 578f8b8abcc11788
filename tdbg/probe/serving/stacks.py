"""A thread's Python stack, read from another thread: where a stalled training loop is stuck."""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback

MAX_FRAMES = 24  # innermost frames kept


def thread_stack(ident: int | None, limit: int = MAX_FRAMES) -> list[str]:
    """``file:line in function: code`` for each frame of thread ``ident``, outermost first (the
    innermost last, as tracebacks print); [] when the thread is gone. Reading another thread's
    frames is safe under the GIL and costs microseconds: only done on a stall."""
    if ident is None:
        return []
    frame = sys._current_frames().get(ident)
    if frame is None:
        return []
    out = []
    for summary in traceback.extract_stack(frame, limit=limit):
        code = (summary.line or "").strip()
        where = f"{summary.filename}:{summary.lineno} in {summary.name}"
        out.append(f"{where}: {code}" if code else where)
    return out


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.join(d, "") for d in dirs if d)


def stuck_where(stack: list[str]) -> str:
    """The innermost frame, and the innermost of the user's own code when that is another
    (a hang inside torch or threading is still *called from* a line of the script)."""
    if not stack:
        return ""
    libraries = _library_dirs()
    innermost = stack[-1].split(": ", 1)[0]
    for line in reversed(stack):
        where = line.split(": ", 1)[0]
        if not where.startswith(libraries) and "/tdbg/" not in where:
            return innermost if where == innermost else f"{innermost}, called from {where}"
    return innermost


def last_collective() -> dict[str, object] | None:
    """The newest entry of PyTorch's flight recorder for this process (its sequence number, op,
    input sizes and state), or None when there is no process group or no recorder
    (``TORCH_FR_BUFFER_SIZE``; ``tdbg run`` sets it). Read only on a stall: a rank that never
    entered the collective the others wait in has a lower sequence number than theirs."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        import json

        import torch

        dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
        if dump is None:
            return None
        raw = dump(includeCollectives=True, onlyActive=False)
        entries = json.loads(raw).get("entries") or []
    except Exception:
        return None
    if not entries:
        return None
    last = entries[-1]
    return {
        "seq": last.get("collective_seq_id"),
        "op": last.get("profiling_name"),
        "sizes": last.get("input_sizes"),
        "state": last.get("state"),
        "group": last.get("process_group"),
    }
