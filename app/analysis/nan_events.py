"""Non-finite gradient events per run: which steps, which parameters, which samples and tokens.

The steps come from the metrics, so every run shows them, also one that rldiag never wrote: rldiag's
`grad/finite` = 0, or a NaN/inf grad norm (`grad_norm` of transformers/TRL, verl's `actor/grad_norm`,
mapped by the alias table). What the collectors' alerts add is read from the run: the events file
`rldiag/alerts.jsonl` (stored when the run ends) or, while it runs, the `rldiag.alert.last` tag.

    events = nan_events(histories, store, run_ids)   # DataFrame, one row per (run, non-finite step)
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from rldiag.app.data.histories import Histories
from rldiag.app.data.store import Store, open_store
from rldiag.collectors import keys

log = logging.getLogger("rldiag.app")

COLUMNS = ["run_id", "step", "grad_norm", "params", "n_params", "positions", "source"]


def _alerts_from_artifact(store: Store, run_id: str) -> list[dict] | None:
    """The run's alert events file, or None when it has none (still running, or no alert)."""
    folder = str(Path(keys.ALERTS_ARTIFACT).parent)
    try:
        names = {f.path for f in store.client.list_artifacts(run_id, folder)}
        if keys.ALERTS_ARTIFACT not in names:
            return None
        with tempfile.TemporaryDirectory() as d:
            local = store.client.download_artifacts(run_id, keys.ALERTS_ARTIFACT, d)
            lines = Path(local).read_text().splitlines()
    except Exception as e:  # noqa: BLE001 - an unreadable artifact store must not hide the metric steps
        log.warning("rldiag: could not read %s of run %s (%s: %s)", keys.ALERTS_ARTIFACT, run_id, type(e).__name__, e)
        return None
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line: the others still count
    return events


def load_alert_events(store: Store | str | None, run_ids: Sequence[str], tags: dict[str, dict[str, str]] | None = None
                      ) -> dict[str, list[dict]]:
    """`{run_id: [event, ...]}` from each run's alerts file, else its last-alert tag (`tags`: run -> tags,
    if the caller has them already; otherwise they are read)."""
    store = store if isinstance(store, Store) else open_store(store)
    out: dict[str, list[dict]] = {}
    for run_id in run_ids:
        events = _alerts_from_artifact(store, run_id)
        if events is None:
            run_tags = tags.get(run_id, {}) if tags is not None else store.client.get_run(run_id).data.tags
            last = run_tags.get(keys.TAG_ALERT_LAST)
            events = []
            if last:
                try:
                    events = [json.loads(last) | {"source": "tag"}]
                except json.JSONDecodeError:
                    pass
        out[run_id] = events
    return out


def _nonfinite_grad_steps(h: Histories, run_id: str) -> dict[int, float]:
    """{step: grad norm (NaN if not logged)} for every step with a non-finite gradient."""
    steps: dict[int, float] = {}
    finite = h.get(run_id, keys.GRAD_FINITE)
    norm = h.get(run_id, keys.GRAD_NORM)
    norm_at = dict(zip(norm.steps.tolist(), norm.values.tolist())) if norm is not None else {}
    if finite is not None:
        for s in finite.steps[finite.values == 0.0].tolist():
            steps[s] = norm_at.get(s, float("nan"))
    if norm is not None:
        bad = ~np.isfinite(norm.values)
        for s, v in zip(norm.steps[bad].tolist(), norm.values[bad].tolist()):
            steps[s] = v
    return steps


def _positions_text(positions: list[dict]) -> str:
    parts = []
    for p in positions:
        s = f"sample {p.get('sample')}" + (f" token {p['position']}" if p.get("position") is not None else "")
        if p.get("micro_batch") is not None:
            s = f"micro-batch {p['micro_batch']} " + s
        if p.get("rank") is not None:
            s = f"rank {p['rank']} " + s
        parts.append(s)
    return "; ".join(parts)


def nan_events(h: Histories, store: Store | str | None, run_ids: Sequence[str] | None = None,
               alerts: dict[str, list[dict]] | None = None) -> pd.DataFrame:
    """One row per (run, step with non-finite gradients), ascending: the grad norm, the parameters and
    the sample/token positions where the alerts name them, and where the row came from (`alerts`, `tag`
    or `metrics`). `alerts` as `load_alert_events` returns them (read here when None)."""
    run_ids = list(run_ids if run_ids is not None else h.run_ids)
    if alerts is None:
        alerts = load_alert_events(store, run_ids)
    rows = []
    for run_id in run_ids:
        by_step = {int(e["step"]): e for e in alerts.get(run_id, []) if "step" in e}
        steps = _nonfinite_grad_steps(h, run_id)
        for step in sorted(set(steps) | set(by_step)):
            e = by_step.get(step, {})
            params = list(e.get("params", []))
            norm = steps.get(step, e.get("grad_norm", float("nan")))
            rows.append({"run_id": run_id, "step": step, "grad_norm": float(norm),
                         "params": ", ".join(params), "n_params": len(params) if e else None,
                         "positions": _positions_text(e.get("positions", [])),
                         "source": e.get("source", "alerts") if e else "metrics"})
    return pd.DataFrame(rows, columns=COLUMNS)
