"""End to end in a real terminal, the issue-4 way: an unmodified script under `tdbg run --record`,
`tdbg-tui ssh://…` through a real sshd, the job killed with SIGKILL, then `tdbg-tui FILE`."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import sshd as sshd_helper
from test_e2e_tmux import tmux, wait_gone, wait_screen
from waiting import wait_until

from tdbg.connect.runtime import discover
from tdbg.recording.reader import Recording, RecordingError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sshd_helper.available(), reason="OpenSSH sshd or ssh is missing"),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

REMOTE_TDBG = str(Path(sys.executable).parent / "tdbg")  # the venv is not on sshd's PATH

# A plain training script: no tdbg in it. Its loss turns NaN (a poisoned weight) once the test
# has seen it live and creates the file named by argv[1]: a fixed step would race a slow attach.
SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import time
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    poisoned = False
    for step in range(100_000):
        if not poisoned and os.path.exists(sys.argv[1]):
            poisoned = True
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(0.01)
    """
)


@pytest.fixture
def sshd() -> Iterator[sshd_helper.Sshd]:
    with sshd_helper.running_sshd() as server:
        yield server


def test_run_record_ssh_attach_kill_and_replay(
    runtime_dir: Path, tmp_path: Path, sshd: sshd_helper.Sshd
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    recording = tmp_path / "journey.tdbgrec"
    poison = tmp_path / "poison"
    session = f"tdbg-journey-{runtime_dir.name}"
    env = f"env -u COLUMNS -u LINES TDBG_RUNTIME_DIR={runtime_dir}"
    tdbg = f"{shlex.quote(sys.executable)} -m tdbg.cli"
    job = f"{sys.executable} {script} {poison}"
    train = f"{env} {tdbg} run --name journey --record {recording} -- {job}"
    tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "48", f"{train}; sleep 60")
    # One tmux session per program: tmux 3.3a's server dies on a second window (or session)
    # once window-size is manual, so each session gets its size from -x/-y instead.
    try:
        wait_until(lambda: discover(runtime_dir), 90, "the script's probe")
        entry = discover(runtime_dir)[0]
        assert entry.name == "journey"
        pid = entry.pid

        # The TUI reaches the run through ssh and the remote `tdbg bridge`, as from a laptop.
        options = " ".join(shlex.quote(o) for o in sshd.client_options())
        url = sshd.url(str(runtime_dir))
        tui = f"{env} {tdbg} tui {url} {options} --remote-tdbg {REMOTE_TDBG}; sleep 60"
        tmux("new-session", "-d", "-s", f"{session}-tui", "-x", "160", "-y", "48", tui)
        pane = f"{session}-tui"
        # The header's verdict word depends on the run (the sleep between steps reads as
        # input-bound); the run's name and pid with its panels prove the attach.
        wait_screen(pane, ["journey", f"pid {pid}", "Loss", "Gradient norms"])
        poison.touch()
        wait_screen(pane, ["nonfinite_"])  # the NaN reached the screen
        tmux("send-keys", "-t", pane, "q")
        wait_gone(pane, "Gradient norms", "tdbg-tui quitting on q")

        # The job dies without a word; the recording holds it up to its last flush, which
        # comes up to a quarter second after the screen showed the NaN: wait until it is on disk.
        wait_until(lambda: _recorded_nan(recording), what="the NaN's alert in the recording")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), what="the killed script to go")

        replay = f"{env} {tdbg} tui {recording}; sleep 60"
        pane = f"{session}-replay"
        tmux("new-session", "-d", "-s", pane, "-x", "160", "-y", "48", replay)
        wait_screen(pane, ["replay", "journey", "nonfinite_", "Loss", "killed"])
        tmux("send-keys", "-t", pane, "Home")
        wait_screen(pane, ["replay · step 0 /"])
        # The panels repaint once the keys pause: at step 0 the NaN's alerts are still to come.
        wait_gone(pane, "nonfinite_", "the alerts panel at step 0")
        tmux("send-keys", "-t", pane, "End")
        wait_screen(pane, ["nonfinite_"])
        tmux("send-keys", "-t", pane, "q")
    finally:
        tmux("kill-server")


def _recorded_nan(path: Path) -> bool:
    try:
        return any(
            m.get("type") == "alert" and str(m.get("kind")).startswith("nonfinite_")
            for m in Recording(path).messages()
        )
    except RecordingError:  # not written yet
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
