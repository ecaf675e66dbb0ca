"""Quality gate: flag output that collapsed into runaway repetition.

Gate on what the output *is*, not on proxies like "more tokens than the window": a short unit of tokens tiled many
times in a row is the signature of the cache-desync collapse (``由于由于…``), with or without newlines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_UNIT = 16  # longest repeating unit considered, in tokens
MIN_REPEATS = 8  # how many back-to-back copies make a runaway


@dataclass(frozen=True)
class Runaway:
    start: int  # index of the first token of the tiled span
    unit: tuple[int, ...]
    repeats: int


def find_runaway(token_ids: Sequence[int], max_unit: int = MAX_UNIT, min_repeats: int = MIN_REPEATS) -> Runaway | None:
    """The first span where a unit of <= ``max_unit`` tokens repeats >= ``min_repeats`` times back to back."""
    ids = list(token_ids)
    n = len(ids)
    for unit in range(1, max_unit + 1):
        # run[i] counts how far ids[i] == ids[i - unit] has held up to i.
        run = 0
        for i in range(unit, n):
            run = run + 1 if ids[i] == ids[i - unit] else 0
            if run >= unit * (min_repeats - 1):
                start = i - unit * min_repeats + 1
                return Runaway(start, tuple(ids[start : start + unit]), min_repeats)
    return None


def quality_report(token_ids: Sequence[int]) -> dict:
    hit = find_runaway(token_ids)
    if hit is None:
        return {"degenerate": False}
    return {"degenerate": True, "runaway": {"start": hit.start, "unit": list(hit.unit), "repeats": hit.repeats}}
