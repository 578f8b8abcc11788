"""``tdbg export TARGET --to tensorboard|csv DIR``: a run's series where other tools read them —
TensorBoard event files (through tensorboardX, ``pip install 'tdbg[export]'``) or one CSV per
series — from a recording, or from a live run (``--follow`` keeps writing as it trains)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import math
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from tdbg.cli.args import positive_float
from tdbg.cli.dump import Window, dump_events, recording_events, unfinite, windowed
from tdbg.cli.errors import CliError
from tdbg.cli.target_args import TARGET_HELP, add_remote_options, attach_target, target_arg
from tdbg.connect.targets import Recording, resolve
from tdbg.protocol.messages.histograms import (
    HIGH_DECADE,
    LOW_DECADE,
    N_BINS,
    NONFINITE_BIN,
    PER_DECADE,
    bin_labels,
)

# The step event's timings and figures exported as series (seconds, or counts).
STEP_SERIES = (
    "step_time",
    "data_time",
    "no_grad_time",
    "forward_time",
    "backward_time",
    "optimizer_time",
    "probe_time",
    "samples",
    "tokens",
    "clip_norm",
    "epoch",
)
MEMORY_FIELDS = ("allocated", "reserved", "peak")
# The activation-statistics dive's figures exported per module.
ACTIVATION_SERIES = ("mean", "std", "min", "max", "zero_frac", "nonfinite")
# A histogram's finite bins as TensorBoard buckets over log10|x|, each by its upper limit:
# exact zeros as (-9.5, -9], under 1e-8 as (-9, -8], then each half decade up to 3, and 1e3 and
# over as (3, 3.5]. (TensorBoard draws a linear axis: in log10 the decades spread evenly.)
LOG_LIMITS: tuple[float, ...] = (
    LOW_DECADE - 1.0,
    *(LOW_DECADE + k / PER_DECADE for k in range((HIGH_DECADE - LOW_DECADE) * PER_DECADE + 1)),
    HIGH_DECADE + 1 / PER_DECADE,
)
FORMATS = ("tensorboard", "csv")
OPEN_FILES = 256  # CSV files kept open at once
FLUSH_EVERY = 200  # steps between flushes of a live export (and at the end)


def add_export_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "export",
        help="write a run's series as TensorBoard event files or CSV",
        description=(
            "Write a run's series — loss, learning rate per group, logged metrics, total and "
            "per-layer gradient norms, update ratios, weight, gradient and activation "
            "histograms (TensorBoard histograms of log10|x|), activation statistics per "
            "module, step time and its phases, memory; alerts as text — as TensorBoard "
            "event files (tensorboard --logdir DIR reads them; needs "
            "`pip install 'tdbg[export]'`) or one CSV file per series. TARGET: a recording or a "
            "live run (its history, then --follow writes on until it ends). A DIR that holds "
            "other files is refused unless --force. Exit status: 0 written; 2 no run, not a "
            "recording, DIR not usable, bad arguments."
        ),
    )
    p.add_argument("target", nargs="?", type=target_arg, metavar="TARGET", help=TARGET_HELP)
    add_remote_options(p)
    p.add_argument(
        "--to",
        nargs=2,
        required=True,
        metavar=("FORMAT", "DIR"),
        help="tensorboard or csv, and the directory to write into (created if needed)",
    )
    p.add_argument(
        "--follow", action="store_true", help="a live run: keep writing until the run ends"
    )
    p.add_argument("--force", action="store_true", help="write into a DIR holding other files")
    p.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="wait at most S seconds for a run (and, with --follow, stop after S seconds)",
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    form, where = args.to
    if form not in FORMATS:
        raise CliError(f"--to {form}: not a format (one of: {', '.join(FORMATS)})")
    events = _events(args)
    first = next(events, None)  # the TARGET resolved (and attached) before DIR is made
    directory = _prepare(Path(where), args.force)
    writer: SeriesWriter = (
        TensorBoardWriter(directory) if form == "tensorboard" else CsvWriter(directory)
    )
    counts = {"steps": 0, "points": 0}
    try:
        for event in itertools.chain([first] if first is not None else [], events):
            counts["points"] += _export(event, writer)
            if event["type"] == "step":
                counts["steps"] += 1
                if counts["steps"] % FLUSH_EVERY == 0:
                    writer.flush()
    except OSError as exc:  # a full disk, a file made unwritable meanwhile: one line
        raise CliError(f"{directory}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            writer.close()
    out.write(f"tdbg: {counts['steps']} steps, {counts['points']} values written to {directory}\n")
    out.flush()
    return 0


def _prepare(directory: Path, force: bool) -> Path:
    """DIR made ready: created, or empty, or (``--force``) holding whatever it holds."""
    if directory.exists() and not directory.is_dir():
        raise CliError(f"{directory}: not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise CliError(f"{directory} holds other files: export into an empty one, or --force")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{directory}: {exc.strerror or exc}") from None
    return directory


def _events(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    target = resolve(args.target)
    if isinstance(target, Recording):
        from tdbg.recording.reader import RecordingError, open_recording

        if args.follow:
            raise CliError("--follow needs a live run: a recording has no new steps")
        try:
            recording = open_recording(target.path)
            yield from recording_events(recording)
        except RecordingError as exc:
            raise CliError(str(exc)) from None
        return
    client = attach_target(target, args.target, args.timeout, args)
    # Without --follow: the history, up to `synced` (the run as it is now), then stop.
    window = Window(history=True, live=args.follow)
    try:
        yield from windowed(dump_events(client, args.timeout if args.follow else None), window)
    finally:
        client.close()


def _export(event: dict[str, Any], writer: SeriesWriter) -> int:
    """Write one dump event's values; how many were written."""
    etype = event["type"]
    step, time = event.get("step"), event.get("time")
    n = 0
    if etype == "step" and isinstance(step, int):
        t = float(time) if isinstance(time, int | float) else None
        n += writer.scalar("loss", step, t, event.get("loss"))
        for group, lr in enumerate(event.get("lr") or []):
            n += writer.scalar(f"lr/group{group}", step, t, lr)
        n += writer.scalar("grad_norm/total", step, t, event.get("grad_norm"))
        for layer, norm in (event.get("grad_norms") or {}).items():
            n += writer.scalar(f"grad_norm/layer/{layer}", step, t, norm)
        for name in STEP_SERIES:
            n += writer.scalar(f"step/{name}", step, t, event.get(name))
    elif etype == "updates" and isinstance(step, int):
        for layer, ratio in (event.get("ratios") or {}).items():
            n += writer.scalar(f"update_ratio/layer/{layer}", step, None, ratio)
    elif etype == "histograms" and isinstance(step, int):
        for layer, counted in (event.get("layers") or {}).items():
            n += _histogram_series(writer, layer, step, counted)
    elif etype == "activations" and isinstance(step, int):
        for module, stats in (event.get("layers") or {}).items():
            if isinstance(stats, dict):
                for key in ACTIVATION_SERIES:
                    n += writer.scalar(
                        f"activation_{key}/module/{module}", step, None, stats.get(key)
                    )
                n += _histogram(writer, f"activation_hist/module/{module}", step, stats.get("hist"))
    elif etype == "metric" and isinstance(step, int):
        n += writer.scalar(f"metric/{event.get('name')}", step, None, event.get("value"))
    elif etype == "memory":
        for device in event.get("cuda") or []:
            if isinstance(device, dict):
                index = device.get("device", device.get("index", 0))
                for key in MEMORY_FIELDS:
                    n += writer.scalar(f"memory/cuda{index}/{key}", None, time, device.get(key))
        host = event.get("host") or {}
        if isinstance(host, dict):
            n += writer.scalar("memory/host/rss", None, time, host.get("rss"))
    elif etype == "alert":
        n += writer.text("alerts", step if isinstance(step, int) else None, time, event)
    return n


