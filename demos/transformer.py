"""Demo: a small causal Transformer LM learning arithmetic sequences, with warm-up + cosine LR."""

from __future__ import annotations

from common import main_guard, parser, run
from models import make_transformer


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or "")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=100, help="LR warm-up steps")
    p.add_argument("--cycle", type=int, default=2000, help="cosine LR period in steps (restarts)")
    args = p.parse_args(argv)
    task = make_transformer(
        layers=args.layers,
        d_model=args.d_model,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        warmup=args.warmup,
        cycle=args.cycle,
        seed=args.seed,
    )
    return run(task, args)


if __name__ == "__main__":
    main_guard(main)
