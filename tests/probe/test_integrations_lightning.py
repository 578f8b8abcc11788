"""tdbg.integrations.lightning: a real Lightning Trainer on CPU, and what the probe recorded.

Each run records to a file (``record=``, no socket) and the test reads the recording after
``fit()``: steps, metrics and the probe's progress, against references the test computes itself
(losses read inside ``training_step``, the LR schedule's formula, an optimizer post-hook)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning.pytorch")

REPO = Path(__file__).resolve().parents[2]


def _recorded(path: Path) -> tuple[list[Any], list[tuple[int, str, float]], list[dict]]:
    """(step records, metric points, probe messages) of a recording."""
    from tdbg.protocol.steps import unpack_steps
    from tdbg.recording.reader import Recording

    messages = list(Recording(path).messages())
    records = [r for m in messages if m.get("type") == "steps" for r in unpack_steps(m)]
    points = [tuple(p) for m in messages if m.get("type") == "metrics" for p in m["points"]]
    probes = [m for m in messages if m.get("type") == "probe"]
    return records, points, probes


def _trainer(lightning: Any, callbacks: list[Any], **kwargs: Any) -> Any:
    return lightning.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def _regression(base: type) -> type:
    class Regression(base):
        """A tiny MLP; remembers each training micro-batch's loss and its optimizer updates."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.micro: list[float] = []  # every training_step's loss, in order
            self.val: list[list[float]] = []  # per validation run: its batches' losses
            self.updates = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.micro.append(loss.item())
            self.log("train_mse", loss)
            return loss

        def on_validation_epoch_start(self) -> None:
            if not self.trainer.sanity_checking:
                self.val.append([])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = F.mse_loss(self(x), y)
            if not self.trainer.sanity_checking:
                self.val[-1].append(loss.item())
            self.log("val_loss", loss)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            opt.register_step_post_hook(lambda *_: setattr(self, "updates", self.updates + 1))
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Regression


def _loaders(n_train: int = 32, batch: int = 4) -> tuple[DataLoader, DataLoader]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(n_train, 4, generator=gen), torch.randn(n_train, 1, generator=gen)
    vx, vy = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    return (
        DataLoader(TensorDataset(x, y), batch_size=batch),
        DataLoader(TensorDataset(vx, vy), batch_size=4),
    )


