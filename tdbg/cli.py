"""The ``tdbg`` (dump, ls, tui) and ``tdbg-tui`` entry points; never imports torch."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from tdbg import __version__
from tdbg.client import ConnectError, ProbeClient, resolve_target
from tdbg.protocol import ProtocolError, unpack_steps
from tdbg.runtime import discover, runtime_dir

EXIT_USAGE = 2


class CliError(Exception):
    """A one-line error for the user; exit code 2."""


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite numbers become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _seconds(value: float) -> float | None:
    return None if math.isnan(value) else value


def step_events(msg: dict[str, Any], layers: list[str]) -> Iterator[dict[str, Any]]:
    """One ``step`` JSON object per record of a ``steps`` message."""
    history = bool(msg.get("history"))
    for rec in unpack_steps(msg):
        norms = None
        if rec.grad_norms is not None:
            norms = {name: _finite(v) for name, v in zip(layers, rec.grad_norms, strict=False)}
        event: dict[str, Any] = {
            "type": "step",
            "step": rec.step,
            "time": rec.time,
            "loss": _finite(rec.loss),
            "lr": [_finite(v) for v in rec.lr],
            "grad_norm": _finite(rec.grad_total) if rec.grad_norms is not None else None,
            "grad_norms": norms,
            "step_time": _seconds(rec.step_time),
            "samples": _seconds(rec.samples),
            "tokens": _seconds(rec.tokens),
            "data_time": _seconds(rec.data_time),
            "forward_time": _seconds(rec.forward_time),
            "backward_time": _seconds(rec.backward_time),
            "optimizer_time": _seconds(rec.optimizer_time),
            "probe_time": _seconds(rec.probe_time),
        }
        if history:
            event["history"] = True
        yield event


def dump_events(client: ProbeClient, timeout: float | None) -> Iterator[dict[str, Any]]:
    """Translate the wire into the documented JSON events (see docs/dump.md)."""
    layers: list[str] = []
    hello: dict[str, Any] = {
        "type": "hello",
        "run": client.run,
        "proto": client.welcome.get("proto"),
        "server_version": client.welcome.get("server_version"),
        "layers": layers,
        "numel": [],
    }
    deadline = None if timeout is None else time.monotonic() + timeout
    for msg in _messages_until(client, deadline):
        mtype = msg.get("type")
        if mtype == "layers":
            # The probe sends its layers right after welcome: hello carries them.
            layers[:] = [str(n) for n in msg.get("names", [])]
            if hello:
                hello["numel"] = msg.get("numel", [])
                yield hello
                hello = {}
            else:
                yield {"type": "layers", "layers": list(layers), "numel": msg.get("numel", [])}
            continue
        if hello:
            yield hello
            hello = {}
        if mtype == "steps":
            yield from step_events(msg, layers)
        elif mtype == "alert":
            yield {k: _finite(v) for k, v in msg.items()}
        elif mtype == "system":
            yield {
                "type": "memory",
                "time": msg.get("time"),
                "host": msg.get("host"),
                "cuda": msg.get("cuda", []),
                "missing": msg.get("missing", []),
            }
            yield {
                "type": "gpu",
                "time": msg.get("time"),
                "gpus": msg.get("gpus", []),
                "missing": [m for m in msg.get("missing", []) if m.startswith("GPU")],
            }
        elif mtype == "probe":
            yield {k: _finite(v) for k, v in msg.items()}
        elif mtype == "synced":
            yield {"type": "synced"}
        elif mtype == "bye":
            yield {"type": "end", "reason": msg.get("reason")}
            return
        elif mtype == "error":
            yield {"type": "error", "code": msg.get("code"), "message": msg.get("message")}
    timed_out = deadline is not None and time.monotonic() >= deadline
    yield {"type": "end", "reason": "timeout" if timed_out else "disconnected"}


def _messages_until(client: ProbeClient, deadline: float | None) -> Iterator[dict[str, Any]]:
    """The client's messages until it closes or ``deadline`` passes (quiet spells included)."""
    if deadline is None:
        yield from client.messages()
        return
    while not client.peer_closed and time.monotonic() < deadline:
        for msg in client.messages(timeout=max(0.05, min(0.5, deadline - time.monotonic()))):
            yield msg
            if time.monotonic() >= deadline:
                return


