"""Non-finite gradient alerts: one event per step, sent to every configured sink, rate-limited.

Sinks: Python logging, a JSONL file, a webhook (HTTP POST of JSON with a Slack-compatible `text`
field, sent from a background thread), and MLflow tags on the run (through the writer). Sinks
marked `rate_limited` get at most `burst` events per `interval_s`, then one summary of what was held
back; the JSONL file and the tags record every event.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from rldiag.collectors import keys

log = logging.getLogger("rldiag.alerts")


def _num(v: float) -> float | str:
    """JSON-safe number: NaN/inf become strings, so any JSON parser reads the event."""
    return v if math.isfinite(v) else str(v)


class StepEvent:
    """What the step events share (this alert, collectors.amp's scaler overflow, collectors.loss_event's
    NaN loss): the run as the text names it, "N steps in a row", and the dict a sink writes."""

    def run_label(self) -> str:
        return f"{self.run_name} ({self.run_id})" if self.run_name else self.run_id

    def in_a_row_text(self) -> str:
        n = getattr(self, "in_a_row", 1)
        return f", {n} steps in a row" if n > 1 else ""

    def as_dict(self) -> dict:
        d = asdict(self)
        d["text"] = self.text()
        return d


@dataclass
class NonFiniteGradAlert(StepEvent):
    """A step whose gradients hold NaN or inf."""

    run_id: str
    step: int
    grad_norm: float
    params: list[str]
    positions: list[dict] = field(default_factory=list)  # {"micro_batch", "sample", "position"}
    nonfinite_positions: int = 0
    run_name: str | None = None
    time: float = field(default_factory=time.time)
    kind: str = "nonfinite_grad"
    # where the NaN entered (collectors/nan_origin.py): {"where", "param", "order", "text"}; params are then
    # in backward order, the entry point first
    origin: dict | None = None
    policy: str | None = None  # the run's non-finite policy (collectors/nonfinite.py); None when not known
    skipped: bool | None = None  # the weights did not change at this step; None when not known (the watcher)

    def as_dict(self) -> dict:
        return super().as_dict() | {"grad_norm": _num(self.grad_norm)}

    def text(self) -> str:
        shown = ", ".join(self.params[:5]) + (f" and {len(self.params) - 5} more" if len(self.params) > 5 else "")
        where = ""
        origin = self.origin or {}
        if self.positions and origin.get("where") != "loss_backward":  # (that origin text holds them)
            from rldiag.collectors.nan_origin import format_positions  # imports torch: not for the read side

            where = f"; non-finite at {format_positions(self.positions)}"
        if self.positions and self.nonfinite_positions > len(self.positions):
            where += f" ({self.nonfinite_positions} positions)"
        name = self.run_label()
        entered = f"{origin['text']}; " if origin.get("text") else ""
        order = " (in backward order)" if origin.get("order") in ("autograd", "hooks") else ""
        return (
            f"rldiag: non-finite gradients in run {name} at step {self.step}: grad_norm={self.grad_norm}; "
            f"{entered}{len(self.params)} parameter tensor(s){order}: {shown}{where}{self.outcome()}"
        )

    def outcome(self) -> str:
        """What the step did to the weights, where known: "; skipped: the weights did not change", ..."""
        if self.skipped:
            return "; skipped: the weights did not change"
        if self.policy == "warn":
            return "; policy warn: the optimizer stepped on it"
        if self.policy == "raise":
            return "; policy raise: training stops"
        return ""


class Sink(Protocol):
    rate_limited: bool

    def send(self, event: dict) -> None: ...

    def close(self) -> None: ...


class LoggingSink:
    """Logs each event's text at WARNING on the `rldiag.alerts` logger."""

    rate_limited = True

    def __init__(self, logger: logging.Logger = log, level: int = logging.WARNING):
        self.logger, self.level = logger, level

    def send(self, event: dict) -> None:
        self.logger.log(self.level, "%s", event["text"])

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends every event as one JSON line, from a background thread: `send` only queues the line, so the
    training thread never opens or writes the file. Lines queued together are written with one open and
    append (the file is opened per batch, so a rotated or removed file is started again); `flush` waits
    until what was sent is written, `close` writes the rest and stops the thread.

    `background=False` writes in `send` itself, for a caller that must know an event is on disk before it
    goes on (`rldiag watch` saves its state only after its events are written: at-least-once delivery)."""

    rate_limited = False

    def __init__(self, path: str | Path, *, background: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.background = background
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None
        self.written = 0
        self.failed = 0

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"

    def send(self, event: dict) -> None:
        line = json.dumps(event, separators=(",", ":"), default=str) + "\n"  # the event as it is now
        if not self.background:
            with self._start, open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            self.written += 1
            return
        self._q.put(line)
        self._running()

    def _running(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start:  # first event, or a forked child (no thread came with it)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="rldiag-alerts-jsonl", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        done = False
        while not done:
            items = [self._q.get()]
            while True:  # everything queued by now: one open and append
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            lines = [x for x in items if isinstance(x, str)]
            if lines:
                try:
                    with open(self.path, "a", encoding="utf-8") as f:
                        f.write("".join(lines))
                    self.written += len(lines)
                except OSError as e:  # report, never crash the trainer; the next batch tries again
                    self.failed += len(lines)
                    log.warning("rldiag: could not append %d alert event(s) to %s: %s", len(lines), self.path, e)
            for x in items:
                if isinstance(x, threading.Event):
                    x.set()
                done = done or x is None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event sent so far is written (or failed); False when `timeout` passed first."""
        if self._thread is None or not self._thread.is_alive():
            return self._q.empty()
        ev = threading.Event()
        self._q.put(ev)
        return ev.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout)


