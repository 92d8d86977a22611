"""What a run-comparison report says, computed once from loaded histories; `rldiag.app.report.html` and
`rldiag.app.report.markdown` only format it.

    content = report_content(histories, store, reference_ids, candidate_ids)
    content.divergence   # one row per (candidate, metric): onset step, kind, size of the departure
    content.summaries    # per candidate: non-finite gradients, first departure, how much was compared
    headline(content.summaries[0], "run")   # "run: non-finite gradients from step 4 (5 steps); ..."
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from rldiag.app.analysis import verdicts as V
from rldiag.app.analysis.causes import RunCauses
from rldiag.app.analysis.comparison import CompareOptions, compare
from rldiag.app.analysis.config_diff import RunConfig, config_diff
from rldiag.app.analysis.divergence import (
    DERIVED_COLUMNS,
    DIVERGENCE_COLUMNS,
    CandidateSummary,
    Divergence,
    DivergenceConfig,
    detectable_text,
    divergence_frame,
)
from rldiag.app.analysis.nan_events import nan_events, no_token_steps, unchecked_steps
from rldiag.app.data.alerts import load_alert_events
from rldiag.app.data.histories import Histories, nonfinite_table
from rldiag.app.data.steps import format_ranges
from rldiag.app.data.store import Store
from rldiag.app.plots.figures import ChartOptions, metric_figure, run_colors, run_order
from rldiag.collectors import keys as K
from rldiag.collectors.uri import redact_uri

# Per-run alert state (a 2 KB JSON of the last alert among them), not configuration: left out of the config diff.
ALERT_TAGS = tuple(v for k, v in vars(K).items() if k.startswith("TAG_ALERT_"))


@dataclass(frozen=True)
class RunInfo:
    """One run of the report, as its tables and legends name it."""

    run_id: str
    name: str
    label: str  # unique within the report: the name, or "name (id prefix)" where names repeat
    role: str  # "reference" or "candidate" (in this report, whatever the run's tag says)
    color: str
    variant: str | None
    seed: str | None
    group: str | None
    status: str


@dataclass(frozen=True)
class ReportContent:
    title: str
    store_uri: str  # without a password
    generated_utc: str
    runs: tuple[RunInfo, ...]  # references first, then candidates
    keys: tuple[str, ...]  # the metrics charted and compared, in canonical order
    divergence: pd.DataFrame  # DIVERGENCE_COLUMNS, one row per (candidate, metric both sides logged)
    nan_events: pd.DataFrame  # rldiag.app.analysis.nan_events.COLUMNS
    nonfinite: pd.DataFrame  # rldiag.app.data.histories.nonfinite_table, every charted metric
    config_diff: pd.DataFrame  # rldiag.app.analysis.config_diff.config_diff, columns group, kind, name, <labels>
    figures: dict[str, object]  # key -> plotly Figure
    summaries: tuple[CandidateSummary, ...] = ()  # per candidate, in candidate order
    causes: tuple[RunCauses, ...] = ()  # per candidate, in candidate order: likely causes with their evidence
    unchecked: dict[str, list[int]] = field(default_factory=dict)  # run -> steps with grad/found = 0
    histories: Histories | None = None  # what was loaded (the NaN episodes read which steps were checked)
    alerts: dict[str, list[dict]] = field(default_factory=dict)  # run -> its alert events (where a NaN entered)
    params: dict[str, dict[str, str]] = field(default_factory=dict)  # run -> its params (fp16 overflow hint)
    reference_note: str = ""  # what a single reference cannot tell (divergence.reference_note)
    detector: str = "defaults"  # the detector options it ran with: "defaults", or each override ("k=6")

    @property
    def labels(self) -> dict[str, str]:
        return {r.run_id: r.label for r in self.runs}

    @property
    def reference_ids(self) -> tuple[str, ...]:
        return tuple(r.run_id for r in self.runs if r.role == "reference")

    @property
    def candidate_ids(self) -> tuple[str, ...]:
        return tuple(r.run_id for r in self.runs if r.role == "candidate")


def default_keys(histories: Histories, run_ids: Sequence[str]) -> list[str]:
    """The canonical metrics that at least one of `run_ids` logged, in canonical order."""
    have = {k for r, k in histories.traces if r in set(run_ids)}
    return [k for k in K.CANONICAL_METRICS if k in have]


def check_ids(histories: Histories, reference_ids: Sequence[str], candidate_ids: Sequence[str]) -> None:
    """ValueError naming the bad ids: none given, both roles, or not loaded in `histories`."""
    if not reference_ids:
        raise ValueError("no reference run: pass at least one reference run id (--reference RUN_ID or --group G)")
    if not candidate_ids:
        raise ValueError("no candidate run: pass --candidate RUN_ID, or tag runs rldiag.role=candidate in the group")
    both = sorted(set(reference_ids) & set(candidate_ids))
    if both:
        raise ValueError(f"run id(s) {both} are given as both reference and candidate; keep each in one role")
    loaded = set(histories.run_ids)
    missing = [r for r in [*reference_ids, *candidate_ids] if r not in loaded]
    if missing:
        raise ValueError(f"run id(s) {missing} are not in the loaded histories (it holds {list(histories.run_ids)}); "
                         "load them with rldiag.app.data.histories.load_histories first")


def report_content(histories: Histories, store: Store, reference_ids: Sequence[str], candidate_ids: Sequence[str],
                   *, keys: Sequence[str] | None = None, options: ChartOptions | None = None,
                   divergence_config: DivergenceConfig = DivergenceConfig()) -> ReportContent:
    """Everything the report shows; see the module docstring. Reads run names, params, tags and alert
    files from `store` (the metrics come from `histories`)."""
    from rldiag.app.data.runs import get_runs, run_labels

    refs, cands = list(dict.fromkeys(reference_ids)), list(dict.fromkeys(candidate_ids))
    check_ids(histories, refs, cands)
    ids = refs + cands
    keys = [K.canonical_key(k) for k in keys] if keys is not None else default_keys(histories, ids)
    options = options or ChartOptions()

    runs = get_runs(store, ids)
    labels = run_labels({r.info.run_id: r.info.run_name for r in runs})
    colors = run_colors(ids, refs, order=_color_order(store, runs))  # as the dashboard colours them
    tags = {r.info.run_id: dict(r.data.tags) for r in runs}
    infos = tuple(RunInfo(r.info.run_id, r.info.run_name or "", labels[r.info.run_id],
                          "reference" if r.info.run_id in refs else "candidate", colors[r.info.run_id],
                          tags[r.info.run_id].get(K.TAG_VARIANT), tags[r.info.run_id].get(K.TAG_SEED),
                          tags[r.info.run_id].get(K.TAG_GROUP), r.info.status) for r in runs)

    configs = {r.info.run_id: RunConfig(dict(r.data.params), tags[r.info.run_id]) for r in runs}
    params = {r: c.params for r, c in configs.items()}
    alerts = load_alert_events(store, ids, tags=tags)
    found = compare(histories, refs, cands, CompareOptions(keys, divergence_config, bands=True), params=params,
                    alerts=alerts)  # bands: the charts draw the band each departure was tested against
    divergences = found.divergences
    divergence = divergence_frame(divergences)

    figures = {key: metric_figure(key, histories.for_key(key, ids), labels=labels, reference_ids=refs,
                                  colors=colors, divergences=divergences.get(key, {}), bands=found.bands.get(key),
                                  options=options) for key in keys}  # the band drawn is the band tested

    events = nan_events(histories, store, ids, alerts=alerts)
    nonfinite = nonfinite_table(histories, ids)
    nonfinite = nonfinite[nonfinite["key"].isin(keys)].reset_index(drop=True)
    summaries, causes = found.summaries, found.causes
    diff = config_diff(configs, labels=labels)
    diff = diff[~diff["name"].isin(ALERT_TAGS)].reset_index(drop=True)  # alert state: the NaN section says it

    groups = sorted({i.group for i in infos if i.group})
    title = (f"group {', '.join(groups)}: " if groups else "") + f"{len(cands)} candidate(s) vs {len(refs)} reference(s)"
    return ReportContent(title, redact_uri(store.uri), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), infos,
                         tuple(keys), divergence, events, nonfinite, diff, figures, summaries, causes,
                         {r: s for r in ids if (s := unchecked_steps(histories, r))}, histories=histories,
                         alerts=alerts, params=params,
                         reference_note=" ".join(t for t in [found.reference_note,
                                                             reference_empty_text(histories, refs, labels, params)]
                                                 if t), detector=found.options_text)


def _color_order(store: Store, runs: list) -> list[str]:
    """Every active run of the report's experiments, oldest first (`run_order`): the order the dashboard
    reads a run's colour from, so that a run has one colour in both."""
    from rldiag.app.data.runs import pages

    exps = sorted({r.info.experiment_id for r in runs})
    found = pages(store.client.search_runs, 100_000, experiment_ids=exps) if exps else []
    return run_order(pd.DataFrame({"run_id": [r.info.run_id for r in found],
                                   "start_time": [r.info.start_time for r in found]}))


