"""`RunSession`: one MLflow run with its writer, alert sinks and non-finite policy.

The framework-free core that `Monitor` (plain loops) and the integrations (transformers, TRL) share.

Every way out of the process ends the run:
- `close()` (or leaving `with Monitor(...)`): the writer drains, the alerts artifact is uploaded, the
  run ends FINISHED (FAILED out of an exception). It never waits longer than its timeout
  (`close_timeout_s`, RLDIAG_CLOSE_TIMEOUT): the store calls that end the run run in a thread with
  the deadline, whatever MLflow's own retries.
- Interpreter exit without `close()`: the same, at exit (FAILED after an uncaught exception).
- SIGTERM and SIGINT: the open runs are drained and ended KILLED, then the signal goes on to the
  handler the process had (a trainer's own handler, Python's KeyboardInterrupt for SIGINT), or, for
  the default action, the signal is raised again and the process exits with its status. The handlers
  are installed from the main thread only, and only over the default action or a Python handler: a
  signal that is ignored or handled outside Python is left alone (RLDIAG_SIGNALS=0: never installed;
  SIGINT not in a REPL or notebook, where Ctrl-C interrupts a cell, not the run).
  A signal that comes while the main thread is in `close()` takes effect when close() returns; a
  second one at once.
- `os.fork()`: the child holds none of its parent's sessions (its exit ends nothing; its close() is a
  no-op); logging through one there raises `ForkedWriterError`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from rldiag.collectors import keys
from rldiag.collectors.alerts import (
    AlertDispatcher,
    JsonlSink,
    LoggingSink,
    MlflowTagSink,
    NonFiniteGradAlert,
    Sink,
    WebhookSink,
)
from rldiag.collectors.gradcheck import GradReport
from rldiag.collectors.settings import (
    RLDIAG_ALERTS_JSONL,
    RLDIAG_CLOSE_TIMEOUT,
    RLDIAG_SIGNALS,
    RLDIAG_SPILL_DIR,
    RLDIAG_WEBHOOK_URL,
    default_tracking_uri,
)
from rldiag.collectors.uri import redact_text
from rldiag.collectors.writer import MetricWriter, WriterStats

log = logging.getLogger("rldiag")

Policy = Literal["warn", "skip", "raise"]
POLICIES = ("warn", "skip", "raise")
MAX_EVENTS_KEPT = 10_000


class NonFiniteGradientError(RuntimeError):
    """Raised under `policy="raise"`; `.alert` holds the event."""

    def __init__(self, alert: NonFiniteGradAlert):
        super().__init__(alert.text())
        self.alert = alert


class RunSession:
    """An open MLflow run, its background writer and its alert sinks.

    Keyword options:
      experiment, run_name, tags, params: the run (params may be nested dicts; logged as dotted keys).
      run_id: resume this run instead of creating one (its journals that no live process holds are replayed).
      tracking_uri: MLflow store; default `MLFLOW_TRACKING_URI`, else `sqlite:///mlruns.db` here.
      policy: on non-finite gradients `warn` (alert, step anyway), `skip` (alert, the caller zeroes
        the grads and does not step) or `raise` (alert, raise `NonFiniteGradientError`).
      alerts_jsonl, webhook_url: extra alert sinks (default from RLDIAG_ALERTS_JSONL, RLDIAG_WEBHOOK_URL).
      sinks: further alert sinks. alert_burst / alert_interval_s: rate limit for log and webhook.
      spill_dir: the writer's journal folder (default RLDIAG_SPILL_DIR, `.rldiag/spill`).
      close_timeout_s: how long close() waits for the store (default RLDIAG_CLOSE_TIMEOUT, 30 s), at
        most, whatever the store does.
    """

    def __init__(
        self,
        experiment: str = "rldiag",
        *,
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        tracking_uri: str | None = None,
        policy: Policy = "warn",
        alerts_jsonl: str | os.PathLike | None = None,
        webhook_url: str | None = None,
        sinks: list[Sink] | None = None,
        alert_burst: int = 3,
        alert_interval_s: float = 300.0,
        spill_dir: str | os.PathLike | None = None,
        close_timeout_s: float | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is not one of {POLICIES}; e.g. policy='skip'")
        from rldiag.collectors.mlflow_store import make_sender, open_run

        self.policy = policy
        self.tracking_uri = tracking_uri or default_tracking_uri()
        # Everything that can refuse the options is built before the run exists: no orphan RUNNING run.
        self.close_timeout_s = close_timeout_s if close_timeout_s is not None else RLDIAG_CLOSE_TIMEOUT.get_float()
        handle_signals = RLDIAG_SIGNALS.get_bool()
        all_sinks: list[Sink] = [LoggingSink(), MlflowTagSink(lambda t: self.writer.set_tags(t))]
        jsonl = alerts_jsonl or RLDIAG_ALERTS_JSONL.get()
        if jsonl:
            all_sinks.append(JsonlSink(jsonl))
        url = webhook_url or RLDIAG_WEBHOOK_URL.get()
        if url:
            all_sinks.append(WebhookSink(url))
        all_sinks.extend(sinks or [])
        self.alerts = AlertDispatcher(all_sinks, burst=alert_burst, interval_s=alert_interval_s)
        try:
            self.client, run = open_run(
                self.tracking_uri, experiment=experiment, run_name=run_name, run_id=run_id, tags=tags, params=params
            )
        except BaseException:
            self.alerts.close()  # a webhook sink's thread
            raise
        self.run_id: str = run.info.run_id
        self.run_name: str | None = run.info.run_name
        try:
            self.writer = MetricWriter(
                self.run_id,
                make_sender(self.tracking_uri),
                tracking_uri=self.tracking_uri,
                spill_dir=spill_dir if spill_dir is not None else RLDIAG_SPILL_DIR.get(),
                close_timeout_s=self.close_timeout_s,
            )
        except BaseException:
            self.alerts.close()
            end = _in_thread("rldiag-close-run", lambda: _end_quietly(self.client, self.run_id, "FAILED"))
            end.join(min(10.0, self.close_timeout_s))
            raise
        self.events: list[dict] = []
        self._closed = False
        self._pid = os.getpid()
        _register(self, handle_signals)

    def on_nonfinite(self, step: int, report: GradReport) -> bool:
        """Alert on a non-finite step and apply the policy: True to step anyway (`warn`), False to skip
        (`skip`; the caller zeroes the grads); raises `NonFiniteGradientError` under `raise`. The one
        implementation is `collectors.nonfinite.NonFinitePolicy.alert`."""
        from rldiag.collectors.nonfinite import NonFinitePolicy

        return NonFinitePolicy(self.policy).alert(self, step, report)

    def close(self, status: str = "FINISHED", *, timeout: float | None = None) -> WriterStats:
        """Drain the writer, send held-back alert summaries, store the alert events, end the run with
        `status`; all within `timeout` seconds (default `close_timeout_s`)."""
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:  # first: a signal from here on waits for this close() (see _on_signal)
            _signals.closing += 1
        try:
            if self._closed:
                return self.writer.stats
            self._closed = True
            _live.pop(id(self), None)
            if os.getpid() != self._pid:  # a forked child: the run, its writer and its store are the parent's
                return self.writer.stats
            return self._close(status, self.close_timeout_s if timeout is None else timeout)
        finally:
            if on_main:
                _signals.closing -= 1
                if _signals.closing == 0 and _signals.deferred is not None:
                    signum, frame = _signals.deferred
                    _signals.deferred = None
                    _chain(signum, frame)

    def _close(self, status: str, timeout: float) -> WriterStats:
        deadline = time.monotonic() + timeout
        # The alert sinks' close (a webhook's last posts) runs beside the drain; ending the run keeps a
        # share of the time, so that a store that answers slowly still sees the run ended.
        alerts = _in_thread("rldiag-close-alerts", lambda: self.alerts.close(self.run_id, self.run_name))
        stats = self.writer.close(timeout=max(0.0, timeout - min(5.0, 0.2 * timeout)))
        end = _in_thread("rldiag-close-run", lambda: self._end_run(status))
        for what, t in (("end run", end), ("close the alert sinks", alerts)):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.error("rldiag: could not %s %s within the close timeout (%g s; the store or the webhook did "
                          "not answer)%s", what, self.run_id, timeout,
                          "; it may stay RUNNING in MLflow" if t is end else "")
        return stats

    def _end_run(self, status: str) -> None:
        """Upload the alert events, then end the run; each failure said once, neither stops the other."""
        if self.events:
            try:
                with tempfile.TemporaryDirectory() as d:
                    path = Path(d) / Path(keys.ALERTS_ARTIFACT).name
                    path.write_text("".join(json.dumps(e, default=str) + "\n" for e in self.events))
                    self.client.log_artifact(self.run_id, str(path), str(Path(keys.ALERTS_ARTIFACT).parent))
            except Exception as e:  # noqa: BLE001 - the events are in the tags and the JSONL sink too
                log.error("rldiag: could not upload %s of run %s (%s)", keys.ALERTS_ARTIFACT, self.run_id,
                          redact_text(f"{type(e).__name__}: {e}", self.tracking_uri))
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:  # noqa: BLE001 - the metrics are safe in the journal; say so, don't crash
            log.error("rldiag: could not finish run %s in MLflow (%s)", self.run_id,
                      redact_text(f"{type(e).__name__}: {e}", self.tracking_uri))


class _Done:
    @staticmethod
    def join(timeout: float | None = None) -> None:
        pass

    @staticmethod
    def is_alive() -> bool:
        return False


def _in_thread(name: str, fn: Callable[[], None]) -> threading.Thread | _Done:
    """Run `fn` in a daemon thread (the caller joins it with a deadline; at exit it is not waited for)."""
    t = threading.Thread(target=fn, name=name, daemon=True)
    try:
        t.start()
    except RuntimeError:  # no new threads (interpreter shutting down): run it here, unbounded
        fn()
        return _Done()
    return t


# ---- every way out of the process ends the run ----------------------------------------------------
_live: dict[int, RunSession] = {}  # open sessions of this process; no lock: a signal handler reads it


class _SignalState:
    def __init__(self) -> None:
        self.installed_atexit = False
        self.previous: dict[int, Any] = {}  # signal -> the handler ours replaced (what we chain to)
        self.closing = 0  # close() calls in progress on the main thread
        self.deferred: tuple[int, Any] | None = None  # a signal that came during one of them


_signals = _SignalState()
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _end_quietly(client: Any, run_id: str, status: str) -> None:
    try:
        client.set_terminated(run_id, status=status)
    except Exception:  # the error that made us end it is the one to show
        log.debug("could not end run %s as %s", run_id, status, exc_info=True)


def _register(session: RunSession, handle_signals: bool) -> None:
    _live[id(session)] = session
    if not _signals.installed_atexit:
        # Registered after mlflow is imported (the run is open), so it runs before mlflow's own exit
        # handlers, and before the writer's (atexit runs the latest first).
        atexit.register(_close_at_exit)
        _signals.installed_atexit = True
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in HANDLED_SIGNALS:
            if sig == signal.SIGINT and _interactive():
                continue  # Ctrl-C in a REPL or notebook interrupts a cell, not the run
            _install(sig)


def _interactive() -> bool:
    import builtins

    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or hasattr(builtins, "__IPYTHON__")


def _install(sig: int) -> None:
    current = signal.getsignal(sig)
    if current is _on_signal:
        return
    if current is not signal.SIG_DFL and not callable(current):
        return  # SIG_IGN (ignored on purpose, e.g. under nohup) or a handler set outside Python: not ours
    try:
        signal.signal(sig, _on_signal)
    except (ValueError, OSError):  # not the main interpreter, or the platform refuses
        return
    _signals.previous[sig] = current


def _on_signal(signum: int, frame: Any) -> None:
    if _signals.closing:
        # This handler interrupted a close() of the main thread: let it finish (it ends the run);
        # the signal takes effect when it returns. A second signal takes effect at once.
        if _signals.deferred is None:
            _signals.deferred = (signum, frame)
            log.warning("rldiag: %s during close(): it takes effect when the run is ended (send it again to "
                        "stop now)", signal.Signals(signum).name)
            return
        _signals.deferred = None
        _chain(signum, frame)
        return
    sessions = [s for s in list(_live.values()) if s._pid == os.getpid()]
    if sessions:
        log.warning("rldiag: %s: delivering what is queued (up to %g s) and ending run(s) %s as KILLED",
                    signal.Signals(signum).name, max(s.close_timeout_s for s in sessions),
                    ", ".join(s.run_id for s in sessions))
        for s in sessions:
            s.close("KILLED")
    _chain(signum, frame)


def _chain(signum: int, frame: Any) -> None:
    """What the process did with the signal before rldiag: its own handler, or the default action."""
    prev = _signals.previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
        return
    if prev == signal.SIG_IGN:
        return
    for f in (sys.stdout, sys.stderr):  # the default action ends the process without flushing them
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):  # a closed, broken or replaced stream
            continue
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)  # exits with the signal's status
    signal.signal(signum, _on_signal)  # (only if the default action did not end the process)


def _close_at_exit() -> None:
    """Interpreter exit with runs still open: end them as close() does (FAILED after an uncaught
    exception, KILLED after an uncaught KeyboardInterrupt)."""
    last = getattr(sys, "last_value", None) if not hasattr(sys, "ps1") else None  # ps1: interactive
    status = ("KILLED" if isinstance(last, KeyboardInterrupt) else
              "FAILED" if last is not None and not isinstance(last, SystemExit) else "FINISHED")
    for s in list(_live.values()):
        if s._pid == os.getpid():
            s.close(status)


def _after_fork_in_child() -> None:
    _live.clear()  # the parent's runs: the child neither ends them nor drains their writers
    _signals.closing = 0
    _signals.deferred = None


os.register_at_fork(after_in_child=_after_fork_in_child)
