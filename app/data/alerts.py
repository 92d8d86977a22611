"""What rldiag's collectors stored about each alert of a run: the events file `rldiag/alerts.jsonl`
(uploaded when the run ends) or, while it runs, the `rldiag.alert.last` tag."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rldiag.app.data.store import Store, require_store
from rldiag.collectors import keys

log = logging.getLogger("rldiag.app")


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


def load_alert_events(store: Store, run_ids: Sequence[str], tags: dict[str, dict[str, str]] | None = None
                      ) -> dict[str, list[dict]]:
    """`{run_id: [event, ...]}` from each run's alerts file, else its last-alert tag (`tags`: run -> tags,
    if the caller has them already; otherwise they are read)."""
    require_store(store)
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
