"""Lightning Trainer(accelerator="cpu", devices=2, strategy=LAUNCH_STRATEGY or "ddp"): its own
launcher re-runs this script for rank 1 (ddp) or spawns/forks the ranks; tdbg-free."""

from __future__ import annotations

import os
import warnings

import common
import lightning as L
import torch

warnings.filterwarnings("ignore")


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = common.model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=os.environ.get("LAUNCH_STRATEGY", "ddp"),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), common.loader(0))


if __name__ == "__main__":
    main()
