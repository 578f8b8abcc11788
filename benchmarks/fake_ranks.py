"""Synthetic ranks of a job served as real probes: one process serves its share of the ranks, one
Unix socket and one metadata file per rank in a runtime directory (a node's), speaking the
probe's side of the wire (preamble, welcome with the rank's run description, layers, the step
history, then a ``steps`` batch every 100 ms, ``system`` every second). Nothing of torch is
loaded: hundreds of torch processes would bury a 2-core machine and measure torch's start-up.

Every rank steps at ``--rate`` steps/s in lockstep (as DDP ranks do) with the same gradients,
except where a fault is asked for:

- ``--slow R``: rank R waits ``--slow-by`` (20 ms) more for each batch (a straggler in its
  input wait); with ``--slow-every P --slow-for L`` only for L steps of every P (a straggler
  that comes and goes);
- ``--diverge R``: rank R's last layer's gradient is 1.5x the others' from ``--diverge-at``;
- ``--hang R``: from ``--hang-at`` every rank stops stepping; a second later each says it
  stalled in collective #N (all_reduce) while rank R's last collective is #N-1, stuck in its
  data loader (the flight recorder's picture of one rank that never joined);
- a dead rank is a rank served by a process of its own that the caller kills;
- ``--gpu``: every rank trains on ``cuda:LOCAL_RANK`` and its ``system`` report carries its
  CUDA allocator's figures and NVML's (12 GiB allocated, 14 reserved, 13 peak, 87 % busy);
  ``--heavy R``: rank R holds twice the memory and its GPU is 40 % busy.

    python benchmarks/fake_ranks.py --ranks 0 1 2 3 --world 8 --runtime DIR [--job J] ...
"""

from __future__ import annotations

import argparse
import os
import selectors
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

TICK = 0.1  # seconds between a rank's step batches (the probe's own rate)
HISTORY = 200  # steps a rank has already run when a client attaches
MAX_BACKLOG = 8 << 20  # bytes queued to a client that does not read before it is dropped
STALL_AFTER = 1.0  # seconds after a hang before the ranks say they stalled


def node_dir(node: int) -> str:
    """A simulated node's name, and its runtime directory's."""
    return f"node{node:03d}"


@dataclass
class Faults:
    slow: int = -1
    slow_by: float = 0.02  # seconds the slow rank waits for its data, more than the others
    diverge: int = -1
    diverge_at: int = 0
    hang: int = -1
    hang_at: int = 1 << 62
    gpu: bool = False  # the ranks train on GPUs (their system reports say so)
    heavy: int = -1  # a rank holding twice the memory, its GPU less busy
    slow_every: int = 0  # the slow rank is slow for slow_for steps of every slow_every (0: always)
    slow_for: int = 0

    def slow_at(self, rank: int, step: int) -> bool:
        if rank != self.slow:
            return False
        return not self.slow_every or step % self.slow_every >= self.slow_every - self.slow_for


@dataclass
class _Client:
    sock: socket.socket
    rank: int
    out: bytearray = field(default_factory=bytearray)
    ready: bool = False


