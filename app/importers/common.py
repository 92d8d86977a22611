"""Writing a tracker's run into MLflow: one MLflow run per source run, found again by its source path.

A reader (tensorboard.py, wandb.py) gives, poll after poll, the points written since its last poll;
`RunImport` sends those past the run's latest imported step per key through rldiag's writer (NaN kept,
inf flagged as the collectors flag it), so a second import adds only new points and `--follow` keeps up.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rldiag.collectors import keys
from rldiag.collectors.limits import MAX_KEY_CHARS, clean_key

log = logging.getLogger("rldiag.import")

TAG_SOURCE = "rldiag.import.source"  # the absolute path of the imported run (folder or file)
TAG_SOURCE_ID = "rldiag.import.id"  # a hash of that path: what a later import searches for
TAG_TRACKER = "rldiag.import.tracker"  # "tensorboard" or "wandb"
POLL_POINTS = 50_000  # points read, sent and waited for at a time: memory stays bounded on a run of any size
CHUNK_BYTES = 64 << 20  # bytes of a run file read at a time: a large file is never in memory whole


@dataclass
class Poll:
    """What a reader found since its previous poll."""

    points: list[tuple[str, int, int, float]] = field(default_factory=list)  # key, step, wall time ms, value
    params: dict[str, object] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # one line each, naming the file
    ended: str | None = None  # "FINISHED" or "FAILED" once the tracker recorded the run's end
    more: bool = False  # stopped at `limit` points: poll again for the rest


class Reader(Protocol):
    tracker: str
    source: Path  # absolute: identifies the run across imports
    name: str  # the run's name in MLflow
    experiment: str  # the experiment a new run goes to unless --experiment says otherwise

    def poll(self, *, final: bool, limit: int) -> Poll:
        """Points since the previous poll, about `limit` at most (whole records; `more` says the rest waits);
        `final`: a partial record at the end is a problem, not a wait."""


def whole_records(path: Path, start: int, read_records, chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """`(end_offset, record)` for each whole record of `path` from offset `start`, read `chunk` bytes at a
    time (more for a larger record); `read_records(buf, base)` is the format's framing (compat modules).
    A partial record at the end stops it; the format's CorruptRecord and OSError propagate."""
    with path.open("rb") as fh:
        pos = start
        while True:
            fh.seek(pos)
            buf = fh.read(chunk)
            end = pos
            for end, record in read_records(buf, pos):
                yield end, record
            if len(buf) < chunk:
                return
            if end == pos:
                chunk *= 2  # one record larger than the chunk
            pos = end


def read_whole_records(path: Path, start: int, compat, parse, out: Poll, *, limit: int, final: bool, what: str,
                       writer: str, resync: Callable[[Path, int], int | None] | None = None) -> tuple[int, bool]:
    """Parse each whole record of `path` from offset `start` into `out` (`parse(record, out)`), up to `limit`
    points; returns `(offset reached, broken)`. Each problem is one line in `out.problems` naming the file: a
    record that does not parse as `what` (skipped), a corrupt record (reading goes on from `resync(path,
    offset)`, the next record start the format can find after it; without one, or None, the rest of the file
    is skipped: broken) or a read error (broken), and, when `final`, a partial record at the end (`writer` is
    still writing it)."""
    done, broken, size = start, False, 0
    while True:
        try:
            for end, record in whole_records(path, done, compat.read_records):
                try:
                    parse(record, out)
                except Exception as e:  # noqa: BLE001 - a record that passed its CRC but does not parse
                    out.problems.append(f"{path}: the record at byte {done} is not {what} ({type(e).__name__}); "
                                        "skipped it")
                done = end
                if len(out.points) >= limit:
                    out.more = True
                    break
            size = path.stat().st_size
        except compat.CorruptRecord as e:
            after = resync(path, e.offset) if resync is not None else None
            if after is not None and after > e.offset:
                out.problems.append(f"{path}: corrupt at byte {e.offset} ({e.why}); bytes {e.offset}-{after} are "
                                    "skipped, the records before and after them imported")
                done = after
                continue
            broken = True
            out.problems.append(f"{path}: corrupt at byte {e.offset} ({e.why}); the records before it were "
                                "imported, the rest of this file is skipped")
        except OSError as e:
            broken = True
            out.problems.append(f"{path}: cannot read it ({e.strerror or e}); the records before byte {done} were "
                                "imported, the rest of this file is skipped")
        break
    if final and not out.more and not broken and done < size:
        out.problems.append(f"{path}: ends in a partial record ({size - done} bytes at byte {done}): still being "
                            "written, or cut short; the whole records before it were imported (import again, or "
                            f"use --follow, once {writer} has written it)")
    return done, broken


def source_id(path: Path) -> str:
    return hashlib.sha1(str(path).encode()).hexdigest()[:20]


def find_imported(client, path: Path) -> str | None:
    """The id of the run an earlier import made of `path` (any experiment, deleted runs aside), or None."""
    exp_ids = [e.experiment_id for e in client.search_experiments()]
    if not exp_ids:
        return None
    runs = client.search_runs(exp_ids, filter_string=f"tags.`{TAG_SOURCE_ID}` = '{source_id(path)}'", max_results=1)
    return runs[0].info.run_id if runs else None


