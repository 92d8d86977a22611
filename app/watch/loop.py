"""`rldiag watch`: alert on non-finite gradients in the active runs of an MLflow store, whoever logged them.

Each poll cycle (one at a time, every `--interval` seconds):
1. lists the runs to look at: status RUNNING, plus runs that ended since the previous cycle started
   (so a run that finishes, or starts and finishes, between two polls is still read to its end);
2. reads only what is new of the gradient keys of those runs (`rldiag.app.data.histories.load_histories` with the
   previous result: a rowid cursor on SQLite, per-key row offsets on a server): `grad/finite` and
   `grad/norm` with every alias of it in `rldiag.collectors.keys.ALIASES` (`grad_norm`, `actor/grad_norm`,
   ...) and rldiag's inf flags;
3. a step is bad when `grad/finite` is 0 or the grad norm is NaN or +-inf. MLflow's SQL stores keep
   inf as +-max-float; `rldiag.app.data.nonfinite.restore_infinities` reads exactly +-1.7976931348623157e308 (and
   any rldiag inf flag) back as inf;
4. every bad step not in the state file becomes one event through the collectors' sinks
   (`rldiag.collectors.alerts`: log, JSONL, webhook, MLflow tags), rate-limited per run for log and webhook;
   then the state is saved (see `rldiag.app.watch.state`);
5. a step whose `loss` is NaN/inf while its gradients are not flagged is an alert of its own kind
   ("nonfinite_loss"); fp16 scaler overflows (`grad/scaler_overflow` = 1) are told once, in one
   "scaler_overflow" event per run and cycle to the sinks that record every event, never alerted
   (`rldiag.app.analysis.step_events`). A run rldiag did not watch logs an overflow as a non-finite
   grad norm: in an fp16 run (params fp16 true) a streak of them shorter than 8 logged rows with a
   finite loss, followed by a finite row, is told as a likely overflow ("likely_scaler_overflow", no
   alert); while it lasts to a running run's last row it is held back (said in the log), and a NaN loss,
   8 rows or a run that ends in it is alerted;
6. an effective-sample-size drop with a rising mismatch (`rldiag.app.watch.is_events`) is alerted once per stretch.
With `--divergence`, candidates (tag rldiag.role=candidate) are also compared with the reference runs
of their rldiag.group (`rldiag.app.analysis.divergence`), once per departure: a burst that ended and a
later lasting shift of one metric are two events (`WatchState`: each departure's onset to alert).

Delivery is at-least-once: events go out before the state is saved, so only a hard kill between the
two can repeat that cycle's events; SIGTERM and Ctrl-C finish the cycle and save.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rldiag.app.analysis.divergence import logged_by_order
from rldiag.app.analysis.nan_events import bad_steps, no_token_steps, truncated_masked_steps
from rldiag.app.analysis.step_events import LONG_STREAK, fp16_streaks, nonfinite_loss, scaler_overflows
from rldiag.app.data.histories import Histories, load_histories
from rldiag.app.data.runs import _quote as search_literal
from rldiag.app.data.runs import pages
from rldiag.app.data.store import Store, store_errors
from rldiag.app.watch.events import (
    EmptyBatchNote,
    LikelyOverflowNote,
    LossAlert,
    OverflowNote,
    WatchAlert,
    divergence_event,
)
from rldiag.app.watch.is_events import WATCH_IS_KEYS, send_is_events
from rldiag.app.watch.state import WatchState
from rldiag.collectors import keys
from rldiag.collectors.alerts import AlertDispatcher, MlflowTagSink, NonFiniteGradAlert
from rldiag.collectors.uri import redact_text, redact_uri

log = logging.getLogger("rldiag.watch")

# canonical; aliases come from keys.ALIASES. The loss tells a NaN's likely cause (finite loss, NaN gradients).
# The fp16 scaler's keys tell its overflows (told, never alerted) from NaN gradients.
# batch/valid_tokens (or TRL's completions/clipped_ratio under mask_truncated_completions) tells a step
# that measured nothing (every token masked).
WATCH_KEYS: tuple[str, ...] = (keys.GRAD_NORM, keys.GRAD_FINITE, keys.LOSS, keys.LOSS_UNFILTERED,
                               keys.GRAD_SCALER_OVERFLOW, keys.GRAD_LOSS_SCALE, keys.BATCH_TOKENS,
                               keys.TRL_CLIPPED_RATIO, keys.GRAD_SKIPPED, *WATCH_IS_KEYS)
ENDED_MARGIN_MS = 120_000  # clock skew between trainer and watcher hosts, for "ended since the last poll"
# ---- the watcher ---------------------------------------------------------------------------------
class _Shared:
    """A sink shared by the per-run dispatchers: their close() must not close it (the watcher does)."""

    def __init__(self, sink):
        self.sink, self.rate_limited = sink, sink.rate_limited

    def send(self, event: dict) -> None:
        self.sink.send(event)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return repr(self.sink)


@dataclass
class CycleResult:
    runs: int  # runs read this cycle
    alerts: int  # new events sent
    fetched: int  # metric rows read
    seconds: float
    new_runs: list[str] = field(default_factory=list)
    skipped: int = 0  # runs of the watched experiments not read: ended before this watcher's window
    notes: int = 0  # events told that are no alert (fp16 scaler overflows, likely ones of unwatched fp16 runs)
    pending: int = 0  # non-finite steps of running fp16 runs held back: a likely scaler overflow not yet over


class Watcher:
    """Polls one store; `poll()` is one cycle, `loop()` repeats it. Sinks are closed by `close()`."""

    def __init__(self, store: Store, state: WatchState, sinks: list, *, experiments: Sequence[str] | None = None,
                 tag_runs: bool = False, divergence: bool = False, burst: int = 3, burst_interval_s: float = 300.0,
                 include_finished: bool = False, count_skipped: bool = False):
        if tag_runs and store.sqlite_path is not None:
            store = replace(store, writes_here=True)  # it writes tags into that file
        self.store, self.state, self.sinks = store, state, list(sinks)
        self.tag_runs, self.divergence, self.include_finished = tag_runs, divergence, include_finished
        from rldiag.app.analysis.divergence import DivergenceConfig

        self.detector = DivergenceConfig.from_env()  # `rldiag watch --detector KEY=VALUE`
        self.count_skipped = count_skipped  # one more search of every run a cycle: for --once, not each poll
        self._burst = (burst, burst_interval_s)
        self._exp_ids = self._resolve(experiments) if experiments else None
        self._h: Histories | None = None
        self._div_h: Histories | None = None
        self._dispatchers: dict[str, AlertDispatcher] = {}
        self._seen: set[str] = set()
        self._notes = 0  # events told this cycle that are no alert (scaler overflows)

    def _resolve(self, names: Sequence[str]) -> list[str]:
        from rldiag.app.errors import ExperimentNotFound

        exps = {e.name: e.experiment_id for e in self._experiments()}
        missing = [n for n in names if n not in exps]
        if missing:
            have = sorted(exps)
            raise ExperimentNotFound(f"experiment(s) {missing} not found in the store at {redact_uri(self.store.uri)!r}; "
                                     f"it has: {have[:20]}{' ...' if len(have) > 20 else ''}. Check --experiment.")
        return [exps[n] for n in dict.fromkeys(names)]

    def _experiments(self) -> list:
        return pages(self.store.client.search_experiments)

    def _search(self, exp_ids: list[str], filter_string: str) -> list:
        return pages(self.store.client.search_runs, experiment_ids=exp_ids, filter_string=filter_string)

    def runs_to_read(self, since_ms: int) -> tuple[list, dict[str, str], int]:
        """Active (RUNNING) runs, plus runs that ended at or after `since_ms` (every run with
        `include_finished`); experiment names by id; and how many runs of those experiments were left out."""
        exps = self._experiments() if self._exp_ids is None else None
        names = {e.experiment_id: e.name for e in exps} if exps is not None else {}
        exp_ids = self._exp_ids if self._exp_ids is not None else list(names)
        if not exp_ids:
            return [], names, 0
        if self.include_finished:
            return self._search(exp_ids, ""), names, 0
        runs = {r.info.run_id: r for r in self._search(exp_ids, "attributes.status = 'RUNNING'")}
        for r in self._search(exp_ids, f"attributes.end_time >= {int(since_ms)}"):
            runs.setdefault(r.info.run_id, r)
        skipped = len({r.info.run_id for r in self._search(exp_ids, "")} - set(runs)) if self.count_skipped else 0
        return list(runs.values()), names, skipped

    def poll(self) -> CycleResult:
        """One cycle: list runs, read what is new, send an event per new bad step, save the state."""
        t0, started_ms = time.perf_counter(), int(time.time() * 1000)
        # Runs that ended since the last cycle started (on a first start: in the last margin) are read
        # once more, so points logged just before the end are not lost between two polls.
        since = (self.state.last_poll_ms or started_ms) - ENDED_MARGIN_MS
        runs, exp_names, skipped = self.runs_to_read(since)
        ids = [r.info.run_id for r in runs]
        self._h = load_histories(self.store, ids, WATCH_KEYS, previous=self._h) if ids else None
        sent, self._notes, self._pending = 0, 0, 0
        for r in runs:
            sent += self._check_run(r, exp_names.get(r.info.experiment_id, ""))
        if self.divergence:
            sent += self._check_divergence(runs)
        if self._pending:
            log.info("rldiag watch: %d non-finite step(s) of running fp16 run(s) held back: likely loss-scaler "
                     "overflows if the next logged rows are finite; alerted if they last %d logged rows, come with a "
                     "NaN loss or the run ends in them", self._pending, LONG_STREAK)
        new = [i for i in ids if i not in self._seen]
        self._seen = set(ids)
        self.state.last_poll_ms = started_ms
        self.state.save()
        return CycleResult(len(ids), sent, self._h.fetched if self._h else 0, time.perf_counter() - t0, new, skipped,
                           self._notes, self._pending)

    def _check_run(self, run, experiment: str) -> int:
        run_id, name = run.info.run_id, run.info.run_name or ""
        sent = self._check_loss(run_id, name, experiment)
        self._note_overflows(run_id, name)
        self._note_empty(run_id, name, dict(run.data.params))
        sent += send_is_events(self._h, run_id, name, experiment, self.state, self.sinks)
        found = bad_steps(self._h, run_id)
        if not found:
            return sent
        rs = self.state.run(run_id, name)
        fresh = set(rs.new_steps(np.array([b.step for b in found], np.int64)).tolist())
        todo = [b for b in found if b.step in fresh]
        if todo:
            todo = self._fp16_overflows(run, rs, todo)
        if not todo:
            return sent
        disp = self._dispatcher(run_id, rs)
        cause = _cause(self._h, run)
        at = logged_by_order(self._h, [run_id], [keys.GRAD_NORM, keys.GRAD_FINITE]).values()
        policy = run.data.params.get(keys.PARAM_NONFINITE_POLICY)  # the run's own, where rldiag watched it
        skipped = self._h.get(run_id, keys.GRAD_SKIPPED)
        skipped = dict(zip(skipped.steps.tolist(), skipped.values.tolist())) if skipped is not None else {}
        for b in todo:
            done = skipped.get(b.step)  # grad/skipped: 1 the weights did not change, 0 the optimizer stepped
            alert = NonFiniteGradAlert(run_id, b.step, b.grad_norm, [], run_name=name, policy=policy,
                                       skipped=None if done is None or done != done else done >= 0.5)
            disp.emit(WatchAlert(alert, b.values,
                                 experiment, cause, next(iter(at), None)))
            rs.mark(b.step)
        self.state.save()  # per run, so a crash repeats as little as possible
        return sent + len(todo)

    def _fp16_overflows(self, run, rs, todo: list) -> list:
        """The bad steps to alert on, after those of an fp16 run rldiag did not watch (params fp16 true, no
        grad/scaler_overflow) that are likely scaler overflows: a streak of non-finite grad norms shorter than
        LONG_STREAK logged rows, with a finite loss, followed by a finite row, is told once as a likely
        overflow (no alert); while such a streak still lasts to the last row of a running run it is held
        back (pending, counted) until the run comes out of it or it reaches LONG_STREAK rows. A NaN loss, a
        long streak, or one the run ended in is alerted."""
        run_id, name = run.info.run_id, run.info.run_name or ""
        streaks = fp16_streaks(self._h, run_id, dict(run.data.params))
        if not streaks:
            return todo
        verdict = {s: st.overflow() for st in streaks for s in st.steps}
        running = run.info.status == "RUNNING"
        likely = [b.step for b in todo if verdict.get(b.step) is True]
        held = [b.step for b in todo if verdict.get(b.step) is None and running]
        new = rs.new_noted(LikelyOverflowNote.kind, likely)
        if new:
            longest = max(len(st.steps) for st in streaks if st.overflow())
            self._dispatcher(run_id, rs).note(LikelyOverflowNote(run_id, name, new, longest))
            rs.note(LikelyOverflowNote.kind, new)
            self.state.save()
            self._notes += 1
        self._pending += len(held)
        spared = {*likely, *held}
        return [b for b in todo if b.step not in spared]

    def _check_loss(self, run_id: str, name: str, experiment: str) -> int:
        """Alert on each new step whose loss is non-finite while its gradients are not (kind
        "nonfinite_loss"; a NaN loss with NaN gradients is the NaN-gradient alert)."""
        nl = nonfinite_loss(self._h, run_id)
        if nl is None:
            return 0
        rs = self.state.run(run_id, name)
        new = set(rs.new_noted(LossAlert.kind, nl.steps))
        if not new:
            return 0
        disp = self._dispatcher(run_id, rs)
        at = next(iter(logged_by_order(self._h, [run_id], [keys.LOSS, keys.LOSS_UNFILTERED]).values()), None)
        for step, value in zip(nl.steps, nl.values):
            if step in new:
                disp.emit(LossAlert(run_id, name, step, value, nl.checked, experiment, at))
        rs.note(LossAlert.kind, new)
        self.state.save()
        return len(new)

    def _note_overflows(self, run_id: str, name: str) -> None:
        """Tell a run's new fp16 scaler overflows once, in one event per cycle: no alert (the scaler
        skips those steps and lowers its scale), not counted in `--once`'s exit status."""
        ov = scaler_overflows(self._h, run_id)
        if ov is None:
            return
        rs = self.state.run(run_id, name)
        new = rs.new_noted("scaler_overflow", ov.steps)
        if not new:
            return
        self._dispatcher(run_id, rs).note(OverflowNote(run_id, name, new, ov.text()))
        rs.note("scaler_overflow", new)
        self.state.save()
        self._notes += 1

    def _note_empty(self, run_id: str, name: str, params: dict[str, str]) -> None:
        """Tell a run's new steps with no valid tokens once, in one event per cycle: no alert."""
        new = no_token_steps(self._h, run_id, params)
        if not new:
            return
        rs = self.state.run(run_id, name)
        new = rs.new_noted(EmptyBatchNote.kind, new)
        if not new:
            return
        self._dispatcher(run_id, rs).note(EmptyBatchNote(run_id, name, new, truncated=bool(
            set(new) & set(truncated_masked_steps(self._h, run_id, params)))))
        rs.note(EmptyBatchNote.kind, new)
        self.state.save()
        self._notes += 1

    def _dispatcher(self, run_id: str, rs) -> AlertDispatcher:
        d = self._dispatchers.get(run_id)
        if d is None:
            sinks = [_Shared(s) for s in self.sinks]
            # The collectors tag their own runs; the watcher tags only runs without rldiag's grad/finite.
            if self.tag_runs and self._h.get(run_id, keys.GRAD_FINITE) is None:
                tag = MlflowTagSink(lambda tags, rid=run_id: self._set_tags(rid, tags))
                tag.count, tag.first_step = rs.alerts, rs.first_step  # continue the counters across restarts
                sinks.append(tag)
            d = self._dispatchers[run_id] = AlertDispatcher(sinks, burst=self._burst[0], interval_s=self._burst[1])
        return d

    def _set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.store.write_client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])  # --tag-runs only

    def _check_divergence(self, runs: list) -> int:
        from rldiag.app.analysis.comparison import CompareOptions, compare, load_keys
        cands = [r for r in runs if r.data.tags.get(keys.TAG_ROLE) == "candidate" and r.data.tags.get(keys.TAG_GROUP)]
        if not cands:
            return 0
        exp_ids = sorted({r.info.experiment_id for r in cands})
        refs: dict[str, list[str]] = {}
        ref_params: dict[str, dict[str, str]] = {}
        for g in sorted({r.data.tags[keys.TAG_GROUP] for r in cands}):
            role = f"tags.`{keys.TAG_ROLE}` = 'reference'"
            lit = search_literal(g)  # quoted; a name with both quote characters: every reference, matched here
            found = self._search(exp_ids, f"tags.`{keys.TAG_GROUP}` = {lit} AND {role}" if lit else role)
            found = [r for r in found if r.data.tags.get(keys.TAG_GROUP) == g]
            refs[g] = [r.info.run_id for r in found]
            ref_params.update({r.info.run_id: dict(r.data.params) for r in found})
        ids = list(dict.fromkeys([i for g in refs.values() for i in g] + [r.info.run_id for r in cands]))
        metrics = [k for k in keys.CANONICAL_METRICS if k not in (keys.GRAD_FINITE, keys.GRAD_NONFINITE_PARAMS)]
        self._div_h = load_histories(self.store, ids, list(load_keys(metrics)), previous=self._div_h)
        sent = 0
        for r in cands:
            g, run_id, name = r.data.tags[keys.TAG_GROUP], r.info.run_id, r.info.run_name or ""
            if not refs.get(g):
                continue
            # the one comparison (the report's and the dashboard's): departures and likely causes
            found = compare(self._div_h, refs[g], [run_id], CompareOptions(metrics, self.detector),
                            params={run_id: dict(r.data.params), **{i: ref_params.get(i, {}) for i in refs[g]}})
            rs, cause = None, _cause_line(found)
            for key, by in found.divergences.items():
                d = by.get(run_id)
                if d is None or not d.diverged:
                    continue
                rs = rs or self.state.run(run_id, name)
                deps = d.departures or (d.lead,)
                if rs.legacy(key):  # an older watcher sent the metric's first departure and kept its onset only
                    rs.tell_departure(key, deps[0].onset_step, deps[0].alert_step)
                new = [p for p in deps if not rs.told_departure(key, p.onset_step, p.end_step)]
                for p in _to_send(new, d.lead, run_id, key):
                    event = divergence_event(run_id, name, g, refs[g], key, p, cause)
                    for sink in self.sinks:  # once per departure, at most a few a poll: no rate limit needed
                        try:
                            sink.send(event)
                        except Exception as e:  # noqa: BLE001 - a broken sink must not stop the others
                            log.warning("rldiag watch: alert sink %r failed: %s: %s", sink, type(e).__name__, e)
                    sent += 1
                for p in new:
                    rs.tell_departure(key, p.onset_step, p.alert_step)
        return sent

    def close(self) -> None:
        for run_id, d in self._dispatchers.items():
            d.close(run_id, self.state.runs[run_id].name if run_id in self.state.runs else None)
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - close the others
                log.warning("rldiag watch: closing %r failed: %s", s, e)