# ---- formatting shared by the HTML and Markdown renderers ------------------------------------------
def fmt(v, digits: int = 4) -> str:
    """A table cell: "-" for missing (None), NaN and inf as "NaN", "inf", "-inf" (a logged value that
    went non-finite shows as such), integers as such, floats to `digits` significant digits."""
    if v is None:
        return "-"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.{digits}g}"
    return str(v)


def fmt_stat(v, digits: int = 4) -> str:
    """A computed statistic (a departure's size): "-" where it is undefined (None or NaN: no departure,
    a non-finite one, a reference without noise), else as `fmt`."""
    if v is None or (isinstance(v, (float, np.floating)) and math.isnan(v)):
        return "-"
    return fmt(v, digits)


def table_delta(kind: str | None, delta: float) -> float:
    """A departure's delta as a table's delta column shows it: a level's move in metric units; NaN (the cell
    "-") for a variance departure, whose size is in noise terms only ("noise x2.5 the reference's")."""
    return math.nan if kind == "variance" else delta


def verdict_table_shown(rows: Sequence[V.VerdictRow]) -> bool:
    """Whether the verdict table (`verdicts.rows_of`) heads the report and the Compare page: where a candidate
    departs, has a likely cause or is short of an all-clear (a metric stopped early, gradients unchecked, too
    few steps), never only to repeat that every candidate is within the band."""
    return any(r.departs != "-" or r.cause != "-" or r.verdict != V.STATUS_WORDS["within"] for r in rows)


