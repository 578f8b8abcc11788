"""Manual SGD updates, no torch.optim optimizer; nothing here knows about tdbg (ZC_WATCH aside)."""

from __future__ import annotations

import torch
from torch import nn
from zc_common import hold, watch_if_asked


def main() -> None:
    torch.manual_seed(1)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    probe = watch_if_asked(model, None)
    x, y = torch.randn(48, 6), torch.randint(0, 3, (48,))
    for _ in range(25):
        model.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p.sub_(0.1 * p.grad)
        if probe is not None:
            probe.step(loss)
    print(f"final loss {loss.item():.6f}")
    hold()


if __name__ == "__main__":
    main()
