"""``tdbg bridge`` (what every node of a job starts) runs without importing the other commands;
every other command, and the bridge's help, go through the whole CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
from tdbg.cli.entry import main
try:
    code = main(sys.argv[1:])
finally:  # argparse's --version and --help exit from within
    print("full cli:", "tdbg.cli.main" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def tdbg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=60
    )


def test_the_bridge_leaves_the_other_commands_unimported(tmp_path: Path) -> None:
    runtime = tmp_path / "runs"
    runtime.mkdir(mode=0o700)
    done = tdbg("bridge", "--list", "--runtime-dir", str(runtime))
    assert done.returncode == 0, done.stderr
    assert "full cli: False" in done.stderr
    assert isinstance(json.loads(done.stdout), dict)


def test_a_bad_bridge_option_is_one_line_and_exit_2() -> None:
    done = tdbg("bridge", "--summaries")
    assert done.returncode == 2
    assert done.stderr.splitlines()[0] == "tdbg bridge: error: --summaries needs --job JOB"
    done = tdbg("bridge", "--bogus")
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr


def test_other_commands_and_help_go_through_the_whole_cli() -> None:
    done = tdbg("--version")
    assert done.returncode == 0 and done.stdout.startswith("tdbg ")
    assert "full cli: True" in done.stderr
    done = tdbg("bridge", "--help")
    assert done.returncode == 0 and "--summaries" in done.stdout
