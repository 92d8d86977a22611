"""What `rldiag watch` has already alerted on, kept in a small JSON file so a restart neither repeats
nor misses an event.

    {"version": 1,
     "last_poll_ms": 1700000000000,          # start of the last completed poll cycle (wall clock)
     "runs": {"<run_id>": {"name": "grpo-v1",
                           "alerted": [[3, 3], [7, 9]],        # steps alerted on, as closed ranges
                           "alerts": 4, "first_step": 3,       # for the MLflow tag sink's counters
                           "diverged": {"policy/ratio_mean": 120},    # the metric's first departure's onset
                           "noted": {"scaler_overflow": [[0, 0]],     # other events told (not alerts)
                                     "divergence policy/ratio_mean": [[118, 125], [300, 312]]}}}}
                                     # each departure sent: its onset to its alert

A metric's departures are remembered by the steps from their onset to their alert: a departure whose steps
meet none of them is new (one that ended and a later one are two events; the same one, its onset placed
again as data arrive, is not).

Only runs that alerted get an entry, and a run of consecutive bad steps is one range, so the file stays
small. It is written atomically (a temporary file, then `os.replace`) and guarded by an exclusive
lock file beside it, so two watchers never share one state.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1
DEPARTURE = "divergence "  # `noted` kind of a metric's departures sent: "divergence policy/ratio_mean"


class StateError(ValueError):
    """The state file cannot be used; the message names the file and the fix."""


def in_ranges(steps: np.ndarray, ranges: list[list[int]]) -> np.ndarray:
    """Boolean mask: which of `steps` fall inside one of the sorted, disjoint closed `ranges`."""
    steps = np.asarray(steps, np.int64)
    if not ranges or not len(steps):
        return np.zeros(len(steps), bool)
    lo = np.array([r[0] for r in ranges], np.int64)
    hi = np.array([r[1] for r in ranges], np.int64)
    i = np.searchsorted(lo, steps, side="right") - 1  # the last range starting at or before the step
    ok = i >= 0
    return ok & (steps <= hi[np.maximum(i, 0)])


def add_steps(ranges: list[list[int]], steps) -> list[list[int]]:
    """`ranges` (sorted, disjoint, closed) with `steps` added, neighbours merged (one sort for all)."""
    return add_ranges(ranges, [[int(s), int(s)] for s in steps])


def add_ranges(ranges: list[list[int]], more: list[list[int]]) -> list[list[int]]:
    """`ranges` (sorted, disjoint, closed) with the closed ranges `more` added, neighbours merged."""
    merged: list[list[int]] = []
    for a, b in sorted(ranges + more):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


@dataclass
class RunState:
    name: str = ""
    alerted: list[list[int]] = field(default_factory=list)
    alerts: int = 0
    first_step: int | None = None
    diverged: dict[str, int] = field(default_factory=dict)
    # steps already told per event kind that is no NaN-gradient alert ("nonfinite_loss", "scaler_overflow")
    noted: dict[str, list[list[int]]] = field(default_factory=dict)

    def new_noted(self, kind: str, steps) -> list[int]:
        """The steps of `steps` not yet told as `kind`."""
        steps = np.unique(np.asarray(list(steps), np.int64))
        return steps[~in_ranges(steps, self.noted.get(kind, []))].tolist()

    def note(self, kind: str, steps) -> None:
        self.noted[kind] = add_steps(self.noted.get(kind, []), steps)

    def told_departure(self, key: str, onset: int, end: int | None) -> bool:
        """A departure of `key` from `onset` to `end` (None: still out) meets one already sent (its onset to
        its alert). A state written before departures were kept has only `diverged`: see `legacy`."""
        hi = end if end is not None else np.iinfo(np.int64).max
        return any(a <= hi and b >= onset for a, b in self.noted.get(DEPARTURE + key, []))

    def legacy(self, key: str) -> bool:
        """`key`'s first departure was sent by a watcher that kept only its onset (`diverged`), not its steps."""
        return key in self.diverged and DEPARTURE + key not in self.noted

    def tell_departure(self, key: str, onset: int, alert: int) -> None:
        """Remember a departure of `key` sent: its steps from onset to alert (`noted`), and the metric's first
        onset (`diverged`)."""
        self.noted[DEPARTURE + key] = add_ranges(self.noted.get(DEPARTURE + key, []), [[int(onset), int(alert)]])
        self.diverged.setdefault(key, int(onset))

    def new_steps(self, steps: np.ndarray) -> np.ndarray:
        """The steps of `steps` (unique, sorted) not alerted on yet."""
        steps = np.unique(np.asarray(steps, np.int64))
        return steps[~in_ranges(steps, self.alerted)]

    def mark(self, step: int) -> None:
        self.alerted = add_steps(self.alerted, [step])
        self.alerts += 1
        self.first_step = int(step) if self.first_step is None else min(self.first_step, int(step))


@dataclass
class WatchState:
    """The watcher's memory: per-run alerted steps and divergences, and when the last poll started."""

    path: Path | None = None
    last_poll_ms: int | None = None
    runs: dict[str, RunState] = field(default_factory=dict)

    def run(self, run_id: str, name: str = "") -> RunState:
        rs = self.runs.setdefault(run_id, RunState(name=name))
        rs.name = rs.name or name
        return rs

    def to_json(self) -> dict:
        return {"version": VERSION, "last_poll_ms": self.last_poll_ms,
                "runs": {r: {"name": s.name, "alerted": s.alerted, "alerts": s.alerts, "first_step": s.first_step,
                             "diverged": s.diverged, "noted": s.noted} for r, s in sorted(self.runs.items())}}

    @classmethod
    def load(cls, path: str | Path) -> WatchState:
        """The state in `path`, or an empty state if the file does not exist yet."""
        path = Path(path)
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {VERSION}")
            runs = {r: RunState(name=str(s.get("name", "")), alerted=[[int(a), int(b)] for a, b in s.get("alerted", [])],
                                alerts=int(s.get("alerts", 0)), first_step=s.get("first_step"),
                                diverged={str(k): int(v) for k, v in s.get("diverged", {}).items()},
                                noted={str(k): [[int(a), int(b)] for a, b in v] for k, v in s.get("noted", {}).items()})
                    for r, s in data.get("runs", {}).items()}
            last = data.get("last_poll_ms")
            return cls(path, int(last) if last is not None else None, runs)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise StateError(f"watch state file {str(path)!r} is unreadable ({type(e).__name__}: {e}); "
                             "move it away to start afresh (past alerts may then repeat) or pass --state "
                             "another file") from None

    def save(self) -> None:
        """Write atomically: a crash leaves the old file or the new one, never half of one."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, self.path)


class StateLock:
    """An exclusive lock on `<state>.lock`, held while a watcher runs (released when its process ends)."""

    def __init__(self, state_path: str | Path):
        self.path = Path(str(state_path) + ".lock")
        self._fd: int | None = None

    def acquire(self) -> StateLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StateError(f"another `rldiag watch` holds {str(self.path)!r}; stop it, or pass --state "
                             "another file to run a second watcher") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
