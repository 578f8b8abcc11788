"""argparse pieces every entry point shares: one-line usage errors, positive numbers, and the
deep-dive commands' options generated from the protocol's command schema."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection
from typing import NoReturn

from tdbg.protocol.messages import COMMANDS, Field

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


def schema_type(command: str, name: str) -> Callable[[str], int | float]:
    """An argparse type checking a value against the protocol's bounds for command.name (read
    when the option is parsed: the schema is the one owner of the bounds)."""

    def parse(text: str) -> int | float:
        try:
            return COMMANDS[command][name].parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = f"{command}.{name}"
    return parse


def schema_help(spec: Field) -> str:
    """An option's help from its schema field: ``steps to profile, 1-200 (default 5)``."""
    if spec.kind is bool:
        return spec.help
    text = f"{spec.help}, {spec.bounds}" if spec.help else spec.bounds
    return text if spec.default is None else f"{text} (default {spec.default:g})"


def add_command_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    command: str,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
) -> None:
    """One ``--option`` per argument of ``command`` in the protocol's schema (``max_seconds``
    becomes ``--max-seconds``): its type, bounds, default, metavar and help come from the schema.
    A bool whose default is False becomes a flag; one that defaults to True has no generic
    spelling (``--off``?) and must be skipped and spelled by the caller."""
    for name, spec in COMMANDS[command].items():
        if name in skip or (only is not None and name not in only):
            continue
        flag = "--" + name.replace("_", "-")
        if spec.kind is bool:
            if spec.default is not False:
                raise ValueError(
                    f"{command}.{name}: a bool defaulting to true needs its own option"
                )
            parser.add_argument(flag, action="store_true", help=schema_help(spec))
            continue
        parser.add_argument(
            flag,
            type=schema_type(command, name),
            default=spec.default,
            metavar=spec.metavar,
            help=schema_help(spec),
        )
