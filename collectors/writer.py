"""The one write path: the training thread enqueues, background threads journal and deliver.

    training thread ──put──► queue ──► ingest thread ──► journal file (append, before sending)
                                                     └──► pending batches ──► sender thread ──► store

- `log_metrics` / `set_tags` only put a tuple on a queue: they never wait on I/O. The queue is bounded
  (`queue_points`, RLDIAG_QUEUE_POINTS entries): past it the call still returns at once and what does
  not fit is counted lost (`stats.lost_queue`), with one warning when such a stretch begins and one,
  naming how many, when the ingest thread has caught up.
- The ingest thread validates (bad values are counted and warned about once per key; keys are checked
  against MLflow's own rules, `key_problem`, and cleaned with a warning once per key), adds the inf
  flags (`keys.inf_flag_key`), and journals each batch.
- The sender merges pending batches up to `max_batch` entries, sends them once a full batch is
  pending or the oldest has waited `send_interval_s` (fewer store calls competing with training for
  the CPU), and acks them in the journal. Every call stays within MLflow's limits: metrics + params +
  tags <= 1000, tags <= 100, request body <= 1 MB (`_chunks`). A send that fails for a reason that
  can pass (the store down, a timeout, 5xx, 429, a locked database) is retried with exponential
  back-off, keeping order; nothing is dropped. A send the store refuses for good (`Refused`: a
  validation error) is split until the refused entries are isolated; those are set aside with one
  warning per key, counted in `stats.refused` and recorded in the journal, and the rest is delivered.
  If the store refuses even an empty batch for the run (run deleted, no permission), the refusal is
  about the run, not the points: they are kept and retried like an outage.
- A failed journal write (ENOSPC, EIO, EROFS, the folder removed) turns the journal DOWN: later batches
  try it again and it is UP again as soon as one is written. While it is down the RAM cap still holds:
  a batch that does not fit is counted lost (`stats.lost_memory`) with a warning naming how many.
- `close()` drains with a bounded wait, then counts every entry wherever it is (the queue, the chunk
  the ingest thread holds, memory, the journal), so that `stats.balance() == 0`: logged + inf flags +
  replayed-in = delivered + refused + rejected + superseded + journaled + lost. Batches that waited only
  in memory are journaled at close if the journal takes them. The summary names the store's, the
  journal's (with its path and the `rldiag sync` command) and the lost counts; a fully delivered
  journal is removed.
  A writer started again for the same run replays its journal first. After `close()`, `flush()`
  returns at once and `log_metrics` / `set_tags` warn once (counted in `stats.after_close`).
- A value that makes the ingest thread raise (an int past float's range, a `__float__` that fails) is
  warned about, counted in `stats.rejected` and skipped; the thread goes on.
- Errors and warnings never show the tracking URI's credentials (`uri.redact_text`): MLflow's own
  errors quote the URL they called, password included.
- After `os.fork()` the child holds no writer of its parent: the parent's writers are marked closed in
  the child (no wait for threads that the child does not have, no undelivered-points report at its
  exit), and logging through one there raises `ForkedWriterError`.

Modelled on MLflow's `async_logging_queue.py`: injected send function, batch merging up to a cap,
flush, drain at exit.
"""

from __future__ import annotations

import atexit
import enum
import logging
import math
import os
import queue
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rldiag.collectors import keys
from rldiag.collectors.journal import Batch, Journal, JournalBusy, Point, Segment
from rldiag.collectors.journal_read import read_batch
from rldiag.collectors.limits import (
    ENVELOPE_JSON,
    MAX_BATCH,
    MAX_INT64,
    MAX_KEY_CHARS,
    MAX_METRIC_KEY_CHARS,
    MAX_REQUEST_BYTES,
    MAX_TAG_VALUE_CHARS,
    MAX_TAGS,
    Entry,
    Refused,
    clean_key,
    entry_bytes,
    entry_problem,
    entry_text,
    json_len,
    key_problem,
)
from rldiag.collectors.settings import RLDIAG_BACKLOG_POINTS, RLDIAG_QUEUE_POINTS
from rldiag.collectors.uri import redact_text

log = logging.getLogger("rldiag.writer")

# send(run_id, metrics, tags): one store call. Raise `Refused` when the store refuses it for good, any
# other exception when it may pass; must be safe to call again with the same points, and to call with
# no metrics and no tags (the writer's probe of whether the store takes anything for the run).
SendFn = Callable[[str, list[Point], dict[str, str]], None]


