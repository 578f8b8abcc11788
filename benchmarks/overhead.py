"""Step-time overhead of the tdbg probe against a baseline run side by side, interleaved."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "demos"))  # the demos' models: the benchmark times the same ones

from models import MAKERS, Batch, Task, parameter_count  # noqa: E402

import tdbg  # noqa: E402
from tdbg.connect.client import ProbeClient  # noqa: E402
from tdbg.probe.training.budget import FIXED_UNTIMED  # noqa: E402
from tdbg.probe.training.gradients import GradientStats, find_layers  # noqa: E402

BASELINE = "baseline"
NOISE = "baseline-again"
DEFAULT = "probe default"
CLIENT = "probe default + client"
EVERY = "probe every-step"
FUSED = "fused norm pass"
NAIVE = "naive .item() loop"
CLIP = "clip_grad_norm_"
# Issue 10's per-step work: a loop that clips (the probe then reads the gradients before the
# clip, in the clip's own call) and logs a metric every step, with and without the probe.
CLIP_LOG = "clip 1.0 + log, no probe"
PROBE_CLIP_LOG = "probe default + clip 1.0 + log"
CONFIGS = (BASELINE, NOISE, DEFAULT, CLIENT, EVERY, FUSED, NAIVE, CLIP, CLIP_LOG, PROBE_CLIP_LOG)
PROBED = {DEFAULT: None, CLIENT: None, EVERY: 1, PROBE_CLIP_LOG: None}  # config -> grad_every
LOGGED = (CLIP_LOG, PROBE_CLIP_LOG)
POOL = 8  # batches generated once per model, cycled: data generation is not timed
DEFAULT_BUDGET = 0.01  # the target for default settings
EVERY_STEP_TARGET = 1.2  # every-step mode's added cost <= 1.2x one fused norm pass


class Reader(threading.Thread):
    """A client attached to the probe that reads what arrived ten times a second."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(name="bench-client", daemon=True)
        self.client = ProbeClient.connect(socket_path)
        self.halt = threading.Event()
        self.messages = 0
        self.last_probe: dict[str, Any] | None = None

    def run(self) -> None:
        while not self.halt.is_set():
            for message in self.client.messages(timeout=0.001):
                self.messages += 1
                if message.get("type") == "probe":
                    self.last_probe = message
            self.halt.wait(0.1)

    def stop(self) -> None:
        self.halt.set()
        self.join()
        self.client.close()


@dataclass
class Result:
    """Per config and round: mean and median step seconds; plus what the probe said of itself.

    The mean carries the verdict for default mode (only every k-th step pays for the gradient
    pass, which a median would hide); the median step, robust to hiccups, compares configs that
    do the same work on every step (every-step mode vs the fused pass).
    """

    model: str
    params: int
    steps: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    medians: dict[str, list[float]] = field(default_factory=dict)
    grad_interval: list[int] = field(default_factory=list)
    probe_time: list[float] = field(default_factory=list)
    cost_fraction: list[float] = field(default_factory=list)
    client_messages: int = 0
    # Per probed config: CPU seconds of the probe's threads and of the reading client, as a
    # fraction of the training thread's (Linux /proc), one figure per block.
    thread_cpu: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    client_cpu: list[tuple[float, float]] = field(default_factory=list)
    in_situ_us: dict[str, float] = field(default_factory=dict)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by thread name, from the scheduler's
    nanosecond accounting (Linux ``/proc/self/task/TID/schedstat``); {} where it cannot tell.
    Unlike step-time ratios this does not move with the machine's load."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue
        out[thread.name] = out.get(thread.name, 0.0) + ns / 1e9
    return out


def cpu_used(
    before: dict[str, float], after: dict[str, float], names: tuple[str, ...]
) -> tuple[float, float]:
    """(CPU seconds of the threads ``names``, of the training thread) over a block."""
    main = after.get("MainThread", 0.0) - before.get("MainThread", 0.0)
    return sum(after.get(n, 0.0) - before.get(n, 0.0) for n in names), main


def share(pairs: list[tuple[float, float]]) -> float:
    main = sum(m for _, m in pairs)
    return sum(u for u, _ in pairs) / main if main > 0 else math.nan


PROBE_THREADS = ("tdbg-server", "tdbg-sampler")


