"""What a usual GPU step's host time is made of: the probe's functions and the C calls they make,
per step, under cProfile; and the CUDA calls the probe makes on a step, each timed alone right
after a real training step (where the probe makes them: the caches cold, the launch queue busy).

``interleaved.py --device cuda`` says how much host CPU the probe adds to a step; this says
where it goes. cProfile slows Python down several times, so its figures rank the parts rather
than price them; the primitives' own timings are plain ``perf_counter`` differences.

    python benchmarks/gpu_parts.py                 (CUDA; without it: says so, exit 0)
    python benchmarks/gpu_parts.py --models cnn --steps 400
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))

from models import MAKERS, Task  # noqa: E402

import tdbg  # noqa: E402
from tdbg.probe.device_copy import current_stream, host_copy, recorded_event, stream_key  # noqa: E402
from tdbg.probe.training.loss_ring import LossRing  # noqa: E402

POOL = 8
HANDED_ON = {"forward", "backward"}  # the loop's calls the probe's wrappers make for it


def primitives(device: torch.device) -> dict[str, Callable[[torch.Tensor], Any]]:
    """The CUDA calls a usual GPU step's probe makes, each given the step's loss."""
    stream = torch.cuda.current_stream(device)
    done = recorded_event(device)

    def copy_loss(loss: torch.Tensor) -> Any:
        return loss.to("cpu", non_blocking=True)

    def copy_and_event(loss: torch.Tensor) -> Any:
        return host_copy(loss, timing=True)

    ring = LossRing(device)  # (its slots never read back: the rounds stay under CAPACITY)
    slot64 = torch.empty(1, dtype=torch.float64, device=device)
    slot32 = torch.empty(1, dtype=torch.float32, device=device)

    return {
        "nothing (the timer's own cost)": lambda loss: None,
        "current_stream (tdbg's cached lookup)": lambda loss: current_stream(device),
        "torch.cuda.current_stream": lambda loss: torch.cuda.current_stream(device),
        "recorded_event (timing)": lambda loss: recorded_event(device, True),
        "recorded_event (no timing)": lambda loss: recorded_event(device, False),
        "event.query() of a done event": lambda loss: done.query(),
        "stream.query()": lambda loss: stream.query(),
        "loss.to('cpu', non_blocking=True)": copy_loss,
        "loss.detach()": lambda loss: loss.detach(),
        "host_copy(loss): the copy and its event": copy_and_event,
        "torch.empty(1, pin_memory=True)": lambda loss: torch.empty(1, pin_memory=True),
        "stream_key (the ring's stream check)": lambda loss: stream_key(device),
        "slot.copy_(loss) into float64": lambda loss: slot64.copy_(loss),
        "slot.copy_(loss) into the loss's dtype": lambda loss: slot32.copy_(loss),
        "LossRing.add(loss): a usual step's ring copy": lambda loss: ring.add(loss.detach()),
    }


def time_primitives(task: Task, pool: list[Any], device: torch.device, rounds: int) -> None:
    calls = primitives(device)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    kept: list[Any] = []  # results outlive the round, as the probe's do
    for r in range(rounds):
        for name, call in calls.items():
            loss = task.train_step(*pool[r % POOL])
            t0 = time.perf_counter()
            kept.append(call(loss))
            seconds[name].append(time.perf_counter() - t0)
        if len(kept) > 64:
            torch.cuda.synchronize(device)
            kept.clear()
    torch.cuda.synchronize(device)
    print(f"  the probe's CUDA calls, each alone right after a training step ({rounds} rounds):")
    for name, values in seconds.items():
        values.sort()
        print(
            f"    {name:<44} median {statistics.median(values) * 1e6:7.1f} us,"
            f" p90 {values[int(len(values) * 0.9)] * 1e6:7.1f} us"
        )


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_steps(task: Task, pool: list[Any], steps: int, top: int) -> None:
    probe = tdbg.watch(task.model, task.optimizer, name="gpu-parts", grad_every=10**9)
    for i in range(100):  # the first sampled steps, the plans
        probe.step(task.train_step(*pool[i % POOL]), samples=task.batch_size, tokens=task.tokens)
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        loss = task.train_step(*pool[i % POOL])
        probe.step(loss, samples=task.batch_size, tokens=task.tokens)
    profiler.disable()
    sync()
    probe.close()
    stats = pstats.Stats(profiler)
    rows = []
    package = str(Path(tdbg.__file__).resolve().parent)
    entries = stats.stats.items()  # type: ignore[attr-defined]
    for (filename, line, name), (_, calls, tottime, _cumulative, callers) in entries:
        if filename.startswith(package):
            rows.append((tottime / steps, calls / steps, f"{Path(filename).name}:{line} {name}"))
            continue
        # Anything else, as far as the probe's code called it: (count, time) from its callers;
        # not the loop's own forward and backward, which the probe's wrappers hand on to.
        ours = [v for c, v in callers.items() if str(c[0]).startswith(package)]
        if ours and name not in HANDED_ON:
            seconds = sum(v[2] for v in ours)
            rows.append((seconds / steps, sum(v[1] for v in ours) / steps, f"<- tdbg: {name}"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"  cProfile, {steps} watched steps: the probe's own time {total * 1e6:.1f} us/step")
    for seconds, calls, where in rows[:top]:
        print(f"    {seconds * 1e6:7.1f} us  {calls:5.2f}/step  {where}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="mlp,cnn", help="comma-separated")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=200, help="rounds of the primitives' timing")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_parts: no CUDA device on this machine: nothing to measure (exit 0)")
        return 0
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"tdbg {tdbg.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name in args.models.split(","):
        task = MAKERS[name.strip()](seed=0)
        pool = task.on_device(device, POOL)
        for i in range(20):
            task.train_step(*pool[i % POOL])
        print(f"\n=== {name} (batch {task.batch_size})")
        time_primitives(task, pool, device, args.rounds)
        profile_steps(task, pool, args.steps, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
