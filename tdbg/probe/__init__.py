"""The probe: runs inside the training process, gathers what the TUI shows and serves it."""
