"""Soak: a long run (1 M steps of a tiny model) with a recording, a TUI attached for part of it
and a client reconnecting every few seconds; reports memory growth, file size and probe cost.

The training process is a subprocess (its RSS is what is measured); this process runs the
reconnecting client; a second subprocess runs the real Textual app (headless, Pilot) attached
to the run for its middle third, and a third the real replay app (``tdbg-tui replay``, headless)
on the recording once the run is over, moving its cursor through it; each reports its RSS.

    .venv/bin/python benchmarks/soak.py                  # 1,000,000 steps (~5 min here)
    .venv/bin/python benchmarks/soak.py --steps 100000   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    import psutil, torch
    from torch import nn
    import tdbg

    steps, record, report = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    me = psutil.Process()
    probe = tdbg.watch(model, opt, name="soak", record=record)
    window = max(1, steps // 20)
    out = open(report, "w")
    t_window = time.perf_counter(); probe_s = 0.0
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        t0 = time.perf_counter()
        probe.step(loss)
        probe_s += time.perf_counter() - t0
        if (i + 1) % window == 0:
            now = time.perf_counter()
            row = {"step": i + 1, "rss": me.memory_info().rss,
                   "step_us": (now - t_window) / window * 1e6,
                   "probe_step_us": probe_s / window * 1e6,
                   "interval": probe.grad_interval, "errors": probe.errors}
            out.write(json.dumps(row) + "\\n"); out.flush()
            t_window = now; probe_s = 0.0
    probe.close()
    """
)

TUI = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import psutil
    from tdbg.tui.app import make_app
    from tdbg.tui.sources.base import SocketSource

    socket_path, seconds = sys.argv[1], float(sys.argv[2])

    async def main():
        app = make_app(SocketSource(path=socket_path))
        async with app.run_test(size=(120, 40)) as pilot:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await pilot.pause(0.5)
            print(json.dumps({"live_rss": psutil.Process().memory_info().rss,
                              "steps_held": app.state.n_steps,
                              "last_step": app.state.last_step}))

    asyncio.run(main())
    """
)

# The real replay app (``tdbg-tui replay FILE``), headless: load the recording, paint, move the
# cursor to the start, back to the end and a few jumps, then read this process's memory.
REPLAY = textwrap.dedent(
    """
    import asyncio, json, resource, sys, time
    import psutil
    from tdbg.tui.replay_app import ReplayApp, load

    async def main():
        t0 = time.perf_counter()
        app = ReplayApp(load(sys.argv[1]))
        loaded = time.perf_counter() - t0
        async with app.run_test(size=(120, 40)) as pilot:
            for key in ("home", "end", "shift+left", "shift+left", "end"):
                await pilot.press(key)
                while not app.settled:
                    await pilot.pause(0.05)
            print(json.dumps({"replay_rss": psutil.Process().memory_info().rss,
                              "replay_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                              * 1024,
                              "replay_seconds": loaded,
                              "steps_held": app.state.n_steps,
                              "last_step": app.state.last_step}))

    asyncio.run(main())
    """
)


def reconnect_forever(runtime: Path, stop: threading.Event, counts: dict[str, int]) -> None:
    from tdbg.connect.client import ConnectError, ProbeClient
    from tdbg.connect.runtime import discover

    while not stop.wait(2.0):
        entries = discover(runtime)
        if not entries:
            continue
        try:
            client = ProbeClient.connect(entries[0].socket)
            for message in client.messages(timeout=0.5):
                if message.get("type") == "synced":
                    break
            client.close()
            counts["reconnects"] += 1
        except (ConnectError, OSError):
            counts["failed"] += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1_000_000)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tdbg-soak-"))
    runtime = work / "rt"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1")
    record, report = work / "soak.tdbg", work / "report.jsonl"
    (work / "train.py").write_text(TRAIN)
    (work / "tui.py").write_text(TUI)
    (work / "replay.py").write_text(REPLAY)
    py = sys.executable
    t0 = time.monotonic()
    train = subprocess.Popen(
        [py, str(work / "train.py"), str(args.steps), str(record), str(report)], env=env
    )
    stop = threading.Event()
    counts = {"reconnects": 0, "failed": 0}
    client = threading.Thread(target=reconnect_forever, args=(runtime, stop, counts), daemon=True)
    client.start()

    def rows() -> list[dict[str, float]]:
        if not report.exists():
            return []
        return [json.loads(line) for line in report.read_text().splitlines() if line.strip()]

    # The TUI attaches for the middle third of the run (by steps reported so far).
    tui_result: dict[str, float] = {}
    while train.poll() is None and (not rows() or rows()[-1]["step"] < args.steps // 3):
        time.sleep(0.5)
    sockets = list(runtime.glob("*.sock"))
    if train.poll() is None and sockets:
        so_far = time.monotonic() - t0
        tui = subprocess.run(
            [py, str(work / "tui.py"), str(sockets[0]), f"{so_far:.1f}"],
            env=env,
            capture_output=True,
            text=True,
        )
        if tui.returncode == 0 and tui.stdout.strip():
            tui_result = json.loads(tui.stdout.strip().splitlines()[-1])
        else:
            print(tui.stderr[-2000:], file=sys.stderr)
    train.wait()
    stop.set()
    elapsed = time.monotonic() - t0
    replay = subprocess.run(
        [py, str(work / "replay.py"), str(record)], env=env, capture_output=True, text=True
    )
    replay_result = json.loads(replay.stdout.strip().splitlines()[-1]) if replay.stdout else {}
    if not replay_result:
        print(replay.stderr[-2000:], file=sys.stderr)
    data = rows()
    first, last = data[0], data[-1]
    mib = 1 << 20
    print(f"soak: {args.steps:,} steps in {elapsed:.0f} s, train rc {train.returncode}")
    print(
        f"training process RSS: {first['rss'] / mib:.1f} MiB at step {first['step']:,} -> "
        f"{last['rss'] / mib:.1f} MiB at step {last['step']:,} "
        f"(growth {(last['rss'] - first['rss']) / mib:+.1f} MiB)"
    )
    print(
        f"step time: {first['step_us']:.1f} us -> {last['step_us']:.1f} us; "
        f"probe.step(): {first['probe_step_us']:.2f} us -> {last['probe_step_us']:.2f} us; "
        f"grad interval {first['interval']} -> {last['interval']}; errors {last['errors']}"
    )
    print(f"recording: {record.stat().st_size / mib:.1f} MiB")
    if tui_result:
        print(
            f"TUI live (attached {tui_result['steps_held']:,} steps held, last step "
            f"{tui_result['last_step']:,}): RSS {tui_result['live_rss'] / mib:.0f} MiB"
        )
    if replay_result:
        print(
            f"tdbg-tui replay of the recording (the real app, headless, the cursor moved "
            f"through it): RSS {replay_result['replay_rss'] / mib:.0f} MiB (peak "
            f"{replay_result['replay_peak_rss'] / mib:.0f} MiB), loaded in "
            f"{replay_result['replay_seconds']:.1f} s, {replay_result['steps_held']:,} steps held "
            f"(last {replay_result['last_step']:,})"
        )
    print(f"reconnecting client: {counts['reconnects']} reconnects, {counts['failed']} failed")
    return 0 if train.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
