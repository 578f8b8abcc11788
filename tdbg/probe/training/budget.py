"""How often gradients are sampled so that the probe stays within its overhead budget."""

from __future__ import annotations

import math

MAX_AUTO_INTERVAL = 1000  # at least one gradient sample every this many steps
# The interval aims this far under the budget: its inputs are running averages of noisy,
# heavy-tailed timings (a pass that waits for the GIL costs 5-10x its median), and sampling
# more often whenever the average dips costs more than sampling less when it peaks saves, so
# aiming at the budget itself lands over it (1.03 % measured for a 1 % budget on the mlp demo).
AIM = 0.8
FLOOR = 0.1  # the share of the budget the gradients keep when the fixed cost takes it all
# ... but no more often than once every this many seconds: where the fixed work alone passes
# the budget (the cnn demo's 7-10 ms CPU steps) a fresh set of norms every two seconds is what
# the screen needs, and the tenth of the budget a faster refresh took put the cnn's measured
# cost over 1 % (+1.09 % +- 0.28 on a busy host; its fixed work alone: +0.81 %).
REFRESH_SECONDS = 2.0
# The probe's fixed per-step work costs the training thread this much more than it times of
# itself: torch calling into its hooks and taps, and the first instructions of each (the
# loop's kernels have just evicted them), are outside any timer inside them. Measured with
# benchmarks/interleaved.py on the cnn demo, fixed work alone, a quiet machine (+-0.1 %):
# 57.6 us a step against 24 us timed, 2.4 times (2026-11-26). Its gradient passes are timed
# whole: a step that carries one costs what the probe timed of it, within the noise. The
# reported cost and the interval count the fixed work at (1 + FIXED_UNTIMED) times its timing.
FIXED_UNTIMED = 1.4
# ... and every step costs the loop this much more, whatever its hooks timed: the probe thread
# resolving and sending the step, which competes with the loop for the GIL and the caches
# (step_parts.py, the probe thread idled: +3.4 +- 4.2 us a step on the tiny model; ~7.5 us of
# its own CPU a step). Negligible on 10 ms steps (0.04 %), it is what the scale alone left out
# on sub-millisecond ones: the tiny model's cost was reported 24 % under the measured.
FIXED_PER_STEP = 4e-6
FIXED_SCALE = 1.0 + FIXED_UNTIMED  # what the fixed work costs the loop per second it timed
# A lean step's (lean.py) hooks do less outside their timers than the full bookkeeping did:
# one flag test before each timer starts, no frames of the sampler's. Measured with
# benchmarks/interleaved.py (2026-11-29 17:18-17:24, load ~1), the tiny model (its interval
# 1,000: the passes a few hundredths of its cost) in four runs, less FIXED_PER_STEP: 1.60,
# 1.30, 1.39 and 1.58 times what its hooks and probe.step() timed (15-17 us a step), mean 1.47;
# the cnn demo's fixed work +64 +- 28 us against 35.8 timed (1.7 +- 0.8). Then the step
# pre-hook went out of its dict on lean steps (its work done in the process-wide tap): less
# timed, not as much less cost. Four tiny runs (2026-11-29 19:49-19:51, load ~1, seeds 5-8):
# 1.82, 1.77, 1.99 and 1.78 times the timed work (10.2-10.8 us a step), mean 1.84.
LEAN_SCALE = 1.8


def probe_seconds(timed: float, whole: float, scale: float = FIXED_SCALE) -> float:
    """What a step's probe work cost the loop: ``timed``, all the probe timed of itself on the
    training thread, of which ``whole`` was work timed whole (a gradient pass, the guard's
    check: counted as timed); the rest, the fixed work, at ``scale`` times its timing
    (FIXED_SCALE; a lean step's LEAN_SCALE); and
    FIXED_PER_STEP for the probe thread's work on the step."""
    untimed = timed - whole
    return whole + (untimed * scale + FIXED_PER_STEP if untimed > 0.0 else FIXED_PER_STEP)


def gradient_interval(
    step_seconds: float,
    grad_seconds: float,
    fixed_seconds: float,
    budget: float,
    spent: float = math.nan,
) -> int:
    """Sample gradients every k steps, k the smallest that keeps the gradient pass and the
    probe's fixed per-step cost together within ``AIM * budget`` (a fraction) of a step.

    Inputs are running averages: the step's time, what a step with a gradient pass costs on
    top of one without (the pass, its staging and its share of the hooks' work; or the pass's
    device time where larger), the probe's cost on a step without a pass (paid on every step) and
    ``spent``, the fraction of step time the probe actually took over its recent steps (what it
    reports as ``cost_fraction``; NaN: not known yet). Where that ran over the budget the aim
    is lowered in proportion, so the cost the model missed is paid back. Where the fixed cost
    alone (nearly) eats the budget (short CPU steps: the cnn demo's 7-10 ms, with a fixed cost
    of ~0.8 %) the gradients still get a tenth of the budget (FLOOR) rather than nothing, but
    no pass more often than every REFRESH_SECONDS, and k never exceeds MAX_AUTO_INTERVAL, so a
    run always shows some gradients. (A quarter, before, put the cnn demo's measured cost at
    1.1 %.) The interval grows continuously as the room left shrinks. Unmeasured (zero) costs
    give 1: sample every step until there is something to go by.
    """
    if not (step_seconds > 0 and grad_seconds > 0 and budget > 0):
        return 1
    aim = AIM * budget
    if spent > budget:
        aim *= budget / spent
    room = aim * step_seconds - max(fixed_seconds, 0.0)
    floor = max(grad_seconds / (budget * step_seconds * FLOOR), REFRESH_SECONDS / step_seconds)
    k = min(grad_seconds / room, floor) if room > 0 else floor
    return max(1, min(MAX_AUTO_INTERVAL, math.ceil(k)))
