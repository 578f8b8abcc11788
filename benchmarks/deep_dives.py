"""What deep dives cost the training loop: nothing once they are over, and how much while on.

For each demo model, interleaved over rounds (medians reported, the baseline against itself
shown so the machine's noise is visible):

- ``plain probe``: a probe that never received a command;
- ``after dives``: a probe that already ran a profile, a NaN hunt, anomaly mode and activation
  statistics (then turned off): must time like the plain probe (no residual hooks);
- ``refusal flood``: a client sends refused commands (20/s) while the loop runs;
- ``activations every K``: activation statistics on, every K steps;
- ``nan-hunt step``: the one step a NaN hunt hooks every module for, against the median step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "demos"))

from models import MAKERS, Batch, Task  # noqa: E402

import tdbg  # noqa: E402
from tdbg.connect.client import ProbeClient  # noqa: E402
from tdbg.probe.watch import Probe  # noqa: E402

PLAIN = "plain probe"
PLAIN_AGAIN = "plain probe again"
AFTER = "after dives"
FLOOD = "refusal flood"
POOL = 8


def submit(probe: Probe, command: str, **args: Any) -> int:
    """Queue a command the way the server thread does once a client's message is valid."""
    from tdbg.protocol.messages import command_args

    desk = probe._server.desk
    assert desk is not None
    return int(desk.submit(command, command_args(command, args), None, "manual")["job"])


def finished(probe: Probe, job: int) -> bool:
    desk = probe._server.desk
    assert desk is not None
    return job not in desk.in_flight()


class Flood(threading.Thread):
    """A client that sends commands the probe refuses (a CPU run has no memory snapshots)."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.client = ProbeClient.connect(path)
        self.halt = threading.Event()
        self.sent = 0

    def run(self) -> None:
        while not self.halt.wait(0.05):
            self.client.send("snapshot")
            self.sent += 1
            for _ in self.client.messages(timeout=0.001):
                pass

    def stop(self) -> None:
        self.halt.set()
        self.join()
        self.client.close()


def hook_count(model: torch.nn.Module) -> int:
    """Hooks registered on the model's modules and parameters (dicts torch keeps per object)."""
    count = 0
    for module in model.modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
        ):
            count += len(getattr(module, attr, {}) or {})
    for param in model.parameters():
        count += len(getattr(param, "_post_accumulate_grad_hooks", None) or {})
        count += len(getattr(param, "_backward_hooks", None) or {})
    return count


def run_steps(task: Task, pool: list[Batch], probe: Probe | None, n: int) -> list[float]:
    times = []
    for i in range(n):
        inputs, targets = pool[i % len(pool)]
        t0 = time.perf_counter()
        loss = task.train_step(inputs, targets)
        if probe is not None:
            probe.step(loss)
        times.append(time.perf_counter() - t0)
    return times


def run_until_done(task: Task, pool: list[Batch], probe: Probe, job: int, limit: int) -> None:
    for _ in range(limit):
        if finished(probe, job):
            return
        run_steps(task, pool, probe, 1)
    deadline = time.monotonic() + 30
    while not finished(probe, job) and time.monotonic() < deadline:
        time.sleep(0.05)


def exercise(task: Task, pool: list[Batch], probe: Probe) -> None:
    """Every dive once, to completion, then activation statistics off."""
    for command, args in (
        ("profile", {"steps": 3}),
        ("nan_hunt", {"steps": 2}),
        ("anomaly", {"steps": 2}),
        ("activations", {"every": 1}),
    ):
        job = submit(probe, command, **args)
        if command == "activations":
            run_steps(task, pool, probe, 3)
            submit(probe, "activations", enabled=False)
            run_steps(task, pool, probe, 2)
            continue
        run_until_done(task, pool, probe, job, 50)


