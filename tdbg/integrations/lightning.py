"""PyTorch Lightning: ``L.Trainer(callbacks=[TdbgCallback()])`` watches the LightningModule.

What the probe is told, and from where:

- **Watch**: at ``on_train_start`` (after the optimizers exist and the sanity check ran),
  ``tdbg.watch()`` on the LightningModule and ``trainer.optimizers``, with ``total_steps`` from
  ``trainer.estimated_stepping_batches`` (the ETA); closed at ``on_train_end`` or on an
  exception.
- **One step per optimizer update**: an optimizer step post-hook counts real updates; at the
  end of a batch that made one, ``probe.step()``. Under ``accumulate_grad_batches`` that is the
  window's last micro-batch; with manual optimization and several optimizers (a GAN) it is one
  step per batch, whatever number of optimizers stepped in it. A batch whose update GradScaler
  skipped (inf/NaN gradients) is not a step.
- **Loss**: automatic optimization runs ``optimizer.step(closure)`` and backpropagates
  ``loss / accumulate_grad_batches``; the callback sums the (already divided) losses Lightning
  returns for the window's micro-batches — ``outputs["loss"]``, no device sync — and rescales a
  short last window, so a step's loss is the mean micro-batch loss. Manual optimization: the
  probe's own, what ``manual_backward`` backpropagated since the previous step (and each
  optimizer's as ``loss/optimizerN`` metrics).
- **Samples**: the size of dimension 0 shared by the batch's tensors, summed over the window.
- **Metrics**: what the module logs with ``self.log`` (``trainer.callback_metrics``): step
  values after each step, epoch and validation values when Lightning has computed them; each
  value once, under the name Lightning's loggers use (``x_step`` / ``x_epoch`` when both).
- **Epoch**: ``trainer.current_epoch``.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tdbg.integrations._common import FailSafe, LazyClass, innermost


class TdbgLightning(FailSafe):
    """What :class:`TdbgCallback` does; Lightning's ``Callback`` is mixed in when the class is
    first used, so importing this module imports neither Lightning nor torch.

    ``TdbgCallback(**options)``: ``options`` are ``tdbg.watch()``'s (``name=``, ``record=``,
    ``grad_every=``, ...). ``probe`` is the live probe during ``fit``."""

    framework = "Lightning"

    def __init__(self, **watch_options: Any) -> None:
        self.watch_options = watch_options
        self.probe: Any = None
        self._hooks: list[Any] = []
        self._optimizers = 0
        self._updates = 0  # optimizer updates since the last probe.step()
        self._window_ended = False  # Lightning reached an optimizer step in this batch
        self._loss: Any = None  # sum of Lightning's (divided) micro-batch losses in the window
        self._micro = 0  # micro-batches that gave a loss
        self._samples: float | None = None
        self._seen: dict[str, Any] = {}  # metric name -> the value last sent (held: identity)
        self._rounds_known = False  # manual optimization: updates a batch makes, looked at

    # --- Lightning hooks ----------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        try:
            self._start(trainer, pl_module)
        except Exception as exc:
            self._failed("watching the LightningModule", exc)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._live():
            self.probe.set_progress(epoch=trainer.current_epoch)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._window_ended = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._live():
            return
        try:
            self._batch_end(trainer, pl_module, outputs, batch)
        except Exception as exc:
            self._failed("recording a step", exc)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Its forwards may call the LightningModule's layers, not the module the probe hooks:
        # the validation's time is then marked here, not taken for a wait on data.
        if self._live():
            self.probe.note_evaluation()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._live():
            self.probe.note_evaluation_end()
            if not trainer.sanity_checking:
                self._send_metrics(trainer, None)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._live():
            self._send_metrics(trainer, None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._live():
            self._send_metrics(trainer, None)
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop()

    # --- the work -----------------------------------------------------------------------------
    def _start(self, trainer: Any, pl_module: Any) -> None:
        import tdbg

        self._stop()
        optimizers = [innermost(o) for o in trainer.optimizers]
        named = (
            {"optimizer": optimizers[0]}
            if len(optimizers) == 1
            else {f"optimizer{i}": o for i, o in enumerate(optimizers)}
        )
        options = dict(self.watch_options)
        total = _total_steps(trainer)
        if total is not None:
            options.setdefault("total_steps", total)
        watch: Any = tdbg.watch  # takes a dict of named models and optimizers
        self.probe = watch({"model": pl_module}, named or None, **options)
        self._optimizers = len(optimizers)
        self._hooks = [o.register_step_post_hook(self._on_update) for o in optimizers]
        self._rounds_known = False
        self._reset()

    def _batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any) -> None:
        automatic = bool(getattr(pl_module, "automatic_optimization", True))
        if automatic:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if _is_scalar(loss):
                loss = loss.detach()  # type: ignore[union-attr]
                self._loss = loss if self._loss is None else self._loss + loss
                self._micro += 1
        size = _batch_size(batch)
        if size is not None:
            self._samples = size if self._samples is None else self._samples + size
        if self._updates or not self._optimizers:
            loss = None  # manual optimization: what the probe saw backpropagated
            if automatic and self._loss is not None:
                window = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
                # Lightning divides every micro-batch's loss by the window; a short last
                # window (the epoch's end) is rescaled to the mean of the ones it had.
                loss = self._loss if self._micro == window else self._loss * (window / self._micro)
            if not automatic and not self._rounds_known:
                self._rounds_known = True
                self._count_rounds(trainer, self._updates)
            self.probe.step(loss, samples=self._samples)
            self._reset()
            self._send_metrics(trainer, self.probe.steps - 1)
        elif self._window_ended:
            self._reset()  # the update was skipped (GradScaler saw inf/NaN): not a step
        self._window_ended = False

    def _count_rounds(self, trainer: Any, updates: int) -> None:
        """Manual optimization counts ``max_steps`` in optimizer updates (a GAN makes two a
        batch) while a tdbg step is a batch: the total is the rounds ``max_steps`` allows."""
        max_steps = int(getattr(trainer, "max_steps", -1) or -1)
        total = self.probe.total_steps
        if updates > 1 and max_steps > 0 and total is not None:
            self.probe.set_progress(total_steps=min(total, math.ceil(max_steps / updates)))

    def _reset(self) -> None:
        self._updates = 0
        self._loss = None
        self._micro = 0
        self._samples = None

    def _send_metrics(self, trainer: Any, step: int | None) -> None:
        """The values of ``trainer.callback_metrics`` not sent yet. Lightning keeps a value's
        tensor until it is logged again, so a value is new when its storage is (the one sent
        last is held, so its memory cannot be reused meanwhile); nothing is read from it."""
        try:
            metrics = dict(trainer.callback_metrics)
        except Exception as exc:
            self._failed("reading Lightning's metrics", exc)
            return
        fresh: dict[str, Any] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not _is_scalar(value, numbers=True):
                continue
            if not _same(self._seen.get(name), value):
                fresh[name] = value
            self._seen[name] = value
        for name in list(fresh):
            # ``x`` beside ``x_step`` / ``x_epoch`` is the same value: send the name the
            # loggers see (both on_step and on_epoch fork it).
            if any(_same(fresh.get(name + s), fresh[name]) for s in ("_step", "_epoch")):
                del fresh[name]
        if fresh:
            self.probe.log(fresh, step=step)

    # --- lifecycle ------------------------------------------------------------------------------
    def _forget(self) -> None:
        self._seen = {}


def _total_steps(trainer: Any) -> int | None:
    try:
        total = float(trainer.estimated_stepping_batches)
    except Exception:  # no finite length (an IterableDataset without max_steps)
        return None
    return int(total) if math.isfinite(total) and total >= 1 else None


def _is_scalar(value: Any, numbers: bool = False) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return numbers and isinstance(value, int | float) and not isinstance(value, bool)


def _same(old: Any, new: Any) -> bool:
    import torch

    if old is None or new is None:
        return False
    if old is new:
        return True
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        return (
            old.device == new.device
            and old.dtype == new.dtype
            and old.data_ptr() == new.data_ptr()
            and old.data_ptr() != 0
        )
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        return False
    return bool(old == new)


def _batch_size(batch: Any) -> float | None:
    """Dimension 0 shared by the batch's tensors (a tensor, or a tuple, list or dict of them)."""
    import torch

    if isinstance(batch, torch.Tensor):
        items: list[Any] = [batch]
    elif isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, list | tuple):
        items = list(batch)
    else:
        return None
    sizes = {t.shape[0] for t in items if isinstance(t, torch.Tensor) and t.dim() > 0}
    return float(sizes.pop()) if len(sizes) == 1 else None


def _lightning_callback_base() -> type:
    """``Callback`` of the Lightning the script uses: ``lightning.pytorch`` or
    ``pytorch_lightning`` (whichever is imported already; else the one installed)."""
    names = ("lightning.pytorch", "pytorch_lightning")
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            return module.Callback
    try:
        module = importlib.import_module(names[0])
    except ImportError:
        module = importlib.import_module(names[1])
    return module.Callback


_class = LazyClass(TdbgLightning, _lightning_callback_base)


if TYPE_CHECKING:
    TdbgCallback = TdbgLightning
else:
    __getattr__ = _class.module_getattr(__name__)
