"""W&B local run folders (online `run-...` or offline `offline-run-...`): each `run-<id>.wandb` is one run.

    for run in find_runs("wandb"):       # a wandb/ folder, one run folder, or one .wandb file
        poll = run.poll(final=True)      # history scalars since the previous poll, config, the exit

History rows give each numeric item at the row's `_step` and `_timestamp` (W&B's own `_`-keys are left
out; a nested dict's items are named `parent.child`, as W&B shows them), or, for an item `define_metric` gave
a step metric (transformers' WandbCallback: every metric against `train/global_step`), at that metric's value
in the row, as W&B's charts show it; the run's config and later
config updates become params; the exit record ends the run (FAILED on a non-zero exit code). After a corrupt
chunk, reading goes on at the next chunk that passes its CRC (`compat_wandb.resync`): only the damaged records
are lost.
"""

from __future__ import annotations

import fnmatch
import json
import math
from pathlib import Path

from rldiag.app.importers import compat_wandb as compat
from rldiag.app.importers.common import Poll, read_whole_records

EXPERIMENT = "wandb"


class NotAWandbRun(ValueError):
    """A path with no W&B run file under it."""


def find_runs(path: str | Path) -> list[WandbRun]:
    """The runs at `path`: a `.wandb` file, a run folder holding one, or a folder of run folders."""
    root = Path(path).expanduser().absolute()
    if not root.exists():
        raise NotAWandbRun(f"{root}: no such file or folder; give a W&B run folder (wandb/run-<date>-<id> or "
                           "wandb/offline-run-...) or the wandb/ folder that holds them")
    files = [root] if root.is_file() else sorted(root.rglob("*.wandb"))
    unique = list({f.resolve(): f for f in files if f.is_file()})  # wandb/latest-run links to a run folder
    if not unique:
        raise NotAWandbRun(f"{root}: no W&B run file (run-<id>.wandb) in it or below it; give a W&B run folder "
                           "(wandb/run-<date>-<id> or wandb/offline-run-...) or the wandb/ folder that holds them")
    return [WandbRun(f) for f in sorted(unique)]


class WandbRun:
    """The history, config and end of one `.wandb` file, read incrementally."""

    tracker = "wandb"

    def __init__(self, file: Path):
        self.file = file
        self.source = file.parent if file.parent.name.endswith(file.stem.removeprefix("run-")) else file
        self.name = file.stem.removeprefix("run-")  # the run id until the run record names it
        self.experiment = EXPERIMENT
        self._offset: int | None = None  # None: the header is not read yet
        self._broken = False
        self._ended: str | None = None
        self._step_metric: dict[str, str] = {}  # define_metric(name, step_metric=...)
        self._step_globs: list[tuple[str, str]] = []  # define_metric("train/*", step_metric=...), in order
        self._steps_of: dict[str, str | None] = {}  # a history key -> its step metric (None: W&B's _step)

    def poll(self, *, final: bool, limit: int = 1 << 62) -> Poll:
        out = Poll()
        if self._broken:
            return out
        if self._offset is None:
            try:
                with self.file.open("rb") as fh:
                    head = fh.read(len(compat.FILE_HEADER))
            except OSError as e:
                self._broken = True
                out.problems.append(f"{self.file}: cannot read it ({e.strerror or e}); skipped")
                return out
            if len(head) < len(compat.FILE_HEADER) and not final:
                return out  # just created: its header is not written yet
            if not compat.is_wandb_file(head):
                self._broken = True
                out.problems.append(f"{self.file}: not a W&B run file (it does not start with W&B's header "
                                    "':W&B'); skipped")
                return out
            self._offset = len(head)
        self._offset, broken = read_whole_records(self.file, self._offset, compat, self._record, out, limit=limit,
                                                  final=final, what="a W&B record", writer="wandb",
                                                  resync=compat.resync)
        self._broken = self._broken or broken
        out.ended = self._ended
        return out

    def _record(self, data: bytes, out: Poll) -> None:
        kind, rec = compat.parse_record(data)
        if kind == "history":
            self._history(rec.history, out)
        elif kind == "run":
            run = rec.run
            self.name = run.display_name or run.run_id or self.name
            self.experiment = run.project or EXPERIMENT
            out.params.update(_config(run.config.update))
        elif kind == "config":
            out.params.update(_config(rec.config.update))
        elif kind == "metric" and rec.metric.step_metric:
            m = rec.metric
            if m.glob_name:
                self._step_globs.append((m.glob_name, m.step_metric))
            else:
                self._step_metric[m.name] = m.step_metric
            self._steps_of.clear()
        elif kind == "exit":
            self._ended = "FINISHED" if rec.exit.exit_code == 0 else "FAILED"

    def _history(self, history, out: Poll) -> None:
        values: dict[str, object] = {}
        for item in history.item:
            values[compat.item_key(item)] = json.loads(item.value_json)
        step = values.get("_step", history.step.num)
        ts = values.get("_timestamp")
        ms = int(ts * 1000) if isinstance(ts, (int, float)) and math.isfinite(ts) else 0
        for key, v in _numbers(values):
            out.points.append((key, self._step(key, values, step), ms, v))

    def _step(self, key: str, values: dict[str, object], default) -> int:
        """`key`'s step in this row: its step metric's value where define_metric gave it one and the row has
        it (a later definition wins, as in W&B), else the row's `_step`."""
        if key not in self._steps_of:
            globs = (sm for glob, sm in reversed(self._step_globs) if fnmatch.fnmatchcase(key, glob))
            self._steps_of[key] = self._step_metric.get(key) or next(globs, None)
        x = values.get(self._steps_of[key]) if self._steps_of[key] else None
        ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        return int(x) if ok else int(default)


def _numbers(values: dict[str, object], prefix: str = ""):
    """`(name, float)` for each number in a history row, nested dicts flattened; W&B's `_` keys and
    media (dicts with a `_type`) left out."""
    for k, v in values.items():
        if k.startswith("_"):
            continue
        if isinstance(v, bool):
            yield prefix + k, float(v)
        elif isinstance(v, (int, float)):
            yield prefix + k, float(v)
        elif isinstance(v, dict) and "_type" not in v:
            yield from _numbers(v, f"{prefix}{k}.")


def _config(items) -> dict[str, object]:
    out = {}
    for item in items:
        key = compat.item_key(item)
        if key.startswith("_"):  # _wandb: W&B's own
            continue
        value = json.loads(item.value_json)
        out[key] = value.get("value", value) if isinstance(value, dict) and set(value) <= {"value", "desc"} \
            else value
    return out
