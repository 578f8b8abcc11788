"""`tdbg run`: unmodified scripts under the preloaded probe report what watch() reports."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until

from tdbg.cli.dump import dump_events
from tdbg.connect.client import ProbeClient
from tdbg.protocol.steps import unpack_steps

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "zero_code"
PRELOAD = Path(__file__).resolve().parents[2] / "tdbg" / "probe" / "zero_code" / "preload"
TDBG = [sys.executable, "-m", "tdbg.cli"]


def private_dir(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir(mode=0o700)
    return path


def start(
    argv: list[str], runtime: Path, env: dict[str, str] | None = None, cwd: Path = SCRIPTS
) -> subprocess.Popen[str]:
    full_env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime), ZC_HOLD=str(runtime / "hold"))
    full_env.update(env or {})
    return subprocess.Popen(
        argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def collect(proc: subprocess.Popen[str], runtime: Path, steps: int) -> dict[str, Any]:
    """Attach with a real client, read every step (history and live), then let the script end."""
    # The run's .json is written once its socket listens (a bare .sock may not be yet).
    wait_until(
        lambda: list(runtime.glob("*.json")) or proc.poll() is not None, 60, "the probe's socket"
    )
    metas = list(runtime.glob("*.json"))
    assert metas, f"no probe socket; script ended: {proc.communicate()}"
    client = ProbeClient.connect(json.loads(metas[0].read_text())["socket"])
    layers: list[str] = []
    seen: dict[int, dict[str, Any]] = {}
    try:
        for event in dump_events(client, timeout=60):
            if event["type"] == "hello":
                layers = list(event["layers"])
            elif event["type"] == "step":
                seen[event["step"]] = event
                if len(seen) >= steps:
                    break
    finally:
        client.close()
    sockets_during = sorted(p.name for p in runtime.glob("*.sock"))
    (runtime / "hold").touch()
    out, err = proc.communicate(timeout=60)
    return {
        "layers": layers,
        "steps": seen,
        "rc": proc.returncode,
        "out": out,
        "err": err,
        "sockets": sockets_during,
        "run": client.run,
    }


def run_both(
    tmp: Path, script: str, steps: int, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The script under `tdbg run --grad-every 1` and, beside it, calling watch() itself."""
    auto_dir, ref_dir = private_dir(tmp, "auto"), private_dir(tmp, "ref")
    auto = start([*TDBG, "run", "--grad-every", "1", script], auto_dir, env)
    ref = start([sys.executable, script], ref_dir, dict(env or {}, ZC_WATCH="1"))
    got = collect(auto, auto_dir, steps), collect(ref, ref_dir, steps)
    for result in got:
        assert result["rc"] == 0, result["err"]
    return got


