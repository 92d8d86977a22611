"""The writer's append-only local journal: every batch is written here before it is sent.

A journal belongs to one process at a time (`journal_lock`: a flock on `<stem>.lock`, taken before
anything is read or appended). The first writer of a run owns `<run_id>`; a second writer of the same
run id, while the first lives, gets `<run_id>-2` (and says so in one line): batch numbers are per
journal, so one writer's acks never mark the other's batches delivered. A writer that starts for a
run also takes over the run's other journals that no live process holds, and delivers them.

The journal is cut into segments of about `segment_bytes` (`journal_read` names them). A segment whose
batches are all acknowledged is deleted while the run goes on, so the journal on disk is what is not
delivered plus the segment being written. Each line is one JSON object:
- `{"rldiag_journal": 2, "run_id": ..., "tracking_uri": ..., "segment": K}`: the header, first line of
  each segment. The URI is stored without its credentials (`redact_uri`: the password and secret query
  values are `***`, and `"uri_redacted": true` says so); `rldiag sync` takes them from
  `--tracking-uri` or `MLFLOW_TRACKING_URI` again;
- `{"seq": N, "n": K, "m": [[key, value, timestamp_ms, step], ...], "t": {tag: value}}`: a batch of K
  entries (points plus tags);
- `{"ack": [N, ...]}`: batches that reached the store, appended to the segment that holds them;
- `{"refused": [[entry, reason], ...]}`: metric points (`[key, value, timestamp_ms, step]`) and tags
  (`[key, value]`) the store refused for good, written before the ack of their batch: set aside, never
  replayed, kept for the record while their segment is.

A journal of rldiag before segments (version 1: one `<run_id>.jsonl`, batches without `"n"`) is
segment 0 of its stem and is read the same way. A batch without an ack is replayed: automatically
when a writer starts again for the same run, or by `rldiag sync FILE`. Replays keep each point's
original timestamp, and MLflow's SQL stores ignore an identical (key, value, step, timestamp) point, so
delivering a batch twice stores it once. Lines that do not parse (a process killed mid-write, a damaged
file) are skipped and counted. NaN and inf are written as JSON's `NaN` / `Infinity` tokens, which
Python's json reads back.

A failed write (ENOSPC, EIO, EROFS) is undone (the segment is cut back to where the line began, so
no torn line sits between two whole ones; where even that fails, the segment is left and the next
append starts a new one), and the writer tries again with its next batch. Acks that could not be
written are kept and written with the next ack. A segment deleted under a running writer (the spill
folder removed) is noticed at the next append: the folder and the lock are made again and a new
segment begins.

The journal holds a run's metrics and tags: its files are created readable by their owner only
(0600), in a folder created 0700 (an existing folder keeps its mode).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from rldiag.collectors.journal_files import header_tmp, new_segment_file, unlink as _unlink, write_all as _write_all
from rldiag.collectors.journal_lock import JournalBusy, JournalLock, holder, try_lock
from rldiag.collectors.journal_read import (
    Batch,
    JournalScan,
    Point,
    Segment,
    iter_pending,
    lock_path,
    scan_journal,
    segment_files,
    segment_path,
    split_name,
)
from rldiag.collectors.uri import redact_uri

__all__ = ["Batch", "Journal", "JournalBusy", "JournalContents", "Point", "Segment", "journal_path", "read_journal"]

log = logging.getLogger("rldiag.writer")

JOURNAL_VERSION = 2
SEGMENT_BYTES = 4 << 20  # about 78k points a segment (54 bytes a point)
MAX_WRITERS = 64  # stems <run_id>, <run_id>-2 ... <run_id>-64


def journal_path(spill_dir: str | os.PathLike, run_id: str) -> Path:
    """Segment 0 of the first journal of `run_id`; `rldiag sync` of this path reads all its segments."""
    return Path(spill_dir) / f"{run_id}.jsonl"


@dataclass
class JournalContents:
    run_id: str | None
    tracking_uri: str | None
    pending: list[Batch]
    corrupt_lines: int
    max_seq: int
    refused: int = 0  # entries recorded as refused by the store for good (not replayed)
    uri_redacted: bool = False  # the header's tracking URI had credentials, which were not stored


def read_journal(path: str | os.PathLike) -> JournalContents:
    """Every unacknowledged batch of the journal that `path` (any of its segments) belongs to, in order.
    For tests and small journals: it holds them all in memory (the writer and sync stream them)."""
    folder, stem, _ = split_name(Path(path))
    scan = scan_journal(folder, stem)
    if scan.unreadable and not scan.segments:
        raise OSError(scan.unreadable[0][1])
    if scan.foreign and not scan.segments:
        raise ValueError(f"{scan.foreign[0][0]} is not an rldiag journal: {scan.foreign[0][1]}")
    pending, corrupt = [], scan.corrupt_lines
    for b in iter_pending(scan):
        if b is None:
            corrupt += 1
        else:
            pending.append(b)
    return JournalContents(scan.run_id, scan.tracking_uri, pending, corrupt, scan.max_seq, scan.refused,
                           scan.uri_redacted)


class Journal:
    """The journal one writer owns: its lock, its scanned segments and the segment being appended.
    Safe to call from several threads. `replay` holds the undelivered batches found at opening."""

    def __init__(self, folder: Path, stem: str, lock: JournalLock, run_id: str, tracking_uri: str, *,
                 segment_bytes: int = SEGMENT_BYTES):
        self.folder, self.stem = folder, stem
        self.path = segment_path(folder, stem, 0)  # what `rldiag sync` is told: it reads every segment
        self.run_id = run_id
        self.segment_bytes = segment_bytes
        self._uri = tracking_uri
        self._lock = threading.Lock()
        self._locks = {stem: lock}  # our own stem and the stems taken over from dead writers
        self._segments: list[Segment] = []  # every segment not deleted yet
        self.replay: list[JournalScan] = []
        self._cur: Segment | None = None
        self._fd = -1
        self._cur_bytes = 0
        self._closed = False
        self._owed: dict[Segment, list[int]] = {}  # acks whose write failed: written with the next ack
        self.unreadable: list[tuple[Path, str]] = []
        self.foreign: list[tuple[Path, str]] = []  # files named like its segments that are not: never touched
        self.corrupt_lines = 0  # lines of the scanned segments that do not parse
        scan = self._adopt(stem)
        self.stored_uri, self.uri_redacted = scan.tracking_uri, scan.uri_redacted  # what the header says
        self.next_seq = scan.max_seq + 1
        numbers = [s.segment.number for s in scan.segments] + [split_name(p)[2] for p, _ in self.foreign]
        self._next_number = max(numbers) + 1 if numbers else 0

    # ---- opening ---------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, spill_dir: str | os.PathLike, run_id: str, tracking_uri: str, *,
                segment_bytes: int = SEGMENT_BYTES) -> Journal:
        """The first journal of `run_id` no live process holds (one line names the holder of any taken
        before it); the run's other free journals are taken over too (`replay`)."""
        folder = Path(spill_dir)
        if not folder.is_dir():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # the last folder 0700, as umask allows
        held = []
        for k in range(1, MAX_WRITERS + 1):
            stem = run_id if k == 1 else f"{run_id}-{k}"
            lock = try_lock(lock_path(folder, stem))
            if lock is None:
                held.append((stem, holder(lock_path(folder, stem))))
                continue
            j = None
            try:
                j = cls(folder, stem, lock, run_id, tracking_uri, segment_bytes=segment_bytes)
                for other in _other_stems(folder, run_id, stem):
                    j._take_over(other)
            except BaseException:
                for lk in (list(j._locks.values()) if j is not None else [lock]):
                    lk.release(delete=False)
                raise
            if held:
                log.warning("rldiag: journal %s of run %s is held by a live writer (%s): this writer of the same "
                            "run journals to %s, numbered apart", segment_path(folder, held[-1][0], 0), run_id,
                            held[-1][1], j.path)
            return j
        raise JournalBusy(segment_path(folder, run_id, 0), f"{MAX_WRITERS} live writers of run {run_id}")

    @classmethod
    def for_file(cls, path: str | os.PathLike, tracking_uri: str = "", *,
                 segment_bytes: int = SEGMENT_BYTES) -> Journal:
        """The journal that `path` (any of its segments) belongs to; `JournalBusy` if a live process
        holds it."""
        folder, stem, _ = split_name(Path(path))
        lk = lock_path(folder, stem)
        lock = try_lock(lk)
        if lock is None:
            raise JournalBusy(Path(path), holder(lk))
        try:
            return cls(folder, stem, lock, "", tracking_uri, segment_bytes=segment_bytes)
        except BaseException:
            lock.release(delete=False)
            raise

    def _adopt(self, stem: str) -> JournalScan:
        scan = scan_journal(self.folder, stem, self.run_id or None)
        self.unreadable += scan.unreadable
        self.foreign += scan.foreign
        self.corrupt_lines += scan.corrupt_lines
        _unlink(header_tmp(self.folder, stem))  # a writer of this stem killed mid-roll: ours (we hold its lock)
        for s in scan.segments:  # verified segments only (`segment_problem`): foreign files are never touched
            if s.segment.open_batches == 0:  # fully delivered by an earlier owner
                _unlink(s.segment.path)
            else:
                self._segments.append(s.segment)
        if scan.pending_batches:
            self.replay.append(scan)
        if not self.run_id and scan.run_id:
            self.run_id = scan.run_id
        return scan

    def _take_over(self, stem: str) -> None:
        lock = try_lock(lock_path(self.folder, stem))
        if lock is None:
            return  # a live writer's: it delivers it
        self._locks[stem] = lock
        scan = self._adopt(stem)
        if scan.pending_batches:
            log.warning("rldiag: taking over journal %s of run %s (its writer has ended): delivering its %d "
                        "undelivered batches", segment_path(self.folder, stem, 0), self.run_id, scan.pending_batches)
        self._release_if_empty(stem)

    # ---- writing ---------------------------------------------------------------------------------
    def append(self, batch: Batch) -> int:
        """Write `batch` into the current segment (a new one past `segment_bytes`); sets `batch.home`
        and returns where its line starts."""
        obj: dict = {"seq": batch.seq, "n": batch.size, "m": batch.metrics}
        if batch.tags:
            obj["t"] = batch.tags
        line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._check_open()
            if self._cur is not None and os.fstat(self._fd).st_nlink == 0:
                self._forget_current()  # deleted under us (the spill folder removed): begin a new one
            if self._cur is None or (self._cur.batches and self._cur_bytes + len(line) > self.segment_bytes):
                self._rotate()
            at = self._cur_bytes
            self._write_current(line)
            self._cur.batches += 1
            self._cur.open_batches += 1
            batch.home = self._cur
            return at

    def ack(self, batches: list[Batch]) -> None:
        """Record delivery, in each batch's own segment; delete segments left with nothing to deliver.
        An ack that cannot be written (a full disk) is kept and written with the next one; the first
        such error is raised once the others are written."""
        with self._lock:
            self._check_open()
            for b in batches:
                if b.home is not None:
                    self._owed.setdefault(b.home, []).append(b.seq)
            self._write_owed()

    def _write_owed(self) -> None:
        error: OSError | None = None
        for seg, seqs in list(self._owed.items()):
            if seg not in self._segments:  # deleted (delivered, or removed under us): nothing to mark
                del self._owed[seg]
                continue
            try:
                self._write_to(seg, {"ack": seqs})
            except FileNotFoundError:
                self._segments.remove(seg)  # removed under us: its batches are gone from disk
                del self._owed[seg]
                continue
            except OSError as e:
                error = error or e
                continue
            del self._owed[seg]
            seg.open_batches -= len(seqs)
            if seg.open_batches <= 0 and seg is not self._cur:
                self._drop(seg)
        if error is not None:
            raise error

    def refuse(self, entries: list[tuple[tuple, str]], home: Segment | None) -> None:
        """Record entries the store refused for good, each with the store's reason."""
        with self._lock:
            self._check_open()
            seg = home if home is not None and home in self._segments else self._cur
            if seg is not None:
                self._write_to(seg, {"refused": [[list(e), why] for e, why in entries]})

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"journal {self.path} is closed")

    def _rotate(self) -> None:
        old = self._cur
        if old is not None:
            os.close(self._fd)
            self._fd = -1
            self._cur = None
            if old.open_batches <= 0:
                self._drop(old)
        self._ensure_folder()
        fd, path, self._next_number, size = new_segment_file(self.folder, self.stem, self._next_number, self._header)
        seg = Segment(path, self._next_number, self.stem)
        self._fd, self._cur, self._cur_bytes = fd, seg, size
        self._next_number += 1
        self._segments.append(seg)

    def _header(self, number: int) -> bytes:
        shown = redact_uri(self._uri or "")
        header: dict = {"rldiag_journal": JOURNAL_VERSION, "run_id": self.run_id, "tracking_uri": shown,
                        "segment": number}
        if shown != (self._uri or ""):
            header["uri_redacted"] = True
        return (json.dumps(header, separators=(",", ":")) + "\n").encode()

    def _ensure_folder(self) -> None:
        """The folder and our lock file, made again if the folder was removed under a running writer."""
        lk = self._locks[self.stem]
        try:
            same = os.stat(lk.path).st_ino == os.fstat(lk.fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        new = try_lock(lk.path)
        if new is None:
            raise OSError(f"{lk.path} was removed and is now held by another process ({holder(lk.path)})")
        lk.release(delete=False)
        self._locks[self.stem] = new
        log.warning("rldiag: the journal folder %s of run %s was removed while the run went on: made it again; "
                    "batches that waited only in the removed files are counted lost", self.folder, self.run_id)

    def _forget_current(self) -> None:
        """The segment being written was deleted under us: let go of it (its batches are gone)."""
        os.close(self._fd)
        self._fd = -1
        if self._cur in self._segments:
            self._segments.remove(self._cur)
        self._cur = None

    def _write_current(self, data: bytes) -> None:
        try:
            _write_all(self._fd, data)  # one write straight into the OS: survives a SIGKILL of this process
        except OSError:
            try:
                os.ftruncate(self._fd, self._cur_bytes)  # undo a part-written line (a full disk mid-line)
            except OSError:
                os.close(self._fd)  # cannot undo: leave the segment (its torn end is read as damaged)
                self._fd, self._cur = -1, None
            raise
        self._cur_bytes += len(data)

    def _write_to(self, seg: Segment, obj: dict) -> None:
        line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        if seg is self._cur:
            self._write_current(line)
            return
        fd = os.open(seg.path, os.O_RDWR | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # the segment ends in a torn line (its writer was killed mid-write)
            try:
                _write_all(fd, line)
            except OSError:
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    pass  # a torn ack line: read as damaged, its batches replayed (stored once)
                raise
        finally:
            os.close(fd)

    def _drop(self, seg: Segment) -> None:
        _unlink(seg.path)
        if seg in self._segments:
            self._segments.remove(seg)
        if seg.stem != self.stem:
            self._release_if_empty(seg.stem)

    def _release_if_empty(self, stem: str) -> None:
        if stem != self.stem and not any(s.stem == stem for s in self._segments):
            lock = self._locks.pop(stem, None)
            if lock is not None:
                lock.release()

    # ---- the end -----------------------------------------------------------------------------------
    @property
    def segments(self) -> list[Segment]:
        with self._lock:
            return list(self._segments)

    def on_disk(self) -> set[Segment]:
        """The segments whose files are still there (not removed under the writer)."""
        with self._lock:
            return {s for s in self._segments if s.path.exists()}

    def close(self, *, delete: bool = True) -> None:
        """Release the journal; with `delete`, remove its segments whose batches are all acknowledged
        (only those: a segment with a batch the store never took, or a damaged one, is kept)."""
        with self._lock:
            if self._closed:
                return
            if self._owed:
                try:
                    self._write_owed()
                except OSError:
                    pass  # still unwritable: those batches are replayed again (stored once)
            self._closed = True
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._cur = None
            for seg in list(self._segments):
                if delete and seg.open_batches <= 0:
                    _unlink(seg.path)
                    self._segments.remove(seg)
            for lock in self._locks.values():
                lock.release()
            self._locks.clear()

    def abandon(self) -> None:
        """In a forked child: let go of the parent's journal without writing to it or unlocking it."""
        self._closed = True
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        for lock in self._locks.values():
            lock.abandon()
        self._locks = {}


def _other_stems(folder: Path, run_id: str, own: str) -> list[str]:
    """Stems of further writers of `run_id` (`<run_id>`, `<run_id>-K`) with segments in `folder`."""
    pat = re.compile(re.escape(run_id) + r"(-\d+)?(?:\.\d+)?\.jsonl")
    stems = set()
    for n in os.listdir(folder):
        m = pat.fullmatch(n)
        if m:
            stems.add(run_id + (m.group(1) or ""))
    stems.discard(own)
    return sorted(s for s in stems if segment_files(folder, s))