@pytest.mark.parametrize("accumulate", [1, 3])
def test_automatic_optimization_one_step_per_update_with_the_mean_loss(
    runtime_dir: Path, tmp_path: Path, accumulate: int
) -> None:
    from tdbg.integrations.lightning import TdbgCallback

    path = tmp_path / "run.tdbg"
    callback = TdbgCallback(record=path, serve=False, grad_every=1)
    model = _regression(L.LightningModule)()
    train, val = _loaders()  # 8 batches of 4 an epoch
    trainer = _trainer(L, [callback], max_epochs=2, accumulate_grad_batches=accumulate)
    trainer.fit(model, train, val)
    assert callback.probe is None  # closed at the end of training

    # The windows Lightning steps on: `accumulate` batches, and what is left at the epoch's end.
    sizes = [accumulate] * (8 // accumulate) + ([8 % accumulate] if 8 % accumulate else [])
    windows = []
    start = 0
    for _epoch in range(2):
        for size in sizes:
            windows.append(model.micro[start : start + size])
            start += size
    assert start == len(model.micro) == 16

    records, points, probes = _recorded(path)
    assert len(records) == model.updates == len(windows) == trainer.global_step
    assert [r.step for r in records] == list(range(len(windows)))
    assert [r.loss for r in records] == pytest.approx([sum(w) / len(w) for w in windows])
    assert [r.micro_batches for r in records] == [len(w) for w in windows]
    assert [r.samples for r in records] == [4.0 * len(w) for w in windows]
    per_epoch = len(sizes)
    assert [r.epoch for r in records] == [0] * per_epoch + [1] * per_epoch
    # StepLR(step_size=2, gamma=0.5) stepped after every update: update k used 0.1 * 0.5**(k//2).
    assert [r.lr for r in records] == [
        [pytest.approx(0.1 * 0.5 ** (k // 2))] for k in range(len(windows))
    ]
    assert all(r.grad_norms is not None and all(v > 0 for v in r.grad_norms) for r in records)
    assert any(m.get("total_steps") == len(windows) for m in probes)

    # self.log("train_mse") at each step: the window's last micro-batch (what Lightning logs).
    train_mse = [(s, v) for s, n, v in points if n == "train_mse"]
    assert train_mse == [(k, pytest.approx(w[-1])) for k, w in enumerate(windows)]
    # The epoch's validation loss once, at the epoch's last step, as Lightning computed it.
    val_loss = [(s, v) for s, n, v in points if n == "val_loss"]
    assert val_loss == [
        (per_epoch * (e + 1) - 1, pytest.approx(sum(v) / len(v))) for e, v in enumerate(model.val)
    ]


def test_a_validation_between_steps_is_no_grad_time_not_data_wait(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """Lightning validates mid-epoch (``val_check_interval``) between two updates; this
    model's ``validation_step`` calls its layers, not the module the probe hooks, so the
    callback marks where it began and ended: its time is the next step's no-grad phase, and
    what the loop does after it is data."""
    import time

    from tdbg.integrations.lightning import TdbgCallback

    pause = 0.3  # slept in the validation: a floor for its time, not a timed wait
    after = 0.2

    class Validated(_regression(L.LightningModule)):  # type: ignore[misc]
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            if batch_idx == 0 and not self.trainer.sanity_checking:
                time.sleep(pause)
            self.log("val_loss", F.mse_loss(self.net(x), y))

        def on_validation_end(self) -> None:
            if not self.trainer.sanity_checking:
                time.sleep(after)  # after the validation (the callback's end mark): not no-grad

    path = tmp_path / "run.tdbg"
    callback = TdbgCallback(record=path, serve=False)
    train, val = _loaders()  # 8 batches of 4: validated after the 4th and the 8th
    trainer = _trainer(L, [callback], max_epochs=1, val_check_interval=4)
    trainer.fit(Validated(), train, val)
    records, _, _ = _recorded(path)
    assert [r.step for r in records] == list(range(8))
    assert records[4].no_grad_time >= pause
    assert after <= records[4].data_time < pause
    assert [r.no_grad_time for r in records[:4] + records[5:]] == [0.0] * 7


def _gan(base: type) -> type:
    class GAN(base):
        """Manual optimization with two optimizers: generator first, then discriminator."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.generator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 4))
            self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.truth: list[tuple[float, float]] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            fake = self.generator(torch.randn(real.shape[0], 2))
            g_loss = F.softplus(-self.discriminator(fake)).mean()
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            d_real = F.softplus(-self.discriminator(real))
            d_fake = F.softplus(self.discriminator(fake.detach()))
            d_loss = (d_real + d_fake).mean()
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            self.log("g_loss", g_loss)
            self.log("d_loss", d_loss)
            self.truth.append((g_loss.item(), d_loss.item()))

        def configure_optimizers(self) -> Any:
            return [
                torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.05),
            ]

    return GAN


def test_manual_optimization_with_two_optimizers_is_one_step_per_round(
    runtime_dir: Path, tmp_path: Path
) -> None:
    from tdbg.integrations.lightning import TdbgCallback

    path = tmp_path / "gan.tdbg"
    model = _gan(L.LightningModule)()
    gen = torch.Generator().manual_seed(2)
    loader = DataLoader(TensorDataset(torch.randn(12, 4, generator=gen)), batch_size=4)
    trainer = _trainer(L, [TdbgCallback(record=path, serve=False, grad_every=1)], max_epochs=2)
    trainer.fit(model, loader)

    records, points, probes = _recorded(path)
    assert len(records) == len(model.truth) == 6  # 3 batches x 2 epochs; 12 updates
    assert [r.epoch for r in records] == [0, 0, 0, 1, 1, 1]
    assert any(m.get("total_steps") == 6 for m in probes)
    for k, (record, (g_loss, d_loss)) in enumerate(zip(records, model.truth, strict=True)):
        assert record.loss == pytest.approx(g_loss)  # the first optimizer's
        assert record.lr == [pytest.approx(1e-3), pytest.approx(0.05)]
        assert record.micro_batches == 1  # the first optimizer's update: its one backward
        assert record.grad_norms is not None and all(v > 0 for v in record.grad_norms)
        mine = {n: v for s, n, v in points if s == k}
        assert mine["loss/optimizer0"] == pytest.approx(g_loss)
        assert mine["loss/optimizer1"] == pytest.approx(d_loss)
        assert mine["g_loss"] == pytest.approx(g_loss)
        assert mine["d_loss"] == pytest.approx(d_loss)


def test_the_pytorch_lightning_name_works_too(runtime_dir: Path, tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from tdbg.integrations._common import LazyClass
    from tdbg.integrations.lightning import TdbgLightning

    # The class a script that imports only pytorch_lightning gets (the base already imported).
    callback = LazyClass(TdbgLightning, lambda: pl.Callback).get()(record=tmp_path / "r.tdbg")
    assert isinstance(callback, pl.Callback)
    model = _regression(pl.LightningModule)()
    train, _ = _loaders(n_train=16)
    _trainer(pl, [callback], max_epochs=1, accumulate_grad_batches=2).fit(model, train)
    records, _, _ = _recorded(tmp_path / "r.tdbg")
    assert len(records) == model.updates == 2
    assert [r.loss for r in records] == pytest.approx(
        [sum(model.micro[0:2]) / 2, sum(model.micro[2:4]) / 2]
    )


def test_a_failing_watch_never_stops_training(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_log: io.StringIO
) -> None:
    import tdbg
    from tdbg.integrations.lightning import TdbgCallback

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no probe today")

    monkeypatch.setattr(tdbg, "watch", broken, raising=False)
    callback = TdbgCallback()
    model = _regression(L.LightningModule)()
    train, _ = _loaders(n_train=8)
    _trainer(L, [callback], max_epochs=1).fit(model, train)
    assert model.updates == 2 and callback.probe is None
    assert "Lightning callback failed watching the LightningModule" in probe_log.getvalue()
    assert "no probe today" in probe_log.getvalue()


def test_importing_the_integrations_loads_no_framework_and_no_torch() -> None:
    code = (
        "import json, sys, tdbg.integrations, tdbg.integrations.lightning, "
        "tdbg.integrations.huggingface\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & {"torch", "lightning", "pytorch_lightning", "transformers", "accelerate"}


def test_a_client_attached_during_fit_sees_each_step_live(runtime_dir: Path) -> None:
    from conftest import Reader, reader_on

    from tdbg.integrations.lightning import TdbgCallback

    callback = TdbgCallback(grad_every=1)  # serving, as by default
    model = _regression(L.LightningModule)()
    readers: list[Reader] = []

    callback_base: Any = L.Callback  # a module found at run time (importorskip)

    class Attach(callback_base):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            readers.append(reader_on(callback.probe))

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            # Every update of the epoch reaches the client while fit() is still running.
            readers[0].wait(lambda r: len(r.records()) >= model.updates)

    train, _ = _loaders(n_train=16)
    _trainer(L, [callback, Attach()], max_epochs=2, accumulate_grad_batches=2).fit(model, train)
    reader = readers[0]
    reader.wait(lambda r: r.ended)  # closed at the end of training: the stream ends
    run = reader.client.run
    assert run["models"] == ["model"]
    assert [o["name"] for o in run["optimizers"]] == ["optimizer"]
    records = reader.records()
    assert [r.step for r in records] == [0, 1, 2, 3] and model.updates == 4
    assert [r.loss for r in records] == pytest.approx(
        [sum(model.micro[i : i + 2]) / 2 for i in range(0, 8, 2)]
    )
    assert [r.epoch for r in records] == [0, 0, 1, 1]
    train_mse = [
        (s, v) for m in reader.of("metrics") for s, n, v in m["points"] if n == "train_mse"
    ]
    assert train_mse == [(k, pytest.approx(model.micro[2 * k + 1])) for k in range(4)]
    reader.close()


def test_a_gan_s_max_steps_counts_updates_and_its_total_counts_rounds(
    runtime_dir: Path, tmp_path: Path
) -> None:
    from tdbg.integrations.lightning import TdbgCallback

    path = tmp_path / "gan.tdbg"
    model = _gan(L.LightningModule)()
    loader = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4)  # 10 batches
    callback = TdbgCallback(record=path, serve=False)
    # Lightning stops after 8 optimizer updates: 4 batches of two updates each.
    _trainer(L, [callback], max_epochs=3, max_steps=8).fit(model, loader)
    records, _, probes = _recorded(path)
    assert len(records) == len(model.truth) == 4
    assert probes[-1]["total_steps"] == 4