def hook_for(config: str, params: list[torch.nn.Parameter]) -> Callable[[], object] | None:
    """The extra work a no-probe config does between backward and optimizer.step()."""
    if config == FUSED:
        return lambda: torch._foreach_norm([p.grad for p in params if p.grad is not None])
    if config == NAIVE:
        return lambda: [p.grad.norm().item() for p in params if p.grad is not None]
    if config == CLIP:
        return lambda: torch.nn.utils.clip_grad_norm_(params, max_norm=math.inf)
    if config in LOGGED:
        return lambda: torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    return None


def run_block(
    task: Task, pool: list[Batch], config: str, warmup: int, steps: int, result: Result
) -> list[float]:
    """Set the config up, warm up, time ``steps`` steps one by one, tear down; step seconds."""
    params = [p for p in task.model.parameters() if p.requires_grad]
    before = hook_for(config, params)
    probe = None
    reader = None
    if config in PROBED:
        probe = tdbg.watch(task.model, task.optimizer, name=task.name, grad_every=PROBED[config])
        if config == CLIENT:
            assert probe.socket_path is not None, "the probe is not serving"
            reader = Reader(probe.socket_path)
            reader.start()
    samples, tokens = task.batch_size, task.tokens
    times: list[float] = []
    clock = time.perf_counter
    cpu_before: dict[str, float] = {}
    try:
        t0 = clock()
        for i in range(warmup + steps):
            inputs, targets = pool[i % len(pool)]
            loss = task.train_step(inputs, targets, before)
            if probe is not None:
                probe.step(loss, samples=samples, tokens=tokens)
            if config in LOGGED:
                tdbg.log(train_loss=loss)  # a no-op without a probe, as in a real script
            t1 = clock()
            if i >= warmup:
                times.append(t1 - t0)
            elif i == warmup - 1 and probe is not None:
                cpu_before = thread_cpu()
            t0 = t1
        if probe is not None and cpu_before:
            cpu_after = thread_cpu()
            used = cpu_used(cpu_before, cpu_after, PROBE_THREADS)
            result.thread_cpu.setdefault(config, []).append(used)
            if reader is not None:
                result.client_cpu.append(cpu_used(cpu_before, cpu_after, (reader.name,)))
    finally:
        if reader is not None:
            reader.stop()
            result.client_messages += reader.messages
            if reader.last_probe and reader.last_probe.get("cost_fraction") is not None:
                result.cost_fraction.append(float(reader.last_probe["cost_fraction"]))
        if probe is not None:
            if config in (DEFAULT, CLIENT):
                result.grad_interval.append(probe.grad_interval)
            costs = getattr(getattr(probe, "_server", None), "recent_costs", None)
            if config == EVERY and costs:  # the probe's own per-step timing (probe_time)
                result.probe_time.extend(p for p, _ in costs if p == p)
            probe.close()  # removes every hook: the next config runs on a clean model
    return times


def in_situ(task: Task, pool: list[Batch], steps: int) -> dict[str, float]:
    """Microseconds of one fused norm pass vs the probe's gradient pass, each run first thing
    after a real backward (caches as cold as in training), alternating step by step.

    Right after backward every small op costs several times what it costs when repeated on warm
    caches, so this, not a tight loop over the same gradients, is the figure that matters.
    """
    params = [p for p in task.model.parameters() if p.requires_grad]
    stats = GradientStats(find_layers(task.model))
    times: dict[str, list[float]] = {"fused _foreach_norm": [], "probe gradient pass": []}
    which = ["fused _foreach_norm"]

    def fused() -> None:
        torch._foreach_norm([p.grad for p in params if p.grad is not None])

    def probe_pass() -> None:
        # What a sampled step does on the training thread: the fused pass, then the no-sync
        # check of its norms (which reads the weights only when one is NaN or Inf).
        stats.compute().host_nonfinite()

    passes = {"fused _foreach_norm": fused, "probe gradient pass": probe_pass}

    def hook() -> None:
        t0 = time.perf_counter()
        passes[which[0]]()
        times[which[0]].append(time.perf_counter() - t0)

    task.train_step(*pool[0], stats.compute)  # builds the probe's plan once
    for i in range(2 * steps):
        which[0] = "fused _foreach_norm" if i % 2 == 0 else "probe gradient pass"
        task.train_step(*pool[i % len(pool)], hook)
    return {label: statistics.median(values) * 1e6 for label, values in times.items()}


