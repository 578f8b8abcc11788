"""``python -m tdbg.tui.demo``: tdbg-tui over the synthetic run, no probe or torch needed.

For screenshots and a look at every panel: two models and optimizers, 4 micro-batches a step,
clipping, epochs and total steps (the ETA), user metrics (``--many`` adds 40 names, ``--nan`` a
diverged run), ``--ended`` a run that closed cleanly, ``--old`` what an older probe sent.
"""

from __future__ import annotations

import argparse
import time

from tdbg.tui.app import make_app
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tdbg.tui.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ended", action="store_true", help="the run ended and its probe closed")
    parser.add_argument("--nan", action="store_true", help="the loss goes NaN near the end")
    parser.add_argument("--many", action="store_true", help="40 more metric names")
    parser.add_argument("--skipped", type=int, default=3, help="updates skipped (non-finite)")
    parser.add_argument("--old", action="store_true", help="an older probe: none of issue 10")
    args = parser.parse_args(argv)
    t0 = time.time() - args.steps * 0.05
    old = args.old
    messages = synthetic_run(
        steps=args.steps,
        n_layers=args.layers,
        nan_at=args.steps - 20 if args.nan else None,
        models=() if old else ("netG", "netD"),
        total_steps=None if old else 1000,
        skipped_steps=0 if old else args.skipped,
        closed=args.ended,
        metrics=not old,
        extra_metrics=40 if args.many else 0,
        true_numbers=not old,
        t0=t0,
    )
    run = dict(RUN, start_time=t0)
    if old:
        for key in ("models", "optimizers", "param_groups"):
            run.pop(key, None)
    source = ReplaySource(messages, run, end=args.ended)
    return int(make_app(source).run() or 0)


if __name__ == "__main__":
    raise SystemExit(main())
