"""``tdbg report --html FILE``: the diagnosis as one self-contained page (inline SVG, offline)."""

from __future__ import annotations

import html
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tdbg.cli.errors import CliError

if TYPE_CHECKING:
    from tdbg.model.diagnosis import Diagnosis, JobDiagnosis

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.6em}
.bad{color:#b00020}.warn{color:#9a6700}.ok{color:#1a7f37}
li{margin:.3em 0}li p{margin:.1em 0 .1em 1.2em;color:#555;font-size:.92em}
table{border-collapse:collapse}td{padding:.15em .8em .15em 0;vertical-align:top}
td:first-child{color:#555;white-space:nowrap}svg{background:#fafafa;border:1px solid #ddd}
code{font-size:.92em}
"""
MARKS = {"bad": "✗", "warn": "!", "ok": "✓"}


def write_html(report: Diagnosis | JobDiagnosis, path: Path) -> None:
    """Write the page to ``path`` whole (a temp file renamed), or a one-line CliError."""
    page = render_html(report)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CliError(f"--html {path}: {exc.strerror or exc}") from None


def render_html(report: Diagnosis | JobDiagnosis) -> str:
    from tdbg.model.diagnosis import Diagnosis

    if isinstance(report, Diagnosis):
        title = f"tdbg report · {report.name}"
        body = _run_html(report, 1)
    else:
        title = f"tdbg report · job {report.job}"
        parts = [f"<h2>job findings</h2>{_verdict_list(report.findings)}"]
        if not report.findings:
            parts.append('<p class="ok">✓ no straggler, no diverged rank, no hang</p>')
        for rank, d in report.ranks.items():
            parts.append(f"<h2>rank {rank}</h2>{_run_html(d, 3)}")
        body = "".join(parts)
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )


def _run_html(d: Diagnosis, level: int) -> str:
    from tdbg.model.diagnosis import figure_lines

    h = f"h{min(level + 1, 6)}"
    head = f'<p class="{d.level}">{html.escape(d.health.word)}: {html.escape(d.health.detail)}</p>'
    rows = "".join(
        f"<tr><td>{html.escape(label)}</td><td>{html.escape(value)}</td></tr>"
        for label, value in figure_lines(d)
    )
    ops = "".join(
        f"<tr><td>{html.escape(_share(op['share']))}</td><td><code>{html.escape(op['name'])}"
        "</code></td></tr>"
        for op in d.top_ops
    )
    charts = ""
    if d.loss_chart:
        charts += f"<{h}>loss</{h}>{svg_line(d.loss_chart)}"
    if d.grad_chart:
        charts += f"<{h}>total gradient norm</{h}>{svg_line(d.grad_chart)}"
    return (
        f"{head}<{h}>verdicts</{h}>{_verdict_list(d.verdicts)}{charts}"
        f"<{h}>evidence</{h}><table>{rows}</table>"
        + (f"<{h}>top ops (last profile)</{h}><table>{ops}</table>" if ops else "")
    )


def _verdict_list(verdicts: list) -> str:
    items = []
    for v in verdicts:
        evidence = "".join(f"<p>{html.escape(e)}</p>" for e in v.evidence)
        mark = MARKS.get(v.level, "?")
        items.append(f'<li class="{v.level}">{mark} {html.escape(v.headline)}{evidence}</li>')
    return f"<ul>{''.join(items)}</ul>"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def svg_line(values: list[float], width: int = 600, height: int = 120) -> str:
    """A line chart of ``values`` as inline SVG (log scale over two decades; gaps at NaN)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "<p>no finite values</p>"
    log = min(finite) > 0 and max(finite) / min(finite) > 100
    ys = [math.log10(v) if log and math.isfinite(v) else v for v in values]
    ok = [y for y in ys if math.isfinite(y)]
    low, high = min(ok), max(ok)
    span = high - low or 1.0
    step = width / max(1, len(values) - 1)
    paths: list[list[str]] = []
    current: list[str] = []
    for i, y in enumerate(ys):
        if not math.isfinite(y):
            if current:
                paths.append(current)
            current = []
            continue
        current.append(f"{i * step:.1f},{height - 8 - (y - low) / span * (height - 16):.1f}")
    if current:
        paths.append(current)
    lines = "".join(
        f'<polyline fill="none" stroke="#0969da" stroke-width="1.5" points="{" ".join(p)}"/>'
        for p in paths
    )
    # Where the values stopped being finite for good (a diverged run): shaded, as the TUI marks it.
    tail = len(values)
    while tail and not math.isfinite(values[tail - 1]):
        tail -= 1
    if tail < len(values):
        x = max(0.0, (tail - 0.5) * step)
        lines = (
            f'<rect x="{x:.1f}" y="0" width="{width - x:.1f}" height="{height}" '
            'fill="#b00020" fill-opacity="0.12"><title>non-finite</title></rect>' + lines
        )
    label = f"{finite[0]:.4g} → {values[-1]:.4g}" + (" (log scale)" if log else "")
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
        f"{lines}</svg><p>{html.escape(label)}</p>"
    )
