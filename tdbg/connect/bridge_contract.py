"""The contract between ``tdbg bridge`` (remote end) and the ssh client (local end): the error
prefix and the exit codes that classify why the bridge could not reach a run."""

from __future__ import annotations

from tdbg.connect.target_errors import Reason

ERROR_PREFIX = "tdbg bridge: error: "  # the local side recognises the bridge's errors by this

EXIT_ERROR = 2  # any other failure: the message says why
EXIT_NO_RUN = 3  # nothing to attach to there: no run, no such socket, a dead run's socket
EXIT_SEVERAL = 4  # several runs and none named: the local side asks for a socket path


def exit_code(reason: Reason) -> int:
    """The bridge's exit status for a TARGET that names no run (TargetError.reason)."""
    if reason in ("missing", "no_run"):
        return EXIT_NO_RUN
    if reason == "several":
        return EXIT_SEVERAL
    return EXIT_ERROR
