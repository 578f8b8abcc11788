"""The probe's thread: a selector loop serving the socket, turning pending steps into records,
keeping history and fanning each encoded batch out to every client."""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from tdbg import __version__
from tdbg.connect.runtime import waiting_pids
from tdbg.probe.alerts import AlertRules
from tdbg.probe.log import warn
from tdbg.probe.serving.clients import ClientLoop
from tdbg.probe.serving.commands import CommandDesk
from tdbg.probe.serving.connection import Buckets, Connection
from tdbg.probe.serving.console_feed import ConsoleFeed
from tdbg.probe.serving.endpoint import Endpoint, EndpointError
from tdbg.probe.serving.history import History
from tdbg.probe.serving.metric_alerts import nonfinite_metric_alerts
from tdbg.probe.serving.nan_origin import KIND as ORIGIN_KIND
from tdbg.probe.serving.nan_origin import NanOrigin, skipped_alert
from tdbg.probe.serving.recorder import Recorder
from tdbg.probe.serving.sampled_feed import SampledFeed
from tdbg.probe.serving.stacks import last_collective, stuck_where, thread_stack
from tdbg.probe.serving.system import SystemSampler
from tdbg.probe.training.inbox import Inbox
from tdbg.probe.training.metrics import MetricsHistory, PendingMetrics
from tdbg.probe.training.pending import (
    USUAL_EXTRAS,
    LeanHanded,
    PendingStep,
    UsualStep,
    usual_ready,
    usual_record,
)
from tdbg.protocol.framing import ProtocolError, negotiate, pack
from tdbg.protocol.messages import (
    Layers,
    ProbeHealth,
    ProbeStats,
    RunInfo,
    Synced,
    System,
    WatchedOptimizer,
    bye_message,
    layers_message,
    metrics_message,
    welcome_message,
)
from tdbg.protocol.messages.alert import STUCK_AT, Alert
from tdbg.protocol.steps import StepRecord, pack_steps

TICK_SECONDS = 0.1  # steps are batched and fanned out at 10 Hz
STATS_SECONDS = 1.0  # system and probe messages
INODE_CHECK_SECONDS = 10.0
MAX_RESOLVE_PER_TICK = 2000
LIVE_FRAME_BYTES = 2 << 20  # a live steps frame is split to stay well under the 4 MiB cap
MAX_EVENTS_PER_TICK = 256  # job and activation messages sent per wakeup
# How long stopping waits for the probe's threads to finish what they are doing (the last tick,
# the recording's end, a dive's analysis). Normally milliseconds; the bound is for a stuck
# thread. It is generous because a thread still inside a torch call when the interpreter exits
# aborts the whole process ("terminate called without an active exception", exit 134).
STOP_SECONDS = 10.0
# How long the sampler thread may spend at stop on work already queued (a sample's statistics:
# milliseconds each): what the run took before it ended reaches the clients and the recording
# instead of being dropped (a short run on a busy machine lost its last samples), within R54's 1 s.
DRAIN_SECONDS = 0.5
# How long stopping waits for the last steps' device copies (a GPU run's losses are read back
# a tick late, loss_ring.py): normally a millisecond or two; never past the drain's second
# above (R54: the whole stop within 1 s).
FINAL_COPY_SECONDS = 0.3
# How long a run that ended keeps serving for a client waiting for a run here that has not
# attached yet (its note, connect/runtime.py): a client that got no CPU for the run's whole
# life still gets it whole. Within the 1 s an exit may take (R54), and only while such a
# client is waiting (a person picking among runs leaves no note).
LINGER_SECONDS = 1.0
LINGER_LOOK_SECONDS = 0.05  # how often a lingering probe looks at the notes
METRICS_PER_FRAME = 5000  # points: well under the 4 MiB frame with 64-character names
NONFINITE_ALERTS = frozenset({"nonfinite_loss", "nonfinite_grad", ORIGIN_KIND})


