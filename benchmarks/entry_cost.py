"""Where the probe's fixed per-step cost goes, entry point by entry point, to a microsecond.

``interleaved.py`` resolves the probe's whole cost to a few tenths of a percent of a step
(tens of microseconds on the cnn demo); this splits its fixed work (no gradient pass:
``grad_every=10**9``) into the places torch calls into it, each timed in place in a real
training step, where the caches are as the loop leaves them:

- ``forward``: from ``model(x)`` to the model's ``forward`` starting (the probe's forward
  pre-hook and torch's slower call path for a module with hooks);
- ``backward``: from ``loss.backward()`` to autograd's engine starting (the probe's backward
  tap, which reads a CPU loss);
- ``optimizer pre`` / ``optimizer post``: from ``optimizer.step()`` to the first of the step's
  own pre-hooks after the probe's, and from the first post-hook (put before the probe's) to
  ``step()`` returning (the probe's process-wide optimizer tap and its step hooks);
- ``probe.step()``: the whole call.

Steps alternate, watched and unwatched: for an unwatched step the probe's hooks come out of
torch's hook dicts and its backward tap off ``torch.autograd.backward`` (a few dict operations
outside the timed spans, the same for both kinds of step); the timing hooks are there in both.
Each span's mean difference over the step pairs is shown with two standard errors: the spans
are microseconds long, so a few thousand pairs resolve +-0.5-2 us even on a busy machine. Also
shown: what the probe timed of itself (its hooks, its taps and ``probe.step()``'s own timer:
the ``probe_time`` it reports, over ``1 + budget.FIXED_UNTIMED``). Not in the table: what the
probe's work costs the loop's own kernels afterwards (caches it evicted); ``interleaved.py
--grad-every 1000000000`` measures everything, to its coarser resolution.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.autograd  # noqa: E402
from models import MAKERS  # noqa: E402
from overhead import POOL  # noqa: E402
from thread_cpu import add_pace, chosen_models, run_models  # noqa: E402
from torch.optim import optimizer as optimizer_mod  # noqa: E402

import tdbg  # noqa: E402
from tdbg.probe.training.budget import FIXED_UNTIMED  # noqa: E402
from tdbg.probe.training.hook_refs import is_tdbg_forward  # noqa: E402

SPANS = ("forward", "backward", "optimizer pre", "optimizer post", "probe.step()")
clock = time.perf_counter_ns


def post_hooks(optimizer: torch.optim.Optimizer) -> OrderedDict[int, Any]:
    """The optimizer's step post-hooks, in the order torch runs them."""
    return cast("OrderedDict[int, Any]", optimizer._optimizer_step_post_hooks)


class Marks:
    """Timestamps taken inside torch's calls by the timing wrappers and hooks."""

    forward = 0
    engine = 0
    # What the timing wrapper of the forward calls: the probe's forward wrapper (forward_tap)
    # while it is in, the model's own forward while it is out.
    inner: Callable[..., Any] | None = None
    pre = 0
    post = 0


