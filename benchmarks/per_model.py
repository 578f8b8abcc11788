"""The command line the per-model cost benchmarks share: ``--models`` and ``--steps``, each
model run in turn, an unknown name a one-line error."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch


def run_over_models(
    description: str | None,
    bench: Callable[[str, int], None],
    models: Sequence[str],
    *,
    default_models: str,
    steps: int,
    steps_help: str,
    argv: list[str] | None = None,
) -> int:
    """Parse ``argv`` and call ``bench(model, steps)`` for each model named, one thread."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", default=default_models, help="comma-separated")
    p.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default {steps})")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in names:  # all checked before any runs: a typo is said at once, not minutes in
        if name not in models:
            p.error(f"unknown model {name}; choose from {', '.join(models)}")
    torch.set_num_threads(1)
    for name in names:
        bench(name, args.steps)
    return 0
