"""`rldiag watch` tells an ESS drop with a rising mismatch (`rldiag.app.analysis.is_health`): kind
"is_degenerate", once per stretch (its first step kept in the state file under `noted`), with its numbers.

The ESS is judged against the run's own first logged values (the watcher reads one run at a time, no
references). A run that logs no effective sample size or no mismatch metric gets no event and no word
here (`is_health` says "not logged": nothing to judge, never an all-clear).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from rldiag.app.analysis.is_health import IS_KEYS, ISEvent, is_health
from rldiag.app.data.histories import Histories
from rldiag.app.watch.events import SOURCE

KIND = "is_degenerate"
WATCH_IS_KEYS = IS_KEYS  # what the watcher loads besides its gradient keys
log = logging.getLogger("rldiag.watch")


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


def is_event(ev: ISEvent, run_name: str, experiment: str = "") -> dict:
    """The event for one stretch: where it starts, the ESS before/after, each risen mismatch before/after."""
    name = f"{run_name} ({ev.run_id})" if run_name else ev.run_id
    where = f" in experiment {experiment!r}" if experiment else ""
    text = (f"rldiag watch: importance weights degenerate in run {name}{where} from step {ev.step}: {ev.text()}; "
            "an ESS drop with a rising train-inference mismatch precedes collapse: correct the ratio (truncated "
            "importance sampling) and find the mismatch's source (rldiag report names likely causes)")
    return {"kind": KIND, "source": SOURCE, "run_id": ev.run_id, "run_name": run_name, "experiment": experiment,
            "step": ev.step, "last_step": ev.last_step, "ess_key": ev.ess_key, "ess_before": _num(ev.ess_before),
            "ess_after": _num(ev.ess_after), "against": ev.against,
            "rises": {r.key: {"before": _num(r.before), "after": _num(r.after)} for r in ev.rises},
            "time": time.time(), "text": text}


def send_is_events(h: Histories, run_id: str, run_name: str, experiment: str, state, sinks: Sequence) -> int:
    """Send the run's new stretches (not yet noted in `state`) to every sink, note them, save; how many."""
    events = is_health(h, run_id).events
    if not events:
        return 0
    rs = state.run(run_id, run_name)  # only a run with an event gets an entry
    new = set(rs.new_noted(KIND, [e.step for e in events]))
    if not new:
        return 0
    for ev in events:
        if ev.step not in new:
            continue
        event = is_event(ev, run_name, experiment)
        for sink in sinks:  # once per stretch: no rate limit needed
            try:
                sink.send(event)
            except Exception as e:  # noqa: BLE001 - a broken sink must not stop the others
                log.warning("rldiag watch: alert sink %r failed: %s: %s", sink, type(e).__name__, e)
    rs.note(KIND, new)
    state.save()
    return len(new)
