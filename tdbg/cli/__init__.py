"""The command line: ``tdbg`` and ``tdbg-tui``, their options, dump, deep dives, run, bridge."""
