"""Demo: a small CNN classifying synthetic grating images by orientation under tdbg."""

from __future__ import annotations

from common import main_guard, parser, run
from models import make_cnn


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or "")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    return run(make_cnn(batch_size=args.batch_size, seed=args.seed), args)


if __name__ == "__main__":
    main_guard(main)
