"""What the TUI knows of a run, free of textual: the run model, deep-dive results, the timeline."""
