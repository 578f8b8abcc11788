"""``tdbg-tui --job``: every rank of one distributed job on one screen (``JobScreen``)."""

from __future__ import annotations

import time
from typing import Any

from textual import work
from textual.message import Message
from textual.screen import Screen

from tdbg.connect.client import ConnectError
from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_nodes import NodesJob
from tdbg.model.job_profile import JobProfile
from tdbg.model.run_state import RunState
from tdbg.protocol.messages import command_args
from tdbg.protocol.step_runs import coalesced
from tdbg.tui.base_app import TdbgBaseApp
from tdbg.tui.ringer import FindingRinger
from tdbg.tui.screens.job import JobScreen, RankScreen
from tdbg.tui.screens.job_profile import JobProfileScreen
from tdbg.tui.screens.job_scale import ScaleJobScreen
from tdbg.tui.screens.waiting import WaitingScreen
from tdbg.tui.sources.job import JobSource, RankBatches

REPAINT_INTERVAL = 1 / 4  # seconds: new data repaints at most this often (keys act at once)
# Seconds between judgements of the job (stragglers, divergence, hangs), when ranks sent
# anything: at 64 ranks batches arrive ~160 times a second and one judgement costs ~15 ms, so
# judging after each batch took the TUI's whole core (benchmarks/job_tui.py).
JUDGE_INTERVAL = 1 / 4
# A large job's nodes summarise twice a second: judging or repainting it more often shows
# nothing newer (at 1,024 ranks each costs a few ms).
SUMMARY_INTERVAL = 1 / 2


