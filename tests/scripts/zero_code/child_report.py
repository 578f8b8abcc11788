"""A script's helper process: reports the TDBG_* variables it got and whether a probe started."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    seen: dict[str, object] = {
        "env": {k: v for k, v in os.environ.items() if k.startswith("TDBG_")},
    }
    if os.environ.get("ZC_CHILD_TRAINS") == "1":
        import torch
        from torch import nn

        import tdbg

        model = nn.Linear(3, 1)
        torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(5, 3)).sum().backward()
        auto = sys.modules.get("tdbg.probe.zero_code.autowatch")
        seen["preloaded"] = auto is not None
        seen["claimed"] = getattr(auto, "_auto", None) is not None
        # An evaluation script that watches itself: it must not record into the run's file.
        probe = tdbg.watch(model, serve=False)
        seen["recording"] = probe.recording_path
        probe.close()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
