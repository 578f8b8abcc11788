"""Remote attach over ssh against a loopback sshd and a demo training job.

- ``attach``: wall time from starting ``tdbg dump TARGET --count 1`` to its first ``step`` line
  (the run's history comes first, so this is "first data"), over ssh and over the local
  socket, interleaved round by round; and the same inside one process (``remote.connect()`` /
  ``ProbeClient.connect()`` to the first ``steps`` message), which leaves out the CLI's own
  interpreter start.
- ``latency``: one direct client and one ssh client attached to the same run at once; for
  every live step both receive, arrival time minus the step's own timestamp for each, and the
  ssh arrival minus the direct arrival of the same step (the added latency per update).

Loopback sshd means no network: what remains is ssh's own cost (crypto, process hops, the
bridge's byte pump). Usage: ``python benchmarks/remote_attach.py [--rounds 8] [--seconds 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import sshd as sshd_helper  # noqa: E402
from demo_job import demo_job  # noqa: E402

from tdbg.connect.client import ProbeClient  # noqa: E402
from tdbg.connect.ssh import RemoteOptions, connect  # noqa: E402
from tdbg.connect.sshurl import parse_ssh_url  # noqa: E402
from tdbg.protocol.steps import unpack_steps  # noqa: E402

TDBG = [sys.executable, "-m", "tdbg.cli"]
REMOTE_TDBG = str(Path(sys.executable).parent / "tdbg")


def cli_first_step(args: list[str]) -> float:
    """Seconds from starting ``tdbg dump ARGS --count 1`` to its first step line."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*TDBG, "dump", *args, "--count", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    took = float("nan")
    for line in proc.stdout:
        if '"type":"step"' in line:
            took = time.perf_counter() - start
            break
    proc.wait(30)
    if proc.returncode != 0:
        raise RuntimeError(f"tdbg dump failed: {proc.stderr.read() if proc.stderr else ''}")
    return took


def client_first_steps(make: object) -> float:
    start = time.perf_counter()
    client = make()  # type: ignore[operator]
    try:
        for msg in client.messages(timeout=10):
            if msg.get("type") == "steps":
                return time.perf_counter() - start
    finally:
        client.close()
    return float("nan")


def arrivals(client: ProbeClient, until: float, out: dict[int, tuple[float, float]]) -> None:
    """Live steps: step -> (arrival wall time, the step's own timestamp)."""
    for msg in client.messages(timeout=0.5):
        now = time.time()
        if msg.get("type") == "steps" and not msg.get("history"):
            for rec in unpack_steps(msg):
                out[rec.step] = (now, rec.time)
        if now > until:
            return


def quantiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (
        f"median {statistics.median(ordered) * 1e3:7.1f} ms   p90 {p90 * 1e3:7.1f} ms   "
        f"min {ordered[0] * 1e3:6.1f}   max {ordered[-1] * 1e3:6.1f}   n={len(ordered)}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0, help="latency window")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not sshd_helper.available():
        print("no sshd/ssh here: nothing to measure", file=sys.stderr)
        return 2
    runtime = Path(tempfile.mkdtemp(prefix="tdbg-b-", dir="/tmp"))
    os.chmod(runtime, 0o700)
    results: dict[str, list[float]] = {
        k: [] for k in ("cli ssh", "cli local", "connect ssh", "connect local")
    }
    latency: dict[str, list[float]] = {"direct": [], "ssh": [], "added": []}
    demo = ("--delay", "0.02", "--width", "64", "--depth", "4")
    with sshd_helper.running_sshd() as server, demo_job("mlp", *demo, runtime=runtime) as (_, e):
        options = server.client_options()
        url = server.url(str(e.socket))
        opts = RemoteOptions(tuple(options[1::2]), remote_tdbg=REMOTE_TDBG)
        target = parse_ssh_url(url)
        cli_ssh = [url, *options, "--remote-tdbg", REMOTE_TDBG]
        cli_first_step(cli_ssh)  # warm-up: known_hosts, page cache
        for r in range(args.rounds):
            order = ["ssh", "local"] if r % 2 == 0 else ["local", "ssh"]
            for kind in order:
                if kind == "ssh":
                    results["cli ssh"].append(cli_first_step(cli_ssh))
                    results["connect ssh"].append(client_first_steps(lambda: connect(target, opts)))
                else:
                    results["cli local"].append(cli_first_step([str(e.socket)]))
                    results["connect local"].append(
                        client_first_steps(lambda: ProbeClient.connect(e.socket))
                    )
        direct_seen: dict[int, tuple[float, float]] = {}
        ssh_seen: dict[int, tuple[float, float]] = {}
        direct, remote = ProbeClient.connect(e.socket), connect(target, opts)
        until = time.time() + args.seconds
        threads = [
            threading.Thread(target=arrivals, args=(direct, until, direct_seen)),
            threading.Thread(target=arrivals, args=(remote, until, ssh_seen)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        direct.close()
        remote.close()
        for step in sorted(set(direct_seen) & set(ssh_seen)):
            d_at, stamp = direct_seen[step]
            s_at, _ = ssh_seen[step]
            latency["direct"].append(d_at - stamp)
            latency["ssh"].append(s_at - stamp)
            latency["added"].append(s_at - d_at)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform(terse=True)}"
    ssh_version = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip()
    if args.json:
        print(json.dumps({"when": when, "machine": machine, "attach": results, **latency}))
        return 0
    print(f"remote attach over loopback ssh — {when} — {machine} — {ssh_version}")
    print(f"attach, time to first step ({args.rounds} rounds, interleaved):")
    for name, values in results.items():
        print(f"  {name:<14} {quantiles(values)}")
    print(f"latency per update ({args.seconds:g} s of live steps, both clients at once):")
    print(f"  {'direct socket':<14} {quantiles(latency['direct'])}   (arrival - step time)")
    print(f"  {'over ssh':<14} {quantiles(latency['ssh'])}")
    print(f"  {'added by ssh':<14} {quantiles(latency['added'])}   (same step, ssh - direct)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
