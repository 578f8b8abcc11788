"""What the probe lets go of after its timers stop: freeing a loop's graph is the loop's work."""

from __future__ import annotations

from typing import Any

# References the probe's bookkeeping drops inside a timed tap or hook (the previous micro-batch's
# loss, whose autograd graph dies with it), kept here until that tap or hook has stopped its
# timer and empties the list. Dropped inside the timer, the graph's release counted as the
# probe's cost: ~70 us per micro-batch on nanoGPT's 4-layer CPU model, 4 a step, which put its
# reported cost at 1.5 % of a 28 ms step (benchmarks/README.md). The loop frees it either way
# (without tdbg, when its ``loss`` variable is next reassigned).
HELD: list[Any] = []
