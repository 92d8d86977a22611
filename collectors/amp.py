"""fp16 loss scaling (`torch.amp.GradScaler`): the true gradient norm, and a scaler overflow told apart
from a NaN in the model.

Under a GradScaler the gradients after `backward()` are the true ones times the loss scale (65536 at
first), until `scaler.unscale_(optimizer)` divides them. The check reads the scale with the step's other
values (one host transfer) and logs `grad/norm` unscaled either way, with `grad/loss_scale` beside it.

A non-finite gradient under a scaler is most often an overflow of the scaled fp16 backward: the scaler
skips that optimizer step and halves its scale by itself. Such a step is logged as `grad/scaler_overflow`
= 1 (no `grad/finite`, no NaN alert) and noted as a `scaler_overflow` event. It is a real non-finite
gradient (a NaN alert, the policy applies) when scaling cannot be the cause: the loss itself is non-finite,
or the scale is already at `min_loss_scale` (1.0, as DeepSpeed's and Megatron's minimum: at scale 1 the
backward is the unscaled one). A NaN that scaling did not cause therefore shows as overflows with a
halving scale until the scale reaches 1 (16 steps from 65536), then as NaN alerts; the overflow event says
how many steps in a row overflowed.

The scaler skips every non-finite step itself, so with a scaler rldiag never zeroes gradients or skips
the optimizer: zeroed gradients would read finite to `scaler.step`, which would then step (momentum and
weight decay still move the weights), and skipping `scaler.step` would leave `scaler.update()` without
its inf check.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from rldiag.collectors.alerts import StepEvent
from rldiag.collectors.gradcheck import GradReport

MIN_LOSS_SCALE = 1.0


def unscale_report(report: GradReport, scale: float | None, *, scaled: bool, loss: float | None,
                   min_loss_scale: float = MIN_LOSS_SCALE) -> GradReport:
    """`report` read under a loss scaler whose scale was `scale` (None: no scaler in play): the norm
    divided by `scale` when the gradients were still `scaled`, `report.scale` set, and a non-finite step
    marked as a scaler overflow (`report.overflow`) unless the `loss` is non-finite or `scale` is at
    `min_loss_scale` already."""
    if scale is None or not report.found:
        return report
    report.scale = scale
    if scaled and scale > 0 and math.isfinite(scale):
        report.norm = report.norm / scale  # the scale is a power of two: the division is exact
    loss_finite = loss is None or math.isfinite(loss)
    if report.finite is False and loss_finite and scale > min_loss_scale:
        report.overflow = True
    return report


@dataclass
class ScalerOverflowEvent(StepEvent):
    """A step whose scaled fp16 gradients overflowed; the scaler skips it and lowers its scale."""

    run_id: str
    step: int
    loss_scale: float  # the scale the step's gradients were multiplied by
    in_a_row: int  # consecutive overflow steps ending with this one
    run_name: str | None = None
    time: float = field(default_factory=time.time)
    kind: str = "scaler_overflow"

    def text(self) -> str:
        name, again = self.run_label(), self.in_a_row_text()
        return (f"rldiag: loss-scaler overflow in run {name} at step {self.step} (loss scale {self.loss_scale:g}{again}): "
                "the scaler skips this step and halves its scale; not a NaN in the model unless it continues "
                "down to scale 1")


class OverflowCounter:
    """Consecutive scaler overflows (for the event's `in_a_row`)."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def update(self, report: GradReport) -> int:
        self.in_a_row = self.in_a_row + 1 if report.overflow else 0
        return self.in_a_row
