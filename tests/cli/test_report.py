"""`tdbg report`: a run's diagnosis from real recordings and a live run — verdicts first, the
evidence after, the same in text, --json and a self-contained --html page; a job's findings."""

from __future__ import annotations

import json
import math
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import Loop, OpenReader, linear_at

import tdbg
from tdbg.cli.main import run
from tdbg.cli.run_report import spark


def _nan_recording(path: Path) -> None:
    """A real run recorded: 8 good steps, then its first layer's weights turn NaN."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path, grad_every=1)
    loop.run(8, probe)
    with loop.torch.no_grad():
        linear_at(loop.model, 0).weight.fill_(math.nan)
    loop.run(4, probe)
    probe.close()


def test_a_nan_run_s_report_says_where_it_began_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nan.tdbg"
    _nan_recording(path)
    assert run(["report", str(path)]) == 0
    text = capsys.readouterr().out
    head, verdicts, evidence = text.split("\n\n")[:3]
    assert "TROUBLE" in head and "clean shutdown at step 11" in head
    first = verdicts.splitlines()[1]
    assert first.startswith("  ✗ the loss is non-finite since step 8"), verdicts
    assert "step 8" in verdicts.splitlines()[2]  # the probe's origin message, as evidence
    assert "12 (last step 11)" in evidence and "×" in evidence  # the chart marks the NaN

    assert run(["report", "--json", str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["level"] == "bad" and got["steps"] == 12 and got["loss_last"] == "nan"
    assert got["verdicts"][0]["step"] == 8 and got["verdicts"][0]["level"] == "bad"
    assert got["health"]["word"] == "ended"


def test_the_html_page_is_whole_and_needs_no_network(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nan.tdbg"
    _nan_recording(path)
    page = tmp_path / "report.html"
    assert run(["report", str(path), "--html", str(page)]) == 0
    capsys.readouterr()
    body = page.read_text()

    class Tags(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: list[str] = []
            self.refs: list[str] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.tags.append(tag)
            self.refs += [v or "" for k, v in attrs if k in ("src", "href")]

    tags = Tags()
    tags.feed(body)
    assert tags.tags.count("svg") == 2 and "polyline" in tags.tags and "rect" in tags.tags
    assert not tags.refs and "http" not in body  # nothing to fetch: opens offline
    assert "the loss is non-finite since step 8" in body
    assert not list(tmp_path.glob(".report.html*"))  # written whole, no temp file left


def test_a_live_input_bound_run_and_bad_input(
    runtime_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, name="starved")
    reader = probe_reader(probe)
    for _ in range(30):
        # The loader: most of each step, even when a busy machine slows the tiny model's own
        # work several times over (0.02 s read as healthy once in CI beside two burners).
        time.sleep(0.05)
        loop.step(probe)
    reader.wait(lambda r: len(r.records()) >= 30)
    assert run(["report"]) == 0  # the only run here
    text = capsys.readouterr().out
    assert "starved" in text.splitlines()[0] and "WARNINGS" in text.splitlines()[0]
    assert "! input-bound:" in text and "input wait" in text
    reader.close()
    probe.close()

    bad = tmp_path / "junk.tdbg"
    bad.write_bytes(b"\x00" * 64)
    assert run(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tdbg: error:") and len(err.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(["report", str(empty)]) == 2
    assert "no tdbg recordings" in capsys.readouterr().err
    assert run(["report", str(tmp_path / "job.html"), "--html", "/nonexistent/x.html"]) == 2


@pytest.mark.slow
def test_a_job_s_report_names_its_straggler_and_diverged_rank(
    straggler_job: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["report", str(straggler_job[0].parent)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("tdbg report · job ")
    findings = text.split("\n\n")[1]
    assert "straggler: rank 1" in findings and "rank divergence: rank 2" in findings
    assert findings.count("✗") == 1 and findings.count("!") == 1  # divergence bad, slow warn
    assert all(f"rank {r}" in text for r in (0, 1, 2))
    assert run(["report", "--json", *map(str, straggler_job)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert sorted(got["ranks"]) == ["0", "1", "2"] and got["level"] == "bad"


def test_the_sparkline_spans_its_range_and_marks_non_finite() -> None:
    line = spark([1.0, 2.0, 3.0, float("nan")])
    assert line.startswith("▁▅█×") and line.endswith("1 → nan")
    assert "(log)" in spark([1000.0, 1.0, 0.001])
