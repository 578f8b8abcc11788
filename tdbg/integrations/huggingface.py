"""Hugging Face: ``Trainer(..., callbacks=[TdbgCallback()])`` watches the model being trained.

What the probe is told, and from where:

- **Watch**: at ``on_train_begin`` (the optimizer exists), ``tdbg.watch()`` on the model and
  the torch optimizer under Accelerate's wrapper, with ``total_steps=state.max_steps`` (the
  ETA); closed at ``on_train_end``.
- **One step per optimizer update**: at ``on_step_end`` (the end of each gradient-accumulation
  window), if the optimizer really stepped — an update Accelerate's GradScaler skipped (inf/NaN
  gradients) is not a step.
- **Loss**: the probe's own, what was backpropagated since the previous update. The Trainer
  divides each micro-batch's loss by the number of micro-batches in the window (the last,
  shorter window included), so the step's loss is their mean; a model that normalises by
  ``num_items_in_batch`` itself gives the window's per-token mean.
- **Tokens**: the growth of ``state.num_input_tokens_seen`` when the Trainer counts it
  (``include_num_input_tokens_seen``).
- **Metrics**: every number of every ``on_log`` (``loss``, ``grad_norm``, ``learning_rate``,
  ``eval_*``, ...), under the Trainer's names, at the step just recorded.
- **Epoch**: the whole epochs of ``state.epoch`` at ``on_epoch_begin``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tdbg.integrations._common import FailSafe, LazyClass, innermost


class TdbgHuggingFace(FailSafe):
    """What :class:`TdbgCallback` does; ``transformers.TrainerCallback`` is mixed in when the
    class is first used, so importing this module imports neither transformers nor torch.

    ``TdbgCallback(**options)``: ``options`` are ``tdbg.watch()``'s (``name=``, ``record=``,
    ``grad_every=``, ...). ``probe`` is the live probe during ``train()``."""

    framework = "Hugging Face"

    def __init__(self, **watch_options: Any) -> None:
        self.watch_options = watch_options
        self.probe: Any = None
        self._hooks: list[Any] = []
        self._updates = 0  # optimizer updates since the last probe.step()
        self._tokens_seen: int | None = None

    # --- TrainerCallback events -----------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            self._start(args, state, kwargs.get("model"), kwargs.get("optimizer"))
        except Exception as exc:
            self._failed("watching the model", exc)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._live():
            # state.epoch is fractional (epoch + steps done / steps in it): whole at a start.
            self.probe.set_progress(epoch=math.floor((state.epoch or 0) + 1e-6))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        try:
            tokens = self._tokens(args, state)
            if self._updates or not self._hooks:
                self._updates = 0
                self.probe.step(tokens=tokens)
        except Exception as exc:
            self._failed("recording a step", exc)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not self._live() or not isinstance(logs, Mapping):
            return
        metrics = {
            name: value
            for name, value in logs.items()
            if isinstance(name, str) and _is_number(value)
        }
        if metrics:
            self.probe.log(metrics)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After the evaluation's metrics (compute_metrics): its forwards marked where it began,
        # its end is here; what follows up to the next step's forward is data again.
        if self._live():
            self.probe.note_evaluation_end()

    on_predict = on_evaluate  # Trainer.predict's forwards: an evaluation too

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop()

    # --- the work -------------------------------------------------------------------------------
    def _start(self, args: Any, state: Any, model: Any, optimizer: Any) -> None:
        import tdbg

        self._stop()
        if model is None:
            raise ValueError("the Trainer passed no model")
        inner = innermost(optimizer) if optimizer is not None else None
        options = dict(self.watch_options)
        total = int(getattr(state, "max_steps", 0) or 0)
        if total > 0:
            options.setdefault("total_steps", total)
        watch: Any = tdbg.watch  # takes a dict of named models and optimizers
        self.probe = watch(
            {"model": model}, {"optimizer": inner} if inner is not None else None, **options
        )
        if inner is not None:
            self._hooks = [inner.register_step_post_hook(self._on_update)]
        self._updates = 0
        self._tokens_seen = _tokens_seen(args, state)

    def _tokens(self, args: Any, state: Any) -> int | None:
        seen = _tokens_seen(args, state)
        if seen is None or self._tokens_seen is None:
            return None
        tokens, self._tokens_seen = seen - self._tokens_seen, seen
        return tokens if tokens > 0 else None


def _tokens_seen(args: Any, state: Any) -> int | None:
    if getattr(args, "include_num_input_tokens_seen", "no") in ("no", False, None):
        return None
    seen = getattr(state, "num_input_tokens_seen", None)
    return seen if isinstance(seen, int) and not isinstance(seen, bool) else None


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    numel = getattr(value, "numel", None)  # a one-element tensor
    return callable(numel) and hasattr(value, "dtype") and numel() == 1


def _trainer_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


_class = LazyClass(TdbgHuggingFace, _trainer_callback_base)

if TYPE_CHECKING:
    TdbgCallback = TdbgHuggingFace
else:
    __getattr__ = _class.module_getattr(__name__)
