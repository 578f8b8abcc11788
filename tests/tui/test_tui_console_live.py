"""The console screen over a real run, with the default capture (TDBG_CONSOLE unset): a training
subprocess's printed lines (stdout and stderr, captured by its probe) on the screen and found by a
search; a plain script under `tdbg run` likewise, and in `tdbg dump --console`; a TUI attaching
after a burst gets the ring's tail; a recording replays the console as it stood at the cursor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from demo_job import wait_for_probe
from test_tui_app import shows
from waiting import wait_for, wait_until

from tdbg.connect.runtime import RunEntry, discover
from tdbg.tui.app import make_app
from tdbg.tui.replay_app import ReplayApp, load
from tdbg.tui.screens.console import ConsoleScreen
from tdbg.tui.sources.base import SocketSource
from tdbg.tui.widgets.console_view import ConsoleView

TRAIN = textwrap.dedent(
    r"""
    import sys, time, torch, tdbg
    torch.set_num_threads(1)
    m = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), 0.01)
    probe = tdbg.watch(m, opt, record=sys.argv[2] if len(sys.argv) > 2 else None)
    for i in range(int(sys.argv[1])):  # a burst before anyone attaches
        print(f"burst {i}")
    step = 0
    while step < int(sys.argv[3] if len(sys.argv) > 3 else 10**9):
        opt.zero_grad()
        loss = m(torch.ones(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % 50 == 0:
            print(f"WARNING: step {step} is a multiple of 50", file=sys.stderr, flush=True)
        step += 1
        time.sleep(0.005)
    probe.close()
    """
)


def _default_env(runtime: Path) -> dict[str, str]:
    """As a user runs: TDBG_CONSOLE unset (the suite's conftest sets it to 0)."""
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime))
    env.pop("TDBG_CONSOLE", None)
    return env


@contextmanager
def training(
    tmp_path: Path, runtime: Path, *args: str
) -> Iterator[tuple[subprocess.Popen[bytes], RunEntry]]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = _default_env(runtime)
    with open(tmp_path / "stderr.log", "wb") as stderr:  # apart from stdout: told apart
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        entry = wait_for_probe(proc, runtime, 60)
        assert entry is not None, f"the run did not serve (exit {proc.poll()})"
        yield proc, entry
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_a_live_run_s_lines_are_shown_and_searched(tmp_path: Path, runtime_dir: Path) -> None:
    with training(tmp_path, runtime_dir, "0") as (_, entry):
        app = make_app(SocketSource(path=str(entry.socket)))
        async with app.run_test(size=(120, 40)) as pilot:
            state = app.state
            await wait_for(pilot, lambda: state.console.next_seq > 30, "printed lines")
            await pilot.press("j")
            await wait_for(pilot, lambda: isinstance(app.screen, ConsoleScreen), "the screen")
            screen = app.screen
            assert isinstance(screen, ConsoleScreen)
            await shows(pilot, app, " loss 0.", "WARNING: step ", "is a multiple of 50")
            assert state.console.lines[0].text.startswith("step 0 loss")  # from the run's start
            stderr = [line for line in state.console.lines if line.text.startswith("WARNING")]
            assert stderr and all(line.stderr for line in stderr)  # two files: told apart
            await pilot.press("slash", *"multiple of", "enter")
            (chosen,) = await wait_for(
                pilot, lambda: None if screen.current is None else (screen.current,), "a match"
            )
            view = screen.query_one(ConsoleView)
            current = view.get_component_rich_style("console-view--current")
            row = chosen - view.scroll_offset.y
            await wait_for(
                pilot,
                lambda: any(s.style == current for s in view.render_line(row)),
                "the match highlighted",
            )
            # Lines go on arriving while the screen is open.
            seen = state.console.next_seq
            await wait_for(pilot, lambda: state.console.next_seq > seen + 20, "more lines")


async def test_a_late_tui_gets_the_tail_of_a_burst(tmp_path: Path, runtime_dir: Path) -> None:
    with training(tmp_path, runtime_dir, "7000") as (_, entry):
        # Late indeed: attached once the burst is all written (the loop's first warning comes
        # after it). Attached as soon as the run served, a starved script was still mid-burst.
        log = tmp_path / "stderr.log"
        wait_until(lambda: "WARNING: step 0 " in log.read_text(), 60, "the burst written")
        app = make_app(SocketSource(path=str(entry.socket)))
        async with app.run_test(size=(120, 40)) as pilot:
            state = app.state
            await wait_for(
                pilot,
                lambda: any(line.text == "burst 6999" for line in state.console.lines),
                "the burst's last line",
            )
            held = [line.text for line in state.console.lines]
            first = state.console.lines[0].seq
            # The probe keeps the newest 5,000: the first 2,000 never reach a late reader, and
            # it says so.
            assert first >= 2000 and held[0] == f"burst {first}"
            assert state.console.missed >= 2000
            await pilot.press("j")
            await shows(pilot, app, "earlier or flooded lines not kept")


async def test_a_recording_replays_the_console_at_the_cursor(
    tmp_path: Path, runtime_dir: Path
) -> None:
    recording = tmp_path / "run.tdbg"
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = _default_env(runtime_dir)
    subprocess.run(
        [sys.executable, str(script), "3", str(recording), "120"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=120,
        check=True,
    )
    timeline = load(str(recording))
    texts = [line.text for line in timeline.full.console.lines]
    assert texts[:3] == ["burst 0", "burst 1", "burst 2"] and "step 110 loss" in texts[-1]
    early = timeline.state_at(timeline.clamp(5)).console
    assert all("step 110" not in line.text for line in early.lines)
    app = ReplayApp(timeline)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("j")
        await shows(pilot, app, "step 110 loss", "burst 0")


PLAIN = textwrap.dedent(
    r"""
    import os, sys, time, warnings, torch
    torch.set_num_threads(1)
    m = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), 0.01)
    warnings.warn("a Python warning, on stderr")
    step = 0
    while not os.path.exists(sys.argv[1]) or step < 60:
        opt.zero_grad()
        loss = m(torch.ones(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % 50 == 0:
            print(f"WARNING: step {step} is a multiple of 50", file=sys.stderr, flush=True)
        step += 1
        time.sleep(0.005)
    print("the end")
    """
)


async def test_tdbg_run_s_default_capture_on_the_screen_and_in_dump(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """A script that knows nothing of tdbg, under `tdbg run`: its prints and its warnings in
    the console screen while it runs, then all of them in `tdbg dump --console`."""
    script, stop, recording = tmp_path / "plain.py", tmp_path / "stop", tmp_path / "run.tdbg"
    script.write_text(PLAIN)
    command = [sys.executable, "-m", "tdbg.cli", "run", "--record", str(recording), "--"]
    with open(tmp_path / "stderr.log", "wb") as stderr:
        proc = subprocess.Popen(
            [*command, sys.executable, str(script), str(stop)],
            env=_default_env(runtime_dir),
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        entry = wait_until(lambda: next(iter(discover(runtime_dir)), None), 60, "the run")
        app = make_app(SocketSource(path=str(entry.socket)))
        async with app.run_test(size=(120, 40)) as pilot:
            state = app.state
            await wait_for(pilot, lambda: state.console.next_seq > 8, "printed lines")
            await pilot.press("j")
            await shows(pilot, app, " loss 0.", "WARNING: step ")
            # From the script's start, before torch was imported: its first lines are kept.
            first = [line.text for line in list(state.console.lines)[:4]]
            assert any("a Python warning, on stderr" in text for text in first), first
            await pilot.press("slash", *"multiple of", "enter")
            screen = app.screen
            assert isinstance(screen, ConsoleScreen)
            await wait_for(pilot, lambda: screen.current is not None, "a match")
        stop.touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, (tmp_path / "stderr.log").read_text()[-2000:]
    printed = out.decode().splitlines()  # the terminal's copy: unchanged
    dumped = subprocess.run(
        [sys.executable, "-m", "tdbg.cli", "dump", str(recording), "--console"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    # stdout (a pipe) and stderr (a file) are two streams, taken a tick at a time: across them
    # the order within one tick is approximate (docs/usage.md), so a warning printed just
    # before the end may follow it in the dump; stdout's own last line is the script's last.
    stdout_lines = [line for line in dumped if not line.startswith("WARNING: ")]
    assert printed[-1] == "the end" and stdout_lines[-1] == "the end"
    assert [line for line in dumped if line.startswith("step ")] == printed[:-1]
    assert any("a Python warning, on stderr" in line for line in dumped)
    assert sum(line.startswith("WARNING: step ") for line in dumped) >= 2
