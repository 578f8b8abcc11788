"""What the probe counts as its own cost in any script, part by part: run the script through it.

``tdbg run -- python benchmarks/cost_parts.py SCRIPT [ARGS...]`` runs ``SCRIPT`` as ``python
SCRIPT ARGS`` would (its directory first on ``sys.path``), under ``tdbg run``, and at its exit
prints to stderr, for the steps without a gradient pass and those with one, the median per step
of what the probe timed of itself: ``probe.step()``'s own timer, its hooks (forward pre-hooks,
optimizer step hooks), its taps (every ``backward()``, the optimizer tap, clipping) and the work
it times whole (gradient passes, staging); the micro-batches and the step time beside them. The
probe reports its fixed work at ``1 + budget.FIXED_UNTIMED`` times the first three (what it costs
the loop beyond what it times: torch calling into it, cold caches), plus the last as it is.

It reads the figures where the probe adds them up (``CostModel._account``; around
``StepSampler.step`` for a usual CPU step, which has it written out), so it changes nothing the
probe does. It answers "where does the reported cost go" on a real script (issue
36: nanoGPT's ``probe 1.5 % > 1 % budget`` on a 28 ms step, benchmarks/README.md); what the
probe truly costs is ``interleaved.py``'s to measure, on the demo models.
"""

from __future__ import annotations

import atexit
import os
import runpy
import statistics
import sys
from typing import Any

from tdbg.probe.training import cost_model, sampler
from tdbg.probe.training.hooks import PhaseHooks, perf

# Per step: probe.step()'s own timer, hooks, taps, work timed whole, sampled?, micro, step time.
_rows: list[tuple[float, float, float, float, bool, int, float]] = []
_SKIP = 20  # the first steps: plans being built, the interval settling
_account = cost_model.CostModel._account
_step = sampler.StepSampler.step


def _recording_account(
    self: Any,
    t0: float,
    hooks: PhaseHooks,
    step_time: float,
    sample: Any,
    hidden: bool,
    micro: int,
) -> float:
    """A step the whole way: its parts where ``_account`` adds them up."""
    _rows.append(
        (
            perf() - t0,
            hooks.seconds,
            self._tap_seconds[0],
            self._grad_seconds,
            sample is not None,
            micro,
            step_time,
        )
    )
    return _account(self, t0, hooks, step_time, sample, hidden, micro)


def _recording_step(
    self: Any, loss: Any, samples: Any, tokens: Any, hooks: PhaseHooks, t0: float
) -> None:
    """A usual CPU step, handed over by ``StepSampler.step`` alone (``_account`` written out
    there): its parts read around the call, the hooks' and taps' before it takes them, its own
    time up to its return (a little more than the probe's timer, which stops before the
    hand-off)."""
    seen = len(_rows)
    hook_seconds, tap_seconds, grads = hooks.seconds, self._tap_seconds[0], self._grad_seconds
    micro = sum(slot.micro for slot in self._slots)
    last = self._last_host
    _step(self, loss, samples, tokens, hooks, t0)
    if len(_rows) == seen:  # not the whole way
        step_time = t0 - last if last is not None else float("nan")
        _rows.append((perf() - t0, hook_seconds, tap_seconds, grads, False, micro, step_time))


def _report() -> None:
    rows = _rows[_SKIP:]
    if not rows:
        print(f"[cost_parts] fewer than {_SKIP + 1} steps: nothing to report", file=sys.stderr)
        return
    for kind, sampled in (("usual steps", False), ("sampled steps", True)):
        these = [r for r in rows if r[4] is sampled]
        if not these:
            continue

        def us(i: int, these: list[Any] = these) -> float:
            return statistics.median(r[i] for r in these) * 1e6

        step_ms = statistics.median(r[6] for r in these if r[6] == r[6]) * 1e3
        print(
            f"[cost_parts] {kind}: {len(these)}; per step (median) probe.step() {us(0):.0f} us,"
            f" hooks {us(1):.0f} us, taps {us(2):.0f} us, timed whole {us(3):.0f} us;"
            f" {statistics.median(r[5] for r in these):.0f} micro-batches, a {step_ms:.1f} ms step",
            file=sys.stderr,
        )


def main() -> int:
    if len(sys.argv) < 2:
        usage = "usage: tdbg run -- python benchmarks/cost_parts.py SCRIPT [ARGS...]"
        print(usage, file=sys.stderr)
        return 2
    script = sys.argv[1]
    if not os.path.isfile(script):
        print(f"cost_parts: no script at {script}", file=sys.stderr)
        return 2
    cost_model.CostModel._account = _recording_account  # type: ignore[method-assign]
    sampler.StepSampler.step = _recording_step  # type: ignore[method-assign]
    atexit.register(_report)
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
