"""How often gradients are sampled so that the probe stays within its overhead budget."""

from __future__ import annotations

import math

MAX_AUTO_INTERVAL = 1000  # at least one gradient sample every this many steps


def gradient_interval(
    step_seconds: float, grad_seconds: float, fixed_seconds: float, budget: float
) -> int:
    """Sample gradients every k steps, k the smallest that keeps the gradient pass and the
    probe's fixed per-step cost together within ``budget`` (a fraction) of a step.

    Inputs are running averages: the step's time, one gradient pass's cost (the larger of host
    and device time) and the probe's other per-step cost. Where the fixed cost alone eats the
    budget (very short steps) the gradients still get a quarter of it rather than nothing, and
    k never exceeds MAX_AUTO_INTERVAL, so a run always shows some gradients. Unmeasured (zero)
    costs give 1: sample every step until there is something to go by.
    """
    if not (step_seconds > 0 and grad_seconds > 0 and budget > 0):
        return 1
    allowed = budget * step_seconds
    available = max(allowed - max(fixed_seconds, 0.0), allowed / 4)
    k = math.ceil(grad_seconds / available)
    return max(1, min(MAX_AUTO_INTERVAL, k))
