"""Whether the probe's per-step hooks and taps time themselves on the step in progress."""

from __future__ import annotations

# Timing itself costs the loop: a clock read, a subtraction and a float stored per hook and
# tap, in the cold moments around the update where every instruction counts (~3 us a step on
# the micro model, benchmarks/entry_floor.py). So the fixed work times itself on sampled steps
# only: the first COUNTED_HERE, every step that goes the whole way or follows one, one usual
# step in TIMED_EVERY; an untimed usual step is counted at the running average of the timed
# ones (CostModel). ``TIMED[0]``: this step's hooks and taps time themselves (one list shared
# by every probe in the process; set by the one that steps, at its step's end).
TIMED: list[bool] = [True]
TIMED_EVERY = 8
