"""Small models on synthetic data for the demos and benchmarks: tiny, MLP, Transformer, CNN."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]


@dataclass
class Task:
    """A model, its optimizer and a source of fresh synthetic batches.

    ``batch()`` draws a new batch (the data never repeats, so the loss that goes down is learning,
    not memorising). ``tokens`` is the number of tokens per batch for sequence tasks, else None.
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[], Batch]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    batch_size: int
    tokens: int | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def train_step(
        self, inputs: Tensor, targets: Tensor, before_step: Callable[[], object] | None = None
    ) -> Tensor:
        """One ordinary iteration; ``before_step`` runs between backward and optimizer.step()."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(inputs), targets)
        loss.backward()
        if before_step is not None:
            before_step()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss.detach()

    def on_device(self, device: torch.device, batches: int) -> list[Batch]:
        """The model moved to ``device`` (the optimizer holds the same parameters, moved with
        it) and ``batches`` fresh batches there, made first: copying a batch from pageable host
        memory waits for the device, a sync of the loop's own that no timed step should pay."""
        self.model.to(device)
        return [(inputs.to(device), targets.to(device)) for inputs, targets in (
            self.batch() for _ in range(batches))]  # fmt: skip


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- MLP ------------------------------------------------------------------------------------


class Residual(nn.Module):
    """``x + W relu(x) + b``: owns its weight directly, so the probe names it ``body.<i>``."""

    def __init__(self, width: int, scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) * (scale / math.sqrt(width)))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor) -> Tensor:
        return x + F.linear(F.relu(x), self.weight, self.bias)


class MLP(nn.Module):
    """``inp`` -> ``depth - 2`` residual blocks in ``body`` -> ``head``: ``depth`` weight layers."""

    def __init__(self, inputs: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        blocks = depth - 2
        self.inp = nn.Linear(inputs, width)
        # Residual branches scaled by 1/sqrt(blocks) keep the activations O(1) at any depth.
        self.body = nn.Sequential(
            *(Residual(width, 1.0 / math.sqrt(blocks)) for _ in range(blocks))
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.body(self.inp(x))))


def make_mlp(
    *,
    width: int = 512,
    depth: int = 21,
    batch_size: int = 32,
    inputs: int = 64,
    classes: int = 10,
    lr: float = 1e-3,
    seed: int = 0,
) -> Task:
    """A ~5 M-parameter, 21-layer MLP classifying points labelled by a fixed random teacher.

    At batch 32 the step is dominated by reading ~20 MB of weights, gradients and Adam state:
    memory-bound, the case where a gradient pass costs most relative to the step.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    teacher_in = torch.randn(inputs, 64, generator=generator)
    teacher_out = torch.randn(64, classes, generator=generator)

    def batch() -> Batch:
        x = torch.randn(batch_size, inputs, generator=generator)
        y = (torch.tanh(x @ teacher_in) @ teacher_out).argmax(dim=1)
        return x, y

    model = MLP(inputs, width, depth, classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return Task("mlp", model, optimizer, batch, F.cross_entropy, batch_size)


# --- Transformer ----------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Token embedding + learned positions -> causal TransformerEncoder -> LM head."""

    mask: Tensor

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len))

    def forward(self, tokens: Tensor) -> Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.encoder(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def warmup_cosine(warmup: int, cycle: int, floor: float = 0.1) -> Callable[[int], float]:
    """LR factor: linear warm-up, then cosine to ``floor``, restarting every ``cycle`` steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = ((step - warmup) % cycle) / cycle
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

    return factor


def make_transformer(
    *,
    vocab: int = 32,
    seq_len: int = 32,
    d_model: int = 64,
    heads: int = 4,
    layers: int = 3,
    batch_size: int = 32,
    lr: float = 2e-3,
    warmup: int = 100,
    cycle: int = 2000,
    seed: int = 0,
) -> Task:
    """A small causal LM on arithmetic sequences ``x_t = (a + b t) mod vocab``.

    Each sequence has its own random ``a`` and ``b``; the model must infer ``b`` from the first
    tokens, after which every next token is determined: the loss falls from ln(vocab) towards 0.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    positions = torch.arange(seq_len + 1)

    def batch() -> Batch:
        a = torch.randint(0, vocab, (batch_size, 1), generator=generator)
        b = torch.randint(1, vocab, (batch_size, 1), generator=generator)
        seq = (a + b * positions) % vocab
        return seq[:, :-1], seq[:, 1:]

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    model = TinyLM(vocab, d_model, heads, layers, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, cycle))
    return Task(
        "transformer",
        model,
        optimizer,
        batch,
        loss_fn,
        batch_size,
        tokens=batch_size * seq_len,
        scheduler=scheduler,
    )


# --- CNN ------------------------------------------------------------------------------------


class SmallCNN(nn.Module):
    """Two conv blocks and a linear classifier for 1x28x28 images."""

    def __init__(self, classes: int, channels: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * channels, 2 * channels, 3, padding=1)
        self.fc = nn.Linear(2 * channels * 7 * 7, 64)
        self.head = nn.Linear(64, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        return self.head(F.relu(self.fc(x.flatten(1))))


def make_cnn(
    *,
    batch_size: int = 32,
    classes: int = 8,
    size: int = 28,
    lr: float = 1e-3,
    seed: int = 0,
) -> Task:
    """A small CNN on noisy synthetic images: class k is a grating at angle k * 180 / classes."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    coords = torch.linspace(-1, 1, size)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    angles = torch.arange(classes) * (math.pi / classes)

    def batch() -> Batch:
        y = torch.randint(0, classes, (batch_size,), generator=generator)
        theta = angles[y].view(-1, 1, 1) + 0.1 * torch.randn(batch_size, 1, 1, generator=generator)
        phase = 2 * math.pi * torch.rand(batch_size, 1, 1, generator=generator)
        along = xx * torch.cos(theta) + yy * torch.sin(theta)
        images = torch.sin(6 * math.pi * along + phase)
        images = images + 0.8 * torch.randn(batch_size, size, size, generator=generator)
        return images.unsqueeze(1), y

    model = SmallCNN(classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return Task("cnn", model, optimizer, batch, F.cross_entropy, batch_size)


def make_tiny(*, batch_size: int = 8, width: int = 32, lr: float = 1e-2, seed: int = 0) -> Task:
    """Four ``Linear(32, 32)`` at batch 8 (a ~0.3 ms CPU step): the short steps of small models,
    RL and tabular nets, where a probe's fixed microseconds are a large share of the step."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
    target = torch.randn(width, width, generator=generator) / math.sqrt(width)

    def batch() -> Batch:
        x = torch.randn(batch_size, width, generator=generator)
        return x, x @ target

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return Task("tiny", model, optimizer, batch, F.mse_loss, batch_size)


MAKERS: dict[str, Callable[..., Task]] = {
    "tiny": make_tiny,
    "mlp": make_mlp,
    "transformer": make_transformer,
    "cnn": make_cnn,
}
