"""Where a run first went non-finite: the finding the probe thread and the NaN hunt both make."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Origin:
    """Where the first non-finite value came from."""

    step: int  # the step whose forward/backward made it, or whose forward used the bad weights
    phase: str  # "weights" | "forward" | "backward" | "loss"
    module: str | None  # as in named_modules(); None when not known ("loss" without a hunt)
    detail: str  # one line for people, the alert's message
    last_finite: int | None = None  # the last step where everything measured was finite
    module_type: str | None = None
    nonfinite: int | None = None  # non-finite values in what was named, when known

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