def serve(
    ranks: list[int],
    world: int,
    runtime: Path,
    rate: float,
    layers: int,
    faults: Faults,
    job: str = "bench-job",
    host: str | None = None,
    per_node: int = 0,
) -> int:
    """Serve ``ranks`` of a ``world``-rank job until killed (their sockets in ``runtime``; with
    ``per_node``, rank R's in ``runtime/node_dir(R // per_node)``, as on simulated nodes)."""
    from tdbg import __version__
    from tdbg.connect.runtime import socket_basename, write_private_json
    from tdbg.protocol.framing import MAX_INBOUND_FRAME, Decoder, negotiate, pack, preamble
    from tdbg.protocol.messages import alert_message
    from tdbg.protocol.messages.reports import CudaStats, GpuStats, HostStats, System
    from tdbg.protocol.steps import StepRecord, pack_steps
    from tdbg.tui.sources.synthetic import layer_names, step_records, system_message

    selector = selectors.DefaultSelector()
    pid, started = os.getpid(), time.time()
    host = host or socket.gethostname()
    names = layer_names(layers)
    runs: dict[int, dict[str, object]] = {}
    for rank in ranks:
        where = runtime / node_dir(rank // per_node) if per_node else runtime
        where.mkdir(mode=0o700, exist_ok=True)
        path = where / f"{socket_basename(rank, pid)}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(8)
        listener.setblocking(False)
        selector.register(listener, selectors.EVENT_READ, rank)
        runs[rank] = {
            "name": f"bench-rank{rank}", "pid": pid, "rank": rank,
            "host": node_dir(rank // per_node) if per_node else host,
            "argv": ["train.py"], "start_time": started, "cwd": str(runtime),
            "torch": "none", "device": f"cuda:{rank % 8}" if faults.gpu else "cpu",
            "commands": {}, "world_size": world,
            "local_rank": rank % 8, "job": job, "socket": str(path), "proto_min": 1,
            "proto_max": 1,
        }  # fmt: skip
        write_private_json(path.with_suffix(".json"), runs[rank])
    clients: list[_Client] = []
    decoders: dict[int, Decoder] = {}
    t0 = started - HISTORY / rate
    made: dict[int, StepRecord] = {}  # step -> its record: the same on every rank, as under DDP

    def steps(rank: int, start: int, count: int) -> bytes:
        for s in range(start, start + count):
            if s not in made:  # one step at a time: its numbers depend on the step alone
                made[s] = step_records(s, 1, layers, t0=t0, seed=0)[0]
        for s in [s for s in made if s < start - HISTORY]:
            del made[s]
        period = 1.0 / rate
        out = []
        for r in (made[s] for s in range(start, start + count)):
            data = period * 0.1 + (faults.slow_by if faults.slow_at(rank, r.step) else 0.0)
            busy = period * 0.9
            norms = r.grad_norms
            if rank == faults.diverge and r.step >= faults.diverge_at and norms:
                norms = [*norms[:-1], norms[-1] * 1.5]
            out.append(
                replace(r, time=t0 + r.step * period, step_time=data + busy, data_time=data,
                        forward_time=busy * 0.3, backward_time=busy * 0.55,
                        optimizer_time=busy * 0.1, grad_norms=norms)
            )  # fmt: skip
        return pack(dict(pack_steps(out, layers)))

    def system(rank: int) -> bytes:
        if not faults.gpu:
            return pack(dict(system_message(), time=time.time()))
        gib, more = 2**30, 2 if rank == faults.heavy else 1
        host = HostStats(rss=int(2.5 * gib), cpu_percent=103.0)
        cuda = CudaStats(rank % 8, "H100", 12 * gib * more, 14 * gib * more, 13 * gib * more)
        util = 40.0 if rank == faults.heavy else 87.0
        nvml = GpuStats(rank % 8, "NVIDIA H100", util, 15 * gib * more, 80 * gib)
        return pack(dict(System(time.time(), host, (cuda,), (nvml,)).to_wire()))

    def stalled(rank: int, step: int) -> bytes:
        behind = rank == faults.hang
        where = "train.py:42 in next_batch" if behind else "distributed.py:2501 in all_reduce"
        message = dict(alert_message("stalled", "warning", step, f"no step for 1 s — stuck at "
                                     f"{where}", [], time.time()))  # fmt: skip
        message["where"] = where
        message["stack"] = ["train.py:80 in main", where]
        message["collective"] = {
            "seq": faults.hang_at - (1 if behind else 0), "op": "gloo:all_reduce",
            "sizes": [[1024]], "state": "started", "group": ["0", "default_pg"],
        }  # fmt: skip
        return pack(message)

    def welcome(client: _Client, message: dict[str, object], step: int, hung: bool) -> None:
        args = message.get("args") or {}
        assert isinstance(args, dict)
        proto = negotiate((int(args["proto_min"]), int(args["proto_max"])))
        run = runs[client.rank]
        client.out += pack({"type": "welcome", "proto": proto, "server_version": __version__,
                            "run": run})  # fmt: skip
        client.out += pack({"type": "layers", "names": names, "numel": [1000] * layers})
        client.out += steps(client.rank, max(0, step - HISTORY), min(step, HISTORY))
        client.out += system(client.rank) + pack({"type": "synced"})
        if hung:
            client.out += stalled(client.rank, step)
        client.ready = True

    def flush(client: _Client) -> bool:
        try:
            while client.out:
                sent = client.sock.send(client.out)
                del client.out[:sent]
        except BlockingIOError:
            return len(client.out) < MAX_BACKLOG
        except OSError:
            return False
        return True

    def drop(client: _Client) -> None:
        if client in clients:
            clients.remove(client)
            selector.unregister(client.sock)
            client.sock.close()

    step = HISTORY
    begun = time.monotonic() - HISTORY / rate
    next_tick = next_system = time.monotonic()
    hung_since: float | None = None
    said_stalled = False
    while True:
        timeout = max(0.0, next_tick - time.monotonic())
        for key, _ in selector.select(timeout):
            if isinstance(key.data, int):  # a listener: a new client for that rank
                sock, _ = key.fileobj.accept()  # type: ignore[union-attr]
                sock.setblocking(False)
                client = _Client(sock, key.data, out=bytearray(preamble()))
                clients.append(client)
                decoders[id(client)] = Decoder(MAX_INBOUND_FRAME)
                selector.register(sock, selectors.EVENT_READ, client)
                continue
            client = key.data
            try:
                chunk = client.sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                drop(client)
                continue
            for message in decoders[id(client)].feed(chunk):
                if message.get("type") == "hello" and not client.ready:
                    welcome(client, message, step, said_stalled)
        now = time.monotonic()
        if now < next_tick:
            continue
        next_tick = now + TICK
        due = min(int((now - begun) * rate), faults.hang_at)
        if due >= faults.hang_at and hung_since is None:
            hung_since = now
        batches = {rank: steps(rank, step, due - step) for rank in ranks} if due > step else {}
        step = max(step, due)
        extra = {}
        if hung_since is not None and not said_stalled and now - hung_since >= STALL_AFTER:
            said_stalled = True
            extra = {rank: stalled(rank, step) for rank in ranks}
        sys_frames = {rank: system(rank) for rank in ranks} if now >= next_system else {}
        if sys_frames:
            next_system = now + 1.0
        for client in list(clients):
            if client.ready:
                client.out += batches.get(client.rank, b"") + extra.get(client.rank, b"")
                client.out += sys_frames.get(client.rank, b"")
            if not flush(client):
                drop(client)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--runtime", type=Path, required=True)
    p.add_argument("--job", default="bench-job")
    p.add_argument("--host", help="the host the ranks say they run on (a simulated node)")
    p.add_argument("--per-node", type=int, default=0, help="ranks per simulated node")
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--slow", type=int, default=-1)
    p.add_argument("--slow-by", type=float, default=0.02, help="seconds (default 20 ms)")
    p.add_argument("--gpu", action="store_true", help="the ranks report CUDA and NVML figures")
    p.add_argument("--heavy", type=int, default=-1, help="a rank holding twice the memory")
    p.add_argument("--slow-every", type=int, default=0, help="steps (default 0: always slow)")
    p.add_argument("--slow-for", type=int, default=0, help="steps slow of every --slow-every")
    p.add_argument("--diverge", type=int, default=-1)
    p.add_argument("--diverge-at", type=int, default=0)
    p.add_argument("--hang", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=1 << 62)
    args = p.parse_args(argv)
    faults = Faults(args.slow, args.slow_by, args.diverge, args.diverge_at, args.hang, args.hang_at,
                    args.gpu, args.heavy, args.slow_every, args.slow_for)  # fmt: skip
    return serve(args.ranks, args.world, args.runtime, args.rate, args.layers, faults, args.job,
                 args.host, args.per_node)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
