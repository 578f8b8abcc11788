"""Where a run first went non-finite: the step and the module, before NaN spreads everywhere.

Once one optimizer update has consumed a non-finite gradient every weight is NaN, and anything
that looks later (the NaN hunt, the per-layer gradient alert) sees the whole model non-finite.
:class:`NanOrigin` runs on the probe thread over the resolved steps, in order, and on the FIRST
non-finite event names where it began:

- ``weights``: a layer's weights were non-finite at the optimizer pre-hook of step K (the weights
  step K's forward used) while they were finite before: the first such layer in layer order.
- ``backward``: the loss of step K is finite but some layers' gradients are not: the backward
  made them; the origin is the non-finite layer LAST in layer order (nearest the loss), since
  backward runs from the loss towards the inputs. Also when step K's gradients were not
  measured (not a sampled step) but its loss was finite and the weights measured at step K+1
  are non-finite, with no sign that code other than the optimizer changed them (``changed``):
  the update of step K applied non-finite gradients; the layer nearest the loss among those
  it reached is named, and the message says the gradients were not measured.
- ``forward``: the loss is non-finite with finite weights and a forward origin was found on the
  spot (:func:`tdbg.probe.training.guard.find_forward_origin`, passed as ``forward``).
- ``loss``: the loss is non-finite and no forward origin is known: the forward or the loss
  overflowed. "With finite weights" is said only when the weights were measured at that step;
  otherwise the alert says they were not, and which setting would have measured them.

A step's gradients are measured on sampled steps, and on a CPU run also on any step whose loss
is already non-finite before its update (read without a sync), so K is the step where it
began, not the one after. Its weights are read where they can matter: on a CPU run by a pass
that finds a NaN or Inf (or on such a loss), before the update; on a GPU by every pass.

No torch here: it works on plain floats and indices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from tdbg.probe.alerts import alert
from tdbg.probe.origin import Origin
from tdbg.protocol.messages import Alert as AlertMessage

KIND = "nonfinite_origin"


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


class NanOrigin:
    """Feed every resolved step in order with :meth:`observe`; the first non-finite event
    returns one ``nonfinite_origin`` alert (severity ``error``) and sets :attr:`origin`.
    Later steps return None: the origin is the first event only."""

    def __init__(self, layer_names: Sequence[str]) -> None:
        self.layer_names = list(layer_names)
        self.layer_types: list[str] = []  # each layer's module class, where known
        # Layers that left the model -> the first step without them: a NaN from then on is no
        # norm at all (before it, their own).
        self.gone: dict[int, int] = {}
        self.origin: Origin | None = None
        # The probe re-runs a non-finite step's forward (on the CPU, or with the guard): its
        # alert then never advises watch(skip_nonfinite=True) to do it.
        self.reruns_forward = False
        self.last_finite: int | None = None  # last step with loss, grads and weights finite
        # The step before: (step, its gradients measured, its loss known finite, last_finite
        # before it) — where an unmeasured update turned finite weights non-finite.
        self._previous: tuple[int, bool, bool, int | None] | None = None

    def _name(self, index: int) -> str:
        if 0 <= index < len(self.layer_names):
            return self.layer_names[index] or "<root>"
        return f"layer {index}"

    def observe(
        self,
        step: int,
        loss: float | None,
        grad_norms: Sequence[float] | None,
        weight_nonfinite: Sequence[int] | None,
        forward: tuple[str, str, int] | None = None,
        changed: Sequence[int] | None = None,
        grad_nonfinite: Sequence[int] | None = None,
    ) -> AlertMessage | None:
        """One resolved step. ``grad_norms``: per layer on sampled steps, else None;
        ``weight_nonfinite``: indices of layers whose weights were non-finite at this step's
        optimizer pre-hook, None when not measured; ``forward``: what
        ``find_forward_origin`` returned for this step, if it ran; ``changed``: layers whose
        weights code other than the optimizer changed since the last measurement (None: not
        known); ``grad_nonfinite``: layers with a non-finite gradient known without norms
        (``skip_nonfinite``'s check). Returns the alert or None."""
        if self.origin is not None:
            return None
        previous = self._previous
        measured = grad_norms is not None or weight_nonfinite is not None
        loss_finite = loss is not None and loss - loss == 0.0  # NaN and +-Inf give NaN
        self._previous = (step, measured, loss_finite, self.last_finite)
        if (
            not measured
            and forward is None
            and not grad_nonfinite
            and (loss_finite or loss is None)
        ):
            # The usual step (nothing measured, its loss finite or unknown): the probe
            # thread's per-step work on short steps, where it competes for the GIL.
            self.last_finite = step
            return None
        bad_weights = sorted(set(weight_nonfinite or ()))
        gone = self.gone
        bad_grads = [
            i
            for i, v in enumerate(grad_norms or ())
            if not math.isfinite(v) and not (i in gone and step >= gone[i])
        ]
        if grad_nonfinite:
            bad_grads = sorted({*bad_grads, *grad_nonfinite})
        loss_ok = _finite(loss)
        if not bad_weights and not bad_grads and loss_ok and forward is None:
            self.last_finite = step
            return None
        since = self.last_finite
        finite_at = f" (finite at step {since})" if since is not None else ""
        if (
            bad_weights
            and previous is not None
            and previous[0] == step - 1
            and not previous[1]
            and previous[2]
            and not set(bad_weights) & set(changed or ())
        ):
            # Step K = step - 1 ran its forward on finite weights (its loss was finite) and
            # its update, unmeasured, left them non-finite; nothing else touched them.
            k, before = previous[0], previous[3]
            last = bad_weights[-1]
            name = self._name(last)
            before_at = f" (finite at step {before})" if before is not None else ""
            origin = Origin(
                k,
                "backward",
                self.layer_names[last] if last < len(self.layer_names) else name,
                f"backward made a non-finite gradient in {name} at step {k}: the update of "
                f"step {k} (its loss finite) left the weights of {len(bad_weights)} layer(s) "
                f"non-finite, seen at step {step}; {name} is nearest the loss (step {k}'s "
                f"gradients were not measured: grad_every=1 measures every step){before_at}",
                before,
            )
        elif bad_weights:
            first = bad_weights[0]
            name = self._name(first)
            more = f"; {len(bad_weights) - 1} more layer(s)" if len(bad_weights) > 1 else ""
            origin = Origin(
                step,
                "weights",
                self.layer_names[first] if first < len(self.layer_names) else name,
                f"weights of {name} non-finite at step {step}{finite_at}{more}",
                since,
            )
        elif forward is not None:
            module, type_name, count = forward
            shown = module or "<root>"
            origin = Origin(
                step,
                "forward",
                module,
                f"forward of {shown} ({type_name}) made {count} non-finite value(s) at step "
                f"{step} from finite inputs and weights{finite_at}",
                since,
                type_name,
                count,
            )
        elif loss_ok and bad_grads:
            last = bad_grads[-1]
            name = self._name(last)
            origin = Origin(
                step,
                "backward",
                self.layer_names[last] if last < len(self.layer_names) else name,
                f"backward made a non-finite gradient in {name} at step {step} with a finite "
                f"loss ({len(bad_grads)} layer(s) non-finite; {name} is nearest the loss)"
                f"{finite_at}",
                since,
            )
        else:
            rerun = (
                "; a re-run of that forward (where its inputs were kept) found no module's "
                "output non-finite: look at the loss computation outside the model's modules"
                if self.reruns_forward
                else "; watch(skip_nonfinite=True) re-runs that forward and names the module"
            )
            if weight_nonfinite is None and grad_norms is not None:
                # Finite gradients of a NaN loss: nothing was re-run (nor would the guard re-run
                # it: it checks gradients), and the NaN never reached the gradients.
                weights = (
                    f"(its gradients were finite; the weights were not read){finite_at}: the "
                    "NaN reached the loss, not the gradients (a detached term of the loss, or "
                    "a model output the loss weights by zero)"
                )
            elif weight_nonfinite is not None:
                weights = (
                    f"with finite weights: the forward or the loss overflowed{finite_at}{rerun}"
                )
            else:
                weights = (
                    "(weights and gradients not measured at that step: grad_every=1 measures "
                    f"every step){finite_at}"
                )
            origin = Origin(step, "loss", None, f"loss is {loss} at step {step} {weights}", since)
        if origin.module_type is None and origin.phase in ("weights", "backward"):
            index = (
                self.layer_names.index(origin.module) if origin.module in self.layer_names else -1
            )
            if 0 <= index < len(self.layer_types) and self.layer_types[index]:
                origin = replace(origin, module_type=self.layer_types[index])
        self.origin = origin
        layers = [origin.module] if origin.module is not None else []
        return alert(KIND, "error", origin.step, origin.detail, layers)


SKIPPED_KIND = "skipped_nonfinite"


def _skipped_layer_name(layer_names: Sequence[str], index: int) -> str:
    if index < 0:  # guard.UNWATCHED: the optimizer's others (a temperature beside the model)
        return "parameters outside the watched model"
    return layer_names[index] if index < len(layer_names) else f"layer {index}"


def skipped_alert(
    step: int, layer_names: Sequence[str], layers: Sequence[int], skipped: int
) -> AlertMessage:
    """The alert for an update ``watch(skip_nonfinite=True)`` skipped (a warning: the model is
    intact). ``layers``: :attr:`NonfiniteGuard.nonfinite_layers`; ``skipped``: its count so far."""
    names = [_skipped_layer_name(layer_names, i) for i in layers]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    where = f" in {shown}" if names else ""
    return alert(
        SKIPPED_KIND,
        "warning",
        step,
        f"skipped the update of step {step}: non-finite gradient{where} "
        f"({skipped} update(s) skipped so far; weights and optimizer state unchanged)",
        names,
    )
