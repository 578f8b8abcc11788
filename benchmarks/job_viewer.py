"""The job viewer's own cost at scale, without the bridges: the real ``JobApp`` under its Pilot
(headless, 120x40) fed N nodes' summaries twice a second, each packed and decoded from msgpack as
a node link decodes it, built by the bridge's own reducer from synthetic rank states (a slow
rank, a diverged rank, a loss outlier). The process's CPU time over wall time, as a share of one
core; ``--profile`` prints where it goes.

    .venv/bin/python benchmarks/job_viewer.py                      # 1,024 ranks on 128 nodes
    .venv/bin/python benchmarks/job_viewer.py --ranks 64 --nodes 8 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import resource
import sys
import time
from collections.abc import Iterator

import msgpack

from tdbg.model.node_reduce import reduce_node
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.node_summary import NodeSummary
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.app import screen_text
from tdbg.tui.job_app import JobApp
from tdbg.tui.sources.job import JobSource, Notify, RankBatches

LAYERS = ["embed", "fc1", "fc2"]


class Feed(JobSource):
    """Summaries as the benchmark hands them; no rank is ever read whole."""

    def __init__(self) -> None:
        super().__init__("bench-job")
        self.aggregated = True
        self.pending: dict[str, NodeSummary] = {}

    def open(self, notify: Notify) -> None:
        pass

    def batches(self) -> Iterator[RankBatches]:
        while not self.stopped:
            self._stop.wait(0.1)
            yield {}

    def take_summaries(self) -> dict[str, NodeSummary]:
        out, self.pending = self.pending, {}
        return out


def wires(ranks: int, nodes: int, steps: int) -> dict[str, bytes]:
    """Each node's summary after ``steps`` steps, packed as the bridge sends it."""
    per = ranks // nodes
    out = {}
    for k in range(nodes):
        states = {}
        for rank in range(k * per, (k + 1) * per):
            state = RunState({"name": "t", "rank": rank, "world_size": ranks, "job": "bench-job"})
            state.apply({"type": "layers", "names": LAYERS, "numel": [10] * 3})
            records = [
                StepRecord(s, float(s), 1.0 + (3.0 if rank == 9 else 0.0),
                           step_time=0.016 + (0.02 if rank == 21 else 0.0),
                           data_time=0.001 + (0.02 if rank == 21 else 0.0), forward_time=0.01,
                           backward_time=0.005, optimizer_time=0.0,
                           grad_norms=[1.0, 2.0, 3.5 if rank == 42 else 3.0])
                for s in range(steps)
            ]  # fmt: skip
            state.apply(pack_steps(records, 3))
            states[rank] = state
        out[f"node{k:03d}"] = msgpack.packb(
            reduce_node(f"node{k:03d}", "bench-job", states).to_wire()
        )
    return out


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(args: argparse.Namespace) -> None:
    sets = [wires(args.ranks, args.nodes, 40), wires(args.ranks, args.nodes, 60)]
    source = Feed()
    app = JobApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        turn = 0

        def feed() -> None:
            nonlocal turn
            read = {n: NodeSummary.from_wire(msgpack.unpackb(b)) for n, b in sets[turn % 2].items()}
            source.pending = {n: summary for n, summary in read.items() if summary is not None}
            turn += 1

        feed()
        while f"{args.ranks} of {args.ranks} ranks" not in screen_text(app):
            await pilot.pause(0.1)
        profile = cProfile.Profile() if args.profile else None
        c0, w0 = cpu(), time.monotonic()
        if profile is not None:
            profile.enable()
        while time.monotonic() - w0 < args.window:
            feed()
            await pilot.pause(0.5)
        if profile is not None:
            profile.disable()
        share = (cpu() - c0) / (time.monotonic() - w0)
    print(f"{args.ranks} ranks on {args.nodes} nodes, summaries at 2 Hz: the viewer "
          f"{100 * share:.1f} % of a core")  # fmt: skip
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(r"tdbg", 25)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--nodes", type=int, default=128)
    p.add_argument("--window", type=float, default=10.0, help="seconds measured")
    p.add_argument("--profile", action="store_true")
    asyncio.run(measure(p.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
