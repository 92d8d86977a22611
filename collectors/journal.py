"""The writer's append-only local journal: every batch is written here before it is sent.

One JSON object per line:
- `{"rldiag_journal": 1, "run_id": ..., "tracking_uri": ...}`: the header, first line. The URI is stored
  without its credentials (`redact_uri`: the password and secret query values are `***`, and
  `"uri_redacted": true` says so); `rldiag sync` takes them from `--tracking-uri` or
  `MLFLOW_TRACKING_URI` again;
- `{"seq": N, "m": [[key, value, timestamp_ms, step], ...], "t": {tag: value}}`: a batch;
- `{"ack": [N, ...]}`: batches that reached the store;
- `{"refused": [[entry, reason], ...]}`: metric points (`[key, value, timestamp_ms, step]`) and tags
  (`[key, value]`) the store refused for good, written before the ack of their batch: set aside, never
  replayed, kept here for the record.

A batch without an ack is replayed: automatically when a writer starts again for the same run, or by
`rldiag sync FILE`. Replays keep each point's original timestamp, and MLflow's SQL stores ignore an
identical (key, value, step, timestamp) point, so delivering a batch twice stores it once. Lines that
do not parse (a process killed mid-write, a damaged file) are skipped and counted. NaN and inf are
written as JSON's `NaN` / `Infinity` tokens, which Python's json reads back.

The journal holds a run's metrics and tags: it is created readable by its owner only (0600), in a
folder created 0700 (an existing folder keeps its mode).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rldiag.collectors.uri import is_redacted, redact_uri

Point = tuple[str, float, int, int]  # key, value, timestamp_ms, step

JOURNAL_VERSION = 1


@dataclass
class Batch:
    seq: int
    metrics: list[Point]
    tags: dict[str, str] = field(default_factory=dict)
    replayed: bool = False  # read back from an earlier journal
    created: float = 0.0  # time.monotonic() when queued for sending (0: send at once)

    @property
    def size(self) -> int:
        return len(self.metrics) + len(self.tags)


@dataclass
class JournalContents:
    run_id: str | None
    tracking_uri: str | None
    pending: list[Batch]
    corrupt_lines: int
    max_seq: int
    refused: int = 0  # entries recorded as refused by the store for good (not replayed)
    uri_redacted: bool = False  # the header's tracking URI had credentials, which were not stored


def journal_path(spill_dir: str | os.PathLike, run_id: str) -> Path:
    return Path(spill_dir) / f"{run_id}.jsonl"


def read_journal(path: str | os.PathLike) -> JournalContents:
    """Parse a journal; unacknowledged batches come back in order, damaged lines are counted."""
    run_id = uri = None
    redacted = False
    batches: dict[int, Batch] = {}
    acked: set[int] = set()
    corrupt = 0
    refused = 0
    max_seq = -1
    if not stat.S_ISREG(os.stat(path).st_mode):  # a device or FIFO would read forever (/dev/zero, /dev/full)
        raise OSError(errno.EINVAL, f"{path} is not a regular file, so not a journal")
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
                if "rldiag_journal" in obj:
                    run_id, uri = obj.get("run_id"), obj.get("tracking_uri")
                    redacted = bool(obj.get("uri_redacted")) or is_redacted(uri)
                elif "ack" in obj:
                    acked.update(int(s) for s in obj["ack"])
                elif "refused" in obj:
                    refused += len(obj["refused"])
                else:
                    seq = int(obj["seq"])
                    points = [(str(k), float(v), int(ts), int(st)) for k, v, ts, st in obj.get("m", [])]
                    tags = {str(k): str(v) for k, v in obj.get("t", {}).items()}
                    batches[seq] = Batch(seq, points, tags)
                    max_seq = max(max_seq, seq)
            except (ValueError, TypeError, KeyError, AttributeError):
                corrupt += 1
    pending = [b for s, b in sorted(batches.items()) if s not in acked]
    return JournalContents(run_id, uri, pending, corrupt, max_seq, refused, redacted)


class Journal:
    """Appends batches and acks for one run; safe to call from several threads."""

    def __init__(self, path: Path, run_id: str, tracking_uri: str):
        self.path = path
        self._lock = threading.Lock()
        if not path.parent.is_dir():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the last folder 0700, as umask allows
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077 and st.st_uid == os.getuid():
                os.fchmod(fd, 0o600)  # an older journal, written before journals were private
            fresh = st.st_size == 0
            self._f = os.fdopen(fd, "a", encoding="utf-8")
        except BaseException:
            os.close(fd)
            raise
        if fresh:
            shown = redact_uri(tracking_uri or "")
            header: dict = {"rldiag_journal": JOURNAL_VERSION, "run_id": run_id, "tracking_uri": shown}
            if shown != (tracking_uri or ""):
                header["uri_redacted"] = True
            self._write(header)

    def _write(self, obj: dict) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()  # into the OS: survives a SIGKILL of this process

    def append(self, batch: Batch) -> None:
        obj: dict = {"seq": batch.seq, "m": batch.metrics}
        if batch.tags:
            obj["t"] = batch.tags
        self._write(obj)

    def ack(self, seqs: list[int]) -> None:
        self._write({"ack": seqs})

    def refuse(self, entries: list[tuple[tuple, str]]) -> None:
        """Record entries the store refused for good, each with the store's reason."""
        self._write({"refused": [[list(e), why] for e, why in entries]})

    def abandon(self) -> None:
        """In a forked child: let go of the parent's journal without writing to it. The file's
        descriptor is pointed at /dev/null, so that whatever the copied buffer holds (a fork in the
        middle of a write) never lands in the parent's file; the lock is not taken (another thread
        of the parent may have held it at the fork)."""
        try:
            fd = self._f.fileno()
        except ValueError:  # already closed
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)

    def close(self, *, delete: bool) -> None:
        with self._lock:
            self._f.close()
        if delete:
            self.path.unlink(missing_ok=True)