@dataclass
class Outcome:
    run_id: str
    created: bool
    points: int = 0  # points sent this time
    skipped: int = 0  # points at or before the key's last imported step
    keys: set[str] = field(default_factory=set)
    params: int = 0
    problems: list[str] = field(default_factory=list)
    undelivered: int = 0
    ended: str | None = None


class RunImport:
    """One source run into one MLflow run. `poll()` imports what is new; `close()` ends the MLflow run.
    `tags` may be a function of the run's name: it is called when the MLflow run is opened, after the first
    poll, so that it sees the name the tracker recorded (a W&B run's display name is in its run record)."""

    def __init__(self, reader: Reader, tracking_uri: str, *,
                 tags: Mapping[str, str] | Callable[[str], Mapping[str, str]], experiment: str | None = None):
        self.reader, self.uri, self.tags, self.experiment = reader, tracking_uri, tags, experiment
        self.client = self.run_id = self.writer = None
        # MLflow key -> its last step in the store when this import began: points up to it were imported
        # before (within this import the readers' file offsets keep anything from being read twice)
        self.cursor: dict[str, int] = {}
        self.params: dict[str, str] = {}
        self.outcome: Outcome | None = None

    def poll(self, *, final: bool) -> Outcome:
        """Import everything the reader has now, `POLL_POINTS` at a time."""
        part = 0
        while True:
            p = self.reader.poll(final=final, limit=POLL_POINTS)
            if self.run_id is None:
                if not p.points and not p.params and p.ended is None:
                    return Outcome("", False, problems=p.problems)  # nothing readable yet: no run for it
                self._open()
            out = self.outcome
            out.problems += p.problems
            out.params += self._log_params(p.params)
            if part:  # back-pressure: the part read while the previous one was delivered waits for it
                self.writer.flush(timeout=600)
            self._send(p.points, out)
            part += 1
            if p.ended is not None:
                out.ended = p.ended
            if not p.more:
                return out

    def _open(self) -> None:
        from rldiag.collectors.mlflow_store import client_for, make_sender, open_run
        from rldiag.collectors.writer import MetricWriter

        r = self.reader
        mine = self.tags(r.name) if callable(self.tags) else self.tags
        tags = {TAG_SOURCE: str(r.source), TAG_SOURCE_ID: source_id(r.source), TAG_TRACKER: r.tracker, **mine}
        existing = find_imported(client_for(self.uri), r.source)
        self.client, run = open_run(self.uri, experiment=self.experiment or r.experiment, run_name=r.name,
                                    run_id=existing, tags=tags)
        self.run_id = run.info.run_id
        self.params = dict(run.data.params)
        if existing is not None:
            proto = self.client.get_run(self.run_id).to_proto()
            self.cursor = {m.key: int(m.step) for m in proto.data.metrics
                           if not m.key.startswith(keys.INF_FLAG_PREFIX)}
        self.writer = MetricWriter(self.run_id, make_sender(self.uri), tracking_uri=self.uri, spill_dir=None)
        self.outcome = Outcome(self.run_id, existing is None)

    def _log_params(self, params: Mapping[str, object]) -> int:
        """Params not yet on the run; a changed value is a warning (MLflow refuses to re-log a param)."""
        from mlflow.entities import Param

        from rldiag.collectors.mlflow_store import flatten_params

        new = []
        for k, v in flatten_params(params).items():
            k = clean_key(k, MAX_KEY_CHARS)
            if k not in self.params:
                self.params[k] = v
                new.append(Param(k, v))
            elif self.params[k] != v:
                log.warning("%s: config %r is now %r; the MLflow run keeps %r (MLflow never changes a param)",
                            self.reader.source, k, v[:80], self.params[k][:80])
                self.params[k] = v
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        return len(new)

    def _send(self, points: list[tuple[str, int, int, float]], out: Outcome) -> None:
        names: dict[str, str] = {}
        group: dict[str, float] = {}
        at: tuple[int, int] | None = None
        sent = 0
        for key, step, ts, value in points:
            k = names.get(key)
            if k is None:
                k = names[key] = clean_key(key)
            if step <= self.cursor.get(k, -(2**63)):
                out.skipped += 1
                continue
            if (step, ts) != at or key in group:
                if group:
                    self.writer.log_metrics(group, at[0], timestamp_ms=at[1])
                group, at = {}, (step, ts)
            group[key] = value
            out.keys.add(k)
            sent += 1
        if group:
            self.writer.log_metrics(group, at[0], timestamp_ms=at[1])
        out.points += sent

    def flush(self, timeout: float = 600) -> bool:
        return self.writer is None or self.writer.flush(timeout=timeout)

    def close(self, status: str = "FINISHED", timeout: float = 600) -> Outcome | None:
        """Deliver what is queued and end the MLflow run with `status`."""
        if self.writer is None:
            return self.outcome
        stats = self.writer.close(timeout=timeout)
        self.outcome.undelivered = stats.undelivered
        self.client.set_terminated(self.run_id, status=status)
        self.writer = None
        return self.outcome