class ProbeServer(ClientLoop):
    """Owns the socket, the history and the probe thread(s); the training thread only appends
    to ``handoff`` (:class:`Inbox`: bounded deques, appending never blocks)."""

    def __init__(
        self,
        run_info: RunInfo,
        layer_names: list[str],
        layer_numel: list[int],
        rank: int,
        stats: Callable[[], ProbeStats],
        on_error: Callable[[BaseException], None],
        directory: Any = None,
        frozen: list[int] | None = None,
        on_grad_device_time: Callable[[float], None] | None = None,
        on_costs: Callable[[list[tuple[int, float, float, bool]]], None] | None = None,
        recorder: Recorder | None = None,
        layer_models: list[int] | None = None,
        layer_types: list[str] | None = None,
        layer_facts: Mapping[str, list[str] | list[int]] | None = None,
    ) -> None:
        # The one hand-off from the training thread; its queues by the names this thread reads.
        self.handoff = Inbox()
        self.inbox: deque[PendingStep | UsualStep | LeanHanded] = self.handoff.steps
        self.consumed = 0  # written by the probe thread only
        self.layer_names = layer_names
        self.layer_numel = layer_numel
        self.layer_models = layer_models  # per layer, its model's index (several models)
        self.layer_facts = layer_facts  # the model summary's columns (layer_facts.py)
        # From MetricsDesk (training thread): tdbg.log() batches, read off the training thread.
        self.metrics_inbox: deque[PendingMetrics] = self.handoff.metrics
        self.metrics = MetricsHistory()
        self._step_points: list[tuple[int, str, float]] = []
        self._layout: tuple[Any, ...] | None = None  # from relayout(), for the probe thread
        self.training_thread: int | None = None  # the thread that calls probe.step()
        self.nan_origin = NanOrigin(layer_names)
        self.nan_origin.layer_types = list(layer_types or [])  # names a NaN's module class
        self._extras: list[PendingStep] = []  # the resolved steps' pending objects, in order
        self.gone: list[int] = []  # layers whose parameters left the model
        self.layer_since: list[int] = []  # per layer, its first step (see Layers.since)
        self.gone_at: list[int] = []  # per gone layer, its first step without (Layers.gone_at)
        self.history = History(len(layer_names))
        self.rules = AlertRules(
            layer_names, frozen or [], lr_groups=(layer_facts or {}).get("lr_group", ())
        )
        self._on_grad_device_time = on_grad_device_time
        # The steps' costs, for the gradient interval's running averages: once a tick, in bulk.
        self._on_costs = on_costs
        self.endpoint = Endpoint(rank, run_info, directory)
        self._stats = stats
        self._on_error = on_error
        self._clients: list[Connection] = []
        self._closing: list[Connection] = []  # dropped, their goodbye still being sent
        self._buckets = Buckets()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sampler = SystemSampler()
        self.latest_system: System | None = None
        self.last_step: int | None = None
        self.last_step_time = time.monotonic()
        self.recent_costs: deque[tuple[float, float]] = deque(maxlen=200)
        self.sampled = SampledFeed()  # update ratios and histograms, for clients attaching later
        self.console = ConsoleFeed()  # the run's stdout/stderr lines (probe/console.py)
        self.rejected_peers = 0
        self.bye_reason = "shutdown"  # the goodbye's reason ("exit 1: ..." when an error ends it)
        self._attached_pids: set[int] = set()  # every client that got our welcome
        self._waiters: set[int] = set()  # waiting clients' pids, as the notes said last
        self._waiters_seen: set[int] = set()  # ... and any the notes named while lingering
        self._linger_until: float | None = None
        self._linger_look = 0.0
        self.side_alerts: deque[Alert] = self.handoff.alerts  # from the training thread
        self.desk: CommandDesk | None = None  # deep-dive commands: see take_commands
        self.auto_nan_hunt = False
        self.recorder = recorder  # watch(record=...): a sink beside the clients
        # Slow work for the sampler thread (profiler tables, snapshot files), so that neither
        # the training thread nor the socket loop waits on it.
        # Each with whether it still runs once stopping (a compaction does not: close drops it).
        self.work: queue.SimpleQueue[tuple[Callable[[], None], bool]] = queue.SimpleQueue()
        self._work_drained = threading.Event()  # set by the sampler thread as it ends
        if recorder is not None:
            # A recording starts with the layers as clients get them (several models' owners,
            # the model summary), not only their names.
            recorder.layers = self._layers_message()

    @property
    def serving(self) -> bool:
        """Something reads what the training thread hands over (the handoff is open)."""
        return self.handoff.open

    @serving.setter
    def serving(self, value: bool) -> None:
        self.handoff.open = value

    @property
    def appended(self) -> int:
        """Steps the training thread handed over, ever."""
        return self.handoff.appended

    @property
    def clients(self) -> list[Connection]:
        """The attached clients (the probe thread's list, copied: read from any thread)."""
        return list(self._clients)

    def relayout(
        self,
        names: list[str],
        numel: list[int],
        layer_models: list[int] | None,
        models: list[str],
        gone: list[int],
        optimizers: list[WatchedOptimizer],
        layer_types: list[str],
        since: list[int],
        gone_at: list[int],
        frozen: list[int],
        facts: Mapping[str, list[str] | list[int]] | None = None,
    ) -> None:
        """From the training thread: the watched layers changed (names only grow). The probe
        thread applies it before the next steps it sends (one reference swap: no lock)."""
        # Read with the names by index (names only grow): set before the new names go out.
        self.nan_origin.layer_types = layer_types
        self._layout = (
            names,
            numel,
            layer_models,
            models,
            gone,
            optimizers,
            since,
            gone_at,
            frozen,
            facts,
        )
        self.wake()

    def _apply_layout(self) -> list[bytes]:
        layout, self._layout = self._layout, None
        if layout is None:
            return []
        names, numel, layer_models, models, gone, optimizers, since, gone_at, frozen, facts = layout
        self.layer_names, self.layer_numel, self.layer_models = names, numel, layer_models
        self.layer_facts = facts
        self.gone, self.layer_since, self.gone_at = gone, since, gone_at
        self.history.n_layers = len(names)
        # A gone layer's NaN from its first step without it on is no norm (GradSample.gone);
        # a row read before it left is still its own.
        left = dict(zip(gone, gone_at, strict=True))
        self.rules.relayout(names, left, frozen, lr_groups=(facts or {}).get("lr_group", ()))
        self.nan_origin.gone = left
        self.nan_origin.layer_names = list(names)
        run = self.endpoint.run_info
        run["models"] = models
        run["optimizers"] = optimizers
        run["param_groups"] = sum(o["groups"] for o in optimizers)
        message = self._layers_message()
        frame = pack(message)
        if self.recorder is not None:
            self.recorder.layers = message  # what a recording created from now on starts with
            self.recorder.add(frame)
        return [frame]

    def _layers_message(self) -> Layers:
        return layers_message(
            self.layer_names,
            self.layer_numel,
            model=self.layer_models,
            models=self.endpoint.run_info.get("models"),
            gone=self.gone,
            since=self.layer_since,
            gone_at=self.gone_at,
            facts=self.layer_facts,
        )

    def take_commands(self, desk: CommandDesk, auto_nan_hunt: bool) -> None:
        """Serve deep-dive commands through ``desk`` (made after the server: its dives use the
        server's work queue); ``auto_nan_hunt`` starts a NaN hunt at the first non-finite alert."""
        self.desk = desk
        self.auto_nan_hunt = auto_nan_hunt

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, listen: bool = True) -> bool:
        """Bind and start the threads; False (training goes on) when serving is impossible.

        A recording probe runs its thread without a socket (``listen=False``, or binding failed).
        """
        listener = None
        if listen:
            try:
                listener = self.endpoint.open()
            except (EndpointError, OSError) as exc:
                warn(f"tdbg: not serving: {exc}")
        if listener is None and self.recorder is None:
            return False
        if listener is not None:
            self._selector.register(listener, selectors.EVENT_READ, "listen")
            if self.desk is not None and self.endpoint.path is not None:
                # One audit log per runtime directory, beside the sockets: every mutating
                # command, who sent it (pid/uid) and what became of it.
                self.desk.audit_path = self.endpoint.path.parent / "audit.jsonl"
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.serving = True
        for name, target in (("tdbg-server", self._serve), ("tdbg-sampler", self._sample_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return True

    @property
    def socket_path(self) -> str | None:
        return None if self.endpoint.path is None else str(self.endpoint.path)

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Send bye, close everything, unlink our files; never waits longer than ``timeout``.

        The threads are waited for, not just told: a probe thread left inside a torch call when
        the interpreter finalizes (a daemon thread re-taking the GIL there is unwound through
        torch's noexcept frames) aborts the training process at its very end, on a busy
        machine where a short wait runs out."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.serving = False  # socket_path reads None from now on
        self.wake()
        self.work.put((lambda: None, False))  # the sampler thread waits on it: wake it too
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            self._shutdown_connections()  # the thread is stuck; close from here
        with contextlib.suppress(OSError):
            self._wake_w.close()

    def abandon_after_fork(self) -> None:
        """In a forked child: drop inherited sockets, touch no files, start nothing."""
        self._stop.set()
        self.serving = False  # the child's socket_path is None: the parent's socket is not its
        for conn in [*self._clients, *self._closing]:
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._clients = []
        self._closing = []
        self.endpoint.close(unlink=False)
        if self.recorder is not None:
            self.recorder.abandon()  # the parent's file: the child writes nothing to it
        for s in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()

    # --- the probe thread -------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._serve_until_stopped()
        finally:
            # Even when the loop itself dies: the recording gets its end marker.
            if self.recorder is not None:
                self.recorder.close()
            self._shutdown_connections()

    def _serve_until_stopped(self) -> None:
        if self.recorder is not None:
            # File I/O on this thread only, never the training thread; compactions rewrite the
            # file on the sampler thread, into a temp file this thread then renames over it.
            self.recorder.submit = lambda fn: self.submit_work(fn, at_stop=False)
            self.recorder.open()
        next_tick = next_stats = time.monotonic()
        next_inode = next_tick + INODE_CHECK_SECONDS
        while not self._stop.is_set() or self._lingers(time.monotonic()):
            try:
                timeout = max(0.0, next_tick - time.monotonic())
                for key, mask in self._selector.select(timeout):
                    self._on_ready(key, mask)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_SECONDS
                    self._tick(now)
                if now >= next_stats:
                    next_stats = now + STATS_SECONDS
                    self._broadcast_stats(now)
                if now >= next_inode:
                    next_inode = now + INODE_CHECK_SECONDS
                    self._check_inode()
            except Exception as exc:  # never let the thread die silently
                self._on_error(exc)
                time.sleep(TICK_SECONDS)
        # What the sampler thread finishes at stop (the last samples) is in this last tick.
        stopping = time.monotonic()
        # The steps so far first: a GPU run's last losses start their copy from the device
        # here (loss_ring.py), before a wait that may take the drain's whole second, and are
        # back on the host for the last tick after it.
        with contextlib.suppress(Exception):
            self._tick(stopping)
        self._work_drained.wait(DRAIN_SECONDS + 0.5)
        with contextlib.suppress(Exception):
            self._tick(time.monotonic())
            # Steps whose device values are still being copied (a GPU run's last batch of
            # losses starts its copy in the tick just run): waited for, briefly, so that the
            # run's last steps are recorded rather than dropped; within the drain's second.
            deadline = min(time.monotonic() + FINAL_COPY_SECONDS, stopping + DRAIN_SECONDS + 0.5)
            while self.inbox and time.monotonic() < deadline:
                time.sleep(0.005)
                self._tick(time.monotonic())
            # Steps still waiting for the device (a GPU-bound run's queue longer than that):
            # counted as dropped in the last word, not left out of it unsaid.
            self.inbox.clear()
            # The run's last word on the probe: closed cleanly (or switched off by errors).
            self._broadcast_stats(time.monotonic())

    def _lingers(self, now: float) -> bool:
        """Stopped, yet serving on (at most LINGER_SECONDS) while a client that waits for a run
        where this one is listed has not attached, or has not got this run's history yet: a run
        that ended before a starved client looked still reaches it, whole, with its goodbye."""
        meta = self.endpoint.meta_path
        if meta is None or self.endpoint.listener is None:
            return False
        if self._linger_until is None:
            self._linger_until = now + LINGER_SECONDS
        if now >= self._linger_until:
            return False
        if now >= self._linger_look:
            self._linger_look = now + LINGER_LOOK_SECONDS
            self._waiters = waiting_pids(meta.parent)
            self._waiters_seen |= self._waiters
        if self._waiters - self._attached_pids - {os.getpid()}:
            return True
        return any(c.wants_write and c.peer_pid in self._waiters_seen for c in self._clients)

    def _shutdown_connections(self) -> None:
        bye = pack(bye_message(self.bye_reason))
        for conn in list(self._clients):
            # What is queued still goes first (the run's last steps), then the bye.
            conn.backlog.clear()
            conn.replaying = False
            conn.append(bye)
            with contextlib.suppress(OSError):
                conn.sock.setblocking(False)
                conn.flush()
            conn.close()
        self._clients = []
        for conn in self._closing:
            conn.close()
        self._closing = []
        self.endpoint.close()
        with contextlib.suppress(Exception):
            self._selector.close()

    def submit_work(self, fn: Callable[[], None], at_stop: bool = True) -> None:
        """Run ``fn`` on the sampler thread (never blocks the caller); ``at_stop``: still run
        when the probe stops before the thread got to it."""
        self.work.put((fn, at_stop))

    def _sample_loop(self) -> None:
        try:
            self._sample_until_stopped()
        finally:
            self._drain_work()
            self._work_drained.set()

    def _sample_until_stopped(self) -> None:
        next_sample = time.monotonic() + STATS_SECONDS
        while not self._stop.is_set():
            try:
                fn, at_stop = self.work.get(timeout=max(0.0, next_sample - time.monotonic()))
            except queue.Empty:
                fn, at_stop = None, False
            if self._stop.is_set():
                if fn is not None and at_stop:
                    self._run_work(fn)  # taken off the queue: not dropped (drained after)
                return
            if fn is not None:
                self._run_work(fn)
                self.wake()  # its result goes out at once, not at the next tick
                continue
            next_sample = time.monotonic() + STATS_SECONDS
            try:
                self.latest_system = self._sampler.sample()
            except Exception as exc:
                self._on_error(exc)

    def _run_work(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            self._on_error(exc)

    def _drain_work(self) -> None:
        """At stop: run what is still queued and wanted, within DRAIN_SECONDS."""
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline:
            try:
                fn, at_stop = self.work.get_nowait()
            except queue.Empty:
                return
            if at_stop:
                self._run_work(fn)

    def _welcome(self, conn: Connection, args: dict[str, Any], mid: int) -> None:
        try:
            proto = negotiate((args["proto_min"], args["proto_max"]))
        except ProtocolError as exc:
            self._reply_error(conn, exc.code, mid, str(exc))
            self._drop(conn)
            return
        conn.handshaken = True
        self._attached_pids.add(conn.peer_pid)
        conn.append(pack(welcome_message(proto, __version__, self.endpoint.run_info)))
        replay: list[Mapping[str, Any]] = [self._layers_message(), *self.history.replay()]
        replay.extend(dict(metrics_message(c), history=True) for c in self.metrics.replay())
        replay.extend([*self.sampled.replay(), *self.console.replay()])
        if self.desk is not None:
            replay.extend(self.desk.replay())
        for latest in (self.latest_system, self._probe_message()):
            if latest is not None:
                replay.append(latest.to_wire())
        synced: Synced = {"type": "synced"}
        replay.append(synced)
        conn.start_replay(replay)

    # --- periodic work ----------------------------------------------------------------------
    def _drain_inbox(self) -> list[tuple[StepRecord, Sequence[int]]]:
        self._extras = []  # kept in step with ``resolved``, even after a failed tick
        resolved: list[tuple[StepRecord, Sequence[int]]] = []
        inbox = self.inbox
        failed: Exception | None = None
        taken = 0
        # Bounded work per wakeup keeps the probe thread's GIL hold short.
        while inbox and taken < MAX_RESOLVE_PER_TICK:
            taken += 1
            handed = inbox[0]
            result: tuple[StepRecord, Sequence[int]] | None
            try:
                if isinstance(handed, tuple):  # a usual step, handed over as it was
                    result = (usual_record(handed), ()) if usual_ready(handed) else None
                    pending = USUAL_EXTRAS
                else:
                    pending = handed
                    result = pending.resolve()
            except Exception as exc:
                # A step that cannot be read must not block every later one, nor cost the
                # steps resolved before it in this tick: dropped, and on to the next. One
                # error a tick is counted (as when a failed tick was), however many failed.
                if inbox and inbox[0] is handed:
                    inbox.popleft()
                    self.consumed += 1
                failed = failed or exc
                continue
            if result is None:
                break  # device work still in flight: keep order, try next tick
            if not inbox or inbox[0] is not handed:
                # The training thread appended to the full hand-off meanwhile, which dropped
                # this step as its oldest: dropped, as the others it drops (popping now would
                # take the next step instead, lost unsaid).
                continue
            inbox.popleft()
            if pending.grad_device_time is not None and self._on_grad_device_time is not None:
                self._on_grad_device_time(pending.grad_device_time)
            self.consumed += 1
            resolved.append(result)
            self._extras.append(pending)
            self._step_points.extend(pending.points)
        ring = self.handoff.ring
        if ring is not None:
            try:
                ring.reclaim()  # a full ring's slots freed where no step asks for them
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            self._on_error(failed)
        return resolved

    def _with_stack(self, stall: Alert) -> Alert:
        """A stall alert with the training thread's Python stack: where it is stuck. ``where``
        is a field readers use; the prose keeps it too, for people and older readers."""
        stack = thread_stack(self.training_thread)
        out = stall
        if stack:
            where = stuck_where(stack)
            out = replace(out, message=f"{stall.message}{STUCK_AT}{where}", where=where)
            out = replace(out, stack=tuple(stack))
        collective = last_collective()
        if collective is not None:  # compared across ranks by `tdbg status`
            out = replace(out, collective=collective)
        return out

    def _drain_metrics(self) -> list[tuple[int, str, float]]:
        points, self._step_points = self._step_points, []
        inbox = self.metrics_inbox
        while inbox:
            try:
                got = inbox[0].resolve()
            except Exception as exc:
                inbox.popleft()
                self._on_error(exc)
                continue
            if got is None:
                break  # a copy in flight: keep the order
            inbox.popleft()
            points.extend(got)
        return points

    def _tick(self, now: float) -> None:
        layout_frames = self._apply_layout()
        resolved = self._drain_inbox()
        # A step pushed after a relayout may have been drained before it was seen above.
        layout_frames += self._apply_layout()
        alerts: list[Alert] = []
        while self.side_alerts:
            alerts.append(self.side_alerts.popleft())
        if resolved:
            self.last_step_time = now
            alerts.extend(self.rules.check_resumed(resolved[0][0].step))
        extras, self._extras = self._extras, []
        sampled: list[tuple[str, Mapping[str, Any]]] = []  # updates and histograms messages
        # Looked up once a tick, not per step: on short steps this loop is most of the probe
        # thread's GIL time.
        observe, check_step = self.nan_origin.observe, self.rules.check_step
        add_cost = self.recent_costs.append
        costs: list[tuple[int, float, float, bool]] = []  # for the interval's running averages
        add_step_cost = costs.append
        for (record, missing), pending in zip(resolved, extras, strict=True):
            if pending.skipped_layers is not None:
                alerts.append(
                    skipped_alert(
                        record.step,
                        self.layer_names,
                        pending.skipped_layers,
                        pending.skipped_layers.so_far,  # counted at its step, not now
                    )
                )
            # Where it began, before this step's other non-finite alerts: the first alert of a
            # NaN names the origin (and the automatic hunt heads its answer with it).
            found = observe(
                record.step,
                record.loss,
                record.grad_norms,
                pending.weight_nonfinite,
                pending.forward_origin,
                pending.changed_layers,
                pending.skipped_layers,
            )
            if found is not None:
                alerts.append(found)
                if self.desk is not None:
                    self.desk.runner.ctx.nan_origin = self.nan_origin.origin
            step_alerts = check_step(record, missing)
            if step_alerts:
                alerts.extend(step_alerts)
            if pending.update_layers is not None or pending.histograms is not None:
                measured, counted = self.sampled.take(record.step, pending)
                if measured is not None:
                    sampled.append(("updates", measured.to_wire()))
                    alerts.extend(self.rules.check_updates(measured))
                if counted is not None:
                    sampled.append(("histograms", counted.to_wire()))
            add_cost((record.probe_time, record.step_time))
            add_step_cost(
                (record.step, record.probe_time, record.step_time, pending.grads is not None)
            )
        if costs and self._on_costs is not None:
            self._on_costs(costs)
        if resolved:
            self.last_step = resolved[-1][0].step
        if not resolved and self.last_step is not None:
            for stall in self.rules.check_stall(self.last_step, now - self.last_step_time):
                alerts.append(self._with_stack(stall))
        frames: list[bytes] = layout_frames
        n_layers = len(self.layer_names)
        per_frame = max(1, LIVE_FRAME_BYTES // (100 + 4 * n_layers))
        for i in range(0, len(resolved), per_frame):
            msg = pack_steps([r for r, _ in resolved[i : i + per_frame]], n_layers)
            self.history.add(msg)
            frames.append(pack(msg))
            if self.recorder is not None:
                self.recorder.add_steps(msg, frames[-1])
        for kind, message in sampled:
            frames.append(pack(message))
            self._record(kind, frames[-1])
        points = self._drain_metrics()
        if points:
            alerts.extend(nonfinite_metric_alerts(self.metrics, self.metrics.add(points)))
            for i in range(0, len(points), METRICS_PER_FRAME):
                chunk = metrics_message(points[i : i + METRICS_PER_FRAME])
                frames.append(pack(dict(chunk)))
                if self.recorder is not None:
                    self.recorder.add(frames[-1])
        for a in alerts:
            self.history.alerts.append(a)
            frames.append(pack(a.to_wire()))
            if self.recorder is not None:
                self.recorder.add(frames[-1])
        if self.desk is not None:
            if self.auto_nan_hunt and any(a.kind in NONFINITE_ALERTS for a in alerts):
                self.desk.auto_nan_hunt()
            events = self.desk.runner.ctx.events
            for _ in range(min(len(events), MAX_EVENTS_PER_TICK)):
                event = events.popleft()
                frame = self._pack_event(event)
                if frame:
                    frames.append(frame)
                    self._record(event.get("type"), frame)
        frames.extend(self.console.frames(self.last_step, self._record))
        self._fan_out(frames, now)
        if self.recorder is not None:
            self.recorder.maybe_flush()

    def _record(self, kind: Any, frame: bytes) -> None:
        """Hand a broadcast frame to the recorder: jobs always kept, each of the other kinds
        thinned by compactions within its own budget."""
        if self.recorder is None:
            return
        if kind in ("activations", "system", "probe", "updates", "histograms", "console"):
            self.recorder.add_thinned(kind, frame)
        else:
            self.recorder.add(frame)

    def _pack_event(self, event: dict[str, Any]) -> bytes:
        """A job or activations message as a frame; one that cannot be sent fails its job."""
        assert self.desk is not None
        try:
            frame = pack(event)
        except Exception as exc:  # too large, or a value msgpack cannot carry
            self._on_error(exc)
            if event.get("type") != "job":
                return b""
            event = dict(event, state="failed", result=None, message=f"result not sendable: {exc}")
            frame = pack(event)
        self.desk.note(event)
        return frame

    def _fan_out(self, frames: list[bytes], now: float) -> None:
        if self._closing:
            self._flush_goodbyes(now)
        for conn in list(self._clients):
            if not conn.handshaken:
                reason = conn.timed_out(now)
                if reason:
                    self._drop(conn)
                continue
            for frame in frames:
                conn.queue(frame)
            if conn.slow_consumer(now):
                self._drop(conn, "slow_consumer")
                continue
            if conn.timed_out(now):
                self._drop(conn)
                continue
            self._flush(conn)

    def dropped(self) -> int:
        return max(0, self.appended - self.consumed - len(self.inbox))

    def _probe_message(self) -> ProbeHealth:
        costs = [(p, s) for p, s in self.recent_costs if p == p and s == s]
        probe_sum, step_sum = sum(p for p, _ in costs), sum(s for _, s in costs)
        stats = self._stats()
        return ProbeHealth(
            time=time.time(),
            clients=len(self._clients),
            dropped=self.dropped(),
            rejected_peers=self.rejected_peers,
            history_bytes=self.history.bytes,
            cost_fraction=probe_sum / step_sum if step_sum > 0 else None,
            grad_interval=stats["grad_interval"],
            grad_mode=stats["grad_mode"],
            overhead_budget=stats["overhead_budget"],
            errors=stats["errors"],
            last_error=stats["last_error"],
            steps_seen=stats["steps_seen"],
            disabled=stats["disabled"],
            closed=stats.get("closed", False),
            total_steps=stats.get("total_steps"),
            skipped_steps=stats.get("skipped_steps", 0),
            amp_skipped_steps=stats.get("amp_skipped_steps", 0),
            takes_commands=self.desk is not None,
            activations_every=self.desk.activations_every if self.desk is not None else None,
            jobs=tuple(self.desk.in_flight()) if self.desk is not None else (),
        )

    def _broadcast_stats(self, now: float) -> None:
        frames = [pack(self._probe_message().to_wire())]
        self._record("probe", frames[-1])
        if self.latest_system is not None:
            frames.append(pack(self.latest_system.to_wire()))
            self._record("system", frames[-1])
        self._fan_out(frames, now)

    def _check_inode(self) -> None:
        if self.endpoint.path is None:
            return  # recording without a socket: nothing to watch
        if self.endpoint.still_ours():
            return
        warn("tdbg: the probe's socket was removed or replaced; binding a new one")
        listener = self.endpoint.listener
        if listener is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(listener)
        self.endpoint.close()
        try:
            self._selector.register(self.endpoint.open(), selectors.EVENT_READ, "listen")
        except (EndpointError, OSError) as exc:
            warn(f"tdbg: not serving any more: {exc}")