def fmt_value(v) -> str:
    """A config value as the run holds it; "(missing)" where it does not have it; a non-finite float as
    "NaN", "inf", "-inf" (as `fmt`)."""
    if v is None:
        return "(missing)"
    if isinstance(v, (float, np.floating)) and not math.isfinite(v):
        return fmt(v)
    return str(v)


def departure_text(row: dict) -> str:
    """Where a candidate leaves the band of a metric, when and by how much (plain text, no label): a
    `divergence` row's first departure in `verdicts.departure_sentence`'s words (`verdicts.row_sentence`)."""
    return V.row_sentence(row)


def others_text(s: CandidateSummary, shown: int = 3) -> str:
    """The metrics it leaves besides the one a headline leads with, lasting then largest first: "3 metrics
    in all; also policy/kl_new_old at step 150, loss alerted at step 12 (started about step 9), came back
    after step 20" ("" for one)."""
    rest = s.ranked[1:]
    if not rest:
        return ""
    listed = ", ".join(f"{d.key} {V.departure_when(d.lead)}" for d in rest[:shown])
    more = f" and {len(rest) - shown} more" if len(rest) > shown else ""
    return f"{len(rest) + 1} metrics in all; also {listed}{more}"


def divergence_sentence(row: dict, label: str) -> str:
    """One line: where a candidate leaves the band of a metric, and by how much (plain text)."""
    return f"{label}: {departure_text(row)}"