@dataclass
class WriterStats:
    enqueued: int = 0  # points accepted from the caller (inf flags not counted)
    delivered: int = 0  # metric points and tags the store acknowledged (inf flags and alert tags included)
    rejected: int = 0  # values that are not numbers (None, str, ...), steps past int64: warned about, not written
    refused: int = 0  # points and tags the store refused for good: warned about, set aside, the rest delivered
    replayed: int = 0  # points delivered from an earlier journal of the same run
    undelivered: int = 0  # set by close(): entries not in the store (journaled + lost)
    after_close: int = 0  # points and tags logged after close(): warned about once, not written
    send_failures: int = 0  # store calls that failed and were retried
    journal_errors: int = 0  # journal writes that failed (each retried with a later batch)
    spilled: int = 0  # points that waited in the journal, not in memory (the backlog past the RAM cap)
    last_error: str | None = None
    last_refusal: str | None = None  # the latest refused entry and the store's reason
    # The ledger (`balance()`): what came in ...
    logged: int = 0  # points and tags the caller logged before close() (the training thread's count)
    flags: int = 0  # inf-flag points the writer added (`keys.inf_flag_key`)
    replay_in: int = 0  # entries found undelivered in earlier journals of the run at start
    # ... and where each entry went, besides delivered / refused / rejected:
    superseded: int = 0  # a tag set again before it was sent: only its latest value is sent
    journaled: int = 0  # set by close(): entries waiting in the journal (`rldiag sync` delivers them)
    lost_queue: int = 0  # logged while the queue to the ingest thread was full
    lost_memory: int = 0  # the journal down and the memory backlog at its cap
    lost_unreadable: int = 0  # in journal lines that could not be read back (damaged, or the file removed)
    lost_at_close: int = 0  # in memory, the queue or the ingest thread's hands when close() gave up, not journaled

    @property
    def lost(self) -> int:
        """Entries that are in neither the store nor the journal, each counted (see the lost_* fields)."""
        return self.lost_queue + self.lost_memory + self.lost_unreadable + self.lost_at_close

    def balance(self) -> int:
        """In minus out: 0 when every entry is accounted for (checked after close())."""
        came = self.logged + self.flags + self.replay_in
        went = (self.delivered + self.refused + self.rejected + self.superseded + self.journaled + self.lost)
        return came - went

    def lost_text(self) -> str:
        """'N lost (why...)', then refused / rejected / superseded counts where not 0."""
        why = [f"{n} {w}" for n, w in ((self.lost_queue, "queue full"), (self.lost_memory, "journal down, memory full"),
                                       (self.lost_unreadable, "journal lines unreadable"),
                                       (self.lost_at_close, "not journaled at close")) if n]
        parts = [f"{self.lost} lost" + (f" ({', '.join(why)})" if why else "")]
        parts += [f"{n} {w}" for n, w in ((self.refused, "refused"), (self.rejected, "rejected"),
                                          (self.superseded, "tags superseded")) if n]
        return " + ".join(parts)

    def ledger(self) -> str:
        """One line: logged = stored + journaled + lost (+ refused, rejected, superseded), and the balance."""
        extra = "".join(f" + {n} {w}" for n, w in ((self.flags, "inf flags"), (self.replay_in, "from earlier journals"))
                        if n)
        return (f"logged {self.logged}{extra} = stored {self.delivered} + journaled {self.journaled} + "
                f"{self.lost_text()}; balance {self.balance()}")


class JournalState(enum.Enum):
    OFF = "off"  # no journal wanted (spill_dir=None): nothing is journaled, no RAM cap
    UP = "up"  # batches are journaled before they are sent
    DOWN = "down"  # the latest write failed: tried again with each later batch; the RAM cap holds


class ForkedWriterError(RuntimeError):
    """Logging, in a process made by `os.fork()`, through a writer that its parent opened."""


class _Flush:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.ok = False  # set with the event: everything enqueued before it was delivered


_STOP = object()


@dataclass(eq=False)
class _OnDisk:
    """Consecutive batches of one journal segment that wait there, not in memory: the outage backlog
    past the RAM cap, or an earlier journal's undelivered batches. The sender reads them back."""

    segment: Segment
    replayed: bool
    offsets: array = field(default_factory=lambda: array("q"))  # where each batch's line starts
    sizes: array = field(default_factory=lambda: array("q"))  # its entries (points + tags)
    size: int = 0
    remaining: int = 0  # entries not yet taken into a group for sending

    def add(self, offset: int, size: int) -> None:
        self.offsets.append(offset)
        self.sizes.append(size)
        self.size += size
        self.remaining += size


