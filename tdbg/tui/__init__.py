"""tdbg-tui: the Textual app that attaches to a probe; never imports torch."""
