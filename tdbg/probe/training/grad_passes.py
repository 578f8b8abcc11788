"""The gradient pass: when it runs (sampled, forced by a NaN, inside a clip) and over what."""

from __future__ import annotations

from typing import Any

import torch

from tdbg.probe.training.gradients import GradientStats, GradSample, Layer
from tdbg.probe.training.guard import find_forward_origin, guard_of
from tdbg.probe.training.histograms import LayerHistograms
from tdbg.probe.training.hooks import perf
from tdbg.probe.training.pending import SkippedUpdate
from tdbg.probe.training.sampler_state import OptimizerSlot, SamplerState
from tdbg.probe.training.step_values import as_number, learning_rates
from tdbg.probe.training.update_ratio import UpdateRatios


class GradientPasses(SamplerState):
    """One fused pass per optimizer over the gradients its update uses, on sampled steps."""

    __slots__ = ()

    def rebuild(
        self, layers: list[Layer], optimizers: list[tuple[int, str, torch.optim.Optimizer]]
    ) -> None:
        """(Re)build the gradient passes: one per optimizer over the watched parameters it
        updates, one for the rest. At watch() and at a step boundary after the watched layers
        changed; a slot kept (same key) keeps what this step already learnt from its hooks."""
        self._clip_covers = None  # the parameter sets changed: what a clip covers too
        current = [layer for layer in layers if layer.params]
        watched = {id(p) for layer in current for p in layer.params}
        slots: list[OptimizerSlot] = []
        held: set[int] = set()
        for key, name, optimizer in optimizers:
            # A parameter two optimizers hold is read with the first one's update.
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]} & watched - held
            held |= ids
            stats = GradientStats(layers, ids)
            slot = self._by_key.get(key)
            if slot is None or slot.optimizer is not optimizer:
                slot = OptimizerSlot(key, optimizer, name, stats)
            slot.grads = stats
            if slot.updates is not None:
                slot.updates.drop()
            slot.updates = UpdateRatios(stats)
            slot.measuring = False
            slot.histograms = LayerHistograms(stats)
            slot.histogram_result = None
            if self.skip_nonfinite:
                slot.guard = guard_of(optimizer, stats.params, stats.param_layer)
            slots.append(slot)
        self._slots = slots
        self._by_key = {slot.key: slot for slot in slots}
        # Parameters no optimizer updates (manual updates, optimizer=None): read at probe.step().
        rest = watched - held
        self._rest = GradientStats(layers, rest) if rest else None
        self._n_layers = len(layers)
        self._n_trainable = sum(1 for layer in current if layer.trainable)

    # --- optimizer hooks (hooks.OptimizerEvents) ------------------------------------------------
    def on_optimizer_pre(self, key: int, grads_ready: bool = False) -> None:
        """The optimizer ``key``'s step begins. ``grads_ready``: its gradients are the ones the
        update uses (a step without a closure): :meth:`on_grads_ready` follows, entered only
        where it has anything to do (a pass due or forced, the guard)."""
        slot = self._by_key.get(key)
        if slot is None:
            return
        slot.in_step = True
        slot.closure_loss = None
        slot.closure_nonfinite = False
        # The learning rates the update uses (read before a scheduler changes them). Plain
        # floats, nearly always: read here, in the cold moment after the backward, without
        # entering learning_rates().
        lrs: list[float] = []
        for group in slot.optimizer.param_groups:
            lr = group.get("lr")
            if type(lr) is not float:
                lrs = learning_rates(slot.optimizer)  # a tensor, a number of another type
                break
            lrs.append(lr)
        slot.lr = lrs
        if self._amp_skip:
            self._forget_amp_skip()  # an update runs: the skipped one got no probe.step()
        if grads_ready and (
            slot.guard is not None
            or (
                slot.sample is None
                and (self._sample_now or self._forced or self._pending_nonfinite)
            )
        ):
            self.on_grads_ready(key)

    def on_grads_ready(self, key: int) -> None:
        slot = self._by_key.get(key)
        if slot is None:
            return
        nonfinite = False
        # A loss the backward tap read non-finite (a CPU one: no sync) forces the pass.
        loss_nonfinite = slot.closure_nonfinite or self._pending_nonfinite
        if slot.sample is None and (self._sample_now or self._forced or loss_nonfinite):
            # A step not due for sampling whose loss is already non-finite: measured anyway,
            # once, weights too, before this update spreads the NaN (where it began needs it).
            self._forced = not self._sample_now
            before_pass = self._grad_seconds
            sample = self._compute_grads(slot.grads, weights=self._forced)
            pass_seconds = self._grad_seconds - before_pass
            if sample is not None:  # checked once, where it was read (a clip reads it first)
                sample, nonfinite = self._check_host(slot.grads, sample)
            slot.sample = sample
            before_extras = self._grad_seconds
            if self._sample_now and slot.updates is not None and not slot.measuring:
                self._begin_updates(slot, pass_seconds)
            if self._sample_now and slot.histograms is not None:
                self._count_histograms(slot, pass_seconds)
            marks = self._grad_marks
            if marks is not None and self._grad_seconds != before_extras:
                # The weight copy and the histograms ran on the device right after the pass:
                # their kernels are the probe's device time too (a GPU-bound step's cost).
                self._grad_marks = (marks[0], self._cuda_mark(), *marks[2:])
        if slot.guard is not None:
            # One sync per update, the price of keeping the model intact (README). Timed whole,
            # as a pass is: a read of every gradient, not the hooks' few cold lines.
            t0 = perf()
            skip = slot.guard.check_and_skip()
            self._grad_seconds += perf() - t0
            if skip:
                if self._skipped_layers is None:
                    self.skipped_steps += 1
                    self._skipped_layers = SkippedUpdate(self.skipped_steps)
                self._skipped_layers.extend(slot.guard.nonfinite_layers)
                self._find_forward_origin()
        elif nonfinite:
            # On the CPU the norms are already computed: checking them costs no sync. A
            # non-finite one: re-run the forward now, before this update spreads NaN.
            self._find_forward_origin()

    @torch.compiler.disable  # eager, where dynamo traces a compiled optimizer.step()
    def _begin_updates(self, slot: OptimizerSlot, pass_seconds: float) -> None:
        """Copy the weights this update is about to change, for its layers' update ratios, if
        they are due (their cost is bounded by the passes': UpdateRatios.due); the copy is
        bounded (update_ratio.COPY_BYTES) and timed whole, as the pass is."""
        updates = slot.updates
        if updates is None or not updates.due(pass_seconds):
            return
        try:
            self._grad_seconds += updates.begin()
            slot.measuring = True
        except torch.OutOfMemoryError:
            # The copy did not fit beside the job's own tensors: never again in this run (the
            # next one might fail the job's own allocation instead).
            slot.updates = None
            self.report_once(
                "update-ratio-memory",
                "update ratios off: copying the weights for them ran out of device memory "
                "(training goes on)",
            )

    @torch.compiler.disable  # eager, where dynamo traces a compiled optimizer.step()
    def _count_histograms(self, slot: OptimizerSlot, pass_seconds: float) -> None:
        """Count this turn's layers' weight and gradient histograms, before the update, if they
        are due (their cost is bounded by the passes': LayerHistograms.due); timed whole, as
        the pass is. A failure turns them off for the run, never the step."""
        histograms = slot.histograms
        if histograms is None or not histograms.due(pass_seconds):
            return
        try:
            slot.histogram_result, took = histograms.compute()
            self._grad_seconds += took
        except Exception as exc:  # out of device memory, an odd tensor: said once
            slot.histograms = slot.histogram_result = None
            self.report_once(
                "histograms",
                f"histograms off: counting them failed ({type(exc).__name__}: "
                f"{str(exc)[:120]}; training goes on)",
            )
            return
        if histograms.sparse_seen:
            histograms.sparse_seen = False
            self.report_once(
                "histograms-sparse",
                "histograms: sparse gradients are not counted (their layers' weights are)",
            )

    def _check_host(self, stats: GradientStats, sample: GradSample) -> tuple[GradSample, bool]:
        """(the sample, whether it is non-finite) for a gradient pass whose values are on the
        host (CPU): checking them costs no sync. A NaN or Inf: the weights are read now too,
        before the update (where it began), and the layers whose weights code other than the
        optimizer changed since the last pass are noted. A device pass: as it is, False."""
        if not sample.host_nonfinite():
            return sample, False
        changed = stats.changed_layers()
        if changed is not None:
            self._changed_layers = sorted({*(self._changed_layers or ()), *changed})
        return stats.with_weights(sample), True

    def _find_forward_origin(self) -> None:
        captured = self.captured()
        if captured is not None and self._forward_origin is None:
            module, args, kwargs = captured
            t0 = perf()  # a whole forward, timed whole (as a gradient pass is)
            self._forward_origin = find_forward_origin(module, args, kwargs)
            self._grad_seconds += perf() - t0

    # Kept as a name: the gradient pass of the first optimizer (tests patch it to fail).
    def on_optimizer_step(self) -> None:
        if self._slots:
            self.on_grads_ready(self._slots[0].key)

    def on_clip(self, parameters: list[Any], max_norm: float, total_norm: Any) -> None:
        if not parameters or self._clip is not None:
            return
        # Which watched parameter sets this clip covers, worked out once per list of
        # parameters: loops clip model.parameters() on every step, and a set of every
        # parameter's id there, right after the backward, cost a Python loop per step.
        key = tuple(map(id, parameters))  # built and compared in C: no Python loop
        covered = self._clip_covers
        if covered is None or covered[0] != key:
            ids = {id(p) for p in parameters}
            slots = [slot.key for slot in self._slots if ids & slot.grads.param_ids]
            covered = self._clip_covers = (
                key,
                slots,
                bool(self._rest and ids & self._rest.param_ids),
            )
        _, slots, covers_rest = covered
        mine = bool(slots)
        for slot_key in slots:
            # Before clip_grad_norm_ scales them: the norms users need to see explode.
            self.on_grads_ready(slot_key)
        rest = self._rest
        if rest is not None and covers_rest:
            mine = True
            if self._rest_sample is None and (self._sample_now or self._pending_nonfinite):
                forced = not self._sample_now
                self._forced = self._forced or forced
                sample = self._compute_grads(rest, weights=forced)  # unclipped, as above
                if sample is not None:  # checked before the loop's own update of them
                    sample, _ = self._check_host(rest, sample)
                self._rest_sample = sample
        if mine:
            self._clip = (as_number(max_norm), total_norm)

    # --- the gradient pass ---------------------------------------------------------------------
    def _compute_grads(self, stats: GradientStats, weights: bool = False) -> GradSample | None:
        """One gradient pass. ``weights``: read the weights' norms too (a step already known
        to be non-finite). On the CPU they are otherwise read only when the pass finds a NaN
        or Inf (:meth:`_check_host`, no sync); on a device, where that check would need a sync,
        every pass reads them in its one fused call."""
        if not stats.n_params:
            return None
        t0 = perf()
        before = self._cuda_mark() if self._cuda_device is not None else None
        sample = stats.compute(weights or stats.device.type != "cpu")
        if self._cuda_device is None and self.grad_every != 1:
            # Steps in between go unmeasured: what tells, at the next pass, an update's NaN
            # from a weight set to NaN by other code (a memory read a parameter; CPU runs,
            # where a non-finite loss forces a pass).
            stats.note_versions()
        if before is not None:
            # Host time is only the launch cost on a GPU: the probe thread times the kernels
            # with these events and reports back (on_grad_device_time).
            after = self._cuda_mark()
            marks = self._grad_marks
            self._grad_marks = (before, after) if marks is None else (marks[0], after, *marks[2:])
        self._grad_seconds += perf() - t0
        if stats.replanned:  # a replanning pass also built index tensors: not typical
            self._replanned = True
        return sample

    def _take_samples(self, force_rest: bool = False, weights: bool = False) -> GradSample | None:
        """This step's gradient sample: each optimizer's, read now for one that did not read
        its own (an optimizer that did not step, manual updates), joined into one row.
        ``force_rest``: read the parameters no optimizer updates even if not due; ``weights``:
        read the weights too (a step known to be non-finite)."""
        weights = weights or self._forced
        samples: list[tuple[GradientStats, GradSample]] = []
        due = self._sample_now or self._forced
        for slot in self._slots:
            sample, slot.sample = slot.sample, None
            if sample is None and due:
                try:
                    sample = self._compute_grads(slot.grads, weights)
                except Exception as exc:  # a failed gradient pass must not cost the loss
                    self._count_error(exc)
                if sample is not None and len(sample.missing) >= len(slot.grads.layer_indices):
                    # The optimizer did not step and zero_grad already ran: no gradient at
                    # all is not "no gradient reached every layer".
                    sample = None
                if sample is not None:
                    sample, _ = self._check_host(slot.grads, sample)
            if sample is not None:
                samples.append((slot.grads, sample))
        rest_sample, self._rest_sample = self._rest_sample, None
        if rest_sample is None and self._rest is not None and (due or force_rest):
            try:
                rest_sample = self._compute_grads(self._rest, weights or force_rest)
                if rest_sample is not None:
                    rest_sample, _ = self._check_host(self._rest, rest_sample)
            except Exception as exc:
                self._count_error(exc)
        if rest_sample is not None and self._rest is not None:
            samples.append((self._rest, rest_sample))
        if not samples or not self._n_layers:
            return None
        if any(s.weights for _, s in samples) and not all(s.weights for _, s in samples):
            # One optimizer's pass found a NaN and read its weights: the others' too, so that
            # the step's row says which layers' weights were non-finite (a rare step).
            samples = [(stats, stats.with_weights(s)) for stats, s in samples]
        return GradSample.join([s for _, s in samples])

    def sampled_this_step(self) -> bool:
        """Some of this step's gradients were read already (before its ``probe.step()``)."""
        return self._rest_sample is not None or any(s.sample is not None for s in self._slots)