def assert_same(auto: dict[str, Any], ref: dict[str, Any], first: int = 0) -> None:
    assert auto["layers"] == ref["layers"] and auto["layers"]
    assert sorted(auto["steps"]) == sorted(ref["steps"])
    compared = 0
    for step in sorted(ref["steps"]):
        if step < first:
            continue
        a, r = auto["steps"][step], ref["steps"][step]
        assert a["loss"] == pytest.approx(r["loss"], rel=1e-6), step
        assert r["grad_norms"] is not None and a["grad_norms"] is not None, step
        assert a["grad_norms"].keys() == r["grad_norms"].keys()
        for name, value in r["grad_norms"].items():
            assert a["grad_norms"][name] == pytest.approx(value, rel=1e-5, abs=1e-12), (step, name)
        assert a["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
        assert a["epoch"] == r["epoch"], step
        compared += 1
    assert compared >= len(ref["steps"]) - first
    # Same script, same seed: the runs trained identically (the probe changes nothing).
    assert auto["out"].splitlines()[-1] == ref["out"].splitlines()[-1]


@pytest.mark.slow
def test_optimizer_script_reports_what_watch_reports(tmp_path: Path, runtime_dir: Path) -> None:
    auto, ref = run_both(runtime_dir, "train_adam.py", 30)
    assert auto["layers"] == ["inp", "mid", "out"]
    assert_same(auto, ref)
    # Created at the first backward, before the first optimizer step: step 0 is sampled as in
    # the script that watches itself, with the learning rate the step used.
    assert auto["steps"][0]["grad_norms"]["out"] > 0
    assert [s["lr"] for s in auto["steps"].values()] == [s["lr"] for s in ref["steps"].values()]
    assert auto["run"]["name"] == "train_adam" and auto["run"]["argv"] == ["train_adam.py"]
    assert auto["err"] == ""  # nothing to say on a normal run


@pytest.mark.slow
def test_manual_sgd_without_optimizer(tmp_path: Path, runtime_dir: Path) -> None:
    auto, ref = run_both(runtime_dir, "train_manual.py", 25)
    assert auto["layers"] == ["0", "2"]
    assert_same(auto, ref)
    assert all(s["lr"] == [] for s in auto["steps"].values())  # no optimizer: no lr


@pytest.mark.slow
def test_lbfgs_closure(tmp_path: Path, runtime_dir: Path) -> None:
    auto, ref = run_both(runtime_dir, "train_lbfgs.py", 12)
    # The loss is the closure's first evaluation in the step (what step(closure) returns), and
    # the gradients are that evaluation's: the ones the update uses (read after the closure's
    # first call, not at the pre-step hook, which runs before the closure's backward).
    assert_same(auto, ref, first=1)
    # Step 0: under tdbg run the probe starts inside that first step.step(closure), after its
    # first backward, so that step's gradients are read at the step's end (LBFGS's last
    # evaluation); the loss is the first evaluation's in both runs.
    assert auto["steps"][0]["loss"] == pytest.approx(ref["steps"][0]["loss"], rel=1e-6)
    assert all(v > 0 for v in ref["steps"][0]["grad_norms"].values())
    assert all(v > 0 for v in auto["steps"][0]["grad_norms"].values())


@pytest.mark.slow
def test_dataloader_workers_and_spawned_child_start_no_probe(
    tmp_path: Path, runtime_dir: Path
) -> None:
    # The spawned child even gets the preload handed on by the script: the owner pid keeps it
    # inert all the same (guarantees: processes).
    env = {"ZC_SPAWN_PRELOAD": str(PRELOAD)}
    auto, ref = run_both(runtime_dir, "train_loader.py", 12, env)
    assert_same(auto, ref)
    # The probe starts at the first backward, after the first pass over the loader began: that
    # pass is epoch 0 all the same (it was "unknown", and the second pass epoch 0).
    assert [auto["steps"][s]["epoch"] for s in range(12)] == [0] * 6 + [1] * 6
    assert len(auto["sockets"]) == 1, auto["sockets"]
    assert "'preloaded': True, 'claimed': False, 'probe_imported': False" in auto["out"]
    assert "tdbg" not in auto["err"], auto["err"]


def test_argv_exit_code_and_streams_pass_through(tmp_path: Path, runtime_dir: Path) -> None:
    user_site = tmp_path / "site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("MARK = 'user sitecustomize ran'\n")
    env = dict(os.environ, PYTHONPATH=str(user_site), ZC_EXIT="3")
    argv = ["--lr", "0.1", "-m", "x", "--", "a b"]
    proc = subprocess.run(
        [*TDBG, "run", "--", sys.executable, "echo_args.py", *argv],
        cwd=SCRIPTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3
    assert proc.stderr == "to stderr\n"
    seen = json.loads(proc.stdout)
    assert seen == {
        "argv": ["echo_args.py", *argv],
        "torch_imported": False,  # the bootstrap waits for the script to import torch
        "autowatch_loaded": True,
        "pythonpath": str(user_site),  # as the script would see it run directly
        "preload_on_path": False,
        "user_sitecustomize": "user sitecustomize ran",  # chained, not shadowed
    }
    # The same script run directly prints the same thing (but for the bootstrap).
    direct = subprocess.run(
        [sys.executable, "echo_args.py", *argv], cwd=SCRIPTS, env=env, capture_output=True
    )
    assert json.loads(direct.stdout) == dict(seen, autowatch_loaded=False)
    assert direct.returncode == 3


def test_run_module_and_script_with_this_interpreter(runtime_dir: Path) -> None:
    for form in (["-m", "echo_args"], ["echo_args.py"], ["--", "-m", "echo_args"]):
        proc = subprocess.run(
            [*TDBG, "run", "--name", "n", *form, "--flag", "-m", "v"],
            cwd=SCRIPTS,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, (form, proc.stderr)
        argv = json.loads(proc.stdout)["argv"]
        assert argv[1:] == ["--flag", "-m", "v"], form
        assert argv[0].endswith("echo_args.py")


def test_signals_are_forwarded(runtime_dir: Path) -> None:
    for sig, code, said in ((signal.SIGTERM, 7, "got signal 15"), (signal.SIGUSR1, 128 + 10, "")):
        proc = subprocess.Popen(
            [*TDBG, "run", "wait_signal.py"],
            cwd=SCRIPTS,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)  # to the launcher only: it forwards to the script
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == code, (sig, err)
        assert out.strip() == said


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "missing.py"], "tdbg: error: no such script: missing.py"),
        (["run", "--", sys.executable, "missing.py"], "tdbg: error: no such script: missing.py"),
        (["run"], "tdbg: error: nothing to run"),
        (["run", "--", "no-such-command-zc"], "tdbg: error: command not found: no-such"),
        (["run", "--grad-every", "0", "x.py"], "tdbg run: error: argument --grad-every"),
        (["run", "--record", "/no/such/dir/rec", "echo_args.py"], "tdbg: error: --record: no"),
        # Empty and malformed forms: tdbg's one line, never python's own message and exit 1.
        (["run", "-m", ""], "tdbg: error: -m: the module name is empty"),
        (["run", "-m", " "], "tdbg: error: -m: the module name is empty"),
        (["run", "-m", ".train"], "tdbg: error: -m: relative module names are not supported"),
        (["run", "-m", "a..b"], "tdbg: error: -m: not a module name: 'a..b'"),
        (["run", "--", sys.executable, "-m", ""], "tdbg: error: -m: the module name is empty"),
        (["run", "--", sys.executable, "-m"], "tdbg: error: -m: the module name is empty"),
        (["run", ""], "tdbg: error: the command is empty"),
        (["run", "--", " "], "tdbg: error: the command is empty"),
        (["run", "--", sys.executable, ""], "tdbg: error: the script's path is empty"),
        (["run", "--name", "", "echo_args.py"], "tdbg: error: --name is empty"),
    ],
)
def test_bad_arguments_one_line_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run([*TDBG, *args], cwd=SCRIPTS, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith(message), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_broken_bootstrap_warns_once_and_the_script_runs(tmp_path: Path) -> None:
    # A tdbg the child cannot import (here: a broken one first on its PYTHONPATH).
    broken = tmp_path / "broken"
    (broken / "tdbg").mkdir(parents=True)
    (broken / "tdbg" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    launcher = (
        "import sys; sys.path.remove(sys.argv.pop(1)); "
        "from tdbg.cli.main import main; sys.exit(main())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", launcher, str(broken), "run", "echo_args.py", "x"],
        cwd=SCRIPTS,
        env=dict(os.environ, PYTHONPATH=str(broken), ZC_EXIT="5"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 5
    assert json.loads(proc.stdout)["argv"] == ["echo_args.py", "x"]
    warning, rest = proc.stderr.split("\n", 1)
    assert warning.startswith("tdbg: warning: the probe was not preloaded (broken on purpose)")
    assert rest == "to stderr\n"


def run_recorded(
    record: Path, *script: str, grad_every: bool = True
) -> subprocess.CompletedProcess[str]:
    """``tdbg run --record RECORD [--grad-every 1] SCRIPT ARGS...`` in the scripts' folder, to
    its end."""
    every = ["--grad-every", "1"] if grad_every else []
    return subprocess.run(
        [*TDBG, "run", "--record", str(record), *every, *script],
        cwd=SCRIPTS,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_record_option_records_the_run(tmp_path: Path, runtime_dir: Path) -> None:
    record = tmp_path / "run.tdbg"
    proc = run_recorded(record, "train_adam.py")
    assert proc.returncode == 0, proc.stderr
    dump = subprocess.run(
        [*TDBG, "dump", str(record)], capture_output=True, text=True, timeout=60, check=True
    )
    events = [json.loads(line) for line in dump.stdout.splitlines()]
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == list(range(30))
    assert all(e["grad_norms"] and set(e["grad_norms"]) == {"inp", "mid", "out"} for e in steps)
    assert all(math.isfinite(e["loss"]) for e in steps)


def test_a_new_optimizer_after_discovery_is_said_not_left_silent(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """A script that swaps its optimizer after tdbg run's discovery steps: tdbg run counts
    steps at the first optimizer's updates (a known limit, docs/usage.md), so it says so,
    once, on stderr and as an alert in the stream, instead of looking stalled."""
    record = tmp_path / "run.tdbg"
    proc = run_recorded(record, "train_swap.py", grad_every=False)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "a new Adam trains" in line]
    assert len(said) == 1, proc.stderr
    assert "at step 40" in said[0] and "SGD" in said[0] and "tdbg.watch" in said[0]
    events = [json.loads(line) for line in dump_lines(record)]
    alerts = [e for e in events if e["type"] == "alert" and "a new Adam" in e.get("message", "")]
    assert len(alerts) == 1, [e for e in events if e["type"] == "alert"]
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(40))


def dump_lines(record: Path) -> list[str]:
    dump = subprocess.run(
        [*TDBG, "dump", str(record)], capture_output=True, text=True, timeout=60, check=True
    )
    return dump.stdout.splitlines()


@pytest.mark.slow
def test_script_that_watches_itself_keeps_its_own_probe(runtime_dir: Path) -> None:
    proc = start([*TDBG, "run", "train_adam.py"], runtime_dir, {"ZC_WATCH": "1"})
    got = collect(proc, runtime_dir, 30)
    assert got["rc"] == 0 and got["err"] == "", got["err"]
    assert got["sockets"] == [f"0-{got['run']['pid']}.sock"]
    # Every step sampled: the script's probe (grad_every=1), not a second one at the default.
    assert all(s["grad_norms"] for s in got["steps"].values())
    # Its taps stay when tdbg run stands down (it put back torch.autograd.backward over them
    # before): each update's backward is seen, counted and timed.
    assert all(s["micro_batches"] == 1 for s in got["steps"].values())
    assert all(s["backward_time"] is not None for s in got["steps"].values())


def test_terminal_ctrl_c_goes_to_the_script_and_the_launcher_waits(runtime_dir: Path) -> None:
    """^C on a real terminal goes to the whole foreground group: the script gets it and decides;
    the launcher neither dies of it nor forwards a second one, and exits with the script's code.
    (A duplicate ^C cannot be told apart reliably here — the kernel merges a second SIGINT that
    arrives while the first is pending — so the count is a sanity check, not the proof.)"""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: a new session on the pty, as in a terminal
        os.chdir(SCRIPTS)
        os.execv(sys.executable, [*TDBG, "run", "count_sigint.py"])
    output = b""
    os.set_blocking(fd, False)
    try:

        def read_until(text: bytes) -> bool:
            nonlocal output
            try:
                output += os.read(fd, 1024)
            except BlockingIOError:
                return False
            except OSError:  # EIO: the terminal's last process closed it
                return True
            return text in output

        wait_until(lambda: read_until(b"ready"), 30, "the script to start")
        os.write(fd, b"\x03")  # ^C: the line discipline signals the foreground process group
        wait_until(lambda: read_until(b"sigint count"), 30, "the script to report")
        wait_until(lambda: read_until(b"\n") and b"\n" in output.split(b"sigint count")[1])
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert b"sigint count 1" in output, output
    assert os.waitstatus_to_exitcode(status) == 4


def test_launcher_and_bootstrap_import_no_torch() -> None:
    code = (
        "import json, sys, tdbg.cli.main, tdbg.cli.run, tdbg.probe.zero_code.autowatch; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def recorded_steps(record: Path) -> list[dict[str, Any]]:
    dump = subprocess.run(
        [*TDBG, "dump", str(record)], capture_output=True, text=True, timeout=60, check=True
    )
    events = [json.loads(line) for line in dump.stdout.splitlines()]
    return [e for e in events if e["type"] == "step"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        "multi",
        "multi-amp",
        "multi-amp-list",
        "grad",
        "grad-own-watch",
        "grad-global-hook",
        "func",
        "compiled-loss",
    ],
)
def test_gradients_without_a_single_backward_are_watched(tmp_path: Path, mode: str) -> None:
    """``torch.autograd.backward([a, b])`` (a multi-task loop): the loss is a + b, as one
    backward of their sum, also of GradScaler's scaled ones (each scaled, or a scaled list).
    ``torch.autograd.grad`` with ``.grad`` set by hand: no backward at all, so the model is
    found at its first update and watched from the second (step 0), its gradients true; the
    loss cannot be seen, which is said once (stderr, an alert), not left silent. A script that
    watches itself, or another global optimizer hook, trains on untouched."""
    record = tmp_path / f"{mode}.tdbg"
    proc = run_recorded(record, "train_no_single_backward.py", mode)
    assert proc.returncode == 0, proc.stderr
    truth = json.loads(proc.stdout)
    if mode == "grad-own-watch":
        assert proc.stderr == ""  # the script's own probe is the run's: nothing from tdbg run
        return
    steps = recorded_steps(record)
    first = 0 if mode.startswith("multi") else 1  # found at the first update, watched after it
    assert [s["step"] for s in steps] == list(range(8 - first))
    assert [s["grad_norm"] for s in steps] == pytest.approx(truth["norms"][first:], rel=1e-5)
    if mode.startswith("multi"):
        assert proc.stderr == ""
        assert [s["loss"] for s in steps] == pytest.approx(truth["losses"], rel=1e-6)
        assert all(s["micro_batches"] == 1 for s in steps)
    else:
        assert all(s["loss"] is None for s in steps)
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and "without a backward() of its loss" in lines[0], proc.stderr
        alerts = [
            json.loads(line)
            for line in dump_lines(record)
            if '"alert"' in line and "without a backward" in line
        ]
        assert len(alerts) == 1 and alerts[0]["step"] == 0


@pytest.mark.slow
def test_amp_grad_scaler_reports_the_unscaled_loss(tmp_path: Path, runtime_dir: Path) -> None:
    record = tmp_path / "amp.tdbg"
    proc = run_recorded(record, "train_amp.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    truth = json.loads(proc.stdout)
    assert len(set(truth["scales"])) > 2  # the scale moved (grew, then halved at the skip)
    assert truth["taken"].count(False) == 1
    steps = recorded_steps(record)
    # A step the scaler skips (inf gradients: optimizer.step() not called) is not a step; every
    # other one reports the loss the script computed, whatever the scale was.
    taken = [loss for loss, ok in zip(truth["losses"], truth["taken"], strict=True) if ok]
    assert [s["step"] for s in steps] == list(range(len(taken)))
    assert [s["loss"] for s in steps] == pytest.approx(taken, rel=1e-6)
    # The probe reads the gradients inside optimizer.step(), after the scaler unscaled them.
    assert all(s["grad_norm"] is not None and s["grad_norm"] < 100 for s in steps)


def test_grad_scaler_wrapper_is_removed_and_the_scaler_unchanged() -> None:
    import torch

    from tdbg.probe.zero_code.autowatch import AutoWatch

    classes: tuple[Any, ...] = (
        torch.amp.GradScaler,
        torch.cpu.amp.GradScaler,
        torch.cuda.amp.GradScaler,
    )
    before = [c.scale for c in classes]
    backward, init = torch.autograd.backward, torch.optim.Optimizer.__init__
    auto = AutoWatch(torch, {"name": None, "grad_every": None})
    auto.install()
    try:
        assert all(c.scale is not b for c, b in zip(classes, before, strict=True))
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        loss = torch.tensor(1.5, requires_grad=True)
        scaled = scaler.scale(loss)
        assert scaled.item() == 12.0  # what the script gets is unchanged
        assert auto._scaled is not None and auto._scaled[0]() is scaled
        assert auto._scaled[1].item() == 1.5 and not auto._scaled[1].requires_grad
        disabled = torch.amp.GradScaler("cpu", enabled=False)
        auto._scaled = None
        assert disabled.scale(loss) is loss and auto._scaled is None
    finally:
        auto.shutdown()
    assert [c.scale for c in classes] == before
    assert torch.autograd.backward is backward and torch.optim.Optimizer.__init__ is init


def test_module_at_the_address_of_a_freed_one_is_still_found() -> None:
    """An id in the forward pre-hook's table may belong to a module freed since (a throwaway
    model whose address the real one reuses): its dead entry must not hide the new module."""
    import weakref

    import torch
    from torch import nn

    from tdbg.probe.zero_code.autowatch import AutoWatch

    auto = AutoWatch(torch, {"name": None, "grad_every": None})
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    throwaway = nn.Linear(2, 1)
    dead: weakref.ref[nn.Module] = weakref.ref(throwaway)
    auto._on_forward(throwaway, ())
    del throwaway
    assert dead() is None
    # Address reuse, made certain: the freed module's entry under the model's id.
    auto._seen = {id(model): dead}
    auto._on_forward(model, ())
    for sub in model:
        auto._on_forward(sub, ())
    model(torch.randn(4, 2)).sum().backward()
    assert auto._choose() == (model, None)


@pytest.mark.slow
def test_script_children_get_no_tdbg_settings_and_stay_inert(
    tmp_path: Path, runtime_dir: Path
) -> None:
    record = tmp_path / "run.tdbg"
    argv = ["run", "--name", "exp", "--grad-every", "2", "--record", str(record)]
    proc = subprocess.run(
        [*TDBG, *argv, "train_subprocess.py"],
        cwd=SCRIPTS,
        env=dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir), ZC_SPAWN_PRELOAD=str(PRELOAD)),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    seen = json.loads(proc.stdout)
    # The user's own settings pass through (TDBG_CONSOLE: the suite's, tests/conftest.py).
    user = {"TDBG_RUNTIME_DIR": str(runtime_dir), "TDBG_CONSOLE": os.environ["TDBG_CONSOLE"]}
    # Before the first backward the script's own watch() may still want TDBG_RECORD.
    assert seen["before"] == {"env": dict(user, TDBG_RECORD=str(record))}
    # After it, the recording is taken: a child that watches itself records nothing.
    assert seen["after"] == {"env": user, "preloaded": True, "claimed": False, "recording": None}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.tdbg"]
    assert len(recorded_steps(record)) == 3


@pytest.mark.slow
def test_a_gan_watches_both_models_and_both_optimizers(tmp_path: Path, runtime_dir: Path) -> None:
    record = tmp_path / "gan.tdbg"
    proc = run_recorded(record, "train_gan.py")
    assert proc.returncode == 0, proc.stderr
    truth = json.loads(proc.stdout)
    dump = subprocess.run(
        [*TDBG, "dump", str(record)], capture_output=True, text=True, timeout=60, check=True
    )
    events = [json.loads(line) for line in dump.stdout.splitlines()]
    hello = events[0]
    # netD is found at the first backward, netG and its optimizer at optG's first step.
    steps = [e for e in events if e["type"] == "step"]
    from tdbg.recording.reader import Recording

    recorded = [m for m in Recording(record).messages() if m.get("type") == "metrics"]
    points = [tuple(p) for m in recorded for p in m["points"]]
    layers = [e for e in events if e["type"] == "layers"]
    names = layers[-1]["layers"] if layers else hello["layers"]
    assert "netG.0" in names and "netG.2" in names and "0" in names
    # Step 0 is D's first update alone; from then on one step per round, D then G. The first
    # round's G update is step 1 on its own (it was found there); rounds 2.. are steps 2..
    d_losses = {s: v for s, n, v in points if n == "loss/optD"}
    g_losses = {s: v for s, n, v in points if n == "loss/optG"}
    for i in range(1, len(truth)):
        step = i + 1
        assert d_losses[step] == pytest.approx(truth[i]["D"], rel=1e-5), step
        assert g_losses[step] == pytest.approx(truth[i]["G"], rel=1e-5), step
    assert steps[0]["loss"] == pytest.approx(truth[0]["D"], rel=1e-5)
    last = steps[-1]
    assert len(last["lr"]) == 2 and set(last["grad_norms"]) >= {"0", "2", "netG.0", "netG.2"}


@pytest.mark.slow
def test_tdbg_run_of_torchrun_watches_every_rank(straggler_job: list[Path]) -> None:
    """`tdbg run -- python -m torch.distributed.run --nproc_per_node=3 ...` (gloo, CPU): each
    rank watches itself, records its own file, and says where it sits in the job. (Ranks 0 and
    1 of the session's straggler job: rank 1 is only slow, so their updates are the same.)"""
    from tdbg.recording.reader import Recording

    runs = {}
    for rank in (0, 1):
        recording = Recording(straggler_job[rank])
        steps = [
            r for m in recording.messages() if m.get("type") == "steps" for r in unpack_steps(m)
        ]
        runs[rank] = (recording.run, steps)
    (run0, steps0), (run1, steps1) = runs[0], runs[1]
    assert (run0["rank"], run1["rank"]) == (0, 1)
    assert run0["world_size"] == run1["world_size"] == 3
    assert run0["job"] and run0["job"] == run1["job"]
    assert [s.step for s in steps0] == [s.step for s in steps1] == list(range(40))
    # DDP: the gradients after the all-reduce are the same on every rank; the losses are not.
    for a, b in zip(steps0, steps1, strict=True):
        assert a.grad_total == pytest.approx(b.grad_total, rel=1e-5)
    assert [s.loss for s in steps0] != [s.loss for s in steps1]


@pytest.mark.slow
def test_a_straggler_and_a_diverged_rank_are_named(
    straggler_job: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Three gloo ranks under DDP: rank 1 waits 40 ms for each batch, rank 2 changes one layer's
    gradient after the all-reduce. `tdbg status` on the job's recordings names both."""
    from tdbg.cli.main import run

    code = run(["status", *map(str, straggler_job)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "3 of 3 ranks" in out
    assert "straggler: rank 1 holds the others up" in out and "input wait" in out
    divergence = [line for line in out.splitlines() if "rank_divergence" in line]
    assert divergence and "rank 2:" in divergence[0] and "in layer 2 at" in divergence[0]
    assert "straggler: rank 0" not in out and "straggler: rank 2" not in out


def test_oom_stacks_on_a_cpu_run_is_said_once_and_the_run_goes_on(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """``tdbg run --oom-stacks`` sets TDBG_OOM_STACKS for the script; its probe, with no CUDA
    to record stacks on, says so once on stderr and watches as usual."""
    record = tmp_path / "run.tdbg"
    proc = subprocess.run(
        [*TDBG, "run", "--oom-stacks", "--record", str(record), "train_adam.py"],
        cwd=SCRIPTS,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "oom_stacks" in line]
    assert said == ["tdbg: oom_stacks needs CUDA: this run has none, no allocation stacks recorded"]
    steps = [json.loads(line) for line in dump_lines(record)]
    assert len([e for e in steps if e["type"] == "step"]) == 30
