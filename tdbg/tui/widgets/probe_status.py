"""ProbeStatus: the probe's own cost and health, one line above the footer."""

from __future__ import annotations

from rich.text import Text

from tdbg.format import fmt, fmt_every
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.reports import ProbeHealth
from tdbg.tui.widgets.steady import SteadyStatic


class ProbeStatus(SteadyStatic):
    """The probe's state first (switched off by its error breaker, closed with the run,
    updates skipped by the non-finite guard), then its cost and counters."""

    def show(self, state: RunState) -> None:
        probe = state.probe or ProbeHealth(time=None)
        cost = probe.cost_fraction
        parts = []
        if state.probe_disabled:
            parts.append(f"PROBE OFF: error breaker after {fmt(probe.errors, 'd')} errors")
        elif state.probe_closed:
            parts.append("run ended · probe closed")
        if state.skipped_steps:
            n = state.skipped_steps
            parts.append(f"skipped {n} non-finite update{'s' if n != 1 else ''}")
        budget = probe.overhead_budget
        cost_text = f"probe {fmt(None if cost is None else cost * 100, '.1f', '%')}"
        # Over its budget when its fixed per-step work alone costs more (a very short step, a
        # busy host): said here, as it is measured, rather than hidden.
        over = False
        if cost is not None and budget is not None and 0 < budget < cost:
            over = True
            cost_text += f" > {fmt(budget * 100, 'g', '%')} budget"
        parts += [
            cost_text,
            f"grads {fmt_every(probe.grad_interval)}",
            f"dropped {fmt(probe.dropped, 'd')}",
            f"errors {fmt(probe.errors, 'd')}",
            f"clients {fmt(probe.clients, 'd')}",
        ]
        deep = state.deep
        if deep.activations_on:
            parts.append(f"activations every {fmt(deep.activations_every, 'd')} steps")
        if deep.active_jobs:
            parts.append("jobs " + " ".join(f"#{j}" for j in deep.active_jobs))
        if probe.last_error:
            parts.append(f"last error: {probe.last_error}")
        if state.errors:
            parts.append(f"protocol: {state.errors[-1]}")
        self.set_class(state.probe_disabled, "-disabled")
        self.set_class(bool(state.skipped_steps), "-skipped")
        self.set_class(over, "-over-budget")
        self.update(Text(" · ".join(parts), no_wrap=True, overflow="ellipsis"))
