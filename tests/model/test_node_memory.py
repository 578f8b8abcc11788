"""Memory and GPU figures in node summaries: each rank's CUDA allocator (allocated, reserved, peak),
RSS and NVML's GPU (memory used, utilisation) from its latest ``system`` report, over the wire and
into the worst-ranks table's memory and GPU-util cells, as the per-rank table reads a rank; a CPU
rank's GPU figures are none; malformed figures read as None."""

from __future__ import annotations

import msgpack

from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_nodes import NodesJob
from tdbg.model.job_scale import worst_rows
from tdbg.model.job_table import rank_rows
from tdbg.model.node_reduce import reduce_node
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.node_summary import NodeSummary
from tdbg.protocol.messages.reports import CudaStats, GpuStats, HostStats, System

GIB = 2**30


def rank_state(rank: int, gpu: bool, more: int = 1) -> RunState:
    device = f"cuda:{rank % 2}" if gpu else "cpu"
    state = RunState({"name": "t", "rank": rank, "world_size": 4, "job": "j", "device": device})
    host = HostStats(rss=3 * GIB + rank)
    if gpu:  # two GPUs on the node: the rank's own is cuda:(rank % 2)
        cuda = (CudaStats(rank % 2, "H100", 10 * GIB * more, 12 * GIB * more, 11 * GIB * more),)
        gpus = tuple(
            GpuStats(i, "H100", 90.0 - 50 * (more > 1 and i == rank % 2), (14 + i) * GIB, 80 * GIB)
            for i in range(2)
        )
        state.apply(System(1.0, host, cuda, gpus).to_wire())
    else:
        state.apply(System(1.0, host, missing=("GPU: NVML not available",)).to_wire())
    return state


def over_the_wire(states: dict[int, RunState]) -> NodesJob:
    nodes = NodesJob("j")
    wire = msgpack.unpackb(msgpack.packb(reduce_node("n0", "j", states).to_wire()))
    summary = NodeSummary.from_wire(wire)
    assert summary is not None
    nodes.update("n0", summary)
    return nodes


def test_each_ranks_memory_and_gpu_arrive_with_its_own_gpu() -> None:
    states = {r: rank_state(r, gpu=True, more=2 if r == 3 else 1) for r in range(4)}
    nodes = over_the_wire(states)
    three, zero = nodes.figures[3], nodes.figures[0]
    assert (three.allocated, three.reserved, three.peak) == (20 * GIB, 24 * GIB, 22 * GIB)
    assert (zero.allocated, zero.reserved, zero.peak) == (10 * GIB, 12 * GIB, 11 * GIB)
    assert three.rss == 3 * GIB + 3 and three.on_gpu
    # rank 3 trains on cuda:1: its GPU's memory and utilisation, not cuda:0's
    assert (three.gpu_mem, three.gpu_util) == (15 * GIB, 40.0)
    assert (zero.gpu_mem, zero.gpu_util) == (14 * GIB, 90.0)


def test_the_worst_table_reads_them_as_the_per_rank_table_does() -> None:
    states = {r: rank_state(r, gpu=r < 2, more=2 if r == 1 else 1) for r in range(4)}
    nodes = over_the_wire(states)
    alerts = JobAlerts()
    scale = {row.rank: row for row in worst_rows(nodes, alerts)}
    whole = {row.rank: row for row in rank_rows(Job("j", states), alerts)}
    for rank in range(4):
        got, want = scale[rank], whole[rank]
        assert (got.memory, got.gpu_util, got.on_gpu) == (want.memory, want.gpu_util, want.on_gpu)
    assert scale[1].memory == 22 * GIB and scale[1].gpu_util == 40.0
    assert scale[3].memory == 3 * GIB + 3 and scale[3].gpu_util is None and not scale[3].on_gpu


def test_malformed_memory_figures_read_as_none() -> None:
    wire = reduce_node("n0", "j", {0: rank_state(0, gpu=True)}).to_wire()
    wire["ranks"]["peak"] = [-5]
    wire["ranks"]["allocated"] = ["lots"]
    wire["ranks"]["gpu_util"] = [None]
    wire["ranks"]["on_gpu"] = ["yes"]
    summary = NodeSummary.from_wire(wire)
    assert summary is not None
    [figures] = summary.ranks
    assert figures.peak is None and figures.allocated is None and figures.gpu_util is None
    assert figures.reserved == 12 * GIB and not figures.on_gpu
