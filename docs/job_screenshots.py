"""Make docs/distributed.md's pictures of the job screen at scale: synthetic ranks on simulated
nodes (benchmarks/fake_ranks.py: GPU ranks, a slow one, a diverged one, one holding twice the
memory, then a hang) read through one real ``tdbg bridge --job --summaries`` per node behind a
stand-in for ssh, the app under its Pilot, an SVG once the straggler (also as the slowest over
time), the divergence and the hang are named.

    .venv/bin/python docs/job_screenshots.py            # 64 ranks on 8 nodes, 1,024 on 128
    .venv/bin/python docs/job_screenshots.py --ranks 64 --nodes 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from fake_ranks import node_dir  # noqa: E402

from tdbg.connect.ssh import RemoteOptions  # noqa: E402
from tdbg.connect.sshurl import parse_ssh_url  # noqa: E402
from tdbg.tui.app import save_screenshot, screen_text  # noqa: E402
from tdbg.tui.job_app import JobApp  # noqa: E402
from tdbg.tui.sources.remote_job import RemoteJobSource  # noqa: E402

# The simulated nodes (their ranks, and their bridges behind the ssh stand-in) at the lowest
# priority: on a cluster they are other machines; here 128 bridges (1.7 cores at rest) share 2
# cores with the viewer (benchmarks/job_tui.py says the same).
LOCAL_SSH = (
    '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift 2\nexec nice -n 19 sh -c "$*"\n'
)
RATE = 2.0  # steps/s: 1,024 synthetic ranks and 128 bridges share this machine's cores


async def capture(ranks: int, nodes: int, out: Path, size: tuple[int, int]) -> str:
    work = Path(tempfile.mkdtemp(prefix="tdbg-shots-", dir="/tmp"))
    os.chmod(work, 0o700)
    ssh, tdbg = work / "ssh", work / "tdbg"
    ssh.write_text(LOCAL_SSH)
    tdbg.write_text(f'#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m tdbg.cli "$@"\n')
    for script in (ssh, tdbg):
        script.chmod(0o755)
    per_node, procs = ranks // nodes, max(1, ranks // 128)
    share = -(-ranks // procs)
    # A hang once the others are named: at 1,024 ranks the 128 bridges' first summaries take a
    # minute or two on this 2-core machine, and in a job hung before they came every rank is
    # stalled (no straggler is judged among ranks that do not step).
    hang_at = 200 + int(RATE * (20 if ranks <= 64 else 150))
    servers = [
        subprocess.Popen(
            ["nice", "-n", "19", sys.executable, str(ROOT / "benchmarks" / "fake_ranks.py"),
             "--ranks",
             *map(str, range(lo, min(lo + share, ranks))), "--world", str(ranks), "--runtime",
             str(work), "--per-node", str(per_node), "--rate", str(RATE), "--slow", "21",
             "--slow-by", "0.2",
             "--diverge", str(ranks - 7), "--hang", "42", "--hang-at", str(hang_at),
             "--gpu", "--heavy", "9"],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        for lo in range(0, ranks, share)
    ]  # fmt: skip
    try:
        while len(list(work.glob("*/*.json"))) < ranks:
            time.sleep(0.1)
        targets = [parse_ssh_url(f"ssh://{node_dir(n)}{work}/{node_dir(n)}") for n in range(nodes)]
        opts = RemoteOptions(ssh=str(ssh), remote_tdbg=str(tdbg))
        source = RemoteJobSource("bench-job", targets, opts, summaries=True)
        app = JobApp(source)
        try:
            async with app.run_test(size=size) as pilot:
                deadline = time.monotonic() + float(os.environ.get("SHOT_TIMEOUT", "600"))
                words = ("straggler", "rank_divergence", "hang", f"{ranks} of {ranks} ranks",
                         "(persistent): the slowest in")  # fmt: skip
                while not all(w in screen_text(app) for w in words):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"not named in time:\n{screen_text(app)}")
                    await pilot.pause(0.5)
                await pilot.pause(1.0)
                return save_screenshot(app, out)
        finally:
            source.close()
    finally:
        for server in servers:
            server.kill()
            server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 128])
    args = p.parse_args()
    for ranks, nodes in zip(args.ranks, args.nodes, strict=True):
        target = ROOT / "docs" / f"job-screen-{ranks}-ranks.svg"
        print(asyncio.run(capture(ranks, nodes, target, (120, 40))))


if __name__ == "__main__":
    main()
