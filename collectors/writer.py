"""The one write path: the training thread enqueues, background threads journal and deliver.

    training thread ──put──► queue ──► ingest thread ──► journal file (append, before sending)
                                                     └──► pending batches ──► sender thread ──► store

- `log_metrics` / `set_tags` only put a tuple on an unbounded queue: they never wait on I/O.
- The ingest thread validates (bad values are counted and warned about once per key, keys MLflow
  rejects are cleaned), adds the inf flags (`keys.inf_flag_key`), and journals each batch.
- The sender merges pending batches up to `max_batch` metrics (MLflow's limit is 1000 a call), sends
  them once a full batch is pending or the oldest has waited `send_interval_s` (fewer store calls
  competing with training for the CPU), and acks them in the journal. While the store is unreachable it retries with exponential
  back-off, keeping order; nothing is dropped.
- `close()` drains with a bounded wait. What is still undelivered is counted and reported with the
  journal's path and the `rldiag sync` command that replays it; a fully delivered journal is removed.
  A writer started again for the same run replays its journal first.

Modelled on MLflow's `async_logging_queue.py`: injected send function, batch merging up to a cap,
flush, drain at exit.
"""

from __future__ import annotations

import atexit
import logging
import math
import queue
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rldiag.collectors import keys
from rldiag.collectors.journal import Batch, Journal, Point, journal_path, read_journal

log = logging.getLogger("rldiag.writer")

# send(run_id, metrics, tags): raise on failure; must be safe to call again with the same points.
SendFn = Callable[[str, list[Point], dict[str, str]], None]

MAX_BATCH = 1000  # MLflow refuses more than 1000 metrics in one batch call
MAX_TAGS = 100
_KEY_OK = re.compile(r"^[/\w.\- :]*$")


def clean_key(key: str) -> str:
    """A metric key MLflow accepts: allowed characters only, no empty path segments, <= 250 chars."""
    if _KEY_OK.match(key) and len(key) <= 250 and not key.startswith("/") and not key.endswith("/") and "//" not in key:
        return key
    cleaned = re.sub(r"[^/\w.\- :]", "_", key)
    cleaned = "/".join(part for part in cleaned.split("/") if part) or "_"
    return cleaned[:250]


@dataclass
class WriterStats:
    enqueued: int = 0  # points accepted from the caller (inf flags not counted)
    delivered: int = 0  # metric points and tags the store acknowledged (inf flags and alert tags included)
    rejected: int = 0  # values that are not numbers (None, str, ...): warned about, not written
    replayed: int = 0  # points delivered from an earlier journal of the same run
    undelivered: int = 0  # set by close(): points still only in the journal
    send_failures: int = 0
    journal_errors: int = 0
    last_error: str | None = None


class _Flush:
    def __init__(self) -> None:
        self.event = threading.Event()


_STOP = object()