def timing_wrappers(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Put the timing points in (both kinds of step have them); returns how to take them out."""
    marks = Marks
    marks.inner = original_forward = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        marks.forward = clock()
        return marks.inner(*args, **kwargs)  # type: ignore[misc]

    model.forward = forward
    # torch.autograd.backward() calls the engine through its module's global.
    original_engine = torch.autograd._engine_run_backward

    def engine(*args: Any, **kwargs: Any) -> Any:
        marks.engine = clock()
        return original_engine(*args, **kwargs)

    torch.autograd._engine_run_backward = engine

    def pre(*_: Any) -> None:
        marks.pre = clock()

    def post(*_: Any) -> None:
        marks.post = clock()

    pre_handle = optimizer.register_step_pre_hook(pre)  # after the probe's: its work is before
    post_handle = optimizer.register_step_post_hook(post)
    # Before the probe's post-hook: its work is between this mark and step() returning.
    post_hooks(optimizer).move_to_end(post_handle.id, last=False)

    def remove() -> None:
        del model.forward
        if is_tdbg_forward(original_forward):
            model.__dict__["forward"] = original_forward  # the probe's wrapper, as it was
        torch.autograd._engine_run_backward = original_engine
        pre_handle.remove()
        post_handle.remove()

    return remove


class ProbeSwitch:
    """The probe's hooks and backward tap in and out of torch, by dict operations."""

    def __init__(self, probe: tdbg.Probe, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.model, self.optimizer = model, opt
        # The probe's forward wrapper, under the timing one (else its forward pre-hook).
        self.wrapper = Marks.inner if is_tdbg_forward(Marks.inner) else None
        self.unwrapped = types.MethodType(type(model).forward, model)
        forward_ids = [h.id for h in probe._hooks.handles if h.id in model._forward_pre_hooks]
        self.forward = {i: model._forward_pre_hooks[i] for i in forward_ids}
        mine = {h.id for h in probe._hooks.handles}
        self.pre = {i: h for i, h in opt._optimizer_step_pre_hooks.items() if i in mine}
        self.post = {i: h for i, h in opt._optimizer_step_post_hooks.items() if i in mine}
        self.global_pre = dict(optimizer_mod._global_optimizer_pre_hooks)
        self.tapped = torch.autograd.backward
        self.untapped = self.tapped.__wrapped__  # type: ignore[attr-defined]  # functools.wraps
        self.post_order = list(opt._optimizer_step_post_hooks)

    def set(self, on: bool) -> None:
        model, opt = self.model, self.optimizer
        if self.wrapper is not None:
            Marks.inner = self.wrapper if on else self.unwrapped
        if on:
            model._forward_pre_hooks.update(self.forward)
            opt._optimizer_step_pre_hooks.update(self.pre)
            opt._optimizer_step_post_hooks.update(self.post)
            for key in self.post_order:  # the timing post-hook first, as placed
                if key in opt._optimizer_step_post_hooks:
                    post_hooks(opt).move_to_end(key)
            optimizer_mod._global_optimizer_pre_hooks.update(self.global_pre)
            torch.autograd.backward = self.tapped
        else:
            for key in self.forward:
                model._forward_pre_hooks.pop(key, None)
            for key in self.pre:
                opt._optimizer_step_pre_hooks.pop(key, None)
            for key in self.post:
                opt._optimizer_step_post_hooks.pop(key, None)
            for key in self.global_pre:
                optimizer_mod._global_optimizer_pre_hooks.pop(key, None)
            torch.autograd.backward = self.untapped


def bench(name: str, args: argparse.Namespace, _rng: Any) -> None:
    task = MAKERS[name](seed=args.seed)
    model, optimizer = task.model, task.optimizer
    pool = [task.batch() for _ in range(POOL)]
    for i in range(20):  # optimizer state, allocator
        task.train_step(*pool[i % POOL])
    probe = tdbg.watch(model, optimizer, name=name, grad_every=10**9)
    remove_timing = timing_wrappers(model, optimizer)
    switch = ProbeSwitch(probe, model, optimizer)
    sampler = probe._sampler
    for i in range(50):  # plans built, the caches as in a run
        probe.step(task.train_step(*pool[i % POOL]))
    spans: dict[bool, list[tuple[int, ...]]] = {True: [], False: []}
    timed: list[float] = []
    pace = args.pace_ms / 1e3
    for i in range(2 * args.pairs):
        watched = i % 2 == 0
        switch.set(watched)
        inputs, targets = pool[i % POOL]
        optimizer.zero_grad(set_to_none=True)
        Marks.forward = Marks.engine = Marks.pre = Marks.post = 0
        t_forward = clock()
        loss = task.loss_fn(model(inputs), targets)
        t_backward = clock()
        loss.backward()
        t_step = clock()
        optimizer.step()
        t_stepped = clock()
        if task.scheduler is not None:
            task.scheduler.step()
        if pace:
            time.sleep(pace)
        # The loop's graph is freed after the spans in both kinds of step (the probe holds the
        # scalar it saw backpropagated until probe.step() ends: freed in there, it would time
        # the loop's own work as the probe's).
        graph, loss = loss, loss.detach()
        t_probe = clock()
        if watched:
            probe.step(loss, samples=task.batch_size)
        t_end = clock()
        del graph
        if not (Marks.forward and Marks.engine and Marks.pre and Marks.post):
            raise SystemExit("a timing point was not reached: this torch calls differently")
        spans[watched].append(
            (
                Marks.forward - t_forward,
                Marks.engine - t_backward,
                Marks.pre - t_step,
                t_stepped - Marks.post,
                t_end - t_probe,
            )
        )
        if watched:
            timed.append(sampler._fixed_cost / (1.0 + FIXED_UNTIMED))
    switch.set(True)
    remove_timing()
    probe.close()
    print(f"\n=== {name}: {args.pairs} pairs of steps, pace {args.pace_ms:g} ms")
    total = 0.0
    for k, span in enumerate(SPANS):
        diffs = [w[k] - u[k] for w, u in zip(spans[True], spans[False], strict=True)]
        mean = statistics.fmean(diffs) / 1e3
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 / 1e3
        base = statistics.median(u[k] for u in spans[False]) / 1e3
        total += mean
        print(f"  {span:<16} {mean:+7.1f} us +- {2 * se:4.1f}   (unwatched: {base:6.1f} us)")
    own = statistics.fmean(timed[len(timed) // 2 :]) * 1e6
    print(
        f"  {'sum':<16} {total:+7.1f} us; the probe timed {own:.1f} us of itself (its running"
        f" average) and reports {own * (1 + FIXED_UNTIMED):.1f} us"
        f" (x{1 + FIXED_UNTIMED:g}); sum / timed = {total / own:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="mlp,transformer,cnn", help="comma-separated")
    p.add_argument("--pairs", type=int, default=3000, help="watched/unwatched step pairs")
    p.add_argument("--seed", type=int, default=0)
    add_pace(p)
    args = p.parse_args(argv)
    if args.pairs < 2 or not args.pace_ms >= 0:
        p.error("--pairs: at least 2; --pace-ms: at least 0")
    models = chosen_models(args.models)
    if models is None:
        return 2
    run_models(models, bench, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
