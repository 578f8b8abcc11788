"""One-line integrations with training frameworks; each watches the run from inside the trainer.

- PyTorch Lightning (``lightning`` or ``pytorch_lightning``)::

      from tdbg.integrations.lightning import TdbgCallback
      trainer = L.Trainer(callbacks=[TdbgCallback()])

- Hugging Face ``transformers.Trainer``::

      from tdbg.integrations.huggingface import TdbgCallback
      trainer = Trainer(..., callbacks=[TdbgCallback()])

Each callback calls ``tdbg.watch()`` when training starts and ``probe.step()`` once per optimizer
update, and feeds the framework's own logged metrics, epoch and total steps to the probe.
Keyword arguments are ``watch()``'s (``name=``, ``record=``, ``grad_every=``, ...).

Importing this package, or either module, imports neither the framework nor torch: the
callback class is built, on the framework's own ``Callback`` base, the first time it is used.
Accelerate needs no integration: call ``watch()`` on the unwrapped model (see README.md).
"""

from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = ("huggingface", "lightning")


def __getattr__(name: str) -> ModuleType:
    # ``import tdbg.integrations`` then ``tdbg.integrations.lightning.TdbgCallback()``.
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
