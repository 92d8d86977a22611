"""`NonFinitePolicy`: what a step's gradient check leads to, for every adapter (`Monitor`, `RldiagCallback`).

The adapters find the gradients and build the `GradReport` (their loops differ: a direct call after
`backward()`, hooks under transformers' `Trainer`); this object owns the rest, in one place:
- the loss-scaler logic (`collectors/amp.py`): the unscaled norm, an overflow told apart from a NaN;
- where the NaN entered (`collectors/nan_origin.py`), on rank 0;
- the `grad/*` keys of the step: `grad/norm`, `grad/finite`, `grad/nonfinite_params`, `grad/found` 0 where no
  gradient was found, `grad/loss_scale` and `grad/scaler_overflow` under a scaler, and on a non-finite step
  `grad/skipped` (1: the weights did not change);
- the events: the NaN alert (saying whether the step was skipped), the scaler-overflow note, the NaN-loss event;
- the policy: `warn` (alert, step anyway), `skip` (alert, the adapter zeroes the gradients and leaves the
  optimizer out; under a scaler `scaler.step` skips it), `raise` (alert, `NonFiniteGradientError`);
- the run param `rldiag.nonfinite_policy`, so a reader knows which policy the run was under.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rldiag.collectors import keys
from rldiag.collectors.alerts import NonFiniteGradAlert
from rldiag.collectors.amp import OverflowCounter, ScalerOverflowEvent, unscale_report
from rldiag.collectors.gradcheck import GradReport
from rldiag.collectors.loss_event import LossCheck
from rldiag.collectors.nan_origin import in_order, nan_origin
from rldiag.collectors.session import MAX_EVENTS_KEPT, POLICIES, NonFiniteGradientError

log = logging.getLogger("rldiag")

__all__ = ["NonFinitePolicy", "check_policy"]


def check_policy(policy: Any) -> str:
    """`policy` when it is one of `POLICIES`, else a one-line ValueError naming it and the choices."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {POLICIES}; e.g. policy='skip'")
    return policy


class NonFinitePolicy:
    """One run's non-finite policy and the state it keeps across steps (overflows and NaN losses in a row).

    Per step: `judge` (scaler and origin) then `settle` (log, tell, decide). `no_grad_hint` ends the warning
    given once when no gradient is found (where to call the check from, in the adapter's words)."""

    def __init__(self, policy: str = "warn", *, rank: int = 0, no_grad_hint: str = ""):
        self.policy = check_policy(policy)
        self.rank = rank
        self.no_grad_hint = no_grad_hint
        self._overflows = OverflowCounter()
        self._loss_check = LossCheck()
        self._warned_no_grads = False
        self._recorded: set[str] = set()

    def record(self, session: Any) -> None:
        """Log the policy as the run param `rldiag.nonfinite_policy` (once per run; a resumed run that had
        another policy keeps its first and is warned about)."""
        if session is None or session.run_id in self._recorded:
            return
        self._recorded.add(session.run_id)
        from mlflow.entities import Param

        try:
            session.client.log_batch(session.run_id, params=[Param(keys.PARAM_NONFINITE_POLICY, self.policy)])
        except Exception as e:  # noqa: BLE001 - the run had another policy before (a resumed run): say so
            from rldiag.collectors.uri import redact_text

            log.warning("rldiag: could not record %s=%s on run %s (%s: %s); the run keeps the value it had",
                        keys.PARAM_NONFINITE_POLICY, self.policy, session.run_id, type(e).__name__,
                        redact_text(str(e))[:300])

    def judge(self, report: GradReport | None, *, scale: float | None = None, scaled: bool = True,
              loss: float | None = None, order: Sequence[str] = (), how: str = "unknown",
              watched: bool = False) -> GradReport:
        """`report` (None: no gradient found) under the loss scale `scale` (None: no scaler; `scaled`: the
        gradients were still multiplied by it), with where the NaN entered on a non-finite step (rank 0):
        `order` is the parameters' backward order, `how` where it came from, `watched` whether the logits
        probe was on."""
        if report is None:
            return GradReport.unknown()
        report = unscale_report(report, scale, scaled=scaled, loss=loss)
        if report.finite is False and not report.overflow and self.rank == 0:
            report.nonfinite_params = in_order(report.nonfinite_params, order)
            report.origin = nan_origin(report.nonfinite_params, loss_value=loss, how=how, watched=watched,
                                       positions=[p.as_dict() for p in report.positions])
        return report

    def skips(self, report: GradReport, *, can_skip: bool = True) -> bool:
        """Whether the weights stay as they were on this non-finite step: policy `skip` where the adapter can
        skip, or a loss scaler (its `scaler.step` skips every non-finite step itself)."""
        return report.scale is not None or (self.policy == "skip" and can_skip)

    def settle(self, session: Any, step: int, report: GradReport, values: Mapping[str, float] | None = None, *,
               loss: float | None = None, can_skip: bool = True) -> bool:
        """Log `values` and the step's `grad/*` keys (rank 0: `session` not None), tell the step's events and
        apply the policy. True: step the optimizer. False: skip it (the adapter zeroes the gradients).
        Raises `NonFiniteGradientError` under `raise`, after the step is logged and alerted."""
        bad = report.found and report.finite is False and not report.overflow
        in_a_row = self._overflows.update(report)
        if not report.found and not self._warned_no_grads and self.rank == 0:
            self._warned_no_grads = True
            log.warning("rldiag: step %d: no parameter has a gradient, nothing was checked: logging %s = 0 and no "
                        "%s or %s%s", step, keys.GRAD_FOUND, keys.GRAD_NORM, keys.GRAD_FINITE,
                        f" ({self.no_grad_hint})" if self.no_grad_hint else "")
        skipped = bad and self.skips(report, can_skip=can_skip)
        if session is not None:
            logged = dict(values or {})
            logged.update(report.metrics())
            if bad:
                logged[keys.GRAD_SKIPPED] = 1.0 if skipped else 0.0
            session.writer.log_metrics(logged, step)
            self._loss_check.update(session, step, loss, report.finite)
        if report.overflow:  # the scaler skips this step and lowers its scale: its own event, no alert
            if session is not None:
                session.alerts.note(ScalerOverflowEvent(session.run_id, step, report.scale, in_a_row,
                                                        run_name=session.run_name))
            return True
        if not bad:  # finite, or unknown: nothing to alert on or to skip
            return True
        return self.alert(session, step, report, can_skip=can_skip)

    def alert(self, session: Any, step: int, report: GradReport, *, can_skip: bool = True) -> bool:
        """The NaN alert of a non-finite `report` (sent and kept by `session`, rank 0) and the policy: True to
        step anyway, False to skip; raises `NonFiniteGradientError` under `raise`."""
        skipped = self.skips(report, can_skip=can_skip)
        alert = NonFiniteGradAlert(
            run_id=session.run_id if session is not None else "", step=step, grad_norm=report.norm,
            params=report.nonfinite_params, positions=[p.as_dict() for p in report.positions],
            nonfinite_positions=report.nonfinite_positions, origin=report.origin,
            run_name=session.run_name if session is not None else None, policy=self.policy, skipped=skipped,
        )
        if session is not None:
            session.alerts.emit(alert)
            if len(session.events) < MAX_EVENTS_KEPT:
                session.events.append(alert.as_dict())
        if self.policy == "raise":
            raise NonFiniteGradientError(alert)
        return not (self.policy == "skip" and can_skip and report.scale is None)
