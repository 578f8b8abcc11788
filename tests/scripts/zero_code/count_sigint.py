"""No torch: counts SIGINTs; one second after the first, prints the count and exits 4."""

from __future__ import annotations

import signal
import sys
import time

count = 0


def on_int(signum: int, frame: object) -> None:
    global count
    count += 1


signal.signal(signal.SIGINT, on_int)
print("ready", flush=True)
deadline = time.monotonic() + 60
while count == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
quiet_until = time.monotonic() + 1.0  # a duplicate (forwarded) ^C would arrive within this
while time.monotonic() < quiet_until:
    time.sleep(0.01)
print(f"sigint count {count}", flush=True)
sys.exit(4)
