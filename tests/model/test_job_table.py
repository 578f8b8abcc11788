"""The rank table's order and the job's line, from synthetic per-rank streams."""

from __future__ import annotations

import sys
import time
import types

import pytest
from fake_nvml import fake_pynvml
from test_job_alerts import feed, job_of, stall

from tdbg.model.health import assess
from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_table import rank_rows, summarize
from tdbg.probe.serving.system import SystemSampler
from tdbg.protocol.messages import alert_message
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.widgets.rank_table import COLUMNS, RankTable


def test_worst_first_a_hang_then_a_straggler_then_the_slowest() -> None:
    job, alerts = job_of(4), JobAlerts()
    for step in range(40):  # rank 3 straggles; rank 1 is a little slower than 0 and 2
        feed(job, alerts, step, {3: 0.040, 1: 0.002})
    assert [r.rank for r in rank_rows(job, alerts)][:2] == [3, 1]
    assert rank_rows(job, alerts)[0].alerts == ["straggler"]
    # Then ranks 0 and 1 wait in collective #9 while rank 2 never entered it: a hang, first.
    job.ranks[0].apply(stall(9, ["0", "default_pg"], "dist.py:1 in all_reduce"))
    job.ranks[1].apply(stall(9, ["0", "default_pg"], "dist.py:1 in all_reduce"))
    job.ranks[2].apply(stall(8, ["0", "default_pg"], "train.py:5 in load"))
    alerts.update(job)
    rows = rank_rows(job, alerts)
    assert [(r.rank, r.alerts) for r in rows][:2] == [(2, ["hang"]), (3, ["straggler"])]


def test_the_job_line_is_the_slowest_rank_and_the_mean_loss() -> None:
    job = job_of(2)
    for rank, state in job.ranks.items():
        records = [
            StepRecord(step=s, time=s * (1.0 + rank), loss=1.0 + rank, step_time=0.1, samples=8)
            for s in range(10 - 3 * rank)
        ]
        state.apply(pack_steps(records, 0))
    summary = summarize(job)
    assert (summary.ranks_seen, summary.world_size, summary.step) == (2, 2, 6)
    assert summary.loss == 1.5
    assert summary.steps_per_sec == 0.5  # rank 1: a step every 2 s holds the job to its pace
    assert summary.samples_per_sec == 160.0  # 80 samples/s on each rank


def test_gpu_util_is_the_ranks_own_gpu_and_na_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's system message from a faked NVML (the library boundary) with two GPUs busy
    at 30 % and 90 %: the rank on cuda:1 reads 90 %, a CPU rank reads n/a."""
    nvml = fake_pynvml(gpus=2)
    busy = {"handle0": 30, "handle1": 90}
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=busy[h], memory=0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    system = SystemSampler().sample()
    job = job_of(2)
    job.ranks[0].run["device"] = "cuda:1"
    job.ranks[1].run["device"] = "cpu"
    for state in job.ranks.values():
        state.apply(system.to_wire())
    rows = {r.rank: r for r in rank_rows(job, JobAlerts())}
    assert (rows[0].on_gpu, rows[0].gpu_util) == (True, 90.0)
    assert (rows[1].on_gpu, rows[1].gpu_util) == (False, None)
    column = COLUMNS.index("GPU util")
    assert RankTable._cells(rows[0])[column].plain == "90%"
    assert RankTable._cells(rows[1])[column].plain == "n/a"


def _live_job(ranks: int, start: float) -> Job:
    """A job whose ranks are attached and stepped 30 times, 0.1 s apart, until ``start``."""
    job = job_of(ranks)
    for state in job.ranks.values():
        state.mark("live")
        records = [
            StepRecord(step=s, time=start - 3.0 + 0.1 * s, loss=1.0, step_time=0.1)
            for s in range(30)
        ]
        state.apply(pack_steps(records, 0))
        state.steps_arrived = start
    return job


def _agree(job: Job, now: float) -> dict[int, tuple[str, str]]:
    """Each rank's row state beside its own screen's verdict (the header's assess)."""
    rows = {r.rank: r.state for r in rank_rows(job, JobAlerts(), now=now)}
    return {
        rank: (rows[rank], assess(s, now, by_arrival=True).word) for rank, s in job.ranks.items()
    }


def test_a_rank_s_row_and_its_own_screen_agree_on_stalled() -> None:
    start = time.time()
    job = _live_job(2, start)
    job.ranks[0].steps_arrived = start + 30.0  # rank 0 kept stepping; rank 1 went quiet
    # Past the one stall rule's limit (5 s for a 0.1 s step), with no alert from the probe.
    assert _agree(job, start + 6.0) == {0: ("live", "live"), 1: ("stalled", "stalled")}
    assert _agree(job, start + 4.0) == {0: ("live", "live"), 1: ("live", "live")}


def test_a_later_alert_does_not_hide_an_open_stall_and_resumed_ends_it() -> None:
    start = time.time()
    job = _live_job(1, start)
    state = job.ranks[0]
    state.apply(stall(9, ["0", "default_pg"], "dist.py:1 in all_reduce"))
    # A row once read only the newest alert: a spike after the stall made it say "live".
    state.apply(alert_message("grad_spike", "warning", 29, "gradient norm jumped", [], start))
    assert _agree(job, start + 1.0) == {0: ("stalled", "stalled")}
    state.apply(alert_message("resumed", "info", 30, "the loop resumed after 4 s", [], start))
    assert _agree(job, start + 1.0) == {0: ("live", "live")}


def test_a_rank_tdbg_run_does_not_watch_is_said_on_the_job_line() -> None:
    """Under `tdbg run` (the ranks name their launcher) a rank still missing 30 s after the
    first rank started is said as `tdbg run` says it on stderr; before, or when no rank names
    a launcher (a script's own watch()), it is only missing."""
    from tdbg.model.unwatched import UNWATCHED_AFTER
    from tdbg.tui.screens.job import _job_line

    job = job_of(2)
    del job.ranks[1]
    rank0 = job.ranks[0].run
    rank0["start_time"] = time.time() - UNWATCHED_AFTER - 1
    assert job.unwatched_line(time.time()) is None
    assert "(missing 1)" in _job_line(job, summarize(job)).plain
    rank0["launcher"] = "mp.spawn"
    words = "rank 1 of 2 is not watched: started by mp.spawn"
    assert job.unwatched_line(time.time()) == words
    assert f"({words})" in _job_line(job, summarize(job)).plain
    assert job.unwatched_line(rank0["start_time"] + 1) is None  # rank 1 may still come
