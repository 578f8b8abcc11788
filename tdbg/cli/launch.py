"""The TUI launchers: each resolves and attaches before its app starts, so a mistake is one line."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from textual.app import App

from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.runtime import discover
from tdbg.connect.targets import Discover, Job, LocalSocket, Recording, Remote, Target, resolve
from tdbg.recording.reader import RecordingError
from tdbg.tui.app import TdbgApp, make_app
from tdbg.tui.sources.base import DiscoverySource, SocketSource, Source, Stoppable

# The job screen's and the replay's modules are imported where they are opened: a single live
# run (the usual case) does not wait for them before its first frame.
if TYPE_CHECKING:
    from tdbg.connect.node_link import Spawned
    from tdbg.tui.sources.job import JobSource


def error(message: str) -> int:
    print(f"tdbg-tui: error: {message}", file=sys.stderr)
    return 2


def _run(app: App[int], source: Stoppable | None = None) -> int:
    """Run ``app`` until the user quits, then close its source; the app's exit code."""
    try:
        result = app.run()
    finally:
        if source is not None:
            source.close()
    return int(result or app.return_code or 0)


def app_for(
    target: str | None,
    more: Sequence[str] = (),
    ssh_options: Sequence[str] = (),
    remote_tdbg: str = "tdbg",
) -> tuple[App[int], Stoppable | None]:
    """The app ``tdbg-tui [TARGET | URL [URL ...]]`` shows, and the source to close after it.

    The first connection is made here, before the App starts, so that a wrong path, a socket
    that is not tdbg or a version mismatch is one line (ConnectError; RecordingError for a
    recording that is not one). ``ssh://`` targets (several: one per node) are listed here over
    ssh for the same reason. A recording opens the replay; the name the ranks of one job share,
    the job screen (as ``--job JOB``).
    """
    texts = [t for t in (target, *more) if t is not None]
    if len(texts) > 1:  # several: one per node, all ssh://
        resolved: Target | None = None
    else:
        resolved = resolve(texts[0] if texts else None)  # --host URL alone counts too
    source: Source
    if resolved is None or isinstance(resolved, Remote):
        from tdbg.tui.sources.remote import remote_source  # ssh machinery only when asked

        source = remote_source(texts, ssh_options, remote_tdbg)
    elif isinstance(resolved, Recording):
        from tdbg.tui.replay_app import ReplayApp, load

        return ReplayApp(load(texts[0])), None
    elif isinstance(resolved, Job):
        from tdbg.tui.job_app import JobApp

        job_source = job_source_for(resolved.job)
        return JobApp(job_source), job_source
    elif isinstance(resolved, Discover):
        source = DiscoverySource(resolved.directory)
        entries = discover(resolved.directory)
        if len(entries) == 1:
            try:
                source = SocketSource(client=ProbeClient.connect(entries[0].socket))
            except ConnectError:
                pass  # it may be going away; discovery keeps looking
    else:
        assert isinstance(resolved, LocalSocket)
        client = ProbeClient.connect(resolved.path)
        source = SocketSource(client=client, directory=resolved.path.parent)
    return make_app(source), source


def launch(
    target: str | None,
    more: Sequence[str] = (),
    ssh_options: Sequence[str] = (),
    remote_tdbg: str = "tdbg",
    compare: Sequence[str] = (),
) -> int:
    """``tdbg-tui [TARGET | URL [URL ...]] [--compare FILE ...]``: the app for the TARGETs
    (``app_for``), with the recordings to compare drawn under its loss, until the user quits;
    its exit code, or one line on stderr and exit code 2 when it cannot start."""
    try:
        baselines = []
        if compare:  # imported for --compare only: a live run's first frame does not wait
            from tdbg.model.recordings import load_run

            baselines = [(Path(path).name, load_run(path)) for path in compare]
        app, source = app_for(target, more, ssh_options, remote_tdbg)
    except (ConnectError, RecordingError) as exc:
        return error(str(exc))
    if baselines:
        if not isinstance(app, TdbgApp):
            if source is not None:
                source.close()
            return error("--compare draws under one run's loss: not on a job's screen")
        app.compare_with(baselines)
    code = _run(app, source)
    from tdbg.tui.replay_app import ReplayApp  # loaded already where the app is one

    if isinstance(app, ReplayApp) and app.timeline.note:
        print(f"tdbg-tui: {app.timeline.note}", file=sys.stderr)
    return code


