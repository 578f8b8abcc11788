"""Demo: an MLP that trains fine, then a named layer turns non-finite at a chosen step."""

from __future__ import annotations

import sys

import torch
from common import batches, main_guard, parser, run
from models import make_mlp
from torch import Tensor, nn

NAN = float("nan")


def layer_names(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that own parameters directly: the names the probe uses for layers."""
    return {
        name: module
        for name, module in model.named_modules()
        if name and any(True for _ in module.parameters(recurse=False))
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or "")
    p.add_argument("--nan-at", type=int, default=200, metavar="STEP", help="default 200")
    p.add_argument("--layer", default="body.2", help="layer that goes bad (default body.2)")
    p.add_argument(
        "--how",
        choices=("grad", "forward"),
        default="grad",
        help="grad: that layer's gradients become NaN (an overflowing backward), so the first "
        "gradient alert names it alone and the loss is NaN from the next step; forward: its "
        "output becomes NaN, so the loss and every layer's gradient are NaN at once",
    )
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    # Gradient statistics every step by default, so that the step that goes bad is the one seen.
    p.set_defaults(grad_every=1, name="nan")
    args = p.parse_args(argv)
    if args.nan_at < 0:
        p.error("--nan-at must be >= 0")
    task = make_mlp(width=args.width, depth=args.depth, seed=args.seed)
    layers = layer_names(task.model)
    target = layers.get(args.layer)
    if target is None:
        print(
            f"nan.py: no layer named {args.layer!r}; valid layers: {', '.join(layers)}",
            file=sys.stderr,
        )
        return 2
    next_step = [0]  # the index of the step whose forward runs next

    def poison_output(module: nn.Module, inputs: object, output: Tensor) -> Tensor | None:
        return output * NAN if next_step[0] >= args.nan_at else None

    def before_step(step: int) -> None:
        next_step[0] = step + 1
        if args.how == "grad" and step == args.nan_at:
            with torch.no_grad():
                for param in target.parameters(recurse=False):
                    if param.grad is not None:
                        param.grad.fill_(NAN)

    if args.how == "forward":
        target.register_forward_hook(poison_output)
    return run(task, args, data=batches(task), before_step=before_step)


if __name__ == "__main__":
    main_guard(main)
