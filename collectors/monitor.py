"""`Monitor`: rldiag in a plain PyTorch loop.

    with Monitor(experiment="grpo", run_name="v1", params=cfg, policy="skip") as mon:
        for step, batch in enumerate(loader):
            logits = mon.watch(model(batch.ids).logits)          # which samples/tokens go non-finite
            lp_new = token_logprobs(logits, batch.ids)
            loss = objective(lp_new, batch.lp_old, batch.mask)
            loss.backward()
            stats = policy_metrics(lp_new, batch.lp_old, batch.mask, logits=logits, rewards=batch.rewards)
            if mon.step(step, model, loss=loss, metrics=stats):  # after backward, before clipping
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            opt.zero_grad()
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from collectors import keys
from collectors.alerts import AlertDispatcher, JsonlSink, LoggingSink, MlflowTagSink, NonFiniteGradAlert, Sink, WebhookSink
from collectors.gradcheck import GradReport, LogitsProbe, build_report, grad_norm_stats, named_grads
from collectors.settings import (
    RLDIAG_ALERTS_JSONL,
    RLDIAG_CLOSE_TIMEOUT,
    RLDIAG_SPILL_DIR,
    RLDIAG_WEBHOOK_URL,
    default_tracking_uri,
)
from collectors.writer import MetricWriter, WriterStats

log = logging.getLogger("rldiag")

Policy = Literal["warn", "skip", "raise"]
POLICIES = ("warn", "skip", "raise")
MAX_EVENTS_KEPT = 10_000


class NonFiniteGradientError(RuntimeError):
    """Raised by `Monitor.step` under `policy="raise"`; `.alert` holds the event."""

    def __init__(self, alert: NonFiniteGradAlert):
        super().__init__(alert.text())
        self.alert = alert


class Monitor:
    """Opens an MLflow run, checks gradients, logs a step's metrics in one host transfer, sends alerts.

    Keyword options:
      experiment, run_name, tags, params: the run (params may be nested dicts; logged as dotted keys).
      run_id: resume this run instead of creating one (an earlier journal of it is replayed).
      tracking_uri: MLflow store; default `MLFLOW_TRACKING_URI`, else `sqlite:///mlruns.db` here.
      policy: on non-finite gradients `warn` (alert, step anyway), `skip` (alert, zero the grads,
        `step()` returns False) or `raise` (alert, raise `NonFiniteGradientError`).
      alerts_jsonl, webhook_url: extra alert sinks (default from RLDIAG_ALERTS_JSONL, RLDIAG_WEBHOOK_URL).
      sinks: further alert sinks. alert_burst / alert_interval_s: rate limit for log and webhook.
      spill_dir: the writer's journal folder (default RLDIAG_SPILL_DIR, `.rldiag/spill`).
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
            raise ValueError(f"policy={policy!r} is not one of {POLICIES}; e.g. Monitor(policy='skip')")
        from collectors.mlflow_store import make_sender, open_run

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
        self.probe = LogitsProbe()
        self.last_report: GradReport | None = None
        self._warned_no_grads = False
        self._closed = False

    # ---- the loop ------------------------------------------------------------------------------
    def watch(self, tensor: torch.Tensor) -> torch.Tensor:
        """Track which samples/token positions of `tensor` (`[B, T, ...]`, e.g. logits) get non-finite
        gradients. Call once per micro-batch, before backward; returns `tensor` unchanged."""
        return self.probe.watch(tensor)

    def step(
        self,
        step: int,
        model: nn.Module | Any,
        *,
        loss: torch.Tensor | float | None = None,
        metrics: Mapping[str, torch.Tensor | float] | None = None,
    ) -> bool:
        """Check `model`'s gradients and log this step's values; True when the optimizer should step.

        Call after `backward()` and before clipping. On a finite step this costs one host transfer
        for everything (gradient norms, `loss`, `metrics`); logging never waits on the store.
        """
        named = named_grads(model)
        if not named and not self._warned_no_grads:
            self._warned_no_grads = True
            log.warning("rldiag: step %d: no parameter has a gradient; call Monitor.step after backward()", step)
        norms = grad_norm_stats([g for _, g in named])
        values: dict[str, torch.Tensor | float] = dict(metrics or {})
        if loss is not None:
            values[keys.LOSS] = loss.detach() if isinstance(loss, torch.Tensor) else loss
        host_norms, host_values = _one_transfer(norms, values)
        report = build_report(named, host_norms, self.probe)
        self.probe.reset()
        self.last_report = report
        host_values.update(report.metrics())
        self.writer.log_metrics(host_values, step)
        if report.finite:
            return True
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
        if self.policy == "skip":
            for _, g in named:
                g.zero_()
            return False
        return True

    def log(self, metrics: Mapping[str, torch.Tensor | float], step: int) -> None:
        """Log any further values at `step` (tensors cross to the host in one transfer)."""
        from collectors.metrics import to_host

        self.writer.log_metrics(to_host(metrics), step)

    # ---- lifecycle -----------------------------------------------------------------------------
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

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FAILED" if exc_type is not None else "FINISHED")


def _one_transfer(norms: torch.Tensor, values: Mapping[str, torch.Tensor | float]) -> tuple[list[float], dict[str, float]]:
    """Host copies of the gradient norms and every tensor value, in a single device-to-host copy."""
    tensor_keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    dtype = torch.float32 if norms.device.type == "mps" else torch.float64
    parts = [norms.to(dtype)]
    for k in tensor_keys:
        v = values[k]
        if v.numel() != 1:
            raise ValueError(f"metric {k!r} has shape {tuple(v.shape)}; pass a scalar, e.g. reduce with .mean()")
        parts.append(v.detach().reshape(1).to(norms.device, dtype))
    host = torch.cat(parts).tolist()
    n = norms.numel()
    out.update(zip(tensor_keys, host[n:]))
    return host[:n], out