MAX_DEPARTURES_PER_POLL = 3  # new departures of one (run, metric) sent in one poll (a first poll of a long run)


def _to_send(new: list, lead, run_id: str, key: str) -> list:
    """The new departures to send, in onset order: all, or the last MAX_DEPARTURES_PER_POLL with the
    metric's lead departure kept among them (the rest are remembered unsent, and logged)."""
    if len(new) <= MAX_DEPARTURES_PER_POLL:
        return new
    keep = new[-MAX_DEPARTURES_PER_POLL:]
    if lead in new and lead not in keep:
        keep = [lead, *new[-(MAX_DEPARTURES_PER_POLL - 1):]]
    log.info("rldiag watch: run %s, %s: %d earlier departures not sent (the report lists every one)",
             run_id, key, len(new) - len(keep))
    return keep


def _cause(h: Histories, run) -> str:
    """The run's first likely cause from its own metrics and params (no reference), in one line ('' when
    none fits); a failure here is logged, never stops an alert."""
    from rldiag.app.analysis.comparison import CompareOptions, compare

    try:
        rid = run.info.run_id
        found = compare(h, [], [rid], CompareOptions(keys=()), params={rid: dict(run.data.params)})
    except Exception as e:  # noqa: BLE001 - the alert goes out without its cause
        log.warning("rldiag watch: likely causes of run %s failed: %s: %s", run.info.run_id, type(e).__name__, e)
        return ""
    return _cause_line(found)


