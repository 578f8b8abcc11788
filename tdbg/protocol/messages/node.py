"""The node stream's messages: every rank of a job on one node over one ssh connection."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from tdbg.protocol.messages.tolerant import as_dict, as_int, as_list, as_str

# ``tdbg bridge --job JOB`` answers with NODE_MAGIC's preamble (framing.py), then frames of these
# messages both ways. Each rank's connection is a numbered channel whose probe-protocol bytes ride
# as opaque ``data`` chunks: the bridge never parses a probe's frame.
#
# bridge -> client: ``node`` (first: who answers), ``open`` (a rank's socket was reached: a new
# channel and the run's metadata), ``data``, ``close`` (the rank's socket closed), ``notice``.
# client -> bridge: ``data`` (to the rank's probe) and ``close`` (the client left that rank).


class NodeHello(TypedDict):
    type: Literal["node"]
    tdbg: str  # the bridge's tdbg version
    protocol: list[int]  # [min, max] probe protocol versions it knows
    host: str
    runtime_dir: str
    job: str


class ChannelOpen(TypedDict):
    type: Literal["open"]
    ch: int
    run: dict[str, Any]  # the rank's run metadata, as `tdbg bridge --list` prints it


class ChannelData(TypedDict):
    type: Literal["data"]
    ch: int
    data: bytes


class ChannelClose(TypedDict):
    type: Literal["close"]
    ch: int
    reason: str


class NodeNotice(TypedDict):
    type: Literal["notice"]
    message: str


NodeMessage = NodeHello | ChannelOpen | ChannelData | ChannelClose | NodeNotice


def node_hello(
    tdbg: str, protocol: tuple[int, int], host: str, runtime_dir: str, job: str
) -> NodeHello:
    return {
        "type": "node",
        "tdbg": tdbg,
        "protocol": [protocol[0], protocol[1]],
        "host": host,
        "runtime_dir": runtime_dir,
        "job": job,
    }


def channel_open(ch: int, run: dict[str, Any]) -> ChannelOpen:
    return {"type": "open", "ch": ch, "run": run}


def channel_data(ch: int, data: bytes) -> ChannelData:
    return {"type": "data", "ch": ch, "data": data}


def channel_close(ch: int, reason: str = "closed") -> ChannelClose:
    return {"type": "close", "ch": ch, "reason": reason}


def node_notice(message: str) -> NodeNotice:
    return {"type": "notice", "message": message}


def read_node_message(message: Any) -> NodeMessage | None:
    """A node-stream message read by its type; None when it is malformed or of another type
    (a peer newer than us may send more kinds: they are skipped, never fatal)."""
    data = as_dict(message)
    kind = data.get("type")
    if kind == "node":
        versions = [as_int(v) for v in as_list(data.get("protocol"))]
        lo, hi = (versions + [None, None])[:2]
        return node_hello(
            as_str(data.get("tdbg")) or "?",
            (lo or 0, hi or 0),
            as_str(data.get("host")) or "",
            as_str(data.get("runtime_dir")) or "",
            as_str(data.get("job")) or "",
        )
    if kind == "notice":
        return node_notice(as_str(data.get("message")) or "")
    ch = as_int(data.get("ch"))
    if ch is None:
        return None
    if kind == "open" and isinstance(data.get("run"), dict):
        return channel_open(ch, dict(data["run"]))
    if kind == "data" and isinstance(data.get("data"), bytes):
        return channel_data(ch, data["data"])
    if kind == "close":
        return channel_close(ch, as_str(data.get("reason")) or "closed")
    return None