def run_replay(path: str) -> int:
    """``tdbg-tui replay FILE``: show the recording at ``path`` until the user quits; one line
    on stderr and exit code 2 when it is not a recording. The caller parses the command line."""
    from tdbg.tui.replay_app import ReplayApp, load

    try:
        app = ReplayApp(load(path))
    except RecordingError as exc:
        return error(str(exc))
    code = _run(app)
    if app.timeline.note:
        print(f"tdbg-tui: {app.timeline.note}", file=sys.stderr)
    return code


def launch_nodes(
    texts: list[str],
    hostfile: str | None,
    job: str | None,
    ssh_options: list[str],
    remote_tdbg: str,
) -> int:
    """``tdbg-tui ssh://node1 ssh://node2 ... | --hostfile F [--job JOB]``: the job across the
    nodes (one ssh per node carries its ranks), or the single-run screen when the nodes' runs
    are not one job's ranks. A bad node list, no answer or several jobs: one line, exit 2."""
    from tdbg.tui.job_app import JobApp
    from tdbg.tui.sources.remote_job import RemoteJobSource, remote_job_source  # ssh: if asked

    try:
        source = remote_job_source(texts, hostfile, job, ssh_options, remote_tdbg)
    except ConnectError as exc:
        return error(str(exc))
    app: App[int] = JobApp(source) if isinstance(source, RemoteJobSource) else make_app(source)
    return _run(app, source)


def launch_job(
    job: str | None, directory: Path | None = None, spawned: Spawned | None = None
) -> int | None:
    """``tdbg-tui --job JOB``: the job screen for JOB (waiting for its ranks). With ``job``
    None (``tdbg-tui`` alone): the job screen when every local run is a rank of one job; None
    when that is not so, and the caller goes on as for single runs. ``spawned``: the job's
    local bridge, started before the TUI's imports (``spawn_local_bridge``)."""
    from tdbg.connect.jobs import local_job
    from tdbg.tui.job_app import JobApp

    job = job if job is not None else local_job(directory)
    if job is None:
        return None
    source = job_source_for(job, directory, spawned)
    return _run(JobApp(source), source)


def job_source_for(
    job: str, directory: Path | None = None, spawned: Spawned | None = None
) -> JobSource:
    """The source for local job ``job``: every rank read whole, or, past SCALE_FROM ranks,
    read through a bridge of their own that sends summaries (as a node of a multi-node job;
    ``spawned``: that bridge, started already)."""
    from tdbg.connect.jobs import SCALE_FROM, job_size
    from tdbg.tui.sources.job import JobSource
    from tdbg.tui.sources.remote_job import local_job_source  # with the ssh parts

    if job_size(discover(directory), job) > SCALE_FROM:
        return local_job_source(job, directory, spawned)
    if spawned is not None:  # the job shrank meanwhile (ranks ended): read whole after all
        spawned.close()
    return JobSource(job, directory)


def launch_job_replay(paths: list[Path]) -> int:
    """``tdbg-tui --job DIR`` or ``--job A.rank0.tdbg B.rank1.tdbg ...``: the ranks'
    recordings replayed as one job (RecordingError for a file that is not one)."""
    from tdbg.model.job_replay import replay_job
    from tdbg.tui.job_app import JobApp
    from tdbg.tui.sources.job_replay import RecordedJobSource

    job, alerts = replay_job(paths)
    return _run(JobApp(RecordedJobSource(job.job), (job, alerts)))
