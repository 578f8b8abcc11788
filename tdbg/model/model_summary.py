"""The model summary: per watched layer its type, parameters, trainable or frozen, dtype, device."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tdbg.format import fmt_bytes, fmt_params

if TYPE_CHECKING:
    from tdbg.model.run_state import RunState


MAX_LAYERS_SHOWN = 200  # past this, the flagged layers and a count (--all: every one)


@dataclass(frozen=True)
class LayerRow:
    """One watched layer: a module that owns parameters (its own, not its children's)."""

    name: str
    type: str  # the module's class ("" when the probe did not say)
    params: int
    trainable: int | None  # elements with requires_grad (None: not known)
    dtype: str
    device: str
    bytes: int | None
    optimizer: str | None  # the optimizer that updates it; None: none does (or not known)
    marks: tuple[str, ...]  # what to look at: frozen, no optimizer, learning rate 0, gone, ...

    @property
    def frozen(self) -> bool:
        return self.trainable == 0 and self.params > 0


@dataclass(frozen=True)
class ModelSummary:
    """What the run trains: the layers, and their totals."""

    rows: list[LayerRow]
    models: list[str]
    known: bool  # the probe sent the summary's columns (older probes send names and sizes only)
    params: int = 0
    trainable: int | None = None
    bytes: int | None = None
    by_dtype: dict[str, int] = field(default_factory=dict)  # parameters per dtype
    by_device: dict[str, int] = field(default_factory=dict)
    optimizers: list[tuple[str, str, int]] = field(default_factory=list)  # (name, type, groups)

    @property
    def frozen(self) -> int | None:
        return None if self.trainable is None else self.params - self.trainable

    def flagged(self) -> list[LayerRow]:
        """The layers with a mark, in layer order."""
        return [row for row in self.rows if row.marks]

    def as_json(self) -> dict[str, Any]:
        """The summary for ``tdbg summary --json`` (docs/automation.md)."""
        return {
            "models": self.models,
            "known": self.known,
            "params": self.params,
            "trainable": self.trainable,
            "frozen": self.frozen,
            "bytes": self.bytes,
            "by_dtype": self.by_dtype,
            "by_device": self.by_device,
            "optimizers": [
                {"name": name, "type": kind, "groups": groups}
                for name, kind, groups in self.optimizers
            ],
            "layers": [
                {
                    "name": row.name,
                    "type": row.type,
                    "params": row.params,
                    "trainable": row.trainable,
                    "dtype": row.dtype,
                    "device": row.device,
                    "bytes": row.bytes,
                    "optimizer": row.optimizer,
                    "marks": list(row.marks),
                }
                for row in self.rows
            ],
        }


def _alerted_layers(state: RunState, kind: str) -> set[str]:
    return {name for alert in state.alerts if alert.kind == kind for name in alert.layers}


def model_summary(state: RunState) -> ModelSummary:
    """The summary of what ``state``'s run trains, from its ``layers`` message and its alerts:
    a layer is marked ``frozen`` (no trainable parameter), ``partly frozen``, ``no optimizer``
    (trainable, yet no watched optimizer updates it: it never changes unless the loop does it
    by hand), ``no gradient`` (a sampled step found none reaching it), ``zero gradient``, ``not
    learning`` (its update ratio stayed near 0 while others learned), or ``gone`` (its
    parameters left the model mid-run)."""
    names = state.layer_names
    facts = state.layer_facts
    known = bool(facts)
    optimizer_names = [name for name, _, _ in state.optimizers]
    no_grad = _alerted_layers(state, "no_grad")
    zero_grad = _alerted_layers(state, "zero_grad")
    not_learning = _alerted_layers(state, "update_stalled")
    gone = set(state.presence.gone_at)
    latest_lr = state.latest_lr()
    rows: list[LayerRow] = []
    by_dtype: Counter[str] = Counter()
    by_device: Counter[str] = Counter()

    def column(key: str, i: int) -> Any:
        values = facts.get(key)
        return values[i] if values is not None else None

    for i, name in enumerate(names):
        params = state.layer_numel[i] if i < len(state.layer_numel) else 0
        trainable = column("trainable", i)
        index = column("optimizer", i)
        optimizer = (
            optimizer_names[index]
            if isinstance(index, int) and 0 <= index < len(optimizer_names)
            else None
        )
        marks: list[str] = []
        if i in gone:
            marks.append("gone")
        elif trainable is not None and params:
            if trainable == 0:
                marks.append("frozen")
            elif trainable < params:
                marks.append("partly frozen")
            if trainable and "optimizer" in facts and optimizer is None and optimizer_names:
                marks.append("no optimizer")
            column_index = column("lr_group", i)
            if (
                trainable
                and optimizer is not None
                and isinstance(column_index, int)
                and 0 <= column_index < len(latest_lr)
                and latest_lr[column_index] == 0.0
            ):
                marks.append("learning rate 0")
        if name in no_grad:
            marks.append("no gradient")
        elif name in zero_grad:
            marks.append("zero gradient")
        if name in not_learning:
            marks.append("not learning")
        dtype = column("dtypes", i) or ""
        device = column("devices", i) or ""
        if i not in gone:
            by_dtype[dtype or "?"] += params
            by_device[device or "?"] += params
        rows.append(
            LayerRow(
                name=name,
                type=column("types", i) or "",
                params=params,
                trainable=trainable,
                dtype=dtype,
                device=device,
                bytes=column("bytes", i),
                optimizer=optimizer,
                marks=tuple(marks),
            )
        )
    present = [row for i, row in enumerate(rows) if i not in gone]
    return ModelSummary(
        rows=rows,
        models=state.models,
        known=known,
        params=sum(row.params for row in present),
        trainable=(sum(row.trainable or 0 for row in present) if "trainable" in facts else None),
        bytes=sum(row.bytes or 0 for row in present) if "bytes" in facts else None,
        by_dtype=dict(by_dtype) if known else {},
        by_device=dict(by_device) if known else {},
        optimizers=state.optimizers,
    )


def _trainable(row: LayerRow) -> str:
    if row.trainable is None:
        return "?"
    if row.trainable == row.params:
        return "yes"
    return "frozen" if row.trainable == 0 else f"{fmt_params(row.trainable)}"


def render_summary(summary: ModelSummary, every: bool = False) -> str:
    """The summary as a table for the terminal: totals first, then the layers, then the ones
    to look at. Past MAX_LAYERS_SHOWN layers (and without ``every``) only the flagged ones."""
    lines: list[str] = []
    rows = summary.rows
    models = ", ".join(summary.models) or "?"
    total = f"{fmt_params(summary.params)} parameters in {len(rows)} layers ({models})"
    if summary.trainable is not None:
        total += (
            f": {fmt_params(summary.trainable)} trainable, {fmt_params(summary.frozen or 0)} frozen"
        )
    if summary.bytes is not None:
        total += f", {fmt_bytes(summary.bytes)}"
    lines.append(total)
    if summary.optimizers:
        lines.append(
            "  optimizers: "
            + ", ".join(
                f"{name} ({kind}, {groups} group{'s' if groups != 1 else ''})"
                for name, kind, groups in summary.optimizers
            )
        )
    for label, counts in (("dtype", summary.by_dtype), ("device", summary.by_device)):
        if len(counts) > 1 or (counts and "?" not in counts):
            parts = sorted(counts.items(), key=lambda kv: -kv[1])
            lines.append(f"  by {label}: " + ", ".join(f"{k} {fmt_params(v)}" for k, v in parts))
    if not summary.known:
        lines.append(
            "  (this probe sent layer names and sizes only: types, dtypes, devices and "
            "optimizers need tdbg 0.3 in the training process)"
        )
    shown = rows if every or len(rows) <= MAX_LAYERS_SHOWN else summary.flagged()
    if shown:
        lines.append("")
        lines.extend(_table(shown))
    if shown is not rows:
        lines.append(
            f"  ({len(rows) - len(shown)} unflagged layers not shown of {len(rows)}: --all shows"
            " them)"
        )
    flagged = summary.flagged()
    if flagged:
        lines.append("")
        lines.append("To look at:")
        for row in flagged[:20]:
            lines.append(f"  {row.name}: {', '.join(row.marks)}")
        if len(flagged) > 20:
            lines.append(f"  ... and {len(flagged) - 20} more (--json lists them)")
    return "\n".join(lines) + "\n"


def _table(rows: list[LayerRow]) -> list[str]:
    header = ("layer", "type", "params", "trainable", "dtype", "device", "bytes", "optimizer")
    cells = [
        (
            row.name,
            row.type or "?",
            fmt_params(row.params),
            _trainable(row),
            row.dtype or "?",
            row.device or "?",
            fmt_bytes(row.bytes) if row.bytes is not None else "?",
            row.optimizer or ("none" if row.trainable else "-"),
        )
        for row in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    # The name column is the one that can be long: cap it so a row stays on one line.
    widths[0] = min(widths[0], 48)

    def line(values: tuple[str, ...]) -> str:
        name = values[0] if len(values[0]) <= widths[0] else "…" + values[0][-(widths[0] - 1) :]
        rest = [
            v.rjust(w) if i in (2, 6) else v.ljust(w)
            for i, (v, w) in enumerate(zip(values[1:], widths[1:], strict=True), start=1)
        ]
        return "  " + "  ".join([name.ljust(widths[0]), *rest]).rstrip()

    return [line(header), *(line(c) for c in cells)]
