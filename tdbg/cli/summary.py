"""``tdbg summary TARGET``: what a run trains — each layer's type, parameters, trainable or frozen,
dtype, device, bytes and optimizer, the totals, and the layers to look at."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from tdbg.cli.glance import add_history_timeout, read_state, the_only_run
from tdbg.cli.target_args import TARGET_HELP, add_remote_options, target_arg
from tdbg.model.model_summary import MAX_LAYERS_SHOWN, model_summary, render_summary


def add_summary_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "summary",
        help="what a run trains: layers, parameters, trainable/frozen, dtype, device, bytes",
        description=(
            "The model summary of a live run or a recording: per watched layer (a module that "
            "owns parameters) its type, parameters, trainable or frozen, dtype, device, bytes "
            "and the optimizer that updates it; the totals; and the layers to look at (frozen, "
            "trainable but updated by no optimizer, no gradient reaching it, gone). Exit "
            "status: 0 shown; 2 no run, not a recording, bad arguments."
        ),
    )
    p.add_argument("target", nargs="?", type=target_arg, metavar="TARGET", help=TARGET_HELP)
    add_remote_options(p)
    p.add_argument("--json", action="store_true", help="the summary as one JSON object")
    p.add_argument(
        "--all",
        action="store_true",
        help=f"every layer, also past {MAX_LAYERS_SHOWN} (default: the flagged ones past that)",
    )
    add_history_timeout(p)
    p.set_defaults(func=cmd_summary)


def cmd_summary(args: argparse.Namespace, out: TextIO) -> int:
    text = args.target if args.target is not None else the_only_run()
    summary = model_summary(read_state(text, args))
    if args.json:
        out.write(json.dumps(summary.as_json()) + "\n")
    else:
        out.write(render_summary(summary, every=args.all))
    out.flush()
    return 0
