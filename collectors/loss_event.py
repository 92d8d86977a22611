"""A loss that went NaN or inf while every gradient stayed finite: its own event, not a NaN-gradient alert.

Backward through a NaN loss makes NaN gradients, and that is the NaN alert (collectors/nan_origin.py says
"the loss was NaN"). A non-finite loss beside finite gradients means part of the loss carries no gradient (a
term detached or computed under `no_grad`, a NaN from a metric added to the logged loss) or backward ran on
another tensor than the one logged. The optimizer step is safe (its gradients are finite), so no policy
applies and no alert tag is set; the first step of each stretch is a warning in the log, and every step an
event in the sinks that record every event (the JSONL file).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from rldiag.collectors.alerts import StepEvent

log = logging.getLogger("rldiag")


@dataclass
class NonFiniteLossEvent(StepEvent):
    """A step whose logged loss is non-finite while its gradients are finite."""

    run_id: str
    step: int
    loss: float | str  # "nan", "inf" or "-inf" (JSON has no NaN)
    in_a_row: int  # consecutive such steps ending with this one
    run_name: str | None = None
    time: float = field(default_factory=time.time)
    kind: str = "nonfinite_loss"

    def text(self) -> str:
        name, again = self.run_label(), self.in_a_row_text()
        return (f"rldiag: the loss is {self.loss} in run {name} at step {self.step}{again} while every gradient is "
                "finite: part of the loss carries no gradient (a detached term, a value computed under no_grad) or "
                "backward ran on another tensor than the loss logged; the optimizer steps on the finite gradients")


class LossCheck:
    """Notes the steps whose loss is non-finite while the gradients are finite (rank 0, with a session)."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def update(self, session, step: int, loss: float | None, grads_finite: bool | None) -> bool:
        """True when `step` is such a step (and its event went out)."""
        if loss is None or math.isfinite(loss) or grads_finite is not True:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        event = NonFiniteLossEvent(session.run_id, step, str(loss), self.in_a_row, run_name=session.run_name)
        if self.in_a_row == 1:
            log.warning("%s", event.text())
        session.alerts.note(event)
        return True


class EmptyBatchCheck:
    """Warns at the first step of each stretch whose `batch/valid_tokens` is 0 (rank 0): every completion
    token masked (a truncation at the length limit, a mask of the wrong sign), so the policy metrics logged
    there are an empty batch's ratio 1, KL 0 and clip rate 0, the values of a perfect step. Nothing went
    non-finite: a warning in the log, no event and no alert (`rldiag watch` tells it as no_valid_tokens)."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def update(self, step: int, valid_tokens: float | None) -> bool:
        """True when `step` had no valid token (and the first of a stretch was warned)."""
        if valid_tokens is None or valid_tokens != 0:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        if self.in_a_row == 1:
            log.warning("rldiag: step %d: no valid tokens (batch/valid_tokens 0): every completion token is masked, "
                        "so the policy metrics logged there are an empty batch's ratio 1, KL 0, clip rate 0, not "
                        "measurements (warned once a stretch); check the completion mask (every completion "
                        "truncated? the mask's sign?)", step)
        return True
