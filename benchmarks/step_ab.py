"""Two versions of ``probe.step()``'s work timed against each other in one run, step by step.

``entry_cost.py`` times ``probe.step()`` to +-0.3 us within a run, but from one run to the next
this VM moves it by several microseconds (other tenants' load), more than a change to its few
lines. Here one watched cnn-demo loop (``grad_every=10**9``: the fixed per-step work) runs
``StepSampler.step`` and the class's other own methods as found in two git revisions
(``tdbg/probe/training/sampler.py`` at each, loaded as modules of their own), alternating per
step in A B B A order, and times the whole ``probe.step()`` call of each. Both run against the
working tree's other modules (the hooks, the server), so the revisions' samplers must share
their interfaces. The loop's graph is freed after the timed call, as in ``entry_cost.py``, and
what the step handed the probe thread is dropped there (each revision's hand-off is its own).
Printed: each version's median and the mean of the paired differences with two standard errors.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from models import MAKERS  # noqa: E402
from overhead import POOL  # noqa: E402

import tdbg  # noqa: E402
from tdbg.probe.training import budget, cost_model  # noqa: E402

SAMPLER = "tdbg/probe/training/sampler.py"
# Where the sampler lived before the probe was split into its training and serving sides (a
# revision from before the split imports modules that have moved: only revisions on one side
# of the split can be compared).
OLD_SAMPLER = "tdbg/probe/sampler.py"


def step_of(revision: str, directory: Path) -> dict[str, Callable[..., Any]]:
    """``StepSampler``'s own methods as ``revision`` has them (``worktree``: the file as it is
    now): ``step`` and the helpers it calls there (a usual step's short way, the whole way),
    which differ between revisions; what the mixins define comes from the working tree."""
    if revision == "worktree":
        source = (ROOT / SAMPLER).read_text()
    else:
        shown = subprocess.run(
            ["git", "show", f"{revision}:{SAMPLER}"], cwd=ROOT, capture_output=True, text=True
        )
        if shown.returncode != 0:
            shown = subprocess.run(
                ["git", "show", f"{revision}:{OLD_SAMPLER}"],
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            )
        source = shown.stdout
    name = f"sampler_at_{len(list(directory.iterdir()))}"
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    own = vars(module.StepSampler)
    return {
        name: value
        for name, value in own.items()
        if isinstance(value, types.FunctionType) and not name.startswith("__")
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("a", help="git revision of version A (or 'worktree')")
    p.add_argument("b", help="git revision of version B (or 'worktree')")
    p.add_argument("--pairs", type=int, default=2000, help="step pairs (default 2000)")
    p.add_argument("--model", default="cnn", choices=sorted(MAKERS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    with tempfile.TemporaryDirectory(prefix="tdbg-ab-") as scratch:
        versions = [step_of(rev, Path(scratch)) for rev in (args.a, args.b)]
        task = MAKERS[args.model](seed=0)
        model, optimizer = task.model, task.optimizer
        pool = [task.batch() for _ in range(POOL)]
        for i in range(20):  # optimizer state, allocator
            task.train_step(*pool[i % POOL])
        probe = tdbg.watch(model, optimizer, name="step-ab", grad_every=10**9)
        sampler: Any = probe._sampler
        bound = [
            {name: types.MethodType(fn, sampler) for name, fn in methods.items()}
            for methods in versions
        ]
        for i in range(50):
            probe.step(task.train_step(*pool[i % POOL]))
        # What each step hands over is dropped, after its timed call: the two revisions' hand-
        # offs may differ (a revision's usual step tuple is its own probe thread's to read), and
        # the probe thread's work on it is not what is timed here.
        dropped: deque[Any] = deque()
        probe._server.handoff.steps = dropped
        # A revision from before the cost model's constants moved to budget.py reads them here.
        if not hasattr(cost_model, "PER_STEP"):
            cost_model.PER_STEP = budget.FIXED_PER_STEP  # type: ignore[attr-defined]
            cost_model.FIXED_SCALE = budget.FIXED_SCALE  # type: ignore[attr-defined]
        clock = time.perf_counter_ns
        times: list[list[int]] = [[], []]
        for i in range(2 * args.pairs):
            version = (i + i // 2) % 2  # A B B A A B ...: neither always goes first
            for name, method in bound[version].items():
                setattr(sampler, name, method)  # instance attributes: the same lookup for both
            inputs, targets = pool[i % POOL]
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            if task.scheduler is not None:
                task.scheduler.step()
            graph, loss = loss, loss.detach()
            start = clock()
            probe.step(loss, samples=task.batch_size)
            times[version].append(clock() - start)
            del graph
            dropped.clear()
        probe.close()
    a, b = times
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    print(
        f"{args.model}, {args.pairs} pairs: A ({args.a}) median {statistics.median(a) / 1e3:.1f}"
        f" us, B ({args.b}) median {statistics.median(b) / 1e3:.1f} us;"
        f" A - B {statistics.fmean(diffs) / 1e3:+.2f} +- {2 * se / 1e3:.2f} us (2 SE)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
