"""``tdbg dump`` carries issue 10's numbers: the step's micro-batches, clip and epoch (null where
an older probe did not send them), one ``metric`` event per point, what is watched in ``hello``
and the probe's ``closed`` / ``total_steps`` / ``skipped_steps``."""

from __future__ import annotations

import json
from typing import Any

from tdbg.cli.dump import message_events
from tdbg.protocol.steps import OPTIONAL_COLUMNS
from tdbg.tui.sources.synthetic import RUN, synthetic_run


def dumped(messages: list[dict[str, Any]], run: dict[str, Any] | None = None) -> list[dict]:
    hello = {"type": "hello", "run": dict(RUN if run is None else run)}
    events = list(message_events(messages, hello))
    for event in events:  # every event is strict JSON (no NaN)
        json.loads(json.dumps(event, allow_nan=False))
    return events


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def test_steps_carry_micro_batches_clip_and_epoch() -> None:
    events = dumped(synthetic_run(steps=120, n_layers=4))
    steps = of(events, "step")
    assert len(steps) == 120
    first, last = steps[0], steps[-1]
    assert (first["micro_batches"], first["clip_max"], first["epoch"]) == (4, 1.0, 0)
    assert last["epoch"] == 1 and isinstance(last["epoch"], int)
    assert isinstance(last["clip_norm"], float) and last["clip_norm"] > 0
    active = [s for s in steps if s["clip_norm"] > s["clip_max"]]
    assert 0 < len(active) < len(steps)


def test_an_older_probe_dumps_null_for_the_new_columns() -> None:
    messages = synthetic_run(steps=10, n_layers=2, true_numbers=False, metrics=False)
    for msg in messages:
        if msg["type"] == "steps":
            for name in OPTIONAL_COLUMNS:
                msg.pop(name, None)
    steps = of(dumped(messages), "step")
    assert len(steps) == 10
    assert all(s[k] is None for s in steps for k in ("micro_batches", "clip_max", "clip_norm"))
    assert all(s["epoch"] is None for s in steps)


def test_metrics_are_one_event_per_point_nan_kept() -> None:
    events = dumped(synthetic_run(steps=120, n_layers=2, nan_at=100))
    metrics = of(events, "metric")
    names = {m["name"] for m in metrics}
    assert {"loss/netG", "loss/netD", "val_loss", "val/acc", "grad_scale"} <= names
    val = [(m["step"], m["value"]) for m in metrics if m["name"] == "val_loss"]
    assert val[0][0] == 0 and isinstance(val[0][1], float)
    assert val[-1] == (100, "nan")  # non-finite: kept, spelled as JSON allows


def test_hello_says_what_is_watched_and_probe_its_state() -> None:
    events = dumped(synthetic_run(steps=5, n_layers=4, skipped_steps=2, closed=True))
    hello = events[0]
    assert hello["type"] == "hello"
    assert hello["run"]["models"] == ["netG", "netD"]
    assert [o["name"] for o in hello["run"]["optimizers"]] == ["optG", "optD"]
    assert hello["run"]["param_groups"] == 2
    assert hello["models"] == ["netG", "netD"] and hello["model"] == [0, 0, 1, 1]
    probe = of(events, "probe")[-1]
    assert probe["closed"] is True and probe["disabled"] is False
    assert probe["total_steps"] == 1000 and probe["skipped_steps"] == 2