def bench_model(name: str, rounds: int, steps: int, every: int) -> dict[str, Any]:
    activations = f"activations every {every}"
    configs = [PLAIN, PLAIN_AGAIN, AFTER, FLOOD, activations]
    # One model per config (same seed, same shapes): probes on a shared model would all hook it.
    tasks = {config: MAKERS[name]() for config in configs}
    pool = [tasks[PLAIN].batch() for _ in range(POOL)]
    probes = {
        config: tdbg.watch(task.model, task.optimizer, name=f"bench-{name}")
        for config, task in tasks.items()
    }
    for config in configs:
        run_steps(tasks[config], pool, None, 20)  # warm caches and the allocator first
    exercise(tasks[AFTER], pool, probes[AFTER])
    hooks = {"plain probe": hook_count(tasks[PLAIN].model), AFTER: hook_count(tasks[AFTER].model)}
    flood = Flood(probes[FLOOD].socket_path or "")
    flood.start()
    submit(probes[activations], "activations", every=every)
    medians: dict[str, list[float]] = {c: [] for c in configs}
    means: dict[str, list[float]] = {c: [] for c in configs}
    hunt_ratios: list[float] = []
    phase_times: list[list[float]] = [[] for _ in range(every)]  # activation steps by i mod K
    try:
        for _ in range(rounds):
            order = configs[:]
            random.shuffle(order)
            for config in order:
                times = run_steps(tasks[config], pool, probes[config], steps)
                if config == activations:  # blocks of a multiple of K steps keep the phase
                    for i, t in enumerate(times):
                        phase_times[(len(medians[config]) * steps + i) % every].append(t)
                medians[config].append(statistics.median(times))
                means[config].append(statistics.fmean(times))
            # One NaN hunt per round, on the plain probe: the hunted step against its neighbours.
            task, probe = tasks[PLAIN_AGAIN], probes[PLAIN_AGAIN]
            job = submit(probe, "nan_hunt", steps=1)
            before = run_steps(task, pool, probe, 1)  # the boundary that arms it runs here
            hunted = run_steps(task, pool, probe, 1)[0]
            after = run_steps(task, pool, probe, 9)
            run_until_done(task, pool, probe, job, 20)
            hunt_ratios.append(hunted / statistics.median(before + after))
    finally:
        flood.stop()
        for probe in probes.values():
            probe.close()
    base = statistics.median(medians[PLAIN])
    ratio = {c: statistics.median(v) / base for c, v in medians.items()}
    mean_ratio = {
        c: statistics.median(v) / statistics.median(means[PLAIN]) for c, v in means.items()
    }
    spread = {c: [min(v) / base, max(v) / base] for c, v in medians.items()}
    return {
        "model": name,
        "plain_step_ms": base * 1e3,
        "median_step_ratio": ratio,
        "mean_step_ratio": mean_ratio,
        "round_spread": spread,
        "nan_hunt_step_ratio": statistics.median(hunt_ratios),
        "activations_sampled_step_ratio": sampled_step_ratio(phase_times),
        "hooks": hooks,
        "refused_commands_sent": flood.sent,
    }


def sampled_step_ratio(phase_times: list[list[float]]) -> float:
    """The sampled step (the phase whose median is highest) against the other phases' median."""
    medians = sorted(statistics.median(t) for t in phase_times if t)
    if len(medians) < 2:
        return float("nan")
    return medians[-1] / statistics.median(medians[:-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="mlp,transformer,cnn")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60, help="timed steps per config per round")
    p.add_argument("--every", type=int, default=10, help="activation statistics interval K")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps % args.every:
        p.error("--steps must be a multiple of --every (the sampled step keeps its phase)")
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TDBG_RUNTIME_DIR", tempfile.mkdtemp(prefix="tdbg-bench-", dir="/tmp"))
    results = []
    for name in args.models.split(","):
        result = bench_model(name, args.rounds, args.steps, args.every)
        results.append(result)
        if args.json:
            print(json.dumps(result))
            continue
        print(f"\n{name}: plain probe step {result['plain_step_ms']:.2f} ms (median)")
        for config, r in result["median_step_ratio"].items():
            lo, hi = result["round_spread"][config]
            mean = result["mean_step_ratio"][config]
            print(
                f"  {config:<22} median step x{r:.3f}  mean step x{mean:.3f}  "
                f"rounds x{lo:.3f}..x{hi:.3f}"
            )
        print(f"  nan-hunt step          x{result['nan_hunt_step_ratio']:.2f} of a normal step")
        print(
            f"  activations sampled    x{result['activations_sampled_step_ratio']:.2f} of a "
            f"normal step (1 step in {args.every})"
        )
        hooks = result["hooks"]
        print(
            f"  hooks on the model     plain probe {hooks['plain probe']}, "
            f"after dives {hooks[AFTER]}"
        )
    print(
        f"\n{platform.node()} {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {args.threads} thread(s), {time.strftime('%Y-%m-%d')}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