def _histogram_series(writer: SeriesWriter, layer: str, step: int, counted: Any) -> int:
    """A layer's histograms as scalars: per kind its largest magnitude and its share of exact
    zeros (``weight_max/layer/LAYER``, ``grad_zero_frac/layer/LAYER``, ...)."""
    if not isinstance(counted, dict):
        return 0
    n = 0
    for kind, prefix in (("weights", "weight"), ("grads", "grad")):
        counts = counted.get(kind)
        if not isinstance(counts, list) or not counts:
            continue
        n += _histogram(writer, f"{prefix}_hist/layer/{layer}", step, counts)
        n += writer.scalar(f"{prefix}_max/layer/{layer}", step, None, counted.get(f"{prefix}_max"))
        total = sum(c for c in counts if isinstance(c, int))
        if total:
            n += writer.scalar(f"{prefix}_zero_frac/layer/{layer}", step, None, counts[0] / total)
    return n


def _histogram(writer: SeriesWriter, tag: str, step: int, counts: Any) -> int:
    """A histogram's counts (N_BINS whole numbers) to ``writer``; nothing for anything else."""
    if not isinstance(counts, list) or len(counts) != N_BINS:
        return 0
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return 0
    return writer.histogram(tag, step, counts)


class SeriesWriter:
    """Where series go: a scalar per (tag, step), a histogram per (tag, step) and alerts as
    text."""

    def scalar(self, tag: str, step: int | None, time: Any, value: Any) -> int:
        raise NotImplementedError

    def histogram(self, tag: str, step: int, counts: list[int]) -> int:
        raise NotImplementedError

    def text(self, tag: str, step: int | None, time: Any, alert: dict[str, Any]) -> int:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _number(value: Any) -> float | None:
    """A dump value as a float (``"nan"``/``"inf"`` strings back to floats); None: no value."""
    value = unfinite(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class CsvWriter(SeriesWriter):
    """One CSV file per series (``step,time,value``), alerts in ``alerts.csv``. At most
    OPEN_FILES are open at once (a model with thousands of layers must not run into the
    process's file limit): the least recently written is closed and reopened to append."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: OrderedDict[str, tuple[TextIO, Any]] = OrderedDict()
        self.paths: dict[str, Path] = {}  # series -> its file, each file one series'
        self.written: set[Path] = set()

    def _path(self, name: str) -> Path:
        path = self.paths.get(name)
        if path is None:
            taken = set(self.paths.values())
            base = _safe(name)
            path = self.directory / f"{base}.csv"
            n = 2
            while path in taken:  # `a/b` and `a.b` spell one file name: the second gets `-2`
                path = self.directory / f"{base}-{n}.csv"
                n += 1
            self.paths[name] = path
        return path

    def _file(self, name: str, header: list[str]) -> Any:
        if name in self.files:
            self.files.move_to_end(name)
            return self.files[name][1]
        if len(self.files) >= OPEN_FILES:
            _, (oldest, _) = self.files.popitem(last=False)
            oldest.close()
        path = self._path(name)
        new = path not in self.written  # this export's first write: over what was there
        self.written.add(path)
        handle = path.open("w" if new else "a", newline="", encoding="utf-8")
        writer = csv.writer(handle)
        if new:
            writer.writerow(header)
        self.files[name] = (handle, writer)
        return writer

    def scalar(self, tag: str, step: int | None, time: Any, value: Any) -> int:
        number = _number(value)
        if number is None:
            return 0
        spelled = repr(number) if math.isfinite(number) else str(number)
        when = "" if time is None else repr(float(time))
        self._file(tag, ["step", "time", "value"]).writerow(
            ["" if step is None else step, when, spelled]
        )
        return 1

    def histogram(self, tag: str, step: int, counts: list[int]) -> int:
        """One row per step: the count in each bin, the bins by their labels."""
        self._file(tag, ["step", *bin_labels()]).writerow([step, *counts])
        return 1

    def text(self, tag: str, step: int | None, time: Any, alert: dict[str, Any]) -> int:
        row = [step, time, alert.get("kind"), alert.get("severity"), alert.get("message")]
        self._file(tag, ["step", "time", "kind", "severity", "message"]).writerow(row)
        return 1

    def flush(self) -> None:
        for handle, _ in self.files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _ in self.files.values():
            handle.close()


class TensorBoardWriter(SeriesWriter):
    """TensorBoard event files through tensorboardX, each scalar stored as a float64 tensor so
    TensorBoard reads back exactly what the run measured; alerts as text."""

    def __init__(self, directory: Path) -> None:
        try:
            from tensorboardX import SummaryWriter
            from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
            from tensorboardX.proto.tensor_pb2 import TensorProto
            from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto
            from tensorboardX.proto.types_pb2 import DT_DOUBLE
        except ImportError:
            raise CliError(
                "--to tensorboard needs tensorboardX: pip install 'tdbg[export]'"
            ) from None
        self.writer = SummaryWriter(logdir=str(directory), flush_secs=30)
        self.memory_steps: dict[str, int] = {}
        # A scalar as TensorBoard's scalars plugin reads it, but a float64 tensor where
        # add_scalar writes a float32: a loss of 2.5164217948913574 reads back as itself.
        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))

        def summary(tag: str, value: float) -> Any:
            tensor = TensorProto(
                dtype=DT_DOUBLE, double_val=[value], tensor_shape=TensorShapeProto()
            )
            return Summary(value=[Summary.Value(tag=tag, tensor=tensor, metadata=metadata)])

        self.summary = summary

    def scalar(self, tag: str, step: int | None, time: Any, value: Any) -> int:
        number = _number(value)
        if number is None:
            return 0
        if step is None:  # a memory report: numbered in order (it has only a time)
            step = self.memory_steps[tag] = self.memory_steps.get(tag, -1) + 1
        walltime = float(time) if isinstance(time, int | float) else None
        self.writer.file_writer.add_summary(self.summary(tag, number), step, walltime)
        return 1

    def histogram(self, tag: str, step: int, counts: list[int]) -> int:
        """The finite bins as a histogram of log10|x| (LOG_LIMITS); NaN/Inf counts left out
        (the alerts say them). Sums from each bucket's middle: what TensorBoard's mean and
        spread lines read, approximately."""
        finite = counts[:NONFINITE_BIN]
        num = sum(finite)
        if not num:
            return 0
        used = [k for k, c in enumerate(finite) if c]
        lows = (LOG_LIMITS[0] - 1 / PER_DECADE, *LOG_LIMITS[:-1])
        middles = [(lo + hi) / 2 for lo, hi in zip(lows, LOG_LIMITS, strict=True)]
        self.writer.add_histogram_raw(
            tag,
            min=lows[used[0]],
            max=LOG_LIMITS[used[-1]],
            num=num,
            sum=sum(c * m for c, m in zip(finite, middles, strict=True)),
            sum_squares=sum(c * m * m for c, m in zip(finite, middles, strict=True)),
            bucket_limits=list(LOG_LIMITS),
            bucket_counts=finite,
            global_step=step,
        )
        return 1

    def text(self, tag: str, step: int | None, time: Any, alert: dict[str, Any]) -> int:
        line = f"**{alert.get('kind')}** ({alert.get('severity')}): {alert.get('message')}"
        walltime = float(time) if isinstance(time, int | float) else None
        self.writer.add_text(tag, line, step or 0, walltime=walltime)
        return 1

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _safe(name: str) -> str:
    """A series name as a file name: path separators and odd characters become ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.replace("/", "."))
