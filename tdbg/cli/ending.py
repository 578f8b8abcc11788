"""How a ``tdbg`` command ends: its exit code; a known error as one line, never a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from tdbg.cli.args import EXIT_USAGE
from tdbg.cli.errors import CliError
from tdbg.connect.client import ConnectError
from tdbg.protocol.framing import ProtocolError

EXIT_FAILED = 1  # a deep-dive job ended failed or cancelled (its reason is on stderr)
EXIT_INTERRUPTED = 130


def run_command(
    call: Callable[[], int], prog: str, failed: tuple[type[Exception], ...] = ()
) -> int:
    """``call()``'s exit code. Bad input or a run that cannot be reached: one line and
    EXIT_USAGE; one of ``failed`` (a deep-dive job that failed): one line and EXIT_FAILED."""
    try:
        return int(call())
    except (CliError, ConnectError, ProtocolError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except failed as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`tdbg dump | head`): not an error; silence the flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