def pick_target(target: str | None, wait: float | None) -> str:
    """The socket to attach to: the given target, or the only live run (waiting for one)."""
    if target is not None:
        return resolve_target(target)
    deadline = time.monotonic() + (wait or 0.0)
    while True:
        entries = discover()
        if len(entries) == 1:
            return str(entries[0].socket)
        if len(entries) > 1:
            listing = "; ".join(f"{e.socket} ({e.name})" for e in entries[:4])
            raise CliError(f"{len(entries)} runs found, name one: {listing}")
        if time.monotonic() >= deadline:
            raise CliError(f"no tdbg run found in {runtime_dir()} (start one with tdbg.watch)")
        time.sleep(0.2)


def cmd_dump(args: argparse.Namespace, out: TextIO) -> int:
    path = pick_target(args.target, args.timeout)
    client = ProbeClient.connect(path)
    steps = 0
    try:
        for event in dump_events(client, args.timeout):
            out.write(json.dumps(event, separators=(",", ":")) + "\n")
            if event["type"] == "step":
                steps += 1
                if args.count is not None and steps >= args.count:
                    break
            out.flush()
    finally:
        client.close()
    out.flush()
    return 0


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    entries = discover()
    if args.json:
        for e in entries:
            out.write(json.dumps(dict(e.meta, socket=str(e.socket))) + "\n")
        return 0
    if not entries:
        out.write(f"no tdbg runs in {runtime_dir()}\n")
        return 0
    for e in entries:
        started = time.strftime("%H:%M:%S", time.localtime(float(e.meta.get("start_time", 0))))
        out.write(
            f"{e.name:<20} pid {e.pid:<8} rank {e.meta.get('rank', 0):<3} "
            f"started {started}  {e.socket}\n"
        )
    return 0


def cmd_tui(args: argparse.Namespace, out: TextIO) -> int:
    from tdbg.tui.app import launch  # textual is loaded only for the TUI

    return launch(args.target)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tdbg", description="tdbg: live PyTorch training monitor")
    parser.add_argument("--version", action="version", version=f"tdbg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dump = sub.add_parser("dump", help="print a run's events as JSON lines")
    dump.add_argument("target", nargs="?", help="socket path, run .json or directory")
    dump.add_argument("--count", type=_positive_int, help="stop after N step events")
    dump.add_argument(
        "--timeout",
        type=_positive_float,
        help="wait at most S seconds for a run and stop after S seconds",
    )
    dump.set_defaults(func=cmd_dump)
    ls = sub.add_parser("ls", help="list live runs on this machine")
    ls.add_argument("--json", action="store_true", help="one JSON object per run")
    ls.set_defaults(func=cmd_ls)
    tui = sub.add_parser("tui", help="the full-screen monitor (same as tdbg-tui)")
    tui.add_argument("target", nargs="?", help="socket path, run .json or directory")
    tui.set_defaults(func=cmd_tui)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def run(argv: Sequence[str], prog: str = "tdbg") -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args, sys.stdout))
    except (CliError, ConnectError, ProtocolError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tdbg dump | head`): not an error; silence the flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


def tui_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tdbg-tui",
        description="Full-screen monitor of a PyTorch run. With no TARGET: attach to the only "
        "local run, pick among several, or wait for one to start.",
    )
    parser.add_argument("target", nargs="?", help="socket path, run .json or directory")
    parser.add_argument("--version", action="version", version=f"tdbg {__version__}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return cmd_tui(args, sys.stdout)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
