"""The watched root's forward start, marked two ways, timed against each other step by step.

The probe marks a forward's start through the module's call entry (``hooks.ForwardEntry``,
torch's fast call path) or, where that slot is taken, with a forward pre-hook (torch's slow
call path). Here one probe on a demo model (``grad_every=10**9``: the fixed work only) has
its way in switched between the two before each step, in shuffled pairs; the span timed is
from ``model(x)`` to the model's ``forward`` starting. Across runs the host moves this span
by more than the difference; within one run, a few thousand pairs resolve it to +-0.2 us.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))

import torch  # noqa: E402
from models import MAKERS  # noqa: E402

import tdbg  # noqa: E402
from tdbg.probe.hooks import ForwardEntry, _ForwardStart  # noqa: E402

PRE_HOOK_ID = -1  # a key of the model's forward pre-hook dict no RemovableHandle takes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="cnn", choices=sorted(MAKERS))
    p.add_argument("--pairs", type=int, default=3000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["TDBG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdbg-bench-")
    task = MAKERS[args.model](seed=0)
    model = task.model
    pool = [task.batch() for _ in range(8)]
    probe = tdbg.watch(model, task.optimizer, grad_every=10**9)
    entry = model.__dict__.get("_compiled_call_impl")
    if not isinstance(entry, ForwardEntry):
        print("this torch has no free call entry: the probe uses a forward pre-hook only")
        return 1
    pre_hook = _ForwardStart.owned_by(probe._hooks)
    clock = time.perf_counter_ns
    started = [0]
    original_forward = model.forward

    def forward(*a: Any, **k: Any) -> Any:
        started[0] = clock()
        return original_forward(*a, **k)

    model.forward = forward  # type: ignore[method-assign]

    def step(way: str, i: int) -> int:
        if way == "entry":
            model.__dict__["_compiled_call_impl"] = entry
            model._forward_pre_hooks.pop(PRE_HOOK_ID, None)
        else:
            model.__dict__.pop("_compiled_call_impl", None)
            model._forward_pre_hooks[PRE_HOOK_ID] = pre_hook
            model._forward_pre_hooks_with_kwargs[PRE_HOOK_ID] = True
        inputs, targets = pool[i % len(pool)]
        task.optimizer.zero_grad(set_to_none=True)
        t0 = clock()
        out = model(inputs)
        span = started[0] - t0
        loss = task.loss_fn(out, targets)
        loss.backward()
        task.optimizer.step()
        probe.step(loss)
        return span

    for i in range(50):  # the optimizer's state, the allocator, the probe's plans
        step("entry", i)
    rng = random.Random(args.seed)
    spans: dict[str, list[int]] = {"entry": [], "pre-hook": []}
    for i in range(args.pairs):
        ways = ["entry", "pre-hook"]
        rng.shuffle(ways)
        for way in ways:
            spans[way].append(step(way, i))
    step("entry", 0)  # as watch() left it, for close()
    diffs = [b - a for a, b in zip(spans["entry"], spans["pre-hook"], strict=True)]
    mean = statistics.fmean(diffs) / 1000
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 / 1000
    print(
        f"{args.model}, {args.pairs} pairs: forward span median entry"
        f" {statistics.median(spans['entry']) / 1000:.1f} us, pre-hook"
        f" {statistics.median(spans['pre-hook']) / 1000:.1f} us; pre-hook - entry"
        f" {mean:+.2f} +- {2 * se:.2f} us (2 SE); probe errors {probe.errors}"
    )
    del model.forward
    probe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
