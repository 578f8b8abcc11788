"""tdbg.integrations.huggingface: a real transformers Trainer on CPU, and what the probe recorded.

Each run records to a file (``record=``, no socket) and the test reads the recording after
``train()``, against references the test computes itself: every micro-batch's loss read inside
the model's forward, the linear schedule's formula, an optimizer post-hook. No downloads: the
models are a plain module and a GPT-2 built from a tiny config."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _recorded(path: Path) -> tuple[list[Any], list[tuple[int, str, float]], list[dict]]:
    """(step records, metric points, probe messages) of a recording."""
    from tdbg.protocol.steps import unpack_steps
    from tdbg.recording.reader import Recording

    messages = list(Recording(path).messages())
    records = [r for m in messages if m.get("type") == "steps" for r in unpack_steps(m)]
    points = [tuple(p) for m in messages if m.get("type") == "metrics" for p in m["points"]]
    probes = [m for m in messages if m.get("type") == "probe"]
    return records, points, probes


class Regression(nn.Module):
    """A tiny MLP as a Trainer model: a dict with ``loss``; remembers each micro-batch's loss."""

    main_input_name = "x"  # what the Trainer counts as tokens

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.micro: list[float] = []  # training forwards, in order
        self.evals: list[float] = []  # evaluation forwards, in order

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        loss = F.mse_loss(out, labels)
        (self.micro if self.training else self.evals).append(loss.item())
        return {"loss": loss, "logits": out}


def _rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def _args(tmp_path: Path, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "num_train_epochs": 2,
        "learning_rate": 0.1,
        "lr_scheduler_type": "linear",
        "optim": "sgd",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    options.update(kwargs)
    return transformers.TrainingArguments(**options)


METRICS_SECONDS = 0.3  # what compute_metrics takes (slept): after the last eval forward


def _slow_metrics(prediction: Any) -> dict[str, float]:
    time.sleep(METRICS_SECONDS)
    return {}


@pytest.mark.parametrize("accumulate", [1, 3])
def test_trainer_one_step_per_update_with_the_mean_loss(
    runtime_dir: Path, tmp_path: Path, accumulate: int
) -> None:
    from tdbg.integrations.huggingface import TdbgCallback

    path = tmp_path / "run.tdbg"
    callback = TdbgCallback(record=path, serve=False, grad_every=1)
    model = Regression()
    trainer = transformers.Trainer(
        model=model,
        args=_args(
            tmp_path,
            gradient_accumulation_steps=accumulate,
            eval_strategy="epoch",
            include_num_input_tokens_seen="all",
        ),
        train_dataset=_rows(32, 1),  # 8 batches of 4 an epoch
        eval_dataset=_rows(8, 2),
        callbacks=[callback],
        compute_metrics=_slow_metrics,
    )
    updates: list[int] = []
    trainer.create_optimizer()
    trainer.optimizer.register_step_post_hook(lambda *_: updates.append(1))
    trainer.train()
    assert callback.probe is None  # closed at the end of training

    sizes = [accumulate] * (8 // accumulate) + ([8 % accumulate] if 8 % accumulate else [])
    windows = []
    start = 0
    for _epoch in range(2):
        for size in sizes:
            windows.append(model.micro[start : start + size])
            start += size
    assert start == len(model.micro) == 16
    n = len(windows)

    records, points, probes = _recorded(path)
    assert len(records) == len(updates) == n == trainer.state.global_step
    assert [r.step for r in records] == list(range(n))
    assert [r.loss for r in records] == pytest.approx([sum(w) / len(w) for w in windows])
    assert [r.micro_batches for r in records] == [len(w) for w in windows]
    assert [r.tokens for r in records] == [16.0 * len(w) for w in windows]  # 4 x 4 a batch
    assert [r.epoch for r in records] == [0] * len(sizes) + [1] * len(sizes)
    # The linear schedule: update k used 0.1 * (n - k) / n (in both of the Trainer's param
    # groups: with and without weight decay).
    assert [r.lr for r in records] == [[pytest.approx(0.1 * (n - k) / n)] * 2 for k in range(n)]
    assert all(r.grad_norms is not None and all(v > 0 for v in r.grad_norms) for r in records)
    assert any(m.get("total_steps") == n for m in probes)

    def metric(name: str) -> list[tuple[int, float]]:
        return [(s, v) for s, m, v in points if m == name]

    # The Trainer's own logs, at the step they describe.
    assert metric("loss") == [(k, pytest.approx(sum(w) / len(w))) for k, w in enumerate(windows)]
    assert metric("learning_rate") == [(k, pytest.approx(r.lr[0])) for k, r in enumerate(records)]
    # max_grad_norm=1.0: the Trainer's grad_norm is the norm its clip measured, as the probe's.
    assert metric("grad_norm") == [(k, pytest.approx(r.clip_norm)) for k, r in enumerate(records)]
    evals = [sum(model.evals[i : i + 2]) / 2 for i in (0, 2)]  # two eval batches an epoch
    assert metric("eval_loss") == [
        (len(sizes) - 1, pytest.approx(evals[0])),
        (n - 1, pytest.approx(evals[1])),
    ]
    assert [s for s, _ in metric("train_loss")] == [n - 1]  # the run's summary, at its end
    # The first epoch's evaluation (forwards without grad, then its metrics) is the next
    # step's no-grad phase, not a wait on data; no other step has one.
    assert [r.no_grad_time > 0 for r in records] == [k == len(sizes) for k in range(n)]
    assert records[len(sizes)].no_grad_time >= METRICS_SECONDS
    assert records[len(sizes)].data_time < METRICS_SECONDS


def test_a_tiny_gpt2_from_its_config_trains_watched(runtime_dir: Path, tmp_path: Path) -> None:
    """A model that normalises its loss by the window's token count (num_items_in_batch): the
    step's loss is what the Trainer logs as the step's loss."""
    from tdbg.integrations.huggingface import TdbgCallback

    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (12, 8), generator=gen)
    rows = [{"input_ids": ids[i], "labels": ids[i]} for i in range(12)]  # 6 batches of 2
    path = tmp_path / "gpt2.tdbg"
    trainer = transformers.Trainer(
        model=model,
        args=_args(
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_train_epochs=1,
            learning_rate=1e-3,
            optim="adamw_torch",
        ),
        train_dataset=rows,
        callbacks=[TdbgCallback(record=path, serve=False, grad_every=1)],
    )
    trainer.train()
    records, points, probes = _recorded(path)
    logged = [v for _, n, v in points if n == "loss"]
    assert len(records) == len(logged) == trainer.state.global_step == 3
    assert [r.loss for r in records] == pytest.approx(logged, rel=1e-5)
    assert [r.micro_batches for r in records] == [2, 2, 2]
    assert any(m.get("total_steps") == 3 for m in probes)
    assert all(r.grad_norms is not None for r in records)
    assert all(v == v for r in records for v in r.grad_norms)


def test_a_watch_that_fails_never_stops_training(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tdbg
    from tdbg.integrations.huggingface import TdbgCallback

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no probe today")

    monkeypatch.setattr(tdbg, "watch", broken, raising=False)
    callback = TdbgCallback()
    model = Regression()
    trainer = transformers.Trainer(
        model=model,
        args=_args(tmp_path, num_train_epochs=1),
        train_dataset=_rows(8, 1),
        callbacks=[callback],
    )
    trainer.train()
    assert trainer.state.global_step == 2 and callback.probe is None