class MetricWriter:
    """Background MLflow writer for one run. Thread-safe; `close()` (or interpreter exit) drains it.

    The journal is `journal_file` if given, else `<spill_dir>/<run_id>.jsonl`; `spill_dir=None` and no
    `journal_file` keeps none. An existing journal is replayed before anything new is sent.
    """

    def __init__(
        self,
        run_id: str,
        send: SendFn,
        *,
        tracking_uri: str = "",
        spill_dir: str | Path | None = ".rldiag/spill",
        journal_file: str | Path | None = None,
        max_batch: int = MAX_BATCH,
        linger_s: float = 0.05,
        send_interval_s: float = 1.0,
        backoff_s: tuple[float, float] = (0.25, 15.0),
        close_timeout_s: float = 30.0,
    ):
        if linger_s < 0:
            raise ValueError(f"linger_s={linger_s}: use 0 or more seconds (how often queued points are taken)")
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch={max_batch} is outside 1..{MAX_BATCH} (MLflow's batch limit)")
        self.run_id = run_id
        self.stats = WriterStats()
        self._send = send
        self._max_batch = max_batch
        self._linger = linger_s
        self._send_interval = send_interval_s
        self._pending_points = 0
        self._flushes_waiting = 0
        self._backoff = backoff_s
        self._close_timeout = close_timeout_s
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: deque[Batch | _Flush] = deque()
        self._cv = threading.Condition()
        self._closing = threading.Event()
        self._ingest_done = threading.Event()
        self._give_up = threading.Event()
        self._closed = False
        self._warned: set[str] = set()
        self._key_cache: dict[str, str] = {}
        self._seq = 0
        self._inflight: list[Batch] = []
        self.journal: Journal | None = None
        if spill_dir is not None or journal_file is not None:
            path = Path(journal_file) if journal_file is not None else journal_path(spill_dir, run_id)
            if path.exists():
                self._recover(path)
            try:
                self.journal = Journal(path, run_id, tracking_uri)
            except OSError as e:
                self._journal_failed(e)
        self._threads = [
            threading.Thread(target=self._ingest_loop, name=f"rldiag-ingest-{run_id[:8]}", daemon=True),
            threading.Thread(target=self._send_loop, name=f"rldiag-send-{run_id[:8]}", daemon=True),
        ]
        for t in self._threads:
            t.start()
        _live_writers.add(self)

    # ---- training thread -------------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Enqueue `{key: value}` at `step`. Never blocks; values are validated in the background."""
        if self._closed:
            raise RuntimeError(f"writer for run {self.run_id} is closed; metrics at step {step} were not logged")
        ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        self._q.put((int(step), ts, dict(metrics)))  # a copy: the caller may reuse its dict

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Enqueue run tags (delivered in order with the metrics)."""
        self._q.put((None, 0, dict(tags)))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything enqueued before this call reached the store; False on timeout."""
        marker = _Flush()
        self._q.put(marker)
        return marker.event.wait(timeout)

    def close(self, timeout: float | None = None) -> WriterStats:
        """Drain within `timeout` seconds (default `close_timeout_s`); report what was not delivered."""
        if self._closed:
            return self.stats
        self._closed = True
        _live_writers.discard(self)
        deadline = time.monotonic() + (self._close_timeout if timeout is None else timeout)
        self._q.put(_STOP)
        self._ingest_done.wait(max(0.0, deadline - time.monotonic()))
        with self._cv:
            self._closing.set()
            self._cv.notify_all()
        self._threads[1].join(max(0.0, deadline - time.monotonic()))
        self._give_up.set()
        with self._cv:
            self._cv.notify_all()
            left = sum(b.size for b in [*self._pending, *self._inflight] if isinstance(b, Batch))
        self.stats.undelivered = left + self._q.qsize()  # qsize: items the ingest thread never reached
        if self.journal is not None:
            self.journal.close(delete=self.stats.undelivered == 0 and self.stats.journal_errors == 0)
        if self.stats.undelivered:
            where = (
                f"They are saved in {self.journal.path}; replay them with: rldiag sync {self.journal.path}"
                if self.journal is not None
                else "No journal was kept (spill_dir=None or the disk refused it): they are lost."
            )
            log.error(
                "rldiag: %d metric points of run %s were not delivered (last error: %s). %s",
                self.stats.undelivered, self.run_id, self.stats.last_error, where,
            )
        return self.stats

    # ---- ingest thread ---------------------------------------------------------------------------
    def _ingest_loop(self) -> None:
        buf: list[Point] = []
        tags: dict[str, str] = {}
        stop = False
        full = False
        while not stop:
            # Poll rather than block on the queue: a `log_metrics` put then wakes no thread, so the
            # training thread's call never hands the CPU over mid-call (on a busy core, that hand-over
            # is a chance for any other runnable task to take the core for a millisecond or more).
            if not full:
                time.sleep(max(self._linger, 0.005))  # lingering also lets batches fill up
            items = []
            while len(items) <= 4 * self._max_batch:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            full = len(items) > 4 * self._max_batch  # more is waiting: take it without sleeping
            for it in items:
                if it is _STOP:
                    stop = True
                elif isinstance(it, _Flush):
                    self._emit(buf, tags)
                    buf, tags = [], {}
                    self._push(it)
                else:
                    step, ts, payload = it
                    if step is None:
                        tags.update({str(k): str(v) for k, v in payload.items()})
                        if len(tags) >= MAX_TAGS:
                            self._emit(buf, tags)
                            buf, tags = [], {}
                    else:
                        self._convert(payload, step, ts, buf)
                        if len(buf) >= self._max_batch:
                            self._emit(buf[: self._max_batch], tags)
                            buf, tags = buf[self._max_batch :], {}
            while len(buf) >= self._max_batch:
                self._emit(buf[: self._max_batch], {})
                buf = buf[self._max_batch :]
            self._emit(buf, tags)
            buf, tags = [], {}
        self._ingest_done.set()

    def _convert(self, payload: Mapping, step: int, ts: int, out: list[Point]) -> None:
        for key, value in payload.items():
            try:
                v = float(value)
            except (TypeError, ValueError):
                self.stats.rejected += 1
                self._warn_once(f"value:{key}", "rldiag: metric %r at step %d has value %r (%s), not a number: "
                                "not logged. Log a float, int or one-element tensor.", key, step, value, type(value).__name__)
                continue
            self.stats.enqueued += 1
            k = self._key_cache.get(key)
            if k is None:
                k = self._key_cache[key] = clean_key(str(key))
                if k != key:
                    self._warn_once(f"key:{key}", "rldiag: metric key %r is not accepted by MLflow; logging it as %r",
                                    key, k)
            out.append((k, v, ts, step))
            if math.isinf(v):
                out.append((keys.inf_flag_key(k), 1.0 if v > 0 else -1.0, ts, step))

    def _emit(self, points: list[Point], tags: dict[str, str]) -> None:
        if not points and not tags:
            return
        batch = Batch(self._seq, list(points), dict(tags))
        self._seq += 1
        if self.journal is not None:
            try:
                self.journal.append(batch)
            except (OSError, ValueError) as e:
                self._journal_failed(e)
        self._push(batch)

    def _push(self, item: Batch | _Flush) -> None:
        with self._cv:
            if isinstance(item, _Flush):
                self._flushes_waiting += 1
            else:
                item.created = time.monotonic()
                self._pending_points += item.size
            self._pending.append(item)
            self._cv.notify_all()

    def _wait_s(self) -> float | None:
        """Under the lock: None when there is nothing to send, 0 when the sender should send now, else
        how long the oldest batch may still wait to be merged with more (fewer, larger store calls)."""
        if not self._pending:
            return None
        if self._closing.is_set() or self._flushes_waiting or self._pending_points >= self._max_batch:
            return 0.0
        first = self._pending[0]
        age = time.monotonic() - first.created if isinstance(first, Batch) else self._send_interval
        return max(0.0, self._send_interval - age)

    def _journal_failed(self, e: OSError) -> None:
        self.stats.journal_errors += 1
        self._warn_once("journal", "rldiag: cannot write the local journal (%s): metrics are still sent, but what "
                        "the store does not take before exit will be lost. Free disk space or set spill_dir.", e)
        self.journal = None

    # ---- sender thread ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
        delay = self._backoff[0]
        while True:
            with self._cv:
                while True:
                    wait = self._wait_s()
                    if wait == 0.0:
                        break
                    if wait is None and self._closing.is_set() and self._ingest_done.is_set():
                        return
                    self._cv.wait(wait)
                group = self._take_group()
                if isinstance(group, _Flush):
                    self._flushes_waiting -= 1
                else:
                    self._inflight = group
                    self._pending_points -= sum(b.size for b in group)
            if isinstance(group, _Flush):
                group.event.set()
                continue
            while True:
                try:
                    metrics = [p for b in group for p in b.metrics]
                    tags = {k: v for b in group for k, v in b.tags.items()}
                    self._send(self.run_id, metrics, tags)
                except Exception as e:  # noqa: BLE001 - any store error means: keep and retry
                    self.stats.send_failures += 1
                    self.stats.last_error = f"{type(e).__name__}: {e}"[:500]
                    self._warn_once("send", "rldiag: tracking store unreachable for run %s (%s); retrying with "
                                    "back-off, metrics are kept", self.run_id, self.stats.last_error)
                    if self._give_up.wait(delay):
                        return  # close() counts the in-flight group as undelivered
                    delay = min(delay * 2, self._backoff[1])
                    continue
                delay = self._backoff[0]
                with self._cv:
                    self._inflight = []
                self.stats.delivered += sum(b.size for b in group)
                self.stats.replayed += sum(b.size for b in group if b.replayed)
                if self.journal is not None:
                    try:
                        self.journal.ack([b.seq for b in group])
                    except ValueError:
                        # close() gave up waiting and closed the journal while this batch was in flight:
                        # it stays there unacknowledged, so a replay sends it again and the SQL stores
                        # keep one copy of an identical point. Nothing is lost: no warning.
                        pass
                    except OSError as e:
                        self._journal_failed(e)
                break

    def _take_group(self) -> list[Batch] | _Flush:
        first = self._pending.popleft()
        if isinstance(first, _Flush):
            return first
        group, n, ntags = [first], len(first.metrics), len(first.tags)
        while self._pending and isinstance(self._pending[0], Batch):
            nxt = self._pending[0]
            if n + len(nxt.metrics) > self._max_batch or ntags + len(nxt.tags) > MAX_TAGS:
                break
            group.append(self._pending.popleft())
            n += len(nxt.metrics)
            ntags += len(nxt.tags)
        return group

    # ---- recovery --------------------------------------------------------------------------------
    def _recover(self, path: Path) -> None:
        """Queue an earlier journal's unacknowledged batches ahead of everything new."""
        try:
            contents = read_journal(path)
        except OSError as e:
            self._warn_once("recover", "rldiag: cannot read journal %s (%s); replay it later with rldiag sync", path, e)
            return
        if contents.corrupt_lines:
            log.warning("rldiag: skipped %d damaged lines in %s", contents.corrupt_lines, path)
        self._seq = contents.max_seq + 1
        for b in contents.pending:
            b.replayed = True  # created = 0: sent at once
            self._pending.append(b)
            self._pending_points += b.size
        if contents.pending:
            log.info("rldiag: replaying %d batches of run %s from %s", len(contents.pending), self.run_id, path)

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)


_live_writers: weakref.WeakSet[MetricWriter] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    for w in list(_live_writers):
        w.close()
