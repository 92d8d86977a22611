"""The pure part of `rldiag watch`: which steps of a run are non-finite, and the events it sends.

Events keep the collectors' format (`rldiag.collectors.alerts.NonFiniteGradAlert.as_dict`, kind
"nonfinite_grad") and add `source="watch"`, `keys` (each flagging key as logged, with its value) and
`experiment`; divergence events have kind "divergence".
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rldiag.collectors.alerts import NonFiniteGradAlert, StepEvent

SOURCE = "watch"


def _num(v: float) -> float | str:
    """JSON-safe number, as the collectors' events spell it: NaN/inf become strings."""
    return v if math.isfinite(v) else str(v)


@dataclass
class WatchAlert:
    """A `NonFiniteGradAlert` seen from outside the trainer: no parameter names, the keys that flagged it,
    and `source="watch"` in the event. It has what `AlertDispatcher.emit` reads (run_id, run_name, step,
    as_dict); `kind` stays "nonfinite_grad" so every sink, the MLflow tag sink included, takes it."""

    alert: NonFiniteGradAlert
    values: dict[str, float]
    experiment: str = ""
    cause: str = ""  # the run's first likely cause in one line (rldiag.app.analysis.causes), "" if none fits
    logged_at: int | None = None  # logged with no step: the one step MLflow stored every point at

    run_id = property(lambda self: self.alert.run_id)
    run_name = property(lambda self: self.alert.run_name)
    step = property(lambda self: self.alert.step)

    def text(self) -> str:
        a = self.alert
        name = a.run_label()
        flagged = ", ".join(f"{k}={v}" for k, v in self.values.items())
        where = f" in experiment {self.experiment!r}" if self.experiment else ""
        cause = f"; {self.cause}" if self.cause else ""
        at = at_step(a.step, self.logged_at)
        return f"rldiag watch: non-finite gradients in run {name}{where} {at}: {flagged}{a.outcome()}{cause}"

    def as_dict(self) -> dict:
        d = self.alert.as_dict()
        d.update(source=SOURCE, keys={k: _num(v) for k, v in self.values.items()}, experiment=self.experiment,
                 cause=self.cause, text=self.text())
        return d


def divergence_event(run_id: str, run_name: str, group: str, references: Sequence[str], key: str, departure,
                     cause: str = "") -> dict:
    """The event for one departure (a `Departure` of `rldiag.app.analysis.divergence`) of a candidate from its
    references' band on `key`, its text in the report's and the Compare page's words
    (`verdicts.departure_sentence`: alerted at step A, started about step O); `cause`: its first likely
    cause in one line (`rldiag.app.analysis.causes.RunCauses.line`), "" if none fits. `step` is the onset
    (as before); `alert_step` and `onset_step` say both."""
    from rldiag.app.analysis.verdicts import STATUS_WORDS, departure_sentence

    d = departure
    text = (f"rldiag watch: run {run_name or run_id} ({run_id}) {STATUS_WORDS['diverged']} from its reference(s) in "
            f"group {group!r}: {departure_sentence(key, d)}" + (f"; {cause}" if cause else ""))
    return {"kind": "divergence", "source": SOURCE, "run_id": run_id, "run_name": run_name, "group": group,
            "references": list(references), "key": key, "step": int(d.onset_step), "onset_step": int(d.onset_step),
            "alert_step": int(d.alert_step), "end_step": None if d.end_step is None else int(d.end_step),
            "departure": d.kind, "delta": _num(float(d.delta)), "delta_sigma": _num(float(d.delta_sigma)),
            "cause": cause, "time": time.time(), "text": text}


def at_step(step: int, logged_at: int | None) -> str:
    """ "at step 12"; for a metric logged with no step (every point stored at step `logged_at`, kept in
    logging order: `Trace.logged_at`) "at value 12 in logging order (counted from 0; ...)"."""
    if logged_at is None:
        return f"at step {step}"
    return (f"at value {step} in logging order (counted from 0; logged with no step, so MLflow shows every value "
            f"at step {logged_at})")


