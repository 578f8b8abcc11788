"""The ranks `tdbg run` does not watch, in the one wording its stderr and the job screen share."""

from __future__ import annotations

# s after a job's first rank started its probe: the others start theirs at about the same
# step, so one still missing then is not watched (`tdbg run` waits as long to say so).
UNWATCHED_AFTER = 30.0


def unwatched(missing: list[int], world: int, launcher: str | None, what: str = "rank") -> str:
    """``rank 1 of 2 is not watched: started by mp.spawn`` (``ranks 1, 3 of 4 are ...``)."""
    names = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    one = len(missing) == 1
    said = f"{what} {names} of {world} is" if one else f"{what}s {names} of {world} are"
    return f"{said} not watched: started by {launcher or 'a launcher tdbg run does not know'}"
