"""Where a process sits in a job, from each launcher's environment (run_info.place)."""

from __future__ import annotations

import pytest

from tdbg.probe import run_info

VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID",
    "SLURM_STEP_ID", "SLURM_LOCALID",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(run_info, "_spawned", {})


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, {}),
        ({"RANK": "3"}, {}),  # a RANK alone is no job
        (  # torchrun, accelerate launch, deepspeed
            {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r9"},
            {"world_size": 2, "job": "r9", "rank": 1, "local_rank": 1},
        ),
        (  # Lightning's launcher: no RANK
            {"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_ADDR": "h",
             "MASTER_PORT": "5"},
            {"world_size": 2, "job": "h:5", "rank": 1, "local_rank": 1},
        ),
        (  # srun
            {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "77",
             "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0"},
            {"world_size": 4, "job": "slurm:77.0", "rank": 2, "local_rank": 0},
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "77"}, {}),
    ],
)  # fmt: skip
def test_place_from_each_launchers_environment(
    env: dict[str, str], expected: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert run_info.place() == expected
    assert run_info.rank() == expected.get("rank", int(env.get("RANK", 0)))


def test_a_spawned_rank_without_a_process_group_has_its_index() -> None:
    run_info.set_spawned(1, 2, "spawn:h:42")
    assert run_info.place() == {"rank": 1, "local_rank": 1, "world_size": 2, "job": "spawn:h:42"}
    assert run_info.rank() == 1
