"""SocketSource.arrived: what a live run sent on attaching, read before the first frame, and
the reader carrying on from there with nothing lost or read twice."""

from __future__ import annotations

import select
from pathlib import Path

import numpy as np
from demo_job import demo_job
from waiting import wait_until

from tdbg.connect.client import ProbeClient
from tdbg.model.run_state import RunState
from tdbg.tui.sources.base import SocketSource


def test_arrived_then_batches_read_every_step_once(runtime_dir: Path) -> None:
    with demo_job("mlp", "--delay", "0.002", "--steps", "100000", runtime=runtime_dir) as (
        proc,
        entry,
    ):
        # A first look, until the run has taken steps: its history then holds some.
        looker = ProbeClient.connect(entry.socket)
        wait_until(
            lambda: any(m.get("type") == "steps" for m in looker.messages(timeout=0.5)),
            what="the run's first steps",
        )
        looker.close()
        client = ProbeClient.connect(entry.socket)
        source = SocketSource(client=client)
        try:
            # The history the probe sends on attaching is in the socket (an event, not a sleep).
            wait_until(lambda: select.select([client.sock], [], [], 0.05)[0], what="history")
            first = source.arrived()
            kinds = {m.get("type") for m in first}
            assert {"layers", "steps"} <= kinds
            state = RunState(dict(source.run))
            state.apply_many(first)
            assert state.n_steps > 0
            arrived_steps = state.n_steps
            for batch in source.batches():
                state.apply_many(batch)
                if state.n_steps > arrived_steps + 50:
                    break
            steps = state.steps.values
            assert np.all(np.diff(steps) == 1), "a step lost or read twice"
        finally:
            source.close()
            proc.terminate()


def test_nothing_arrived_from_a_source_without_a_client(tmp_path: Path) -> None:
    assert SocketSource(path=tmp_path / "none.sock").arrived() == []
