"""`RunSession`: one MLflow run with its writer, alert sinks and non-finite policy.

The framework-free core that `Monitor` (plain loops) and the integrations (transformers, TRL) share.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
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
    RLDIAG_SPILL_DIR,
    RLDIAG_WEBHOOK_URL,
    default_tracking_uri,
)
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
      run_id: resume this run instead of creating one (an earlier journal of it is replayed).
      tracking_uri: MLflow store; default `MLFLOW_TRACKING_URI`, else `sqlite:///mlruns.db` here.
      policy: on non-finite gradients `warn` (alert, step anyway), `skip` (alert, the caller zeroes
        the grads and does not step) or `raise` (alert, raise `NonFiniteGradientError`).
      alerts_jsonl, webhook_url: extra alert sinks (default from RLDIAG_ALERTS_JSONL, RLDIAG_WEBHOOK_URL).
      sinks: further alert sinks. alert_burst / alert_interval_s: rate limit for log and webhook.
      spill_dir: the writer's journal folder (default RLDIAG_SPILL_DIR, `.rldiag/spill`).
      close_timeout_s: how long close() waits for the store (default RLDIAG_CLOSE_TIMEOUT, 30 s).
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
        self.client, run = open_run(
            self.tracking_uri, experiment=experiment, run_name=run_name, run_id=run_id, tags=tags, params=params
        )
        self.run_id: str = run.info.run_id
        self.run_name: str | None = run.info.run_name
        self.writer = MetricWriter(
            self.run_id,
            make_sender(self.tracking_uri),
            tracking_uri=self.tracking_uri,
            spill_dir=spill_dir if spill_dir is not None else RLDIAG_SPILL_DIR.get(),
            close_timeout_s=close_timeout_s if close_timeout_s is not None else RLDIAG_CLOSE_TIMEOUT.get_float(),
        )
        all_sinks: list[Sink] = [LoggingSink(), MlflowTagSink(self.writer.set_tags)]
        jsonl = alerts_jsonl or RLDIAG_ALERTS_JSONL.get()
        if jsonl:
            all_sinks.append(JsonlSink(jsonl))
        url = webhook_url or RLDIAG_WEBHOOK_URL.get()
        if url:
            all_sinks.append(WebhookSink(url))
        all_sinks.extend(sinks or [])
        self.alerts = AlertDispatcher(all_sinks, burst=alert_burst, interval_s=alert_interval_s)
        self.events: list[dict] = []
        self._closed = False

    def on_nonfinite(self, step: int, report: GradReport) -> bool:
        """Alert on a non-finite step and apply the policy: True to step anyway (`warn`), False to skip
        (`skip`; the caller zeroes the grads); raises `NonFiniteGradientError` under `raise`."""
        alert = NonFiniteGradAlert(
            run_id=self.run_id, run_name=self.run_name, step=step, grad_norm=report.norm,
            params=report.nonfinite_params, positions=[p.as_dict() for p in report.positions],
            nonfinite_positions=report.nonfinite_positions,
        )
        self.alerts.emit(alert)
        if len(self.events) < MAX_EVENTS_KEPT:
            self.events.append(alert.as_dict())
        if self.policy == "raise":
            raise NonFiniteGradientError(alert)
        return self.policy == "warn"

    def close(self, status: str = "FINISHED") -> WriterStats:
        """Drain the writer, send held-back alert summaries, store the alert events, end the run."""
        if self._closed:
            return self.writer.stats
        self._closed = True
        self.alerts.close(self.run_id, self.run_name)
        stats = self.writer.close()
        try:
            if self.events:
                with tempfile.TemporaryDirectory() as d:
                    path = Path(d) / Path(keys.ALERTS_ARTIFACT).name
                    path.write_text("".join(json.dumps(e, default=str) + "\n" for e in self.events))
                    self.client.log_artifact(self.run_id, str(path), str(Path(keys.ALERTS_ARTIFACT).parent))
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:  # noqa: BLE001 - the metrics are safe in the journal; say so, don't crash
            log.error("rldiag: could not finish run %s in MLflow (%s: %s)", self.run_id, type(e).__name__, e)
        return stats