@dataclass
class LossAlert(StepEvent):
    """A step whose logged loss is NaN or inf while its gradients are not flagged (kind "nonfinite_loss"):
    an alert of its own, never a NaN-gradient one (no MLflow tag; see `rldiag.app.analysis.step_events`)."""

    run_id: str
    run_name: str
    step: int
    value: float
    checked: bool  # a finite gradient check was logged at this step
    experiment: str = ""
    logged_at: int | None = None  # logged with no step: the one step MLflow stored every point at
    kind = "nonfinite_loss"

    def text(self) -> str:
        name = self.run_label()
        where = f" in experiment {self.experiment!r}" if self.experiment else ""
        grads = ("every gradient is finite there: part of the loss carries no gradient (a detached term, a value "
                 "computed under no_grad), or backward ran on another tensor" if self.checked
                 else "no gradient check was logged at this step (unknown, not finite)")
        return f"rldiag watch: loss is {_num(self.value)} in run {name}{where} {at_step(self.step, self.logged_at)}; {grads}"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "source": SOURCE, "run_id": self.run_id, "run_name": self.run_name,
                "step": self.step, "loss": _num(self.value), "grads_checked": self.checked,
                "experiment": self.experiment, "time": time.time(), "text": self.text()}


@dataclass
class OverflowNote(StepEvent):
    """The scaler overflows of a run new since the last poll (kind "scaler_overflow"): told, never alerted."""

    run_id: str
    run_name: str
    steps: list[int]  # new this cycle
    summary: str  # `ScalerOverflows.text()` of all of the run's overflows so far

    def as_dict(self) -> dict:
        name = self.run_label()
        return {"kind": "scaler_overflow", "source": SOURCE, "run_id": self.run_id, "run_name": self.run_name,
                "steps": self.steps, "step": self.steps[-1], "time": time.time(),
                "text": f"rldiag watch: run {name}: {self.summary}; not a NaN gradient"}


@dataclass
class EmptyBatchNote(StepEvent):
    """Steps of a run new since the last poll that logged `batch/valid_tokens` 0 (kind "no_valid_tokens"):
    every completion token masked, so the policy metrics there are an empty batch's ratio 1, KL 0 and
    clip rate 0, which read as a perfect step. Told (the JSONL sink, the log), never alerted: nothing
    went non-finite."""

    run_id: str
    run_name: str
    steps: list[int]  # new this cycle
    truncated: bool = False  # found (some) as TRL's completions/clipped_ratio 1 under mask_truncated_completions
    kind = "no_valid_tokens"

    def as_dict(self) -> dict:
        shown = ", ".join(map(str, self.steps[:8])) + (" ..." if len(self.steps) > 8 else "")
        why = ("every completion cut at max_completion_length (completions/clipped_ratio 1) and masked "
               "(mask_truncated_completions=True), so TRL's loss, kl, entropy and clip ratios there are an empty "
               "batch's 0; raise max_completion_length" if self.truncated else
               "every completion token masked, so the policy metrics there are an empty batch's ratio 1, KL 0, "
               "clip rate 0; check the completion mask")
        what = "no valid tokens" if self.truncated else "no valid tokens (batch/valid_tokens 0)"
        return {"kind": self.kind, "source": SOURCE, "run_id": self.run_id, "run_name": self.run_name,
                "steps": self.steps, "step": self.steps[-1], "time": time.time(),
                "text": f"rldiag watch: run {self.run_label()}: {what} at {len(self.steps)} step(s) ({shown}): {why}"}


@dataclass
class LikelyOverflowNote(StepEvent):
    """Non-finite grad-norm steps of an fp16 run rldiag did not watch that are likely loss-scaler overflows
    (kind "likely_scaler_overflow"; see `rldiag.app.analysis.step_events.fp16_streaks`): told, never alerted.
    Likely, not known: nothing such a run logs tells an overflow from a NaN gradient."""

    run_id: str
    run_name: str
    steps: list[int]  # new this cycle
    longest: int  # the longest streak of them, in logged rows
    kind = "likely_scaler_overflow"

    def as_dict(self) -> dict:
        name = self.run_label()
        return {"kind": self.kind, "source": SOURCE, "run_id": self.run_id, "run_name": self.run_name,
                "steps": self.steps, "step": self.steps[-1], "time": time.time(),
                "text": (f"rldiag watch: run {name}: non-finite grad norm at {len(self.steps)} step(s) "
                         f"({', '.join(map(str, self.steps[:8]))}{' ...' if len(self.steps) > 8 else ''}) of an fp16 "
                         f"run (fp16=True), at most {self.longest} in a row, each followed by finite steps, with a "
                         "finite loss: likely loss-scaler overflows, which the GradScaler skips itself (not alerted; "
                         "nothing this run logs tells them from NaN gradients)")}
