"""``tdbg bridge --job --summaries`` tries a rank again when its handshake failed: a rank too busy
to answer in time (a stopped process here) is said once, retried, and read once it answers —
a node whose ranks all failed their first try used to send no summary ever."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from processes import kill_tree
from waiting import wait_until

from tdbg.cli import bridge_summary
from tdbg.cli.bridge_summary import SummaryBridge
from tdbg.connect.client import ProbeClient
from tdbg.protocol.framing import NODE_MAGIC, NODE_MAX_FRAME, Decoder
from tdbg.protocol.messages.node_summary import NodeSummary

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "benchmarks" / "fake_ranks.py"


def test_a_rank_whose_handshake_timed_out_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "node"
    runtime.mkdir(mode=0o700)
    argv = [sys.executable, str(FAKE), "--ranks", "0", "1", "--world", "2", "--runtime",
            str(runtime), "--job", "big", "--rate", "10"]  # fmt: skip
    rank = subprocess.Popen(
        argv, env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True
    )
    ours, theirs = socket.socketpair()
    bridge = SummaryBridge("big", runtime, theirs.fileno())
    frames: list[Any] = []

    def read() -> None:
        decoder = Decoder(NODE_MAX_FRAME, magic=NODE_MAGIC)
        while chunk := ours.recv(1 << 20):
            frames.extend(decoder.feed(chunk))

    def summarised() -> set[int]:
        wire = [f for f in list(frames) if isinstance(f, dict) and f.get("type") == "summary"]
        summaries = [s for s in map(NodeSummary.from_wire, wire) if s is not None]
        return {figures.rank for s in summaries for figures in s.ranks}

    def notices() -> list[str]:
        return [str(f["message"]) for f in list(frames) if f.get("type") == "notice"]

    try:
        wait_until(lambda: len(list(runtime.glob("*.json"))) == 2, 30, "both ranks listed")
        # A handshake of 0.3 s, against a rank process that answers nothing while stopped.
        short = ProbeClient.connect.__func__  # type: ignore[attr-defined]
        monkeypatch.setattr(
            bridge_summary.ProbeClient,
            "connect",
            classmethod(lambda cls, path: short(cls, path, timeout=0.3)),
        )
        os.kill(rank.pid, signal.SIGSTOP)
        threading.Thread(target=read, daemon=True).start()
        bridge.start()
        wait_until(lambda: len(notices()) >= 2, 30, "both ranks' failed handshakes said")
        assert all(n.endswith("; retrying") for n in notices()), notices()
        os.kill(rank.pid, signal.SIGCONT)
        wait_until(lambda: summarised() == {0, 1}, 30, "both ranks in a summary, retried")
        assert len(notices()) == 2, notices()  # each failure said once, not on every retry
    finally:
        bridge.close()
        theirs.close()
        ours.close()
        if rank.poll() is None:
            os.kill(rank.pid, signal.SIGCONT)  # a stopped process would not see its SIGTERM
        kill_tree(rank)