class JobApp(TdbgBaseApp):
    """The job view. One worker reads every rank; handlers fold batches into per-rank state."""

    source: JobSource

    class RanksReceived(Message):
        def __init__(self, batches: RankBatches) -> None:
            super().__init__()
            self.batches = batches

    def __init__(self, source: JobSource, replayed: tuple[Job, JobAlerts] | None = None) -> None:
        """``replayed``: a job already folded from recordings (``state.job_replay``)."""
        super().__init__()
        self.source = source
        self.job, self.alerts = replayed or (Job(source.job or "", {}), JobAlerts())
        # A large job: its nodes' summaries; ``job`` then holds only the ranks opened whole.
        self.nodes = NodesJob(source.job or "") if source.aggregated else None
        self.revision = 1 if replayed else 0
        self._painted = -1
        self._shown = (-1, -1)
        self._unfolded: dict[int, list[dict[str, Any]]] = {}  # rank -> messages not folded yet
        self._judged = self.revision if replayed else -1  # the revision last judged...
        self._judged_at = 0.0  # ...and when (monotonic seconds)
        self.notices: list[str] = []
        self.node_lines: list[str] = []  # an ssh job's nodes that are not read, version mismatch
        self.job_profile: JobProfile | None = None  # the last `p` on the job screen
        self._rank_screen: RankScreen | None = None  # the one rank screen, re-pointed on Enter
        # The bell on the first finding of each kind (TDBG_BELL=0 or --no-bell: off); a job
        # replayed from recordings never rings: nothing in it is news.
        self.ringer = FindingRinger()
        self.ringer.enabled = self.ringer.enabled and replayed is None
        self.rings: list[str] = []  # the kinds rung for, in order (tests read it)

    def get_default_screen(self) -> Screen[Any]:
        if self.nodes is not None:
            return ScaleJobScreen(id="job")
        return JobScreen(id="job")

    def on_mount(self) -> None:
        self.set_interval(REPAINT_INTERVAL, self._repaint)
        self._pump()

    @work(thread=True, exclusive=True, group="source")
    def _pump(self) -> None:
        source = self.source

        try:
            source.open(self.post_message)
        except ConnectError:
            return
        for batches in source.batches():
            self.post_message(self.RanksReceived(batches))

    # --- what the source says: one handler per message type --------------------------------

    def on_job_source_wait_started(self, event: JobSource.WaitStarted) -> None:
        if not isinstance(self.screen, WaitingScreen):
            self.push_screen(WaitingScreen(event.what))

    def on_job_source_nodes_checked(self, event: JobSource.NodesChecked) -> None:
        self._show_nodes(event.lines)

    def on_job_source_warning_raised(self, event: JobSource.WarningRaised) -> None:
        self.notices.append(event.text)
        self.notify(event.text, severity="warning")

    def _show_nodes(self, lines: list[str]) -> None:
        for line in lines:
            if line not in self.node_lines:  # new: also a toast, seen over the waiting screen
                self.notices.append(line)
                self.notify(line, severity="warning")
        self.node_lines = lines
        for screen in self.screen_stack:
            if isinstance(screen, JobScreen) and screen.is_mounted:
                screen.show_nodes(lines)

    def on_job_app_ranks_received(self, event: RanksReceived) -> None:
        if not self.screen_stack:
            return  # the app is shutting down: its screens are gone before its worker
        if isinstance(self.screen, WaitingScreen):
            self.pop_screen()
        self.job.job = self.source.job or self.job.job
        for rank, messages in event.batches.items():
            self._unfolded.setdefault(rank, []).extend(messages)

    def fold(self) -> None:
        """Fold what the ranks sent into their states, a rank's step batches merged into one
        (at 64 ranks ~640 batches a second arrive; each costs its fixed decode once, not 640
        times). Runs with the repaint tick, so the state is at most one tick behind."""
        pending, self._unfolded = self._unfolded, {}
        for rank, messages in pending.items():
            for message in coalesced(messages):
                self._fold_one(rank, message)
        summaries = self.source.take_summaries() if self.nodes is not None else {}
        if self.nodes is not None:
            if summaries and isinstance(self.screen, WaitingScreen):
                self.pop_screen()
            self.nodes.job = self.source.job or self.nodes.job
            for node, summary in summaries.items():
                self.nodes.update(node, summary)
            problems: dict[str, str] = getattr(self.source, "problems", {})
            for node, why in list(problems.items()):  # nodes not read now (reconnecting)
                if node in self.nodes.nodes and node not in self.nodes.lost:
                    self.nodes.node_lost(node, why)
                    summaries = summaries or {node: self.nodes.nodes[node]}
        if pending or summaries:
            self.revision += 1

    def _fold_one(self, rank: int, message: dict[str, Any]) -> None:
        if message.get("type") == "hello":  # a rank attached (or restarted): start anew
            run = {k: v for k, v in message.items() if k != "type"}
            self.job.ranks[rank] = RunState(run)
            self.job.ranks[rank].mark("live")
            self.job.ranks = dict(sorted(self.job.ranks.items()))
            if isinstance(self.screen, RankScreen) and self.screen.rank == rank:
                self.screen.show(self.job.ranks[rank])
            return
        state = self.job.ranks.get(rank)
        if state is None:
            return
        state.apply(message)
        if message.get("type") == "bye":
            state.mark("ended", str(message.get("reason") or "closed"))

    def judge(self) -> None:
        """Compare the ranks (job alerts) when anything arrived since the last judgement, at
        most every JUDGE_INTERVAL."""
        now = time.monotonic()
        every = SUMMARY_INTERVAL if self.nodes is not None else JUDGE_INTERVAL
        if self._judged == self.revision or now - self._judged_at < every:
            return
        self._judged, self._judged_at = self.revision, now
        raised = self.alerts.update(self.nodes if self.nodes is not None else self.job)
        for finding in raised:
            if not finding.cleared:
                self.notices.append(finding.message)
        if self.ringer.enabled:
            for alert in self.ringer.new_findings(raised, self.job):
                self.rings.append(alert.kind)
                self.ring(self.ringer.sequence(alert, f"job {self.job.job or '?'}"))

    def _repaint(self) -> None:
        if not self.screen_stack:
            return
        self.fold()
        self.judge()
        screen = self.screen
        if isinstance(screen, RankScreen):
            screen.repaint()
        elif isinstance(screen, JobProfileScreen) and self.job_profile is not None:
            screen.show(self.job_profile, self.job)
        elif isinstance(screen, JobScreen) and (self.revision, self._judged) != self._shown:
            if screen.show(self.job, self.alerts):
                self._painted = self.revision
                self._shown = (self.revision, self._judged)  # new data, or new alerts on it
        elif isinstance(screen, ScaleJobScreen) and self.nodes is not None:
            # Repainted once per judgement (SUMMARY_INTERVAL), not per summary that came in.
            fresh = self._judged != self._shown[1]
            if fresh and screen.show(self.nodes, self.alerts):
                self._painted = self.revision
                self._shown = (self.revision, self._judged)

    def repaint_job(self) -> None:
        """Repaint the job screen now (it changed what it shows: a node opened or closed)."""
        self._shown = (-1, -1)
        self._repaint()

    # --- drilling into one rank ---------------------------------------------------------------
    def open_rank(self, rank: int) -> None:
        if self.nodes is not None and rank not in self.job.ranks:
            # A large job: ask the rank's node for its whole stream; its screen fills in when
            # the rank's hello arrives (_fold_one shows the new state).
            node = self.nodes.rank_node.get(rank)
            if node is None or not self.source.subscribe(rank, node):
                self.notify(self.source.send_error or f"rank {rank} cannot be opened")
                return
            self.job.ranks[rank] = RunState({"name": f"rank {rank}", "rank": rank})
        state = self.job.ranks.get(rank)
        if state is None:
            return
        screen = self._rank_screen
        if screen is None:  # built once; installed, so that Esc keeps it for the next Enter
            screen = self._rank_screen = RankScreen(rank, id="rank")
            self.install_screen(screen, "rank")
        else:
            screen.point_at(rank)
        self.push_screen(screen)
        screen.show(state)

    def close_rank(self, rank: int) -> None:
        """Back from a rank's screen: in a large job its whole stream is given back."""
        if self.nodes is not None:
            self.source.unsubscribe(rank)
            self.job.ranks.pop(rank, None)

    def profile_job(self) -> None:
        """``p`` on the job screen: the profile command, with the single-run form's defaults, to
        every rank at once (a rank that has ended or cannot be reached is named, not waited
        for); the comparison screen follows the answers as they fold in."""
        args = command_args("profile", {})
        profile = JobProfile(args)
        for rank, state in self.job.ranks.items():
            if state.ended:
                profile.unsent[rank] = f"not running ({state.end_reason or 'ended'})"
                continue
            mid = self.source.send(rank, "profile", **args)
            if mid is None:
                profile.unsent[rank] = self.source.send_error or "not sent"
                continue
            state.sent(mid, "profile", args)
            profile.sent[rank] = mid
        self.job_profile = profile
        screen = JobProfileScreen()
        self.push_screen(screen)
        screen.show(profile, self.job)

    def send_command(self, command: str, **args: Any) -> int | None:
        """A deep-dive command from the rank screen: to that rank's probe."""
        screen = self.screen
        if not isinstance(screen, RankScreen):
            return None
        mid = self.source.send(screen.rank, command, **args)
        if mid is None:
            self.notify(self.source.send_error or f"{command} not sent", severity="warning")
            return None
        self.job.ranks[screen.rank].sent(mid, command, args)
        return mid