def redact_url(url: str) -> str:
    """Scheme and host only: webhook paths and queries carry secrets."""
    p = urllib.parse.urlsplit(url)
    try:
        port = f":{p.port}" if p.port else ""
    except ValueError:
        port = ":?"
    return f"{p.scheme}://{p.hostname or ''}{port}/..."


class WebhookSink:
    """POSTs each event as JSON (with a Slack-compatible `text`) from a background thread.

    The URL comes from configuration only and is never logged in full (see `redact_url`).
    """

    rate_limited = True

    def __init__(self, url: str, *, timeout_s: float = 5.0, retries: int = 2):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook URL must start with http:// or https://; got {redact_url(url)!r}")
        try:
            urllib.parse.urlsplit(url).port
        except ValueError:
            raise ValueError(f"webhook URL {redact_url(url)!r} has an invalid port; use e.g. https://host:8443/path") from None
        self._url, self._timeout, self._retries = url, timeout_s, retries
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.sent = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._loop, name="rldiag-webhook", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"WebhookSink({redact_url(self._url)!r})"

    def send(self, event: dict) -> None:
        self._q.put(event)

    def _loop(self) -> None:
        while (event := self._q.get()) is not None:
            body = json.dumps(event, default=str).encode()
            for attempt in range(self._retries + 1):
                try:
                    req = urllib.request.Request(self._url, data=body, headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                        resp.read()
                    self.sent += 1
                    break
                except Exception as e:  # noqa: BLE001 - report, never crash the trainer
                    if attempt == self._retries:
                        self.failed += 1
                        log.warning("rldiag: webhook %s failed: %s", redact_url(self._url), type(e).__name__)
                    else:
                        time.sleep(0.5 * 2**attempt)

    def close(self, timeout: float = 10.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)


class MlflowTagSink:
    """Records alerts as tags on the run, through the writer: count, first step, the last event."""

    rate_limited = False

    def __init__(self, set_tags):
        self._set_tags = set_tags
        self.count = 0
        self.first_step: int | None = None

    def send(self, event: dict) -> None:
        if event.get("kind") != "nonfinite_grad":
            return
        self.count += 1
        tags = {}
        if self.first_step is None:
            self.first_step = event["step"]
            if (event.get("origin") or {}).get("text"):  # where the first NaN entered: what to fix
                tags[keys.TAG_ALERT_ORIGIN] = event["origin"]["text"][:5000]
        last = json.dumps({k: event[k] for k in ("step", "grad_norm", "params", "positions", "origin", "skipped")
                           if k in event},
                          default=str)
        tags.update({
            keys.TAG_ALERT_COUNT: str(self.count),
            keys.TAG_ALERT_FIRST_STEP: str(self.first_step),
            keys.TAG_ALERT_LAST: last[:5000],
        })
        self._set_tags(tags)

    def close(self) -> None:
        pass


class AlertDispatcher:
    """Sends events to every sink; rate-limited sinks get `burst` events per `interval_s`, then a summary."""

    def __init__(self, sinks: list[Sink], *, burst: int = 3, interval_s: float = 300.0, clock=time.monotonic):
        self.sinks = list(sinks)
        self.burst, self.interval_s, self._clock = burst, interval_s, clock
        self._window_start: float | None = None
        self._sent_in_window = 0
        self._held: list[int] = []  # steps held back from rate-limited sinks
        self.total = 0
        self._annotations: dict[int, dict] = {}

    def annotate(self, step: int, **fields) -> None:
        """Fields (of `NonFiniteGradAlert`, e.g. `origin`) to set on the alert of `step` when it is emitted:
        what the check knows beyond the `GradReport` the session builds the alert from."""
        self._annotations[step] = fields

    def note(self, event) -> None:
        """An event that is no alert (a loss-scaler overflow): logged at INFO and written to the sinks that
        record every event (the JSONL file); it takes no share of the alerts' rate limit and sets no tag."""
        d = event.as_dict()
        log.info("%s", d["text"])
        for sink in self.sinks:
            if not sink.rate_limited:
                self._send(sink, d)

    def emit(self, alert: NonFiniteGradAlert) -> None:
        self.total += 1
        for k, v in self._annotations.pop(alert.step, {}).items():
            setattr(alert, k, v)
        self._annotations.clear()  # never carried to a later step's alert
        event = alert.as_dict()
        now = self._clock()
        if self._window_start is None or now - self._window_start >= self.interval_s:
            self._flush_summary(alert.run_id, alert.run_name)
            self._window_start, self._sent_in_window = now, 0
        limited_ok = self._sent_in_window < self.burst
        if limited_ok:
            self._sent_in_window += 1
        else:
            self._held.append(alert.step)
        for sink in self.sinks:
            if limited_ok or not sink.rate_limited:
                self._send(sink, event)

    def _flush_summary(self, run_id: str, run_name: str | None) -> None:
        if not self._held:
            return
        n, first, last = len(self._held), self._held[0], self._held[-1]
        self._held = []
        event = {
            "kind": "summary", "run_id": run_id, "run_name": run_name, "suppressed": n,
            "first_step": first, "last_step": last, "time": time.time(),
            "text": f"rldiag: run {run_name or run_id} had {n} more non-finite gradient step(s), steps {first}..{last} "
                    f"(alerts rate-limited to {self.burst} per {self.interval_s:g} s)",
        }
        for sink in self.sinks:
            if sink.rate_limited:
                self._send(sink, event)

    @staticmethod
    def _send(sink: Sink, event: dict) -> None:
        try:
            sink.send(event)
        except Exception as e:  # noqa: BLE001 - a broken sink must not stop the others or the run
            log.warning("rldiag: alert sink %r failed: %s: %s", sink, type(e).__name__, e)

    def close(self, run_id: str = "", run_name: str | None = None) -> None:
        self._flush_summary(run_id, run_name)
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - the other sinks and the run must still close
                log.warning("rldiag: alert sink %r failed to close: %s: %s", sink, type(e).__name__, e)
