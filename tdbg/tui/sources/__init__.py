"""Where a TUI's events come from: a local socket, discovery, ssh, a replay, synthetic data."""
