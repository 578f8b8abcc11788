"""No torch: handles SIGTERM (exit 7), lets SIGUSR1 kill it; says when it is ready."""

from __future__ import annotations

import signal
import sys
import time


def on_term(signum: int, frame: object) -> None:
    print(f"got signal {signum}", flush=True)
    sys.exit(7)


signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(1)
