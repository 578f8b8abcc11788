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


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["/venv/bin/torchrun", "--nproc_per_node=2", "train.py"], "torchrun"),
        (["python", "-m", "torch.distributed.run", "train.py"], "torchrun"),
        (["python", "-m", "torch.distributed.launch", "train.py"], "torch.distributed.launch"),
        (["/venv/bin/accelerate", "launch", "train.py"], "accelerate launch"),
        (["python", "-m", "accelerate.commands.launch", "train.py"], "accelerate launch"),
        # deepspeed cannot be installed here: its two launchers are recognised by argv only.
        (["/venv/bin/deepspeed", "--num_gpus=2", "train.py"], "deepspeed"),
        (["python", "-u", "-m", "deepspeed.launcher.launch", "train.py"], "deepspeed"),
        (["python", "train.py"], None),
        (["python", "-m", "mypkg.train"], None),
    ],
)
def test_each_launcher_is_recognised_by_how_it_was_started(
    argv: list[str], name: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tdbg.probe.zero_code import launchers

    monkeypatch.setattr("sys.orig_argv", argv)
    assert launchers.launcher_name() == name
    assert launchers.is_launcher() is (name is not None)


def test_what_started_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher its parent named first; else srun by its task variables; else nothing."""
    from tdbg.probe.zero_code import launchers

    monkeypatch.setattr(launchers, "lightning", lambda: False)
    assert launchers.started_by({"launcher": "mp.spawn"}) == "mp.spawn"
    assert launchers.started_by({}) is None
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert launchers.started_by({}) == "srun"
    assert launchers.started_by({"launcher": "torchrun"}) == "torchrun"  # srun torchrun ...
    monkeypatch.setattr(launchers, "lightning", lambda: True)
    assert launchers.started_by({}) == "Lightning DDP"
    assert launchers.child_launcher("mp.spawn") == "Lightning DDP"
