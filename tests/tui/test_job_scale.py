"""The job screen at scale under its Pilot: 64 ranks on 8 nodes fed as node summaries (built from
synthetic rank states by the bridge's own reducer). The worst ranks lead with the straggler and
the diverged rank, the spread names the outliers, the nodes are listed worst first; Enter on a
node shows its ranks, Enter on a rank asks its node for its whole stream and opens its screen,
Esc gives the stream back; the slowest rank over time is named from the windows summarised."""

from __future__ import annotations

from test_job_bell import FeedJobSource
from waiting import wait_for

from tdbg.model.job import Job
from tdbg.model.node_reduce import reduce_node
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.node_summary import NodeSummary
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.app import screen_text
from tdbg.tui.job_app import JobApp
from tdbg.tui.screens.job import RankScreen
from tdbg.tui.screens.job_scale import NodeTable, ScaleJobScreen
from tdbg.tui.widgets.rank_table import RankTable

RANKS, PER_NODE = 64, 8
SLOW, OFF, HIGH_LOSS = 21, 42, 9
LAYERS = ["embed", "fc1", "fc2"]


class SummaryFeed(FeedJobSource):
    """Node summaries as the test puts them; subscriptions recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.aggregated = True
        self.pending: dict[str, NodeSummary] = {}
        self.subscribed: list[tuple[int, str]] = []
        self.given_back: list[int] = []

    def take_summaries(self) -> dict[str, NodeSummary]:
        out, self.pending = self.pending, {}
        return out

    def subscribe(self, rank: int, node: str) -> bool:
        self.subscribed.append((rank, node))
        return True

    def unsubscribe(self, rank: int) -> None:
        self.given_back.append(rank)


def summaries(steps: int = 40) -> dict[str, NodeSummary]:
    """64 ranks, ``steps`` steps: rank SLOW waits 20 ms more for data, rank OFF's fc2 gradient
    differs, rank HIGH_LOSS's loss is far above the others'."""
    job = Job("feedjob", {})
    for rank in range(RANKS):
        state = RunState({"name": "t", "rank": rank, "world_size": RANKS, "job": "feedjob"})
        state.apply({"type": "layers", "names": LAYERS, "numel": [10] * 3})
        records = []
        for step in range(steps):
            data = 0.001 + (0.020 if rank == SLOW else 0.0)
            loss = 1.0 + rank * 1e-4 + (3.0 if rank == HIGH_LOSS else 0.0)
            norms = [1.0, 2.0, 3.0 + (0.5 if rank == OFF else 0.0)]
            records.append(
                StepRecord(step, float(step), loss, step_time=data + 0.015, data_time=data,
                           forward_time=0.010, backward_time=0.005, optimizer_time=0.0,
                           grad_norms=norms)
            )  # fmt: skip
        state.apply(pack_steps(records, 3))
        job.ranks[rank] = state
    out = {}
    for k in range(RANKS // PER_NODE):
        mine = {r: job.ranks[r] for r in range(k * PER_NODE, (k + 1) * PER_NODE)}
        out[f"node{k}"] = reduce_node(f"node{k}", "feedjob", mine)
    return out


def shown_ranks(app: JobApp) -> list[int]:
    table = app.screen.query_one(RankTable)
    return [int(str(key.value)) for key in table.rows]


async def test_64_ranks_as_worst_ranks_spread_and_nodes_with_drill_down() -> None:
    source = SummaryFeed()
    app = JobApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        source.pending = summaries()
        await wait_for(pilot, lambda: "64 of 64 ranks" in screen_text(app), "the first summaries")
        source.pending = summaries(60)  # the job moves on: the straggler has held 20 steps

        def ready() -> str | None:
            text = screen_text(app)
            # The table's rows change before the screen is painted again: wait for the paint.
            wanted = ("straggler", "rank_divergence", "loss outlier")
            return text if all(w in text for w in wanted) else None

        text = await wait_for(pilot, ready, "the straggler, diverged rank and outlier on screen")
        assert isinstance(app.screen, ScaleJobScreen)
        assert "64 of 64 ranks on 8 nodes" in text
        assert "Worst ranks of 64" in text
        order = shown_ranks(app)
        assert order[:2] == [OFF, SLOW]  # divergence is worse than a straggler
        assert HIGH_LOSS in order
        spread = str(app.screen.query_one("#job-spread-text").render())
        assert f"rank {HIGH_LOSS}" in spread.split("loss")[1].splitlines()[0]
        assert f"rank {SLOW}" in spread.split("step time")[1].splitlines()[0]
        nodes = app.screen.query_one(NodeTable)
        assert nodes.row_count == 8
        # Enter on a node: its ranks in the worst table; Esc: the whole job again.
        nodes.focus()
        await pilot.pause()
        top = nodes.selected_node
        assert top in ("node2", "node5")  # the nodes of the diverged and the slow rank lead
        await pilot.press("enter")
        await wait_for(pilot, lambda: f"Node {top}'s ranks" in screen_text(app), "the node's ranks")
        shown = shown_ranks(app)
        k = int(str(top)[4:])
        assert sorted(shown) == list(range(k * PER_NODE, (k + 1) * PER_NODE))
        await pilot.press("escape")
        await wait_for(pilot, lambda: "Worst ranks of 64" in screen_text(app), "all ranks")
        # Enter on a rank: its node is asked for its stream; its screen fills in as it comes.
        # (The cursor stays on the rank it was on in the node's ranks: one of the two.)
        table = app.screen.query_one(RankTable)
        table.focus()
        await pilot.pause()
        opened = table.selected_rank
        assert opened in (OFF, SLOW)
        await pilot.press("enter")
        assert source.subscribed == [(opened, f"node{opened // PER_NODE}")]
        await wait_for(pilot, lambda: isinstance(app.screen, RankScreen), "the rank's screen")
        run = {"name": "ddp", "rank": opened, "world_size": RANKS, "job": "feedjob"}
        source.feed(opened, {"type": "hello", **run})
        await wait_for(pilot, lambda: app.job.ranks[opened].run.get("name") == "ddp", "its hello")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, ScaleJobScreen), "back to the job")
        assert source.given_back == [opened] and opened not in app.job.ranks
        # 140 steps: the record over time names the straggler, from the windows summarised.
        source.pending = summaries(140)
        named = f"rank {SLOW} (persistent): the slowest in "
        await wait_for(pilot, lambda: named in screen_text(app), "the slowest rank over time")
        panel = str(app.screen.query_one("#job-slowest-list").render())
        assert panel.startswith(named) and panel.endswith("input wait")


async def test_the_scale_screen_fits_80x24() -> None:
    source = SummaryFeed()
    app = JobApp(source)
    async with app.run_test(size=(80, 24)) as pilot:
        source.pending = summaries()

        def ready() -> str | None:
            text = screen_text(app)
            panels = ("Worst ranks of 64", "Nodes (worst", "Slowest rank over time", "Job alerts",
                      "Quit")  # fmt: skip
            return text if all(p in text for p in panels) else None

        # Every panel and the footer: nothing pushed off the bottom.
        text = await wait_for(pilot, ready, "the scale screen, every panel and the footer")
        assert "64 of 64 ranks on 8 nodes" in text


async def test_the_node_table_s_cursor_stays_on_the_worst_until_moved_then_follows_its_node() -> (
    None
):
    # Nodes' first summaries come seconds apart: a cursor that followed the first node to come
    # scrolled the worst nodes out of sight (seen at 128 nodes) though nobody had moved it.
    from textual.app import App, ComposeResult

    from tdbg.model.job_scale import NodeRow

    def rows(*names: str) -> list[NodeRow]:
        return [NodeRow(n, "host", 8, 1, 1, 0.5, (0, 0.25), 0) for n in names]

    class OneTable(App[None]):
        def compose(self) -> ComposeResult:
            yield NodeTable()

    app = OneTable()
    async with app.run_test(size=(80, 12)) as pilot:
        table = app.query_one(NodeTable)
        table.show(rows("n7"))
        await pilot.pause()
        table.show(rows("n2", "n5", "n7"))  # worse nodes came: the top row is still the worst
        await pilot.pause()
        assert (table.cursor_row, table.selected_node) == (0, "n2")
        table.focus()
        await pilot.press("down")
        assert table.selected_node == "n5"
        table.show(rows("n1", "n2", "n5", "n7"))  # a cursor moved off the top follows its node
        await pilot.pause()
        assert (table.cursor_row, table.selected_node) == (2, "n5")
