"""One comparison of candidate runs against reference runs: the report, the dashboard (its Build report
included) and the watcher call `compare` and only render what it found.

    keys = load_keys(["policy/ratio_mean"])      # what to load: the charted metrics and what the verdict reads
    c = compare(histories, refs, cands, CompareOptions(keys=shown), params=params, alerts=alerts)
    c.verdicts[0].status, .summary.departures, .causes.line()    # per candidate, in candidate order
    c.verdicts[0].lead                           # the metric every product's headline leads with
    c.all_clear                                  # every candidate compared in full and clean: nothing found

Per candidate (`Verdict`): its status, every departure, its non-finite gradient steps (the NaN-first
headline), the metrics with too few steps, those that stop before the references' last step, never
logged or with unchecked gradients (`CandidateSummary`), the fp16-overflow and TRL-truncation hints, and
its likely causes with their notes (`RunCauses`). A cause check that raises is said there, never raised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rldiag.app.analysis.causes import SIGNATURE_KEYS, RunCauses, likely_causes
from rldiag.app.analysis.divergence import (
    HEADLINE_METRICS,
    Band,
    CandidateSummary,
    Divergence,
    DivergenceConfig,
    compare_runs,
    compute_band,
    reference_note,
    summarize,
)
from rldiag.app.data.histories import Histories
from rldiag.collectors import keys as K

# What a verdict reads besides the charted metrics: gradient flags and norms (the NaN-first headline),
# grad/found (unchecked gradients), the loss (real or a trainer's filtered one), the tokens of a batch
# and TRL's truncation (steps that measured nothing), the fp16 scaler (overflows, not NaN), the worst
# token (the mismatch's position), and the likely causes' signatures.
VERDICT_KEYS: tuple[str, ...] = (K.GRAD_FINITE, K.GRAD_NORM, K.GRAD_FOUND, K.GRAD_SKIPPED, K.LOSS, K.LOSS_UNFILTERED, K.BATCH_TOKENS,
                                 K.TRL_CLIPPED_RATIO, K.GRAD_SCALER_OVERFLOW, K.GRAD_LOSS_SCALE, *K.WORST_TOKEN_KEYS,
                                 *SIGNATURE_KEYS)


def load_keys(metric_keys: Sequence[str]) -> tuple[str, ...]:
    """The one list of what to load for a comparison: `metric_keys` (charted and compared), then
    VERDICT_KEYS (read, not charted). The report, the dashboard and the watcher load these."""
    return tuple(dict.fromkeys([*(K.canonical_key(k) for k in metric_keys), *VERDICT_KEYS]))


@dataclass(frozen=True)
class CompareOptions:
    """`keys`: the metrics compared (None: every canonical metric any of the runs logged); `detector`:
    the divergence detector's options (None: `DivergenceConfig.from_env`, i.e. `--detector` or defaults);
    `bands`: also keep the band each diverged candidate was tested against (`Comparison.bands`, for charts:
    a few ms a diverged pair, but six arrays of its steps each, so only where charts are drawn from it)."""

    keys: Sequence[str] | None = None
    detector: DivergenceConfig | None = None
    bands: bool = False


@dataclass(frozen=True)
class Verdict:
    """What the comparison says about one candidate: its `summary` (status, departures, evidence) and
    its likely `causes`."""

    summary: CandidateSummary
    causes: RunCauses

    @property
    def run_id(self) -> str:
        return self.summary.run_id

    @property
    def status(self) -> str:
        """nonfinite, diverged, within, not_enough_steps or not_compared (`CandidateSummary.status`)."""
        return self.summary.status

    @property
    def departures(self) -> tuple[Divergence, ...]:
        return self.summary.departures

    @property
    def lead(self) -> Divergence | None:
        """The metric its headline leads with, in the report, on the Compare page and in the verdict rows
        alike (`CandidateSummary.first`: still out at the end, then furthest past the bar; its
        `Divergence.lead` the departure named), or None."""
        return self.summary.first

    @property
    def clean(self) -> bool:
        """Within the band on every metric, in full, gradients finite and checked, and no likely cause."""
        return self.summary.clean and not self.causes.causes and not self.causes.failed


@dataclass(frozen=True)
class Comparison:
    """The result of `compare`: the metrics compared, the detector's options, every (metric, candidate)
    `Divergence`, and one `Verdict` per candidate in candidate order."""

    reference_ids: tuple[str, ...]
    candidate_ids: tuple[str, ...]
    keys: tuple[str, ...]
    detector: DivergenceConfig
    divergences: dict[str, dict[str, Divergence]]
    verdicts: tuple[Verdict, ...]
    reference_note: str = ""  # what a single reference cannot tell
    options_text: str = field(default="defaults")  # the detector options it ran with: "defaults" or each override
    # {key: {candidate: Band}}: the band each diverged candidate's lead level departure was tested against
    # (`tested_band`), for a chart to draw: the band drawn is the band tested (with `CompareOptions.bands`)
    bands: dict[str, dict[str, Band]] = field(default_factory=dict)

    @property
    def summaries(self) -> tuple[CandidateSummary, ...]:
        return tuple(v.summary for v in self.verdicts)

    @property
    def causes(self) -> tuple[RunCauses, ...]:
        return tuple(v.causes for v in self.verdicts)

    @property
    def all_clear(self) -> bool:
        """Every candidate `clean`: the only case a product may say that no candidate leaves the references."""
        return bool(self.verdicts) and all(v.clean for v in self.verdicts)


def compare(histories: Histories, reference_ids: Sequence[str], candidate_ids: Sequence[str],
            options: CompareOptions | None = None, *, params: Mapping[str, Mapping[str, str]] | None = None,
            alerts: Mapping[str, list[dict]] | None = None) -> Comparison:
    """Compare `candidate_ids` with `reference_ids` (several references form a noise band; none: only
    the candidates' own signatures, e.g. a NaN's likely cause) on what `histories` holds (load
    `load_keys(shown)`). `params`: run -> its params (the causes, the fp16 and TRL hints); `alerts`: run
    -> its alert events (`rldiag.app.data.alerts.load_alert_events`: where a NaN entered)."""
    from rldiag.app.analysis.nan_events import with_truncation_hints
    from rldiag.app.analysis.step_events import with_overflow_hints

    options = options or CompareOptions()
    config = options.detector if options.detector is not None else DivergenceConfig.from_env()
    refs, cands = tuple(dict.fromkeys(reference_ids)), tuple(dict.fromkeys(candidate_ids))
    ids = [*refs, *cands]
    if options.keys is not None:
        keys = tuple(dict.fromkeys(K.canonical_key(k) for k in options.keys))
    else:
        have = {k for r, k in histories.traces if r in set(ids)}
        keys = tuple(k for k in K.CANONICAL_METRICS if k in have)
    params = {r: dict(p) for r, p in (params or {}).items()}
    divergences = compare_runs(histories, refs, cands, keys, config) if refs else {}
    summaries = with_truncation_hints(with_overflow_hints(
        summarize(divergences, histories, refs, cands, keys, config), histories, params), histories, params)
    causes = likely_causes(histories, params, refs, cands, summaries=summaries, alerts=alerts)
    bands = {key: b for key, by in divergences.items()
             if options.bands and (b := tested_bands(histories, key, refs, by, config))}
    return Comparison(refs, cands, keys, config, divergences,
                      tuple(Verdict(s, c) for s, c in zip(summaries, causes)),
                      reference_note(len(refs), config) if refs else "", options_text(config), bands)


# The most bands one chart shades: 9 candidates' bands in a panel overlapped into one block no colour
# could be told in (and were 144 of the Compare page's 306 traces and 58% of its points at 10 runs x 8
# metrics, most of plotly.js's drawing time); 3 stay apart.
BANDS_PER_CHART = 3


def tested_bands(histories: Histories, key: str, reference_ids: Sequence[str],
                 divergences: Mapping[str, Divergence], config: DivergenceConfig | None = None,
                 limit: int | None = BANDS_PER_CHART) -> dict[str, Band]:
    """`{candidate: Band}` of `key` for a chart's `bands=`: `tested_band` of each diverged candidate in
    `divergences` (`{candidate: Divergence}`, as `Comparison.divergences[key]`) that has one, at most
    `limit` (None: all), the first to alert (then the first onset) first: the chart's title says when it
    shows fewer than could be (`figures.bands_shown_text`). `config`: the verdicts' (None:
    `DivergenceConfig.from_env`, as `compare`); only the candidates banded cost anything."""
    config = config if config is not None else DivergenceConfig.from_env()
    refs = [t for t in histories.for_key(key, reference_ids).values() if len(t)] if reference_ids else []
    out = {}
    for cand in banded_order(divergences):
        if limit is not None and len(out) >= limit:
            break
        t = histories.get(cand, key) if refs else None
        if t is not None and len(t) and (band := tested_band(refs, t, divergences[cand], config)) is not None:
            out[cand] = band
    return out


def banded_order(divergences: Mapping[str, Divergence]) -> list[str]:
    """The candidates a band can be drawn for (diverged, a level lead departure), the first to alert
    (then the first onset) first."""
    def when(cand: str) -> tuple[float, float]:
        lead = divergences[cand].lead
        alert = lead.alert_step if lead.alert_step is not None and np.isfinite(lead.alert_step) else np.inf
        return float(alert), float(lead.onset_step)

    leads = [c for c, d in divergences.items() if d.diverged and d.lead is not None and d.lead.kind == "level"]
    return sorted(leads, key=when)


def tested_band(references: Sequence, candidate, divergence: Divergence,
                config: DivergenceConfig | None = None) -> Band | None:
    """The band the detector tested `divergence`'s lead departure (`Divergence.lead`, a level one) against:
    of its trailing windows, longest first, the one whose median first leaves its band at or after the
    onset exactly at the alert step; else the one that leaves it earliest within the departure. None for
    a variance, zero-rate or non-finite lead (no band tests those) or where no window's median leaves its
    band within the departure (a band that held a flagged candidate would read as "inside")."""
    # None: the verdicts' own config, as `compare` and `tested_bands` take it (`--detector`, else defaults)
    dep, config = divergence.lead, config if config is not None else DivergenceConfig.from_env()
    if dep is None or dep.kind != "level":
        return None
    best, best_step = None, None
    for window in reversed(config.windows):
        band = compute_band(references, candidate, config, window=window)[0]
        with np.errstate(invalid="ignore"):
            out = (band.candidate < band.lower) | (band.candidate > band.upper)
        out &= band.steps >= dep.onset_step
        if dep.end_step is not None:
            out &= band.steps <= dep.end_step
        if not out.any():
            continue
        first = int(band.steps[np.flatnonzero(out)[0]])
        if first == dep.alert_step:
            return band
        if best_step is None or first < best_step:
            best, best_step = band, first
    return best


def options_text(config: DivergenceConfig) -> str:
    """ "defaults", or each option that differs from the default ("k=6, windows=5,9,17")."""
    from dataclasses import fields

    base = DivergenceConfig()
    changed = [f"{f.name}={_opt(getattr(config, f.name))}" for f in fields(config)
               if getattr(config, f.name) != getattr(base, f.name)]
    return ", ".join(changed) or "defaults"


def _opt(v: object) -> str:
    """As `--detector` takes it: "5,9,17", "11:33,21:65"."""
    if isinstance(v, (tuple, list)):
        return ",".join(":".join(map(str, x)) if isinstance(x, (tuple, list)) else str(x) for x in v)
    return str(v)


__all__ = ["HEADLINE_METRICS", "VERDICT_KEYS", "CompareOptions", "Comparison", "Verdict", "compare", "load_keys",
           "options_text", "tested_band", "tested_bands", "banded_order", "BANDS_PER_CHART"]