def bench_model(name: str, args: argparse.Namespace, rng: random.Random) -> Result:
    task = MAKERS[name](seed=args.seed)
    pool = [task.batch() for _ in range(POOL)]
    for i in range(20):  # first steps allocate optimizer state and warm the allocator
        task.train_step(*pool[i % POOL])
    t0 = time.perf_counter()
    for i in range(10):
        task.train_step(*pool[i % POOL])
    step = (time.perf_counter() - t0) / 10
    steps = max(args.min_steps, round(args.block_seconds / step))
    result = Result(name, parameter_count(task.model), steps)
    print(
        f"\n{name}: {result.params / 1e6:.2f} M parameters, {len(find_layers(task.model))} layers,"
        f" ~{step * 1e3:.1f} ms/step; {args.rounds} rounds x {len(CONFIGS) - 1} configs, each"
        f" beside a baseline block, x"
        f" ({args.warmup} warm-up + {steps} timed) steps",
        flush=True,
    )
    for r in range(args.rounds):
        order = [c for c in CONFIGS if c != BASELINE]
        rng.shuffle(order)  # no config always runs right after another
        for k, config in enumerate(order):
            # Each config is paired with a baseline block right beside it (ABBA order), so
            # that the machine's slow drift cancels out of the ratio.
            pair = (BASELINE, config) if (r + k) % 2 == 0 else (config, BASELINE)
            for which in pair:
                times = run_block(task, pool, which, args.warmup, steps, result)
                key = f"{BASELINE}:{config}" if which == BASELINE else config
                result.seconds.setdefault(key, []).append(statistics.fmean(times))
                result.medians.setdefault(key, []).append(statistics.median(times))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    for values in (result.seconds, result.medians):
        values[BASELINE] = [
            statistics.fmean(values[f"{BASELINE}:{c}"][r] for c in CONFIGS if c != BASELINE)
            for r in range(args.rounds)
        ]
    result.in_situ_us = in_situ(task, pool, args.in_situ_steps)
    return result


def ratios(values: dict[str, list[float]], config: str) -> list[float]:
    """Per-round ratio of ``config`` to the baseline block beside it."""
    if config == BASELINE:
        return [1.0] * len(values[BASELINE])
    base = values[f"{BASELINE}:{config}"]
    return [t / b for t, b in zip(values[config], base, strict=True)]


def added_ms(values: dict[str, list[float]], config: str) -> float:
    """Median over rounds of (config - its paired baseline) step time, in ms."""
    if config == BASELINE:
        return 0.0
    pairs = zip(values[config], values[f"{BASELINE}:{config}"], strict=True)
    return statistics.median(t - b for t, b in pairs) * 1e3


def columns(values: dict[str, list[float]], config: str) -> tuple[str, dict[str, float]]:
    rs = ratios(values, config)
    row = {
        "ms": statistics.median(values[config]) * 1e3,
        "ratio": statistics.median(rs),
        "ratio_min": min(rs),
        "ratio_max": max(rs),
        "added_ms": added_ms(values, config),
    }
    if config == BASELINE:
        return f"{row['ms']:>8.2f} {'1 (ref)':>7} {'':>13}", row
    spread = f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
    return f"{row['ms']:>8.2f} {row['ratio']:>7.3f} {spread:>13}", row


