"""A DCGAN-shaped loop (two models, two optimizers, D steps first) with gradient accumulation
on D; prints each iteration's losses as JSON. tdbg-free: run it under `tdbg run`."""

from __future__ import annotations

import json

import torch
from torch import nn


def main() -> None:
    torch.manual_seed(3)
    torch.set_num_threads(1)
    netG = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    netD = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3)
    optG = torch.optim.SGD(netG.parameters(), lr=1e-2)
    bce = nn.BCEWithLogitsLoss()
    real = torch.randn(16, 2) + 2
    truth = []
    for _ in range(8):
        optD.zero_grad()
        err_real = bce(netD(real), torch.ones(16, 1))
        err_real.backward()
        fake = netG(torch.randn(16, 4))
        err_fake = bce(netD(fake.detach()), torch.zeros(16, 1))
        err_fake.backward()
        optD.step()
        optG.zero_grad()
        err_g = bce(netD(fake), torch.ones(16, 1))
        err_g.backward()
        optG.step()
        truth.append({"D": err_real.item() + err_fake.item(), "G": err_g.item()})
    print(json.dumps(truth))


if __name__ == "__main__":
    main()
