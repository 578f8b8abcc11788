"""Demo: a 21-layer, 5 M-parameter MLP learning a synthetic classification task under tdbg."""

from __future__ import annotations

from common import batches, main_guard, parser, run
from models import make_mlp


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or "")
    p.add_argument(
        "--data-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="simulated loading time per batch: makes the job input-bound on purpose",
    )
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=21)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    task = make_mlp(width=args.width, depth=args.depth, batch_size=args.batch_size, seed=args.seed)
    return run(task, args, data=batches(task, args.data_delay))


if __name__ == "__main__":
    main_guard(main)