def report(result: Result) -> dict[str, Any]:
    print(f"\n=== {result.model} ({result.params / 1e6:.2f} M params, {result.steps} timed steps)")
    print(f"{'':<24} {'mean step (per block)':^30}   {'median step (per block)':^30}")
    head = f"{'ms':>8} {'ratio':>7} {'spread':>13}"
    print(f"{'config':<24} {head}   {head}")
    table = {}
    for config in CONFIGS:
        mean_text, mean_row = columns(result.seconds, config)
        median_text, median_row = columns(result.medians, config)
        print(f"{config:<24} {mean_text}   {median_text}")
        table[config] = {"mean": mean_row, "median": median_row}
    noise = ratios(result.seconds, NOISE)
    noise_band = max(abs(min(noise) - 1), abs(max(noise) - 1))
    default_over = statistics.median(ratios(result.seconds, DEFAULT)) - 1
    client_over = statistics.median(ratios(result.seconds, CLIENT)) - 1
    every, fused = added_ms(result.medians, EVERY), added_ms(result.medians, FUSED)
    every_vs_fused = every / fused if fused > 0 else math.nan
    iso = result.in_situ_us
    iso_fused, iso_probe = iso["fused _foreach_norm"], iso["probe gradient pass"]
    probe_us = statistics.median(result.probe_time) * 1e6 if result.probe_time else math.nan
    print(f"probe grad_interval in default mode (per block): {sorted(result.grad_interval)}")
    if result.cost_fraction:
        own = statistics.median(result.cost_fraction) * 100
        print(f"probe's own cost_fraction in default mode (read by the client): {own:.2f} %")
    for config, pairs in result.thread_cpu.items():
        print(
            f"probe threads' CPU / training thread's CPU, {config}: "
            f"{share(pairs) * 100:.2f} % (all its timed blocks)"
        )
    if result.client_cpu:
        print(
            "the in-process reading client's own thread (a real client is another process): "
            f"{share(result.client_cpu) * 100:.2f} % of the training thread's CPU"
        )
    print(f"machine noise: baseline-again ratio within +-{noise_band * 100:.1f} % (worst round)")
    for label, over in (("default", default_over), ("default + client", client_over)):
        verdict = "PASS" if over <= DEFAULT_BUDGET else "over budget"
        if abs(over) <= noise_band:
            verdict = f"not resolvable: within machine noise (+-{noise_band * 100:.1f} %)"
        print(
            f"{label} mode: {over * 100:+.2f} % (median of per-round mean ratios) vs target"
            f" <= {DEFAULT_BUDGET * 100:.0f} % -> {verdict}"
        )
    base_ms = statistics.median(result.medians[BASELINE]) * 1e3
    if fused <= noise_band * base_ms:
        resolved = "not resolvable: the fused pass costs less than the machine noise"
    else:
        resolved = f"{every_vs_fused:.2f}x"
    print(
        f"every-step mode, step times (median steps): added {every:+.3f} ms vs the fused pass's"
        f" {fused:+.3f} ms -> {resolved}"
    )
    print(
        f"every-step mode, probe's own probe_time per step (gradient pass + step(), its"
        f" fixed part counted at {1 + FIXED_UNTIMED:.1f}x its timing):"
        f" {probe_us:.0f} us = {probe_us / iso_fused:.2f}x one fused pass"
    )
    verdict = "PASS" if iso_probe / iso_fused <= EVERY_STEP_TARGET else "over budget"
    print(
        f"gradient pass vs fused pass, right after backward, alternating steps: fused"
        f" {iso_fused:.0f} us, probe {iso_probe:.0f} us = {iso_probe / iso_fused:.2f}x"
        f" (target <= {EVERY_STEP_TARGET}x) -> {verdict}"
    )
    return {
        "model": result.model,
        "params": result.params,
        "timed_steps": result.steps,
        "table": table,
        "mean_seconds": result.seconds,
        "median_seconds": result.medians,
        "grad_interval": result.grad_interval,
        "cost_fraction": result.cost_fraction,
        "every_step_probe_time_us": probe_us,
        "noise_band": noise_band,
        "default_overhead": default_over,
        "client_overhead": client_over,
        "every_vs_fused_in_situ": every_vs_fused,
        "in_situ_us": iso,
        "client_messages": result.client_messages,
        "thread_cpu": result.thread_cpu,
        "client_cpu": result.client_cpu,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="~1 minute: 3 rounds, short blocks")
    p.add_argument("--models", default="mlp,transformer,cnn", help="comma-separated")
    p.add_argument("--rounds", type=int, default=None, help="default 7 (3 with --quick)")
    p.add_argument("--block-seconds", type=float, default=None, help="timed seconds per block")
    p.add_argument("--min-steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per block")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--in-situ-steps", type=int, default=None, help="default 150 (40 --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write raw results here")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.block_seconds = args.block_seconds or (0.3 if args.quick else 0.8)
    args.in_situ_steps = args.in_situ_steps or (40 if args.quick else 150)
    if args.quick:
        args.min_steps = min(args.min_steps, 15)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MAKERS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MAKERS)}")

    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    # A private runtime directory: the probes this creates cannot meet any other run.
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    print(
        f"tdbg {tdbg.__version__}, torch {torch.__version__}, python {platform.python_version()},"
        f" {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
        f" (the probe's threads and the client run beside them)"
    )
    for tool in ("wandb", "tensorboard"):
        present = importlib.util.find_spec(tool) is not None
        print(f"{tool}: {'installed, not benchmarked here' if present else 'not installed'}")
    rng = random.Random(args.seed)
    started = time.perf_counter()
    results = [bench_model(m, args, rng) for m in models]
    summaries = [report(r) for r in results]
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "results": summaries}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