def status_text(row: dict) -> str:
    """A `divergence` row's status in words (`Divergence.evidence`): "diverged", "within the band",
    "not enough steps (8 compared, 15 needed)", "not compared (0 steps)"."""
    return Divergence(**{f: row[f] for f in DIVERGENCE_COLUMNS[1:] if f not in DERIVED_COLUMNS}).evidence


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def nonfinite_text(s: CandidateSummary) -> str | None:
    """ "non-finite gradients from step 4 (5 steps)", or None for finite gradients."""
    if not s.nonfinite_steps:
        return None
    hint = "; an fp16 run: likely loss-scaler overflows, see the NaN events" if s.likely_overflows else ""
    return f"non-finite gradients from step {s.nonfinite_steps[0]} ({_plural(len(s.nonfinite_steps), 'step')}{hint})"


def empty_text(s: CandidateSummary) -> str | None:
    """ "no valid tokens at steps 3, 7 (2 steps): ...", or None where every step had some."""
    if not s.empty_steps:
        return None
    where = f"no valid tokens at step{'s' if len(s.empty_steps) > 1 else ''} {format_ranges(s.empty_steps, limit=8)}"
    if s.empty_truncated:
        return (f"{where} ({_plural(len(s.empty_steps), 'step')} with every completion token masked: every completion "
                f"cut at max_completion_length ({K.TRL_CLIPPED_RATIO} 1) and {K.TRL_MASK_TRUNCATED}=True, so the "
                "loss, kl, entropy and clip ratios there are an empty batch's 0, not measurements; raise "
                "max_completion_length)")
    return (f"{where} ({_plural(len(s.empty_steps), 'step')} with every completion token masked: the policy metrics "
            "there are an empty batch's ratio 1, KL 0, clip rate 0, not measurements; check the completion mask)")


def reference_empty_text(histories: Histories, reference_ids: Sequence[str], labels: dict[str, str],
                         params: dict[str, dict[str, str]] | None = None) -> str:
    """What the band rests on where a reference logged no valid tokens ("" where none did): its policy
    metrics there are an empty batch's placeholders, and they enter the band as if measured. `params`
    (run -> params) finds TRL's every-completion-truncated steps too (`truncated_masked_steps`)."""
    parts = [f"{labels.get(r, r)} at step{'s' if len(e) > 1 else ''} {format_ranges(e, limit=8)}"
             for r in reference_ids if (e := no_token_steps(histories, r, (params or {}).get(r)))]
    if not parts:
        return ""
    return ("No valid tokens in reference " + "; ".join(parts) + ": every completion token masked (batch/valid_tokens "
            "0, or TRL's completions/clipped_ratio 1 under mask_truncated_completions=True), so its policy metrics "
            "there are an empty batch's placeholders (ratio 1, KL 0, clip rate 0), not measurements, and they are in "
            "the band; check the reference's completion mask or its max_completion_length.")


def metric_note(s: CandidateSummary, key: str) -> str:
    """What a table says beside a metric's status: "no reference logged it", "last logged at step N"."""
    notes = (["no reference logged it"] if key in s.no_reference else []) + (
        [f"last logged at step {s.last_logged[key]}"] if key in s.last_logged else []) + (
        [f"logged with no step (every point at step {s.by_order[key]}): steps are the logging order"]
        if key in s.by_order else [])
    return ", ".join(notes)


def _named(s: CandidateSummary, key: str) -> str:
    note = metric_note(s, key)
    return f"{key} ({note})" if note else key


def _by_step(steps: dict[str, int]) -> list[tuple[int, list[str]]]:
    """`{key: step}` as `[(step, [keys])]`, steps ascending."""
    out: dict[int, list[str]] = {}
    for k, step in steps.items():
        out.setdefault(step, []).append(k)
    return sorted(out.items())


