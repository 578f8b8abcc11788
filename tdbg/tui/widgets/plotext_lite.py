"""plotext without the documentation browser that plotext 6 builds at import."""

from __future__ import annotations

import sys
import types

# plotext's __init__ ends with ``from plotext._doc.doc import docs as doc``: that module imports
# some forty section files and formats every docstring (~70 ms here, before the first frame).
# tdbg never opens plotext's interactive docs, so an empty module stands in for it; with a
# plotext that has no such module, the entry is never looked up.
if "plotext" not in sys.modules:
    _docs = types.ModuleType("plotext._doc.doc", "plotext's documentation browser: not loaded")
    _docs.docs = None  # type: ignore[attr-defined]
    sys.modules.setdefault("plotext._doc.doc", _docs)

import plotext

__all__ = ["plotext"]
