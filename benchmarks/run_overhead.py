"""Step-time overhead of `tdbg run`'s zero-code probe vs watch() vs no probe, interleaved.

`tdbg run` hooks torch globally (every module, every optimizer in the process), so each config
trains in a process of its own, all started up front: ``none``, ``none-again`` (the machine's
noise), ``watch()`` (the script calls ``tdbg.watch(model, optimizer)`` and ``probe.step``) and
``tdbg run`` (the same loop, unmodified, started by ``tdbg run``). The parent asks one worker at
a time for a block of steps (the others wait on a pipe, idle), config order shuffled per round;
per round each config's mean step is divided by the ``none`` block of that round; the table
shows the median over rounds and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
NONE, NOISE, WATCH, RUN = "none", "none-again", "watch()", "tdbg run"
CONFIGS = (NONE, NOISE, WATCH, RUN)
POOL = 8  # batches generated once, cycled: data generation is not timed
BUDGET = 0.01


# --- worker: one config, one model, blocks of steps on request ---------------------------------
def worker(config: str, model: str, seed: int) -> int:
    import torch

    sys.path.insert(0, str(ROOT / "demos"))
    from models import MAKERS

    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    task = MAKERS[model](seed=seed)
    pool = [task.batch() for _ in range(POOL)]
    probe = None
    if config == WATCH:
        import tdbg

        probe = tdbg.watch(task.model, task.optimizer, name=f"bench-{model}")
    samples, tokens = task.batch_size, task.tokens
    clock = time.perf_counter
    i = 0
    out: TextIO = sys.stdout
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "micro":
            out.write(json.dumps({"us": hot_path_us(task, pool)}) + "\n")
            out.flush()
            continue
        warmup, steps = int(words[1]), int(words[2])
        times: list[float] = []
        t0 = clock()
        for k in range(warmup + steps):
            inputs, targets = pool[i % POOL]
            i += 1
            loss = task.train_step(inputs, targets)  # the plain loop: nothing of tdbg in it
            if probe is not None:
                probe.step(loss, samples=samples, tokens=tokens)
            t1 = clock()
            if k >= warmup:
                times.append(t1 - t0)
            t0 = t1
        reply: dict[str, Any] = {
            "mean": statistics.fmean(times),
            "median": statistics.median(times),
        }
        watched = probe
        if config == RUN:
            auto = getattr(sys.modules.get("tdbg.probe.zero_code.autowatch"), "_auto", None)
            watched = getattr(auto, "probe", None)
            reply["model"] = type(getattr(auto, "model", None)).__name__
            reply["optimizer"] = type(getattr(auto, "optimizer", None)).__name__
            reply["global_hooks"] = global_hooks()
        if watched is not None:
            reply["interval"] = watched.grad_interval
            reply["steps_seen"] = watched.steps
            reply["cost_fraction"] = cost_fraction(watched)
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


def global_hooks() -> int:
    """Process-wide module and optimizer hooks still registered: the zero-code discovery hooks
    must all be gone once the probe started (each one would cost every module call)."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    return sum(
        len(getattr(mod, name, {}))
        for mod, name in (
            (module, "_global_forward_pre_hooks"),
            (module, "_global_forward_hooks"),
            (optimizer, "_global_optimizer_pre_hooks"),
            (optimizer, "_global_optimizer_post_hooks"),
        )
    )


def cost_fraction(probe: Any) -> float | None:
    """The probe's own measure of its cost (probe time / step time, last 200 steps), as it
    reports it to clients; robust to the machine's noise, which a step-time ratio is not."""
    costs = [(p, s) for p, s in list(probe._server.recent_costs) if p == p and s == s]
    step_sum = sum(s for _, s in costs)
    return sum(p for p, _ in costs) / step_sum if step_sum > 0 else None


def hot_path_us(task: Any, pool: list[Any], calls: int = 20_000) -> float:
    """Microseconds a step pays for what `tdbg run` adds to watch(): the backward wrapper's
    bookkeeping and its own optimizer pre-hook (its post-hook is probe.step(), which watch()
    pays as well), timed in a tight loop on a real loss tensor."""
    auto = getattr(sys.modules.get("tdbg.probe.zero_code.autowatch"), "_auto", None)
    if auto is None or auto.probe is None:
        return float("nan")
    loss = task.loss_fn(task.model(pool[0][0]), pool[0][1])
    after, pre = auto._after_backward, auto._on_own_step_pre
    t0 = time.perf_counter()
    for _ in range(calls):
        after(loss)
        pre(None, (), {})
    seconds = time.perf_counter() - t0
    auto._in_step = False
    auto._loss = None
    return seconds / calls * 1e6


