"""A client waiting for a run (``tdbg dump`` with no TARGET) never misses one that lived a second,
however busy the machine: two CPU burners beside it and, the extreme of busy, the client given no
CPU at all for the run's whole life. The run serves on for a client that waits and has not
attached yet (its note in the runtime directory), so the client still gets it whole."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from test_cli import TDBG
from waiting import wait_until

from tdbg.connect.runtime import WAITING_SUFFIX

STEPS = 60
# A run of about a second on a quiet machine: 60 tiny steps, 15 ms apart. It says when its loop
# is done; the probe then closes at exit (atexit), as a script that never calls close() does.
RUN = f"""
import time, torch, tdbg
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
probe = tdbg.watch(model, opt, name="short")
for _ in range({STEPS}):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.015)
    probe.step(loss)
print("trained", flush=True)
"""


@contextlib.contextmanager
def burners(count: int) -> Iterator[None]:
    """``count`` processes that burn a CPU each until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_waiting_dump_gets_a_one_second_run_it_had_no_cpu_to_see(runtime_dir: Path) -> None:
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir))
    with burners(2):
        dump = subprocess.Popen(
            [*TDBG, "dump", "--timeout", "30"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        run = subprocess.Popen(
            [sys.executable, "-c", RUN], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            note = runtime_dir / f"{dump.pid}{WAITING_SUFFIX}"
            wait_until(note.exists, what="the dump noted as waiting for a run")
            os.kill(dump.pid, signal.SIGSTOP)  # from here until the run is over: no CPU at all
            assert run.stdout is not None
            assert run.stdout.readline() == "trained\n", run.poll()  # its loop is over
            os.kill(dump.pid, signal.SIGCONT)
            out, err = dump.communicate(timeout=60)
            assert dump.returncode == 0, err
            events = [json.loads(line) for line in out.splitlines()]
            assert events[0]["type"] == "hello" and events[0]["run"]["name"] == "short"
            steps = [e["step"] for e in events if e["type"] == "step"]
            assert steps == list(range(STEPS)), steps[:5]  # every step, from its history
            assert events[-1] == {"type": "end", "reason": "shutdown"}
            assert run.wait(timeout=60) == 0  # and then the run is free to go
            assert not note.exists()
        finally:
            for proc in (dump, run):
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                    proc.wait()