def evidence_parts(s: CandidateSummary) -> list[str]:
    """How much the comparison of `s` rests on, in words: the metrics compared on enough steps without
    a departure (only when it left no band: the departure says more), those with not enough steps,
    those not compared, those compared only up to the references' last step, metrics that stop early.
    Counts only what was compared."""
    parts = []
    if not s.departures and s.within:
        lead = "no departure on" if s.nonfinite_steps else "stays within the reference band on"
        missed = detectable_text(s.within)  # what "within" could have missed
        parts.append(f"{lead} {_plural(len(s.within), 'metric')} compared" + (f" ({missed})" if missed else ""))
    if s.thin:
        n = sorted(d.steps_compared for d in s.thin)
        shown = str(n[0]) if n[0] == n[-1] else f"{n[0]}-{n[-1]}"
        k = sorted(d.steps_needed for d in s.thin)  # more where a metric's zeros are left out (two parts)
        need = str(k[0]) if k[0] == k[-1] else f"{k[0]}-{k[-1]}"
        parts.append(f"not enough steps ({shown} compared, {need} needed) on "
                     + ", ".join(_named(s, d.key) for d in s.thin))
    if s.not_compared:
        parts.append("not compared: " + ", ".join(_named(s, k) for k in s.not_compared))
    if s.past_references:
        parts.append("; ".join(f"compared only to step {end} on {', '.join(keys)} (the references end there; "
                               "later steps not compared)" for end, keys in _by_step(s.past_references)))
    if s.by_order:
        parts.append("; ".join(f"{', '.join(keys)} logged with no step (every point at step {step}): compared "
                               "in logging order, point i as step i (log with step= to compare by step)"
                               for step, keys in _by_step(s.by_order)))
    listed = {d.key for d in s.thin} | set(s.not_compared)
    stopped = [f"{k} last logged at step {step}" for k, step in s.last_logged.items()
               if k not in listed and k not in s.stops_short]
    if stopped:
        parts.append("; ".join(stopped))
    parts += gap_parts(s, listed)
    if not parts and not s.departures:
        parts.append("no metric compared")
    return parts


def gap_parts(s: CandidateSummary, listed: set[str] = frozenset()) -> list[str]:
    """What the comparison of `s` lacks beyond its too-few-steps metrics (those in `listed` say it
    already), in words: "reward/mean stops at step 59 of 200", "never logged (a reference did): ...",
    "gradients never checked (grad/found 0 at every step)". Any of them: no all-clear."""
    stopped = [f"{k} stops at step {mine} of {theirs}" for k, (mine, theirs) in s.stops_short.items()
               if k not in listed]
    return ([("; ".join(stopped))] if stopped else []) + (
        [f"never logged (a reference did): {', '.join(s.never_logged)}"] if s.never_logged else []) + (
        [t for t in [unchecked_text_of(s)] if t])


def unchecked_text_of(s: CandidateSummary) -> str:
    """ "gradients never checked (grad/found 0 at every step)", "gradients not checked at steps 3-5
    (grad/found 0)", or "" where every logged step found its gradients."""
    if not s.unchecked:
        return ""
    if len(s.unchecked) >= s.checked_steps:
        return f"gradients never checked ({K.GRAD_FOUND} 0 at every step)"
    where = format_ranges(list(s.unchecked), limit=8)
    return (f"gradients not checked at {_plural(len(s.unchecked), 'step')} ({where}; "
            f"{K.GRAD_FOUND} 0)")


def headline(s: CandidateSummary, label: str) -> str:
    """One plain-text line per candidate: non-finite gradients first, then steps with no valid tokens,
    then its first departure, then how much the comparison rests on; never "within the band" on too few
    steps or with NaN gradients."""
    parts = [p for p in [nonfinite_text(s), empty_text(s)] if p]
    if s.first is not None:  # lasting, then largest (`CandidateSummary.ranked`): the Compare page's too
        parts += [t for t in [V.departure_sentence(s.first.key, s.first.lead), others_text(s)] if t]
    parts += evidence_parts(s)
    return f"{label}: " + "; ".join(parts)
