"""The node list of a multi-node job: brace ranges and lists, hostfiles, and the one-line
refusals of bad input (before any ssh starts); which job a set of listed runs shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tdbg.connect.jobs import one_job
from tdbg.connect.nodes import expand_braces, node_targets, read_hostfile
from tdbg.connect.runtime import RunEntry
from tdbg.connect.target_errors import TargetError


def test_brace_ranges_and_lists_expand() -> None:
    assert expand_braces("ssh://gpu{01..03}") == ["ssh://gpu01", "ssh://gpu02", "ssh://gpu03"]
    assert expand_braces("ssh://gpu{8..10}") == ["ssh://gpu8", "ssh://gpu9", "ssh://gpu10"]
    assert expand_braces("ssh://n{1..3}") == ["ssh://n1", "ssh://n2", "ssh://n3"]
    assert expand_braces("ssh://{a,b}-{1..2}") == [
        "ssh://a-1",
        "ssh://a-2",
        "ssh://b-1",
        "ssh://b-2",
    ]
    assert expand_braces("ssh://me@gpu{098..100}:2222/tmp/r") == [
        "ssh://me@gpu098:2222/tmp/r",
        "ssh://me@gpu099:2222/tmp/r",
        "ssh://me@gpu100:2222/tmp/r",
    ]
    assert expand_braces("ssh://plain") == ["ssh://plain"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("ssh://gpu{01..08", "is not closed"),
        ("ssh://gpu01..08}", "'}' without '{'"),
        ("ssh://gpu{a..c}", "is neither a list"),
        ("ssh://gpu{1}", "is neither a list"),
        ("ssh://gpu{a,}", "empty item"),
        ("ssh://gpu{{a,b},c}", "nested braces"),
        ("ssh://gpu{1..100000}", "more than 4096 nodes"),
        ("ssh://gpu{1..100}{1..100}", "more than 4096 nodes"),
    ],
)
def test_bad_braces_are_one_line(text: str, needle: str) -> None:
    with pytest.raises(TargetError) as err:
        node_targets([text])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_hostfile(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(
        "# the training nodes\n"
        "gpu01\n"
        "\n"
        "me@gpu02:2222   # another user and port\n"
        "gpu{03..04} slots=8\n"
        "ssh://gpu05/tmp/tdbg-runs\n"
    )
    assert read_hostfile(str(hostfile)) == [
        "ssh://gpu01",
        "ssh://me@gpu02:2222",
        "ssh://gpu03",
        "ssh://gpu04",
        "ssh://gpu05/tmp/tdbg-runs",
    ]
    nodes = node_targets(["ssh://head"], str(hostfile))
    assert [n.node for n in nodes] == ["head", "gpu01", "me@gpu02:2222", "gpu03", "gpu04", "gpu05"]
    assert nodes[2].port == 2222 and nodes[2].user == "me" and nodes[5].path == "/tmp/tdbg-runs"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("gpu01\ngpu02 gpu03\n", "line 2: one host a line (unexpected 'gpu03')"),
        ("# nothing\n\n", "names no host"),
        ("gpu01\nme:secret@gpu02\n", "password"),
        ("gpu{01..02\n", "line 1:"),
        ("gpu01\n-oProxyCommand=x\n", "must not start with '-'"),
        ("gpu01\ngpu01\n", "named twice"),
        ("gpu:99999\n", "out of range"),
    ],
)
def test_bad_hostfiles_are_one_line(tmp_path: Path, content: str, needle: str) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(content)
    with pytest.raises(TargetError) as err:
        node_targets([], str(hostfile))
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_missing_hostfile_and_a_local_target_among_nodes(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="cannot read hostfile .*No such file"):
        node_targets([], str(tmp_path / "nope"))
    with pytest.raises(TargetError, match="must be ssh:// URLs"):
        node_targets(["ssh://a", "/tmp/local.sock"])


def test_the_cli_refuses_bad_node_lists_on_one_line(tmp_path: Path) -> None:
    """`tdbg-tui` with a bad range or hostfile: one line on stderr, exit 2, no ssh, no screen."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu01 extra\n")
    code = "import sys; from tdbg.cli.main import tui_main; sys.exit(tui_main())"
    for args, needle in (
        (["ssh://gpu{01..x}"], "is neither a list"),
        (["--hostfile", str(hostfile)], "one host a line"),
        (["--hostfile", str(tmp_path / "missing")], "cannot read hostfile"),
    ):
        out = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("tdbg-tui: error: ") and out.stderr.count("\n") == 1
        assert needle in out.stderr, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "tdbg.cli", "ls", "--hostfile", str(hostfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("tdbg: error: hostfile ") and "one host a line" in out.stderr


def _rank(job: str, rank: int) -> RunEntry:
    return RunEntry(Path(f"/tmp/{job}-{rank}.sock"), {"job": job, "world_size": 2, "rank": rank})


def test_one_job_or_a_clear_refusal() -> None:
    assert one_job([_rank("a", 0), _rank("a", 1)]) == "a"
    single = RunEntry(Path("/tmp/s.sock"), {"name": "s", "pid": 1})
    assert one_job([_rank("a", 0), single]) is None  # not every run a rank: the picker
    with pytest.raises(TargetError) as err:
        one_job(
            [_rank("a", 0), _rank("a", 1), _rank("b", 0)],
            lambda e: "n1" if "a-" in str(e.socket) else "n2",
        )
    assert str(err.value) == (
        "ranks of 2 different jobs here: a (ranks 0, 1 on n1); b (rank 0 on n2); "
        "pick one with --job JOB"
    )
