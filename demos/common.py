"""The demos' shared command line and training loop: watch, train, pace, stop cleanly."""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType

import torch
from models import Batch, Task

import tdbg


def parser(description: str) -> argparse.ArgumentParser:
    """Options every demo takes; a demo adds its own before calling ``parse_args``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--steps", type=int, default=None, help="stop after N steps (default: until Ctrl-C)"
    )
    p.add_argument(
        "--delay",
        type=float,
        default=0.02,
        help="seconds to pause after each step so a human can watch (default 0.02; 0 = flat out)",
    )
    p.add_argument("--name", default=None, help="run name shown in the TUI")
    p.add_argument(
        "--grad-every",
        type=int,
        default=None,
        metavar="K",
        help="gradient statistics every K steps (default: auto, within a 1 %% budget)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=250,
        metavar="N",
        help="a validation pass (no grad, logged as val_loss) every N steps (default 250; 0: none)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    return p


def batches(task: Task, data_delay: float = 0.0) -> Iterator[Batch]:
    """A simulated data loader: ``data_delay`` seconds of 'loading' before each batch."""
    while True:
        if data_delay > 0:
            time.sleep(data_delay)
        yield task.batch()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(
    task: Task,
    args: argparse.Namespace,
    data: Iterator[Batch] | None = None,
    before_step: Callable[[int], object] | None = None,
) -> int:
    """Train ``task`` under a probe until ``--steps`` or Ctrl-C/SIGTERM; returns the exit code.

    ``before_step(step)`` runs between backward and ``optimizer.step()`` (nan.py uses it).
    The pacing ``--delay`` sits between ``optimizer.step()`` and ``probe.step()``: the TUI shows
    it as unattributed step time, not as data time, so only ``--data-delay`` looks input-bound.
    """
    torch.set_flush_denormal(True)
    torch.set_num_threads(max(1, args.threads))
    signal.signal(signal.SIGTERM, _interrupt)  # the launcher's SIGTERM closes the probe too
    data = data if data is not None else batches(task)
    probe = tdbg.watch(
        task.model, task.optimizer, name=args.name or task.name, grad_every=args.grad_every
    )
    print(f"{probe.name}: serving at {probe.socket_path}", flush=True)
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
    step = 0
    try:
        while args.steps is None or step < args.steps:
            if args.eval_every > 0 and step > 0 and step % args.eval_every == 0:
                probe.log(val_loss=validate(task))
            inputs, targets = next(data)
            hook = functools.partial(before_step, step) if before_step is not None else None
            loss = task.train_step(inputs, targets, hook)
            if args.delay > 0:
                time.sleep(args.delay)
            probe.step(loss, samples=task.batch_size, tokens=task.tokens)
            last = loss  # read once at the end: no per-step host sync
            first = loss if first is None else first
            step += 1
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        probe.close()
    if first is not None and last is not None:
        print(
            f"{probe.name}: {step} steps, loss {float(first):.4g} -> {float(last):.4g}", flush=True
        )
    return 0


def validate(task: Task, batches: int = 8) -> torch.Tensor:
    """The loss on fresh batches, without grad and in eval mode, as a validation pass is: a
    tensor (tdbg reads it off the training thread: no host-device sync here)."""
    task.model.eval()
    try:
        with torch.no_grad():
            losses = [
                task.loss_fn(task.model(x), y) for x, y in (task.batch() for _ in range(batches))
            ]
        return torch.stack(losses).mean()
    finally:
        task.model.train()


def main_guard(main: Callable[[list[str] | None], int]) -> None:
    """``sys.exit(main(None))``, with Ctrl-C during start-up also a clean exit."""
    try:
        code = main(None)
    except KeyboardInterrupt:
        code = 0
    sys.exit(code)
