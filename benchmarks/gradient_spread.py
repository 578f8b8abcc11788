"""How far each layer's largest gradient entry stands above the bulk of its entries on the demo
models, as ``tdbg report`` reads it from the histograms (``tdbg/model/learning.py``): the
largest |gradient| over the edge that 99 % of the non-zero counted entries stay under. Printed
per model: the four layers with the highest median over their counted steps, and their
highest. What the report's ``CONCENTRATED`` threshold (1e3) is set against.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))

import torch  # noqa: E402
from models import MAKERS  # noqa: E402
from per_model import run_over_models  # noqa: E402

import tdbg  # noqa: E402
from tdbg.model.learning import bulk_edge  # noqa: E402
from tdbg.model.recordings import load_run  # noqa: E402
from tdbg.probe.training import histograms  # noqa: E402


def spread(name: str, steps: int) -> None:
    task = MAKERS[name](seed=0)
    path = Path(tempfile.mkdtemp()) / f"{name}.tdbg"
    probe = tdbg.watch(task.model, task.optimizer, serve=False, record=path, grad_every=2)
    for _ in range(steps):
        inputs, targets = task.batch()
        task.optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(task.model(inputs), targets)
        loss.backward()
        task.optimizer.step()
        probe.step(loss.detach())
    probe.close()
    state = load_run(path)
    rows = []
    for layer in state.distributions.layers():
        ratios = sorted(
            c.max / edge
            for c in state.distributions.series(layer, "grads")
            if (edge := bulk_edge(c.counts)) is not None
        )
        if ratios:
            rows.append((ratios[len(ratios) // 2], ratios[-1], len(ratios), layer))
    rows.sort(reverse=True)
    shown = ", ".join(
        f"{state.layer_names[layer]} {median:.2g}x (max {top:.2g}x, {n} steps)"
        for median, top, n, layer in rows[:4]
    )
    print(f"{name:<12} {shown}")


def main(argv: list[str] | None = None) -> int:
    torch.set_flush_denormal(True)
    histograms.HISTOGRAM_SHARE = 1e9  # every sampled step counted: the figure, not the cost
    return run_over_models(
        __doc__,
        spread,
        list(MAKERS),
        default_models="mlp,transformer,cnn",
        steps=120,
        steps_help="steps per model",
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main())
