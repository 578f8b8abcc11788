"""A loop prepared by Hugging Face Accelerate (CPU); tdbg-free. Run by `accelerate launch` or
`python -m torch.distributed.run`."""

from __future__ import annotations

import common
import torch
from accelerate import Accelerator


def main() -> None:
    accelerator = Accelerator(cpu=True)
    model = common.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, data = accelerator.prepare(model, opt, common.loader(accelerator.process_index))
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        accelerator.backward(loss)
        opt.step()
        losses.append(loss.item())
    common.done(accelerator.process_index, losses)


if __name__ == "__main__":
    main()
