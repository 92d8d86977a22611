"""The table an experiment ends with: per run it compared, its verdict, first departure and likely cause,
from the same comparison as the report, the dashboard and the watcher (`rldiag.app.compare`)."""

from __future__ import annotations

from collections.abc import Sequence

from rldiag.app.analysis.verdicts import VerdictRow


def store_verdicts(uri: str, run_ids: Sequence[str]) -> list[VerdictRow]:
    """A `VerdictRow` (run, verdict, first departure, likely cause, its fix) per candidate among `run_ids` (references: the
    runs tagged rldiag.role=reference among them), compared on every canonical metric they logged."""
    from rldiag.app.analysis.comparison import CompareOptions, compare, load_keys
    from rldiag.app.analysis.verdicts import verdict_rows  # noqa: I001 - the comparison's rows
    from rldiag.app.data.alerts import load_alert_events
    from rldiag.app.data.histories import load_histories
    from rldiag.app.data.runs import get_runs
    from rldiag.app.data.store import open_store
    from rldiag.collectors import keys as K

    store = open_store(uri)
    runs = get_runs(store, list(run_ids))
    tags = {r.info.run_id: dict(r.data.tags) for r in runs}
    refs = [r for r in run_ids if tags.get(r, {}).get(K.TAG_ROLE) == "reference"]
    cands = [r for r in run_ids if tags.get(r, {}).get(K.TAG_ROLE) == "candidate"]
    if not (refs and cands):
        return []
    logged = {k for r in runs for k in r.data.metrics}
    keys = [k for k in K.CANONICAL_METRICS if k in logged]
    histories = load_histories(store, refs + cands, list(load_keys(keys)))
    params = {r.info.run_id: dict(r.data.params) for r in runs}
    found = compare(histories, refs, cands, CompareOptions(keys), params=params,
                    alerts=load_alert_events(store, refs + cands, tags=tags))
    return verdict_rows(found, {r.info.run_id: r.info.run_name or r.info.run_id for r in runs})


def format_verdicts(rows: Sequence[VerdictRow]) -> str:
    """An aligned plain-text table, then each likely cause's fix under it."""
    head = ("run", "verdict", "first departure", "likely cause")
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    lines = [f"{head[0]:{w[0]}}  {head[1]:{w[1]}}  {head[2]:{w[2]}}  {head[3]}"]
    lines.append("-" * max(len(lines[0]), *(len(f"{a:{w[0]}}  {b:{w[1]}}  {c:{w[2]}}  {d}") for a, b, c, d, _ in rows)))
    lines += [f"{a:{w[0]}}  {b:{w[1]}}  {c:{w[2]}}  {d}" for a, b, c, d, _ in rows]
    runs_by_fix: dict[str, list[str]] = {}
    for a, _, _, _, fix in rows:
        if fix:
            runs_by_fix.setdefault(fix, []).append(a)
    fixes = [f"  {', '.join(names)}: {fix}" for fix, names in runs_by_fix.items()]
    return "\n".join(lines + (["Fixes:", *fixes] if fixes else []))


def print_verdicts(run_ids: Sequence[str], uri: str) -> None:
    """The experiment's closing table (`verdict_rows`), or one line saying why there is none."""
    try:
        rows = store_verdicts(uri, run_ids)
    except Exception as e:  # noqa: BLE001 - the runs are logged; a failed comparison must not hide that
        print(f"verdicts: could not compare the runs ({type(e).__name__}: {e}); try rldiag report")
        return
    print(format_verdicts(rows) if rows else "verdicts: no reference and candidate runs among these to compare")
