"""argparse pieces every entry point shares: one-line usage errors and positive numbers."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn

EXIT_USAGE = 2  # bad arguments, no run, refused command, timeout, run ended mid-job


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump): ``tdbg profile: error: ...``, exit 2.
    Subparsers made from it are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be an integer >= 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number > 0") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError("must be a number > 0")
    return value
