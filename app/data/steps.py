"""Sets of steps as closed ranges: how the watcher stores what it alerted and how reports print steps."""

from __future__ import annotations

from collections.abc import Iterable


def steps_to_ranges(steps: Iterable[int]) -> list[list[int]]:
    """Sorted unique steps as closed ranges: [1, 2, 3, 7] -> [[1, 3], [7, 7]]."""
    out: list[list[int]] = []
    for s in sorted(set(int(s) for s in steps)):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def format_ranges(steps: Iterable[int], limit: int = 25) -> str:
    """Steps as ranges, "3, 50-52, 90", at most `limit` ranges then "... (N more steps)"."""
    ranges = steps_to_ranges(steps)
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges[:limit]]
    if len(ranges) > limit:
        rest = sum(b - a + 1 for a, b in ranges[limit:])
        parts.append(f"... ({rest} more steps)")
    return ", ".join(parts)