# --- parent: start the workers, interleave their blocks, report ---------------------------------
class Worker:
    def __init__(self, config: str, model: str, seed: int) -> None:
        own = [sys.executable, __file__, "--worker", config, "--models", model, "--seed", str(seed)]
        if config == RUN:
            own = [
                sys.executable,
                "-m",
                "tdbg.cli.main",
                "run",
                "--name",
                f"bench-{model}",
                "--",
                *own,
            ]
        self.proc = subprocess.Popen(
            own, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )

    def block(self, warmup: int, steps: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"block {warmup} {steps}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker ended (exit {self.proc.wait()})")
        return dict(json.loads(line))

    def micro(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("micro\n")
        self.proc.stdin.flush()
        return float(json.loads(self.proc.stdout.readline())["us"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(30)


def bench(model: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    workers = {c: Worker(c, model, args.seed) for c in CONFIGS}
    try:
        # First blocks: imports, optimizer state, allocator; then the step time sets the size.
        for w in workers.values():
            w.block(20, 10)
        step = workers[NONE].block(5, 10)["median"]
        steps = max(args.min_steps, round(args.block_seconds / step))
        print(
            f"\n{model}: ~{step * 1e3:.1f} ms/step; {args.rounds} rounds x {len(CONFIGS)} configs"
            f" x ({args.warmup} warm-up + {steps} timed) steps",
            flush=True,
        )
        means: dict[str, list[float]] = {c: [] for c in CONFIGS}
        last: dict[str, dict[str, Any]] = {}
        intervals: dict[str, list[int]] = {WATCH: [], RUN: []}
        fractions: dict[str, list[float]] = {WATCH: [], RUN: []}
        for _ in range(args.rounds):
            order = list(CONFIGS)
            rng.shuffle(order)
            for config in order:
                reply = workers[config].block(args.warmup, steps)
                means[config].append(reply["mean"])
                last[config] = reply
                if config in intervals and "interval" in reply:
                    intervals[config].append(reply["interval"])
                if config in fractions and reply.get("cost_fraction") is not None:
                    fractions[config].append(reply["cost_fraction"])
        hot_us = workers[RUN].micro()
    finally:
        for w in workers.values():
            w.close()
    ratios = {c: [m / b for m, b in zip(means[c], means[NONE], strict=True)] for c in CONFIGS}
    print(f"{'config':<12} {'mean step ms':>12} {'ratio':>7} {'spread':>13}  grad interval")
    for config in CONFIGS:
        rs = ratios[config]
        ms = statistics.median(means[config]) * 1e3
        spread = f"{min(rs):.3f}-{max(rs):.3f}"
        ivals = sorted(set(intervals.get(config, [])))
        print(
            f"{config:<12} {ms:>12.2f} {statistics.median(rs):>7.3f} {spread:>13}"
            f"  {ivals if ivals else ''}"
        )
    noise = max(abs(r - 1) for r in ratios[NOISE])
    run_over = statistics.median(ratios[RUN]) - 1
    watch_over = statistics.median(ratios[WATCH]) - 1
    run_vs_watch = statistics.median(r / w for r, w in zip(ratios[RUN], ratios[WATCH], strict=True))
    found = last.get(RUN, {})
    print(
        f"tdbg run found {found.get('model')} + {found.get('optimizer')}, "
        f"{found.get('steps_seen')} steps seen; global hooks left: {found.get('global_hooks')}"
    )
    print(
        f"tdbg run's own hot path (backward wrapper + optimizer pre-hook): {hot_us:.1f} us a"
        f" step = {hot_us / (statistics.median(means[NONE]) * 1e6) * 100:.3f} % of the step"
    )
    own = {c: statistics.median(v) if v else float("nan") for c, v in fractions.items()}
    step_us = statistics.median(means[NONE]) * 1e6
    run_total = own[RUN] + hot_us / step_us
    print(
        f"probe's own cost_fraction (per block, median): watch() {own[WATCH] * 100:.2f} %,"
        f" tdbg run {own[RUN] * 100:.2f} % + hot path = {run_total * 100:.2f} %"
        f" vs target <= {BUDGET * 100:.0f} % -> {'PASS' if run_total <= BUDGET else 'over budget'}"
    )
    print(f"machine noise: none-again within +-{noise * 100:.1f} % of none (worst round)")
    for label, over in (("watch()", watch_over), ("tdbg run", run_over)):
        verdict = "PASS" if over <= BUDGET else "over budget"
        if abs(over) <= noise:
            verdict = f"not resolvable: within machine noise (+-{noise * 100:.1f} %)"
        print(f"{label}: {over * 100:+.2f} % vs target <= {BUDGET * 100:.0f} % -> {verdict}")
    print(f"tdbg run / watch() step time: {run_vs_watch:.3f} (median of per-round ratios)")
    return {
        "model": model,
        "timed_steps": steps,
        "means": means,
        "ratios": ratios,
        "intervals": intervals,
        "noise": noise,
        "run_overhead": run_over,
        "watch_overhead": watch_over,
        "run_vs_watch": run_vs_watch,
        "found": found,
        "hot_path_us": hot_us,
        "cost_fraction": fractions,
        "run_cost_with_hot_path": run_total,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="~1 minute: 3 rounds, short blocks")
    p.add_argument("--models", default="mlp,transformer,cnn", help="comma-separated")
    p.add_argument("--rounds", type=int, default=None, help="default 7 (3 with --quick)")
    p.add_argument("--block-seconds", type=float, default=None, help="default 0.6 (0.3 quick)")
    p.add_argument("--min-steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write raw results here")
    p.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.models, args.seed)
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.block_seconds = args.block_seconds or (0.3 if args.quick else 0.6)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    sys.path.insert(0, str(ROOT / "demos"))
    from models import MAKERS

    unknown = [m for m in models if m not in MAKERS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MAKERS)}")
    # A private runtime directory: the probes started here meet no other run.
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    import torch

    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs;"
        " each config in its own process, 1 torch thread, one process training at a time"
    )
    rng = random.Random(args.seed)
    started = time.perf_counter()
    results = [bench(m, args, rng) for m in models]
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
