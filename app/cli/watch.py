"""`rldiag watch`: the command line of `rldiag.app.watch` (a library usable without argparse)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from rldiag.app.cli.options import CliError, add_detector_option, add_tracking_option, positive_seconds, store_failed
from rldiag.collectors.settings import RLDIAG_ALERTS_JSONL, RLDIAG_WEBHOOK_URL

# The watcher (rldiag.app.watch) is imported when it runs: `rldiag watch --help` reads only these.
DEFAULT_INTERVAL = 30.0
DEFAULT_STATE = ".rldiag/watch-state.json"

EXAMPLES = """\
examples:
  rldiag watch                                   every 30 s, all experiments in ./mlruns.db
  rldiag watch --tracking-uri http://mlflow:5000 --experiment grpo --jsonl alerts.jsonl
  RLDIAG_WEBHOOK_URL=https://hooks.slack.com/... rldiag watch --interval 60 --divergence
  rldiag watch --once                            one poll cycle (cron); exit 1 if it sent alerts

A step is non-finite when grad/finite is 0, or grad/norm (or grad_norm, actor/grad_norm, ...) is NaN
or inf (MLflow stores inf as 1.797e308; read back as inf). A NaN/inf loss beside finite gradients is an
alert of its own kind (nonfinite_loss); fp16 scaler overflows (grad/scaler_overflow) are told, never
alerted. In an fp16 run rldiag did not watch (params fp16=True), a short streak of non-finite grad norms
with a finite loss is held back until the next finite row (then told as a likely scaler overflow) or
alerted once it lasts 8 logged rows, has a NaN loss, or the run ends in it. Steps with no valid tokens
(batch/valid_tokens 0, or TRL's completions/clipped_ratio 1 with mask_truncated_completions=True: every token
masked) are told once as no_valid_tokens, never alerted. An importance-sampling effective sample size
(policy/ess, or a framework's alias of it) a fifth below its baseline for 3 logged steps while a mismatch
metric (mismatch/low_prob_share, mismatch/logprob_abs_diff_mean, ...) at least doubles is alerted as
is_degenerate, with both metrics before and after. The state file remembers what was already alerted, so a
restarted watcher neither repeats nor misses an event.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EXAMPLES
    p.add_argument("--experiment", action="append", default=None, metavar="NAME",
                   help="experiment to watch (repeatable; default: every experiment)")
    p.add_argument("--interval", default=str(DEFAULT_INTERVAL), metavar="SECONDS",
                   help=f"seconds between the starts of two poll cycles (default: {DEFAULT_INTERVAL:g})")
    p.add_argument("--once", action="store_true", help="one poll cycle, then exit: 0 nothing new, 1 alerts sent")
    p.add_argument("--all", action="store_true", dest="include_finished",
                   help="read finished runs too, not only running and just-ended ones (e.g. with --once on a store "
                        "of past runs)")
    p.add_argument("--state", default=DEFAULT_STATE, metavar="FILE",
                   help=f"what was already alerted, so restarts neither repeat nor miss (default: {DEFAULT_STATE})")
    p.add_argument("--jsonl", default=RLDIAG_ALERTS_JSONL.get(), metavar="FILE",
                   help="append every event to this JSONL file (default: $RLDIAG_ALERTS_JSONL)")
    p.add_argument("--webhook", default=None, metavar="URL",
                   help="POST events (Slack-compatible JSON) here (default: $RLDIAG_WEBHOOK_URL; never printed)")
    p.add_argument("--tag-runs", action="store_true",
                   help="also write rldiag.alert.* tags on runs that rldiag's collectors do not watch "
                        "(the watcher's only write to the store; off by default)")
    p.add_argument("--divergence", action="store_true",
                   help="also alert when a candidate run (tag rldiag.role=candidate) leaves the band of the "
                        "reference runs of its rldiag.group")
    add_tracking_option(p, read=True)
    add_detector_option(p)


def _interval(raw: str) -> float:
    return positive_seconds(raw, example=30)


def run(args: argparse.Namespace) -> int:
    """`rldiag watch`: see the module docstring and `rldiag watch --help`."""
    from rldiag.app.data.store import open_store, store_errors
    from rldiag.app.errors import DataError
    from rldiag.app.watch.loop import Watcher, log, loop
    from rldiag.app.watch.state import StateError, StateLock, WatchState
    from rldiag.collectors.alerts import JsonlSink, LoggingSink, WebhookSink
    from rldiag.collectors.uri import redact_uri

    interval = _interval(args.interval)
    log.setLevel(logging.INFO)
    # MLflow's client retries a dead server for minutes; the watcher polls again anyway.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    try:
        store = open_store(args.tracking_uri)
        if args.tag_runs:  # opened now: a store of another schema is one line here, never migrated
            store.write_client  # noqa: B018
    except DataError as e:
        raise CliError(str(e)) from None
    sinks: list = [LoggingSink()]
    try:
        webhook = args.webhook or RLDIAG_WEBHOOK_URL.get()
        if webhook:
            sinks.append(WebhookSink(webhook))
        if args.jsonl:
            sinks.append(JsonlSink(args.jsonl, background=False))  # on disk before the state is saved
        lock = StateLock(args.state).acquire()
        state = WatchState.load(args.state)
    except (StateError, ValueError, OSError) as e:
        raise CliError(str(e)) from None
    try:
        try:
            watcher = Watcher(store, state, sinks, experiments=args.experiment, tag_runs=args.tag_runs,
                              divergence=args.divergence, include_finished=args.include_finished,
                              count_skipped=args.once)
        except DataError as e:
            raise CliError(str(e)) from None
        except store_errors() as e:
            raise store_failed(store.uri, e) from None
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
        what = ", ".join(args.experiment) if args.experiment else "all experiments"
        if args.divergence:  # as every report's header and the Compare page say it: never a silent change of verdicts
            from rldiag.app.analysis.comparison import options_text

            if (opts := options_text(watcher.detector)) != "defaults":
                log.info("rldiag watch: divergence verdicts with detector options %s (--detector or $RLDIAG_DETECTOR)",
                         opts)
        if not args.once:
            extra = [f"JSONL {args.jsonl}"] * bool(args.jsonl) + [repr(s) for s in sinks if isinstance(s, WebhookSink)]
            log.info("rldiag watch: polling %s every %g s (%s); state %s%s", redact_uri(store.uri), interval, what,
                     args.state, "; also to " + ", ".join(extra) if extra else "")
        try:
            return loop(watcher, interval, stop, once=args.once)
        except KeyboardInterrupt:
            return 0
        finally:
            watcher.close()
            state.save()
    finally:
        lock.release()