def _cause_line(found) -> str:
    """The first candidate's likely cause in one line (`RunCauses.line`), with any check that failed; ''
    when none fits."""
    (c,) = found.causes
    return c.line() if c.causes or c.failed else ""


class _Collect:
    """A sink that keeps every event in a list (for `watch_once`)."""

    rate_limited = False

    def __init__(self):
        self.events: list[dict] = []

    def send(self, event: dict) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


def watch_once(tracking_uri: str | Store | None = None, *, experiments: Sequence[str] | None = None,
               state: WatchState | None = None, sinks: Sequence | None = None,
               divergence: bool = False, include_finished: bool = True) -> tuple[CycleResult, list[dict]]:
    """One watcher cycle, from a notebook or a script: `(result, events)`, the events it found.

    `state` (default: a fresh one in memory, so every bad step of the runs read is reported) makes
    repeated calls report only what is new; `sinks` also receive the events (log, JSONL, webhook);
    `include_finished` (default True here, unlike the polling command) reads every run, not only the
    running and just-ended ones.
    """
    from rldiag.app.data.store import open_store

    store = tracking_uri if isinstance(tracking_uri, Store) else open_store(tracking_uri)
    collect = _Collect()
    watcher = Watcher(store, state if state is not None else WatchState(), [collect, *(sinks or [])],
                      experiments=experiments, divergence=divergence, burst=1 << 30, include_finished=include_finished)
    try:
        result = watcher.poll()
    finally:
        watcher.close()
    return result, collect.events