class MetricWriter:
    """Background MLflow writer for one run. Thread-safe; `close()` (or interpreter exit) drains it.

    The journal is `journal` (an opened `Journal`) or the one `journal_file` belongs to if given
    (`JournalBusy` when a live process holds it), else the run's first free journal in `spill_dir`
    (`Journal.for_run`); `spill_dir=None` and no journal keeps none. An existing journal's undelivered
    batches are sent before anything new. At most `backlog_points` entries wait in memory (default
    RLDIAG_BACKLOG_POINTS); past that the backlog waits in the journal and is read back from there.
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
        journal: Journal | None = None,
        backlog_points: int | None = None,
        segment_bytes: int | None = None,
        queue_points: int | None = None,
    ):
        if linger_s < 0:
            raise ValueError(f"linger_s={linger_s}: use 0 or more seconds (how often queued points are taken)")
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch={max_batch} is outside 1..{MAX_BATCH} (MLflow's limit of metrics, "
                             "params and tags in one call)")
        cap = RLDIAG_BACKLOG_POINTS.get_int() if backlog_points is None else backlog_points
        if cap < 0:
            raise ValueError(f"backlog_points={cap}: use 0 or more (points the outage backlog keeps in memory)")
        qcap = RLDIAG_QUEUE_POINTS.get_int() if queue_points is None else queue_points
        if qcap < 1:
            raise ValueError(f"queue_points={qcap}: use 1 or more (points that may wait for the ingest thread; "
                             f"default {RLDIAG_QUEUE_POINTS.default})")
        self.run_id = run_id
        self.stats = WriterStats()
        self._ram_cap = cap
        self._ram_points = 0  # entries of the batches waiting in memory (not those in the journal only)
        self._src: _OnDisk | None = None  # the journal run the sender is reading back
        self._send = send
        self._max_batch = max_batch
        self._linger = linger_s
        self._send_interval = send_interval_s
        self._pending_points = 0
        self._flushes_waiting = 0
        self._backoff = backoff_s
        self._close_timeout = close_timeout_s
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._queue_cap = qcap
        self._put = 0  # entries put on the queue (training thread) ...
        self._got = 0  # ... and taken from it (ingest thread): their difference is what waits
        self._q_full = False  # in a stretch of a full queue (ends below half the cap)
        self._q_stretch = 0  # entries lost in the current stretch
        self._drop_lock = threading.Lock()
        self._ingest_lock = threading.Lock()  # held by the ingest thread while it handles one item
        self._held: list = []  # the chunk the ingest thread took from the queue ...
        self._held_pos = 0  # ... and how far it got
        self._hb: list[Point] = []  # entries it converted and has not emitted yet
        self._ht: dict[str, str] = {}
        self._pending: deque[Batch | _Flush] = deque()
        self._cv = threading.Condition()
        self._closing = threading.Event()
        self._ingest_done = threading.Event()
        self._give_up = threading.Event()
        self._closed = False
        self._close_done = threading.Event()
        self._pid = os.getpid()
        self._uri = tracking_uri
        self._flush_lock = threading.Lock()
        self._flush_markers: set[_Flush] = set()
        self._flushes_released = False
        self._warned: set[str] = set()
        self._key_cache: dict[str, str] = {}
        self._tag_key_cache: dict[str, str] = {}
        self._seq = 0
        self._threads_started = False
        self._inflight: list[Batch] = []
        self._inflight_done = 0  # entries of the in-flight group already delivered or set aside
        self._counted = False  # close() has counted what is undelivered: the counts change no more
        self._delay = backoff_s[0]
        self.journal: Journal | None = None
        self._jstate = JournalState.OFF if journal is None and journal_file is None and spill_dir is None \
            else JournalState.UP
        self._spill_dir = spill_dir
        self._seg_kw = {} if segment_bytes is None else {"segment_bytes": segment_bytes}
        self._reopen_at = 0.0  # when to try opening the journal again (it could not be opened)
        self._down_lost = 0  # entries lost in the current stretch of the journal being down
        if journal is not None:
            self.journal = journal
        elif journal_file is not None:
            self.journal = Journal.for_file(journal_file, tracking_uri, **self._seg_kw)  # JournalBusy: the caller's
        elif spill_dir is not None:
            self._open_journal()
        if self.journal is not None:
            self._recover(self.journal)
        self._threads = [
            threading.Thread(target=self._ingest_loop, name=f"rldiag-ingest-{run_id[:8]}", daemon=True),
            threading.Thread(target=self._send_loop, name=f"rldiag-send-{run_id[:8]}", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._threads_started = True
        _live_writers.add(self)

    # ---- training thread -------------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Enqueue `{key: value}` at `step`. Never blocks; values are validated in the background."""
        if self._closed:
            self._after_close(len(metrics), f"metrics at step {step}")
            return
        ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        if self._admit(len(metrics)):
            self._q.put((int(step), ts, dict(metrics)))  # a copy: the caller may reuse its dict

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Enqueue run tags (delivered in order with the metrics)."""
        if self._closed:
            self._after_close(len(tags), "tags")
            return
        if self._admit(len(tags)):
            self._q.put((None, 0, dict(tags)))

    def _admit(self, n: int) -> bool:
        """Count `n` logged entries; False (and counted lost) when the queue holds `queue_points` already."""
        self.stats.logged += n
        waiting = self._put - self._got
        if self._q_full and waiting <= self._queue_cap // 2:
            self._end_queue_stretch()
        if waiting + n > self._queue_cap:
            with self._drop_lock:
                self.stats.lost_queue += n
                self._q_stretch += n
                if not self._q_full:
                    self._q_full = True
                    log.warning("rldiag: the writer of run %s has %d points queued for its ingest thread "
                                "(RLDIAG_QUEUE_POINTS / queue_points=%d): points logged until it catches up are "
                                "counted lost, in stats.lost_queue", self.run_id, waiting, self._queue_cap)
            return False
        self._put += n
        return True

    def _end_queue_stretch(self) -> None:
        with self._drop_lock:
            if not self._q_full:
                return
            n, self._q_full, self._q_stretch = self._q_stretch, False, 0
        log.warning("rldiag: the ingest thread of run %s caught up; %d points logged while its queue was full "
                    "were lost (%d in all, stats.lost_queue)", self.run_id, n, self.stats.lost_queue)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything enqueued before this call reached the store; False on timeout.

        After `close()` it returns at once: True when close() delivered everything."""
        if self._closed:
            if os.getpid() != self._pid:
                return False  # a forked child: its parent's writer delivers nothing from here
            self._close_done.wait(timeout)  # a close() in progress on another thread ends within its bound
            return self._close_done.is_set() and self.stats.undelivered == 0
        marker = _Flush()
        lost = self.stats.lost  # a loss meanwhile (queue full, journal down and memory full): not all delivered
        with self._flush_lock:
            if self._flushes_released:
                return self.stats.undelivered == 0
            self._flush_markers.add(marker)
        self._q.put(marker)
        try:
            return marker.event.wait(timeout) and marker.ok and self.stats.lost == lost
        finally:
            with self._flush_lock:
                self._flush_markers.discard(marker)

    def _after_close(self, n: int, what: str) -> None:
        if os.getpid() != self._pid:
            raise ForkedWriterError(
                f"rldiag: this process (pid {os.getpid()}) was forked from pid {self._pid}, whose writer for run "
                f"{self.run_id} cannot deliver from here; {what} were not logged. Log from the parent, or open "
                "a Monitor / RunSession in the child (run_id= to log to the same run)."
            )
        self.stats.after_close += n
        self._warn_once("after-close", "rldiag: %s logged after the writer of run %s was closed are not written "
                        "(this warning is shown once; later ones are counted in stats.after_close). Log before "
                        "close(), or open a new Monitor / RunSession(run_id=...) to go on.", what, self.run_id)

    def close(self, timeout: float | None = None) -> WriterStats:
        """Drain within `timeout` seconds (default `close_timeout_s`); report what was not delivered."""
        if self._closed:
            return self.stats
        self._closed = True
        _live_writers.discard(self)
        try:
            return self._close(self._close_timeout if timeout is None else timeout)
        finally:
            self._close_done.set()

    def _close(self, timeout: float) -> WriterStats:
        deadline = time.monotonic() + timeout
        self._q.put(_STOP)
        self._ingest_done.wait(max(0.0, deadline - time.monotonic()))
        with self._cv:
            self._closing.set()
            self._cv.notify_all()
        self._threads[1].join(max(0.0, deadline - time.monotonic()))
        self._give_up.set()
        # Count every entry where it is. The ingest thread is stopped between two items (it holds its lock
        # while it handles one); if a journal write holds it past the deadline, what it holds is counted lost.
        still = self._ingest_lock.acquire(timeout=max(0.5, deadline - time.monotonic()))
        try:
            with self._cv:
                self._cv.notify_all()
                self._counted = True
                batches, on_disk = self._left_at_close()
            in_hands = sum(len(it[2]) for it in self._held[self._held_pos:] if isinstance(it, tuple))
            in_hands += len(self._hb) + len(self._ht)
        finally:
            if still:
                self._ingest_lock.release()
        queued = self._drain_queue()  # points the ingest thread never reached: not journaled
        if not self._ingest_done.is_set():
            self._q.put(_STOP)  # the drain may have taken it: the thread must still stop when it gets free
        self._settle(batches, on_disk, in_hands + queued)
        with self._flush_lock:  # no flush() waits past close(), whatever it waited for
            self._flushes_released = True
            for m in self._flush_markers:
                m.ok = self.stats.undelivered == 0
                m.event.set()
        if self.journal is not None:
            self.journal.close(delete=True)  # only segments whose batches the store all acknowledged
        if self.stats.undelivered:
            st = self.stats
            where = (f"{st.journaled} in the journal {self.journal.path} (replay them with: rldiag sync "
                     f"{self.journal.path})" if self.journal is not None
                     else f"{st.journaled} in a journal (none was kept: spill_dir=None or the disk refused it)")
            log.error("rldiag: %d metric points of run %s were not delivered (last error: %s): %d in the store, "
                      "%s, %s.%s", st.undelivered, self.run_id, st.last_error, st.delivered - st.replayed, where,
                      st.lost_text(),
                      "" if still else " The ingest thread was stuck in a journal write at close: the points it "
                      "held are counted lost, though that write may still land.")
        if self.stats.refused:
            log.warning(
                "rldiag: the store refused %d metric points/tags of run %s for good; they were set aside "
                "(each key named in a warning; latest: %s) and held nothing else up.",
                self.stats.refused, self.run_id, self.stats.last_refusal,
            )
        return self.stats

    def _left_at_close(self) -> tuple[list[tuple[Batch, int]], list[tuple[Segment, int]]]:
        """Under the lock: the batches not delivered (with how many of their entries are left) and the
        entries waiting only in journal segments."""
        batches = [(b, b.size) for b in self._pending if isinstance(b, Batch)]
        done = self._inflight_done  # the in-flight group's first entries went (or were set aside)
        for b in self._inflight:
            n = min(done, b.size)
            done -= n
            if b.size - n:
                batches.append((b, b.size - n))
        on_disk = [(d.segment, d.remaining) for d in self._pending if isinstance(d, _OnDisk) and d.remaining]
        if self._src is not None and self._src.remaining:
            on_disk.append((self._src.segment, self._src.remaining))
        return batches, on_disk

    def _settle(self, batches: list[tuple[Batch, int]], on_disk: list[tuple[Segment, int]], unheld: int) -> None:
        """Set the journaled and lost counts of close(). A batch that waited only in memory is journaled
        now if the journal takes it (it is up again, or was never down)."""
        alive = self.journal.on_disk() if self.journal is not None else set()
        journaled = lost = 0
        can_append = self.journal is not None
        for b, left in batches:
            if (b.home is None or b.home not in alive) and can_append:  # only in memory, or its file removed
                try:
                    self.journal.append(b)
                    alive.add(b.home)
                except (OSError, ValueError):
                    can_append = False
            if b.home is not None and b.home in alive:
                journaled += left
            else:
                lost += left
        for seg, left in on_disk:
            if seg in alive:
                journaled += left
            else:
                self.stats.lost_unreadable += left  # its file was removed under the writer
        self.stats.journaled = journaled
        self.stats.lost_at_close = lost + unheld
        self.stats.undelivered = self.stats.journaled + self.stats.lost

    # ---- ingest thread ---------------------------------------------------------------------------
    def _ingest_loop(self) -> None:
        try:
            self._ingest()
        finally:
            self._ingest_done.set()  # even if it died: close() must not wait for it in vain

    def _ingest(self) -> None:
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
            with self._ingest_lock:  # close() counts what waits while this thread is between two items
                if self._counted or self._give_up.is_set():
                    return
                got = 0
                while len(items) <= 4 * self._max_batch:
                    try:
                        it = self._q.get_nowait()
                    except queue.Empty:
                        break
                    items.append(it)
                    if isinstance(it, tuple):
                        got += len(it[2])
                self._got += got
                self._held, self._held_pos = items, 0
            full = len(items) > 4 * self._max_batch  # more is waiting: take it without sleeping
            for i, it in enumerate(items):
                if self._give_up.is_set():
                    return  # close() gave up: it counts what this thread holds (no lock race to win)
                with self._ingest_lock:
                    if self._counted:
                        return  # close() gave up and counted what this thread holds
                    if it is _STOP:
                        stop = True
                    elif isinstance(it, _Flush):
                        self._emit(buf, tags)
                        buf, tags = [], {}
                        self._push(it)
                    else:
                        buf, tags = self._ingest_item(it, buf, tags)
                    self._held_pos, self._hb, self._ht = i + 1, buf, tags
            with self._ingest_lock:
                if self._counted or self._give_up.is_set():
                    return
                try:
                    self._emit(buf, tags)
                except Exception as e:  # noqa: BLE001 - a bug must cost these points, not the thread
                    self._ingest_failed(len(buf) + len(tags), e)
                buf, tags = [], {}
                self._hb, self._ht, self._held = buf, tags, []

    def _ingest_item(self, it: tuple, buf: list[Point], tags: dict[str, str]) -> tuple[list[Point], dict[str, str]]:
        step, ts, payload = it
        seen = self.stats.enqueued + self.stats.rejected
        try:
            if step is None:
                self._convert_tags(payload, tags)
            else:
                self._convert(payload, step, ts, buf)
            return self._emit_full(buf, tags)
        except Exception as e:  # noqa: BLE001 - whatever a value does, the thread goes on
            counted = self.stats.enqueued + self.stats.rejected - seen
            self._ingest_failed(max(0, len(payload) - counted) if step is not None else 0, e)
            return buf, tags

    def _ingest_failed(self, n: int, e: Exception) -> None:
        self.stats.rejected += n
        self._warn_once(f"ingest:{type(e).__name__}", "rldiag: the writer of run %s could not take %d value(s) "
                        "(%s: %s); skipped, the rest goes on", self.run_id, n, type(e).__name__, _safe_repr(e))

    def _emit_full(self, buf: list[Point], tags: dict[str, str]) -> tuple[list[Point], dict[str, str]]:
        """Journal and queue full batches (at most `max_batch` entries, at most MAX_TAGS tags);
        returns what is left over."""
        while len(buf) + len(tags) >= self._max_batch or len(tags) >= MAX_TAGS:
            if len(tags) > MAX_TAGS:
                items = list(tags.items())
                self._emit([], dict(items[:MAX_TAGS]))
                tags = dict(items[MAX_TAGS:])
                continue
            cut = max(0, self._max_batch - len(tags))
            self._emit(buf[:cut], tags)
            buf, tags = buf[cut:], {}
        return buf, tags

    def _convert_tags(self, payload: Mapping, out: dict[str, str]) -> None:
        for key, value in payload.items():
            try:
                k = self._tag_key_cache.get(key)
                if k is None:
                    k = self._tag_key_cache[key] = clean_key(str(key), MAX_KEY_CHARS)
                    if k != str(key):
                        self._warn_once(f"tag-key:{key}", "rldiag: tag name %r is not accepted by MLflow (it %s); "
                                        "setting it as %r", key, key_problem(str(key)), k)
                v = str(value)
            except Exception as e:  # noqa: BLE001 - a key or value whose str() fails
                self.stats.rejected += 1
                self._warn_once(f"tag-value:{type(e).__name__}", "rldiag: a tag could not be made a string (%s: %s); "
                                "not set", type(e).__name__, _safe_repr(e))
                continue
            if len(v) > MAX_TAG_VALUE_CHARS:
                self._warn_once(f"tag-value:{k}", "rldiag: tag %r is %d characters; MLflow keeps %d, setting it "
                                "truncated", k, len(v), MAX_TAG_VALUE_CHARS)
                v = v[:MAX_TAG_VALUE_CHARS]
            if out.pop(k, None) is not None:  # a tag set again moves to the end: the latest value is sent last
                self.stats.superseded += 1
            out[k] = v

    def _convert(self, payload: Mapping, step: int, ts: int, out: list[Point]) -> None:
        if not -MAX_INT64 - 1 <= step <= MAX_INT64 or not 0 <= ts <= MAX_INT64:
            self.stats.rejected += len(payload)
            self._warn_once("step-range", "rldiag: metrics at step %d (timestamp %d) were not logged: MLflow "
                            "stores steps as 64-bit integers and timestamps as non-negative ones", step, ts)
            return
        for key, value in payload.items():
            try:
                v = float(value)
            except (TypeError, ValueError):
                self.stats.rejected += 1
                self._warn_once(f"value:{key}", "rldiag: metric %r at step %d has value %s (%s), not a number: "
                                "not logged. Log a float, int or one-element tensor.", key, step, _safe_repr(value),
                                type(value).__name__)
                continue
            except Exception as e:  # noqa: BLE001 - OverflowError (an int past float's range), a failing __float__
                self.stats.rejected += 1
                self._warn_once(f"value:{key}", "rldiag: metric %r at step %d has value %s (%s), which does not "
                                "convert to a float (%s: %s): not logged", key, step, _safe_repr(value),
                                type(value).__name__, type(e).__name__, _safe_repr(e))
                continue
            k = self._key_cache.get(key)
            if k is None:
                k = clean_key(str(key))
                if k != str(key):
                    why = key_problem(str(key)) or (
                        f"is over {MAX_METRIC_KEY_CHARS} characters, which leaves no room for its inf flag "
                        f"{keys.INF_FLAG_PREFIX}<key> in MLflow's {MAX_KEY_CHARS}")
                    self._warn_once(f"key:{key}", "rldiag: metric key %r is not accepted by MLflow (it %s); "
                                    "logging it as %r", key, why, k)
                self._key_cache[key] = k
            self.stats.enqueued += 1
            out.append((k, v, ts, step))
            if math.isinf(v):
                out.append((keys.inf_flag_key(k), 1.0 if v > 0 else -1.0, ts, step))
                self.stats.flags += 1

    def _emit(self, points: list[Point], tags: dict[str, str]) -> None:
        if not points and not tags:
            return
        batch = Batch(self._seq, list(points), dict(tags))
        self._seq += 1
        offset = self._journal_append(batch) if self._jstate is not JournalState.OFF else None
        self._push(batch, offset)

    def _journal_append(self, batch: Batch) -> int | None:
        """Journal `batch`; None when the journal cannot take it (it is then DOWN, and tried again with
        the next batch; a journal that could not even be opened, at most once a second)."""
        if self.journal is None and not self._open_journal():
            return None
        try:
            offset = self.journal.append(batch)
        except (OSError, ValueError) as e:  # ValueError: close() closed it meanwhile
            self._journal_failed(e)
            return None
        if self._jstate is JournalState.DOWN:
            self._jstate = JournalState.UP
            log.warning("rldiag: the journal %s of run %s is written again%s", self.journal.path, self.run_id,
                        f"; {self._down_lost} points did not fit in memory while it was down and are lost "
                        f"({self.stats.lost_memory} in all, stats.lost_memory)" if self._down_lost else
                        "; nothing was lost while it was down")
            self._down_lost = 0
        return offset

    def _open_journal(self) -> bool:
        """Open the run's journal in spill_dir (at start, or again after it could not be)."""
        if time.monotonic() < self._reopen_at:
            return False
        try:
            journal = Journal.for_run(self._spill_dir, self.run_id, self._uri, **self._seg_kw)
        except (OSError, JournalBusy) as e:
            self._reopen_at = time.monotonic() + 1.0
            self._journal_failed(e)
            return False
        if self._threads_started:
            self._recover(journal)  # mid-run: the journal could not be opened at start
        self.journal = journal
        return True

    def _push(self, item: Batch | _Flush, offset: int | None = None) -> None:
        """Queue for the sender. A journaled batch that would take the memory backlog past its cap
        waits in the journal instead (only its offset is kept)."""
        dropped = 0
        with self._cv:
            if self._counted:
                return  # close() gave up and counted it where this thread held it
            if isinstance(item, _Flush):
                self._flushes_waiting += 1
                self._pending.append(item)
            elif (offset is None and self._jstate is not JournalState.OFF
                  and self._ram_points + item.size > self._ram_cap):
                dropped = item.size  # the journal is down and memory is at its cap: lost, counted
                self.stats.lost_memory += dropped
                self._down_lost += dropped
            else:
                item.created = time.monotonic()
                self._pending_points += item.size
                if offset is not None and item.home is not None and self._ram_points + item.size > self._ram_cap:
                    tail = self._pending[-1] if self._pending else None
                    if not (isinstance(tail, _OnDisk) and tail.segment is item.home):
                        tail = _OnDisk(item.home, replayed=False)
                        self._pending.append(tail)
                    tail.add(offset, item.size)
                    self.stats.spilled += item.size
                    spill = True
                else:
                    self._ram_points += item.size
                    self._pending.append(item)
                    spill = False
            self._cv.notify_all()
        if dropped:
            self._warn_once("lost-memory", "rldiag: the journal of run %s cannot be written and %d points already "
                            "wait in memory (RLDIAG_BACKLOG_POINTS): a batch of %d points was lost (later ones "
                            "are counted in stats.lost_memory, and said when the journal is written again). Free "
                            "space in the spill folder or point RLDIAG_SPILL_DIR at a writable one",
                            self.run_id, self._ram_points, dropped)
            return
        if not isinstance(item, _Flush) and spill:
            self._warn_once("spill", "rldiag: the backlog of run %s passed %d points in memory "
                            "(RLDIAG_BACKLOG_POINTS); the rest waits in the journal %s and is read back from "
                            "there when the store takes it", self.run_id, self._ram_cap, self.journal.path)

    def _wait_s(self) -> float | None:
        """Under the lock: None when there is nothing to send, 0 when the sender should send now, else
        how long the oldest batch may still wait to be merged with more (fewer, larger store calls)."""
        if not self._pending:
            return None
        if self._closing.is_set() or self._flushes_waiting or self._pending_points >= self._max_batch:
            return 0.0
        first = self._pending[0]
        if isinstance(first, _OnDisk):
            return 0.0  # a backlog: send it now
        age = time.monotonic() - first.created if isinstance(first, Batch) else self._send_interval
        return max(0.0, self._send_interval - age)

    def _journal_failed(self, e: Exception) -> None:
        """A journal write failed: DOWN until a later batch is written (what it holds is still read back)."""
        self.stats.journal_errors += 1
        if self._jstate is not JournalState.DOWN:  # one warning per stretch
            self._jstate = JournalState.DOWN
            self._warned.discard("lost-memory")
            where = self.journal.path if self.journal is not None else self._spill_dir
            log.warning("rldiag: cannot write the local journal %s (%s): metrics are still sent, and it is tried "
                        "again with each later batch; meanwhile at most %d points wait in memory "
                        "(RLDIAG_BACKLOG_POINTS), the rest is counted lost. Free disk space or set spill_dir.",
                        where, e, self._ram_cap)

    def _ack_failed(self, e: OSError) -> None:
        """An ack could not be written: it is written with the next one (a replay meanwhile stores it once)."""
        self.stats.journal_errors += 1
        self._warn_once("journal-ack", "rldiag: cannot record deliveries in the journal of run %s (%s); tried "
                        "again with the next ones", self.run_id, e)

    # ---- sender thread ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
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
                elif isinstance(group, _OnDisk):
                    self._src = group
                    self._pending_points -= group.size
                else:
                    self._inflight, self._inflight_done = group, 0
                    self._pending_points -= sum(b.size for b in group)
                    self._ram_points -= sum(b.size for b in group)
            if isinstance(group, _Flush):
                group.ok = True
                group.event.set()
                continue
            ok = self._deliver_from_disk(group) if isinstance(group, _OnDisk) else self._deliver(group)
            if not ok:
                return  # close() gave up waiting; it counts what is left of the group as undelivered

    def _deliver_from_disk(self, src: _OnDisk) -> bool:
        """Read a journal run back batch by batch and deliver it in groups, as if it had been in memory."""
        try:
            f = open(src.segment.path, "rb")  # noqa: SIM115 - closed by the with below
        except OSError as e:
            self._lose(src, src.remaining, f"cannot read {src.segment.path} back ({e})")
            with self._cv:
                self._src = None
            return True
        with f:
            i, carry = 0, None
            while carry is not None or i < len(src.offsets):
                group: list[Batch] = []
                n = ntags = 0
                while True:
                    if carry is None:
                        if i >= len(src.offsets):
                            break
                        carry, size = read_batch(f, src.offsets[i]), src.sizes[i]
                        i += 1
                        if carry is None:
                            self._lose(src, size, f"a damaged line in {src.segment.path}")
                            continue
                        carry.home, carry.replayed = src.segment, src.replayed
                    if group and (n + carry.size > self._max_batch or ntags + len(carry.tags) > MAX_TAGS):
                        break
                    group.append(carry)
                    n += carry.size
                    ntags += len(carry.tags)
                    carry = None
                if not group:
                    continue
                with self._cv:
                    src.remaining -= n
                    self._inflight, self._inflight_done = group, 0
                if not self._deliver(group):
                    return False
        with self._cv:
            self._src = None
        return True

    def _lose(self, src: _OnDisk, n: int, why: str) -> None:
        """`n` entries of `src` cannot be read back: counted lost, under the lock that close() counts under."""
        with self._cv:
            if self._counted:
                return
            self.stats.lost_unreadable += n
            src.remaining -= n
        self._warn_once("lost", "rldiag: %d points of run %s could not be read back from the journal: %s (later "
                        "losses are only counted, in stats.lost)", n, self.run_id, why)

    def _deliver(self, group: list[Batch]) -> bool:
        """Send a group in calls within MLflow's limits; retry what may pass, set aside what is refused
        for good. False when close() gave up waiting."""
        entries: list[Entry] = []
        for b in group:
            entries.extend(b.metrics)
            entries.extend(b.tags.items())
        todo = deque(self._chunks(entries))
        refused: list[tuple[Entry, str]] = []
        probed = False
        while todo:
            chunk = todo[0]
            try:
                self._send_entries(chunk)
            except Refused as e:
                reason = redact_text(f"{e}", self._uri)[:300]
                local = [(x, entry_problem(x)) for x in chunk]
                bad = [(x, f"{why}; the store said: {reason}") for x, why in local if why is not None]
                if not bad and len(chunk) == 1:
                    bad = [(chunk[0], reason)]
                if bad or not probed:
                    # Before splitting a group, and before setting anything aside: does the store take
                    # an empty call for this run? If not, the refusal is about the run (deleted, no
                    # permission) or the store went down meanwhile: keep everything and retry.
                    verdict = self._probe_run()
                    if verdict is not None:
                        if not self._back_off(verdict, run_level=True):
                            return False
                        continue
                    probed = True
                    self._delay = self._backoff[0]  # the store answers and takes writes for the run
                if not bad:  # not named by MLflow's rules: split the call to isolate what it refuses
                    mid = len(chunk) // 2
                    todo[0] = chunk[mid:]
                    todo.appendleft(chunk[:mid])
                    continue
                for x, why in bad:
                    self._set_aside(x, why)
                refused.extend(bad)
                self._done(len(bad), refused=True)
                rest = [x for x, why in local if why is None] if len(bad) < len(chunk) else []
                if rest:
                    todo[0] = rest
                else:
                    todo.popleft()
                continue
            except Exception as e:  # noqa: BLE001 - anything but a refusal may pass: keep and retry
                if not self._back_off(e):
                    return False
                continue
            self._delay = self._backoff[0]
            todo.popleft()
            # groups never mix replayed and new batches (_take_group)
            self._done(len(chunk), delivered=True, replayed=group[0].replayed)
        with self._cv:
            self._inflight, self._inflight_done = [], 0
        if self.journal is not None:
            try:
                if refused:
                    self.journal.refuse(refused, group[0].home)
                self.journal.ack(group)
            except ValueError:
                # close() gave up waiting and closed the journal while this batch was in flight:
                # it stays there unacknowledged, so a replay sends it again and the SQL stores
                # keep one copy of an identical point. Nothing is lost: no warning.
                pass
            except OSError as e:
                self._ack_failed(e)
        return True

    def _send_entries(self, chunk: list[Entry]) -> None:
        metrics = [x for x in chunk if len(x) == 4]
        tags = {x[0]: x[1] for x in chunk if len(x) == 2}
        self._send(self.run_id, metrics, tags)

    def _probe_run(self) -> Exception | None:
        """After a refusal: does the store take an empty call for this run? None if it does (so the
        refusal was about the entries); else the error (the run is deleted or missing, no permission,
        or the store went down meanwhile), and the entries are kept."""
        try:
            self._send(self.run_id, [], {})
        except Exception as e:  # noqa: BLE001 - any failure of the probe: keep the entries
            return e
        return None

    def _back_off(self, e: Exception, *, run_level: bool = False) -> bool:
        """Count a failed call, warn once, wait; False when close() gave up waiting."""
        self.stats.send_failures += 1
        self.stats.last_error = redact_text(f"{type(e).__name__}: {e}", self._uri)[:500]
        if run_level and isinstance(e, Refused):
            self._warn_once("run-refused", "rldiag: the tracking store refuses every write to run %s (%s); is the "
                            "run deleted, or are the credentials wrong? Metrics are kept and retried with back-off",
                            self.run_id, self.stats.last_error)
        else:
            self._warn_once("send", "rldiag: tracking store unreachable for run %s (%s); retrying with "
                            "back-off, metrics are kept", self.run_id, self.stats.last_error)
        if self._give_up.wait(self._delay):
            return False
        self._delay = min(self._delay * 2, self._backoff[1])
        return True

    def _set_aside(self, entry: Entry, why: str) -> None:
        self.stats.last_refusal = f"{entry_text(entry)}: {why}"[:500]
        self._warn_once(f"refused:{len(entry)}:{entry[0]}", "rldiag: the store refused %s for good (%s); set aside, "
                        "the rest is delivered (further refusals of this key are only counted, in stats.refused)",
                        entry_text(entry), why)

    def _done(self, n: int, *, delivered: bool = False, replayed: bool = False, refused: bool = False) -> None:
        """Count `n` entries of the in-flight group as delivered or set aside, under the lock that close()
        counts what is left under: an entry the store took just as close() gave up is counted once,
        either delivered or undelivered (counted outside it, one was seen as both: 900 of 300,000)."""
        with self._cv:
            if self._counted:
                return  # close() gave up and counted these as undelivered (a replay sends them again)
            if delivered:
                self.stats.delivered += n
                if replayed:
                    self.stats.replayed += n
            if refused:
                self.stats.refused += n
            self._inflight_done += n

    def _chunks(self, entries: list[Entry]) -> list[list[Entry]]:
        """`entries` in order, cut into store calls within MLflow's limits: at most `max_batch` entries
        (metrics + tags), MAX_TAGS tags, MAX_REQUEST_BYTES of JSON body."""
        chunks: list[list[Entry]] = []
        cur: list[Entry] = []
        ntags = nbytes = 0
        budget = MAX_REQUEST_BYTES - ENVELOPE_JSON - json_len(self.run_id)
        for e in entries:
            is_tag = len(e) == 2
            eb = entry_bytes(e)
            if cur and (len(cur) >= self._max_batch or (is_tag and ntags >= MAX_TAGS) or nbytes + eb > budget):
                chunks.append(cur)
                cur, ntags, nbytes = [], 0, 0
            cur.append(e)
            ntags += is_tag
            nbytes += eb
        if cur:
            chunks.append(cur)
        return chunks

    def _take_group(self) -> list[Batch] | _Flush | _OnDisk:
        first = self._pending.popleft()
        if isinstance(first, (_Flush, _OnDisk)):
            return first
        group, n, ntags = [first], first.size, len(first.tags)
        while self._pending and isinstance(self._pending[0], Batch):
            nxt = self._pending[0]
            if (n + nxt.size > self._max_batch or ntags + len(nxt.tags) > MAX_TAGS
                    or nxt.replayed != first.replayed):
                break
            group.append(self._pending.popleft())
            n += nxt.size
            ntags += len(nxt.tags)
        return group

    # ---- recovery --------------------------------------------------------------------------------
    def _recover(self, journal: Journal) -> None:
        """Queue the journal's undelivered batches (read back from disk) ahead of everything new."""
        for path, why in journal.foreign:
            log.warning("rldiag: %s is not an rldiag journal (%s): left as it is", path, why)
        for path, why in journal.unreadable:
            self._warn_once("recover", "rldiag: cannot read journal %s (%s); replay it later with rldiag sync", path, why)
        if journal.corrupt_lines:
            log.warning("rldiag: skipped %d damaged lines in %s", journal.corrupt_lines, journal.path)
        self._seq = max(self._seq, journal.next_seq)
        n = 0
        with self._cv:
            for scan in journal.replay:
                for s in scan.segments:
                    if not s.pending:
                        continue
                    src = _OnDisk(s.segment, replayed=True)
                    for p in s.pending:
                        src.add(p.offset, p.size)
                    self._pending.append(src)
                    self._pending_points += src.size
                    self.stats.replay_in += src.size
                    n += len(s.pending)
            self._cv.notify_all()
        if n:
            log.info("rldiag: replaying %d batches of run %s from %s", n, self.run_id, journal.path)

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def _drain_queue(self) -> int:
        """Empty the queue; the number of points and tags in it (what the ingest thread never took)."""
        n = 0
        while True:
            try:
                it = self._q.get_nowait()
            except queue.Empty:
                return n
            if isinstance(it, tuple):
                n += len(it[2])

    def _forget_after_fork(self) -> None:
        """In a forked child: this writer's threads are the parent's and its journal is the parent's."""
        self._closed = True  # (no Event.set() here: a parent thread may have held its lock at the fork)
        if self.journal is not None:
            self.journal.abandon()
            self.journal = None


def _safe_repr(value: object, limit: int = 80) -> str:
    """A short repr that cannot fail (an int of 5000 digits has no repr in Python 3.11+)."""
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__, or an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


_live_writers: weakref.WeakSet[MetricWriter] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    for w in list(_live_writers):
        if w._pid == os.getpid():
            w.close()


def _after_fork_in_child() -> None:
    # The child has none of the writers' threads: closing one there would wait its full close timeout
    # and then report the parent's in-flight points as undelivered.
    for w in list(_live_writers):
        w._forget_after_fork()
    _live_writers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
