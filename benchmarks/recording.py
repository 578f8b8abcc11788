"""Step-time cost of recording (``watch(record=...)``) against the same probe without it.

Three arms share one model and are run in interleaved blocks (so drift on a shared machine hits
them alike): ``probe`` (watch(), serving, the baseline), ``probe again`` (the same, to show the
machine's noise) and ``probe + record`` (watch(record=PATH)). Each block runs ``--steps`` steps;
the figure is the median step time of each block, and the ratio of each arm's median of block
medians to the baseline's. Also reports the recording's size per step and the time to load it
into the replay timeline and to move the replay cursor. Runs in about a minute.

    python benchmarks/recording.py [--rounds 5] [--steps 400] [--grad-every 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tdbg
from tdbg.model.timeline import Timeline
from tdbg.probe.serving.recorder import Recorder
from tdbg.recording.reader import Recording

ARMS = ("probe", "probe again", "probe + record")
SPENT = [0.0]  # seconds inside the recorder's methods (on the probe thread), all blocks


def _timed(method: Callable[..., None]) -> Callable[..., None]:
    def wrapper(*args: object, **kwargs: object) -> None:
        t0 = time.perf_counter()
        try:
            method(*args, **kwargs)
        finally:
            SPENT[0] += time.perf_counter() - t0

    return wrapper


for _name in ("open", "add", "add_steps", "add_thinned", "maybe_flush", "close"):
    setattr(Recorder, _name, _timed(getattr(Recorder, _name)))


def model_and_data() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(64, 256), torch.randn(64, 256)


def block(arm: str, steps: int, grad_every: int | None, directory: Path, n: int) -> list[float]:
    model, opt, x, y = model_and_data()
    record = directory / f"bench-{n}.tdbgrec" if arm == "probe + record" else None
    probe = tdbg.watch(model, opt, grad_every=grad_every, record=record)
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            probe.step(loss)
            times.append(time.perf_counter() - t0)
    finally:
        probe.close()
    return times[steps // 10 :]  # the first steps warm caches and the probe's plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--grad-every", type=int, default=None, help="default: auto (budget)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="tdbg-bench-") as tmp:
        os.environ.setdefault("TDBG_RUNTIME_DIR", tmp)
        os.chmod(tmp, 0o700)
        directory = Path(tmp)
        n = 0
        for r in range(args.rounds):
            order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                n += 1
                medians[arm].append(
                    statistics.median(block(arm, args.steps, args.grad_every, directory, n))
                )
        base = statistics.median(medians["probe"])
        cpu = platform.processor() or platform.machine()
        every = args.grad_every or "auto"
        print(
            f"{time.strftime('%Y-%m-%d %H:%M')} · {platform.node()} · {cpu} · "
            f"{os.cpu_count()} CPUs · torch {torch.__version__} · grad_every {every}"
        )
        print(f"{args.rounds} rounds x {args.steps} steps per arm, interleaved; median step time")
        for arm in ARMS:
            med = statistics.median(medians[arm])
            spread = ", ".join(f"{m / base:.3f}" for m in medians[arm])
            print(f"  {arm:<16} {med * 1e3:7.3f} ms   x{med / base:.3f}   (blocks: {spread})")
        recorded_steps = args.rounds * args.steps
        print(
            f"recorder's own time on the probe thread: {SPENT[0] / recorded_steps * 1e6:.1f} µs "
            f"per step ({SPENT[0] * 1e3:.1f} ms for {recorded_steps} steps)"
        )
        files = sorted(directory.glob("bench-*.tdbgrec"))
        size = files[-1].stat().st_size
        print(
            f"recording: {size / args.steps:.0f} bytes/step ({size} bytes for {args.steps} steps)"
        )
        # Replay side: load a long synthetic recording and time cursor moves.
        from tdbg.protocol.framing import pack
        from tdbg.protocol.steps import pack_steps
        from tdbg.tui.sources.synthetic import RUN, layer_names, step_records

        long_path = directory / "long.tdbgrec"
        rec = Recorder(long_path, dict(RUN), layer_names(24), [1] * 24)
        rec.open()
        for start in range(0, 100_000, 200):
            msg = pack_steps(step_records(start, 200, 24, grad_every=4), 24)
            rec.add_steps(msg, pack(msg))
            rec.flush()
        rec.close()
        t0 = time.perf_counter()
        timeline = Timeline(Recording(long_path))
        load = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(0, len(timeline), len(timeline) // 200):
            timeline.state_at(i)
        move = (time.perf_counter() - t0) / 200
        print(
            f"replay: 100,000 steps x 24 layers ({long_path.stat().st_size >> 20} MiB) load "
            f"{load:.2f} s, state at a cursor {move * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
