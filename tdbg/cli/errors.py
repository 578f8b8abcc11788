"""CliError: a command's one-line error for the user (``tdbg: error: ...``, exit code 2)."""

from __future__ import annotations


class CliError(Exception):
    """A one-line error for the user; exit code 2."""