def loop(watcher: Watcher, interval: float, stop: threading.Event, *, once: bool = False) -> int:
    """Poll until `stop` is set (or once). A store that fails is reported once, then again when it answers."""
    errors = store_errors()
    uri = redact_uri(watcher.store.uri)
    down_since: float | None = None
    failures = 0
    sent_total = 0
    while True:
        t0 = time.monotonic()
        try:
            watcher.store.check(timeout_s=5.0)  # a server that is down fails in seconds, not after MLflow's retries
            res = watcher.poll()
        except errors as e:
            failures += 1
            first = redact_text(str(e).splitlines()[0] if str(e) else "", watcher.store.uri)
            if once:
                log.error("rldiag watch: the tracking store at %s did not answer: %s: %s", uri, type(e).__name__, first)
                return 2
            if down_since is None:
                down_since = t0
                log.warning("rldiag watch: the tracking store at %s is unreachable (%s: %s); still polling every %g s",
                            uri, type(e).__name__, first[:300], interval)
        else:
            sent_total += res.alerts
            if down_since is not None:
                log.warning("rldiag watch: the tracking store at %s answers again after %.0f s (%d failed polls); "
                            "caught up", uri, time.monotonic() - down_since, failures)
                down_since, failures = None, 0
            if res.new_runs:
                log.info("rldiag watch: reading %d run(s), %d new: %s", res.runs, len(res.new_runs),
                         ", ".join(res.new_runs[:5]) + (" ..." if len(res.new_runs) > 5 else ""))
            log.debug("rldiag watch: cycle %.3f s, %d runs, %d rows, %d alerts", res.seconds, res.runs, res.fetched,
                      res.alerts)
            if once:
                log.info("rldiag watch: one cycle: %d run(s) read, %d new alert(s), %d scaler-overflow note(s) (no "
                         "alert), %d step(s) held back (fp16, not yet told apart: not an all-clear), %d rows, %.2f s",
                         res.runs, res.alerts, res.notes, res.pending, res.fetched, res.seconds)
                if res.skipped:
                    log.info("rldiag watch: %d run(s) skipped: they ended before this watcher's window (%d s "
                             "before its first poll); --all reads finished runs too", res.skipped,
                             ENDED_MARGIN_MS // 1000)
                return 1 if res.alerts else 0
        if stop.wait(max(0.0, interval - (time.monotonic() - t0))):
            return 0


