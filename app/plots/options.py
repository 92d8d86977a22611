"""How every metric chart of a view is drawn (`ChartOptions`): its own module, so that the figure code and its
marks (`rldiag.app.plots.marks`) both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from rldiag.app.plots.decimate import DEFAULT_POINTS


@dataclass(frozen=True)
class ChartOptions:
    """How every metric chart of a view is drawn."""

    delta: bool = False  # plot each run minus the reference (mean of the references) at the same step
    smoothing: float = 0.0  # exponential moving average weight in [0, 1), as TensorBoard's slider; 0: raw
    log_y: bool = False  # logarithmic y axis (values <= 0: a line break and an open circle at the bottom)
    first: int | None = None  # first step shown (None: the start)
    last: int | None = None  # last step shown (None: the end)
    n_points: int = DEFAULT_POINTS  # line points per run after decimation
    height: int = 300  # pixels, the legend's rows above the plot added to it

    def __post_init__(self):
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"smoothing={self.smoothing}: use a weight in [0, 1), e.g. 0.6 (0 turns it off)")
        if self.first is not None and self.last is not None and self.first > self.last:
            raise ValueError(f"step range {self.first}..{self.last} is empty: the first step must be <= the last")
