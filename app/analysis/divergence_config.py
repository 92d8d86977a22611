"""The detector's options: `DivergenceConfig`, one object for the dashboard, the report and the watcher
(`--divergence KEY=VALUE`, or `--detector KEY=VALUE` and $RLDIAG_DETECTOR for every reader). The test they
set: `rldiag.app.analysis.divergence`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

DETECTOR_ENV = "RLDIAG_DETECTOR"  # KEY=VALUE options, space-separated: what `--detector` sets for every reader


@dataclass(frozen=True)
class DivergenceConfig:
    """The detector's options (one object for the dashboard, the report and the watcher; the CLI's
    `--divergence KEY=VALUE` sets them). Defaults measured on `bench.divergence_rl` (README)."""

    window: int = 9  # centre: each reference seed's centred rolling median, in steps (odd)
    k: float = 5.0  # bar of the longest trailing median, in sd of its no-change difference from the centre
    k_per_halving: float = 0.25  # the bar rises by this for each halving of the window (tested more often)
    windows: tuple[int, ...] = (11, 21, 41, 81, 129)  # trailing medians tested, in compared steps
    change_windows: tuple[tuple[int, int], ...] = ((11, 33), (21, 65))  # (recent, before): the candidate vs its own past
    k_change: float = 7.5  # bar of a change, in sd of (recent median - the one before) under no change
    k_change_loo: float = 6.5  # ... with 2+ references, whose leave-one-out scores raise it where they reach more
    detrend_window: int = 65  # steps of the wide smooth the noise is measured around
    seed_spread: float = 0.4  # prior seed-to-seed spread, in noise sd (all that 1 or 2 seeds can give)
    seed_spread_weight: float = 1.0  # the prior counts as this many seeds beside the references' estimate
    wander_span: int = 8193  # steps of the trend each reference's own slow wander is measured around (0: not measured)
    calibration_margin: float = 1.1  # a window's bar >= this x the largest value the references reach on it
    var_ratio: float = 2.5  # candidate / reference step-to-step noise of a variance departure (at least: see var_bar)
    var_window: int = 31  # trailing steps over which the candidate's noise is measured
    var_persist: int = 9  # steps in a row it must be so: clustered spikes lift the scale for a few steps (README)
    nonfinite_persist: int = 3  # non-finite steps in a row that count where the references go non-finite too
    zero_seed_spread: float = 0.1  # two-part comparison: prior seed-to-seed spread of the zero rate, in sd of one step's 0/1
    impulse_clip: float = 10.0  # innovations beyond this many robust sd: impulses, echo out (0: off; clean_impulses)
    alpha: float = 0.001  # false-alarm probability per candidate and metric over the run that sets the bars (0: fixed bars)
    tail_points: int = 50_000  # the references' noise simulated over this many points for the bars' tails (0: normal; tail_sim)
    min_delta: float = 0.0  # a departure must exceed this, in metric units
    rel_delta: float = 0.0  # ... and this fraction of the reference's level

    def __post_init__(self):
        if self.window < 1 or self.window % 2 == 0:
            raise ValueError(f"window={self.window}: use an odd number of steps >= 1, e.g. 9")
        if not self.windows or min(self.windows) < 3 or list(self.windows) != sorted(self.windows):
            raise ValueError(f"windows={self.windows}: use ascending window lengths of 3 steps or more, e.g. (5, 9, 17)")
        if self.k <= 0 or self.k_change <= 0 or self.k_change_loo <= 0 or self.detrend_window < 3 or self.var_ratio <= 1 or self.var_window < 5:
            raise ValueError(f"invalid {self}: need k, k_change and k_change_loo > 0, detrend_window >= 3, var_ratio > 1, var_window >= 5")
        if (self.nonfinite_persist < 1 or self.seed_spread < 0 or self.calibration_margin < 1 or self.var_persist < 1
                or self.zero_seed_spread < 0):
            raise ValueError(f"invalid {self}: need nonfinite_persist >= 1, seed_spread >= 0, calibration_margin >= 1, "
                             "var_persist >= 1, zero_seed_spread >= 0")
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha={self.alpha}: use a false-alarm probability in [0, 1), e.g. 0.001 (0: the fixed bars)")
        if not self.impulse_clip >= 0:
            raise ValueError(f"impulse_clip={self.impulse_clip}: use 0 (off) or a number of innovation sd > 0, e.g. 10")
        if self.tail_points < 0:
            raise ValueError(f"tail_points={self.tail_points}: use 0 (normal noise's ratio alone) or a number of "
                             f"simulated points, e.g. 50000")

    @property
    def min_steps(self) -> int:
        """Compared steps a candidate needs before staying inside says anything: the shortest window
        twice (a stretch at parity, then one outside it). Fewer, and no departure: "not enough steps"."""
        return 2 * self.windows[0]

    @classmethod
    def from_env(cls) -> DivergenceConfig:
        """The options `rldiag report|watch|app --detector KEY=VALUE` set ($RLDIAG_DETECTOR), else the defaults."""
        raw = os.environ.get(DETECTOR_ENV, "").split()
        try:
            return cls.from_options(raw)
        except ValueError as e:
            raise ValueError(f"${DETECTOR_ENV}: {e}") from None

    @classmethod
    def from_options(cls, options: Sequence[str]) -> DivergenceConfig:
        """From `KEY=VALUE` strings (the CLI's `--divergence`), e.g. `k=6` or `windows=5,9,17`."""
        kinds = {f.name: f for f in fields(cls)}
        values: dict = {}
        for item in options:
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in kinds:
                raise ValueError(f"divergence option {item!r}: use KEY=VALUE with KEY one of {', '.join(kinds)}")
            default = getattr(cls(), key)
            try:
                if key == "change_windows":
                    values[key] = tuple(tuple(int(x) for x in pair.split(":")) for pair in raw.split(",") if pair.strip())
                elif isinstance(default, tuple):
                    values[key] = tuple(int(x) for x in raw.split(",") if x.strip())
                else:
                    values[key] = type(default)(raw)
            except ValueError:
                raise ValueError(f"divergence option {item!r}: {key} takes a {type(default).__name__}, "
                                 f"e.g. {key}={default if not isinstance(default, tuple) else ','.join(map(str, default))}") from None
        return cls(**values)
