"""JobProfileScreen: ``p`` on the job screen — the ranks' profiles as they come, then the slowest
and fastest rank's top ops side by side, a line for each other rank; Esc closes it."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from tdbg.format import fmt_us
from tdbg.model.job import Job
from tdbg.model.job_profile import JobProfile, RankAnswer
from tdbg.model.rank_profiles import ProfileComparison, rank_line

OPS_SHOWN = 12  # the top ops of the two ranks: what fits a 24-line terminal with the header


class JobProfileScreen(ModalScreen[None]):
    """Dumb view: the app calls ``show(profile, job)`` on its repaint tick."""

    BINDINGS = [Binding("escape", "close", "Close")]
    DEFAULT_CSS = """
    JobProfileScreen { align: center middle; }
    JobProfileScreen #job-profile-box {
        width: 100%; max-width: 120; height: 100%; max-height: 40;
        border: round $primary; background: $surface; padding: 0 1;
    }
    """

    def __init__(self) -> None:
        super().__init__()
        self._shown: tuple[JobProfile, Job] | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="job-profile-box"):
            yield Static("", id="job-profile")

    def on_mount(self) -> None:
        box = self.query_one("#job-profile-box")
        box.border_title = "Profile of every rank"
        box.border_subtitle = "escape closes"
        box.focus()
        if self._shown is not None:
            self.show(*self._shown)

    def show(self, profile: JobProfile, job: Job) -> None:
        """Paint the profile as it stands (kept for the first paint when not mounted yet)."""
        self._shown = (profile, job)
        if self.is_mounted:
            self.query_one("#job-profile", Static).update(job_profile_view(profile, job))

    def action_close(self) -> None:
        self.dismiss(None)


def job_profile_view(profile: JobProfile, job: Job) -> RenderableType:
    """The progress while ranks are at it; then the comparison; the ranks with no result last."""
    answers = profile.answers(job)
    steps = profile.args.get("steps")
    head = Text(f"{profile.progress(answers)} (the next {steps} steps each)", style="bold")
    failed = [a for a in answers if a.error is not None]
    if not profile.finished(answers):
        lines = [f"rank {a.rank}: {a.progress}" for a in answers if not a.settled]
        return Group(head, Text("\n".join(lines)), _failures(failed))
    comparison = profile.comparison(answers)
    if comparison is None:
        return Group(head, Text("no rank answered", style="yellow"), _failures(failed))
    return Group(head, *_compared(comparison), _failures(failed))


def _compared(comparison: ProfileComparison) -> list[RenderableType]:
    slow, fast = comparison.slowest, comparison.fastest
    out: list[RenderableType] = [Text(f"slowest {rank_line(slow, wall=False)}", style="red")]
    if fast is not slow:
        out.append(Text(f"fastest {rank_line(fast, wall=False)}", style="green"))
    column = slow.column.replace("_", " ")
    table = Table(
        title=f"{column} per step, by op",
        title_justify="left",
        box=None,
        padding=(0, 1),
        expand=True,
    )
    table.add_column("op", no_wrap=True, overflow="ellipsis", ratio=1, min_width=12)
    sides = [slow] if fast is slow else [slow, fast]
    for side in sides:
        table.add_column(f"rank {side.rank}", justify="right", no_wrap=True)
    if fast is not slow:
        table.add_column("difference", justify="right", no_wrap=True)
    for op in comparison.ops[:OPS_SHOWN]:
        cells = [op.name, fmt_us(op.slow_us)]
        if fast is not slow:
            cells += [fmt_us(op.fast_us), op.difference_text]
        table.add_row(*cells)
    out.append(table)
    biggest = comparison.biggest_difference_line()
    if biggest is not None:
        out.append(Text(biggest))
    out += [Text(rank_line(other, wall=False), style="dim") for other in comparison.others]
    return out


def _failures(failed: list[RankAnswer]) -> Text:
    ranks = Text(style="yellow")
    for i, answer in enumerate(failed):
        ranks.append(("\n" if i else "") + f"rank {answer.rank}: no profile: {answer.error}")
    return ranks
