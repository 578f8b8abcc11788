"""The deep dives a probe serves, by command name: each imports its module on first use."""

from __future__ import annotations

from typing import Any

from tdbg.probe.dives.base import Dive, DiveContext


# Dive factories import their module on first use: torch.profiler and friends are loaded only
# by a run that is profiled. The names are fixed here; nothing a client sends names a module.
def _profile(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.profiling import ProfileDive

    return ProfileDive(ctx, job, args, trigger)


def _snapshot(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.snapshot import SnapshotDive

    return SnapshotDive(ctx, job, args, trigger)


def _nan_hunt(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.nan_hunt import NanHuntDive

    return NanHuntDive(ctx, job, args, trigger)


def _anomaly(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.anomaly import AnomalyDive

    return AnomalyDive(ctx, job, args, trigger)


def _activations(ctx: DiveContext, job: int, args: dict[str, Any], trigger: str) -> Dive:
    from tdbg.probe.dives.activations import ActivationsDive

    return ActivationsDive(ctx, job, args, trigger)


DIVES = {
    "profile": _profile,
    "snapshot": _snapshot,
    "nan_hunt": _nan_hunt,
    "anomaly": _anomaly,
    "activations": _activations,
}
