"""Epochs from the DataLoader's passes: which loader is the training one, and when a pass begins."""

from __future__ import annotations

import weakref
from typing import Any

from tdbg.probe.training.sampler_state import SamplerState


class EpochCounter(SamplerState):
    """The epoch, counted from the training DataLoader's passes (unless the loop gives it)."""

    __slots__ = ()

    def on_loader_iter(self, loader: Any) -> None:
        if self.epoch_given:
            return
        if self._loader is not None and self._loader() is loader:
            self.epoch = (0.0 if self.epoch != self.epoch else self.epoch) + 1.0
            self._iterating = None
            self._pass_batches = 0
            return
        # The dataset by id: a loader made inline (``for x in DataLoader(ds)``) is gone by the
        # first step; its dataset is the script's and stays.
        self.loader_started(weakref.ref(loader), id(getattr(loader, "dataset", None)))

    def loader_started(self, ref: Any, dataset: int) -> None:
        """A DataLoader pass started (its loader's weak reference, its dataset's id): seen by
        the tap, or begun before this probe existed (``tdbg run`` starts it at the first
        backward); the next step decides whether it is the training loader's."""
        if self.epoch_given:
            return
        self._iterating = (ref, dataset)
        self._steps_at_iter = self.step_count

    def _note_loader(self) -> None:
        """At a step, the DataLoader started since the last one: the first that steps follow is
        the training one (its passes are epochs); later, one reading the training dataset
        while the training loader is gone is a new DataLoader made for a new epoch. Others
        (validation, or a pass over the training data while its loader lives) are not."""
        started, self._iterating = self._iterating, None
        if started is None or self.epoch_given:
            return
        ref, dataset = started
        if self._loader is None:
            self._adopt(ref, dataset)
            self.epoch = 0.0
        elif dataset == self._dataset and (
            self._loader() is None
            or (self._pass_length is not None and self._pass_batches >= self._pass_length)
        ):
            self._adopt(ref, dataset)
            self.epoch = (0.0 if self.epoch != self.epoch else self.epoch) + 1.0

    def _adopt(self, ref: Any, dataset: int) -> None:
        """``ref``'s loader is the training one from now on; its pass starts now."""
        self._loader, self._dataset = ref, dataset
        self._pass_batches = 0
        loader = ref()
        try:
            self._pass_length = len(loader) if loader is not None else None
        except Exception:  # an IterableDataset without a length
            self._pass_length = None
