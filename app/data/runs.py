"""Find runs by experiment, rldiag tags and ids: one row per run, the columns a runs overview shows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pandas as pd

from rldiag.app.data.store import Store, require_store
from rldiag.app.errors import DataError, ExperimentNotFound, NoRunsFound, RunNotFound, StoreUnreachable
from rldiag.collectors import keys
from rldiag.collectors.uri import redact_text, redact_uri

RUN_COLUMNS: tuple[str, ...] = (
    "run_id", "name", "experiment", "experiment_id", "status", "start_time", "end_time",
    "group", "variant", "role", "seed", "last_step", "metrics", "alerts", "first_alert_step",
)
_TAG_COLUMNS = {"group": keys.TAG_GROUP, "variant": keys.TAG_VARIANT, "role": keys.TAG_ROLE, "seed": keys.TAG_SEED}
TagFilter = str | Sequence[str] | None


def _as_list(v: TagFilter) -> list[str] | None:
    if v is None:
        return None
    return [v] if isinstance(v, str) else list(v)


def _quote(value: str) -> str | None:
    """`value` as a search-filter literal, or None when it holds both quote characters."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    return None


def _filter_string(tag_filters: dict[str, list[str] | None]) -> str:
    """Equality on single-valued tag filters, done by the store (the rest is filtered here)."""
    parts = []
    for tag, values in tag_filters.items():
        if values is not None and len(values) == 1 and (lit := _quote(values[0])) is not None:
            parts.append(f"tags.`{tag}` = {lit}")
    return " AND ".join(parts)


def find_runs(
    store: Store,
    *,
    experiments: str | Sequence[str] | None = None,
    group: TagFilter = None,
    variant: TagFilter = None,
    role: TagFilter = None,
    run_ids: Sequence[str] | None = None,
    max_runs: int = 5000,
) -> pd.DataFrame:
    """Active runs matching every given filter (a list means any of its values), newest first.

    Columns: RUN_COLUMNS. `experiments` are names (None: every experiment, or those of `run_ids`);
    `metrics` is the sorted tuple of canonical keys the run logged (aliases mapped); `last_step` the
    highest step of any metric. Raises ExperimentNotFound, RunNotFound, NoRunsFound (messages name
    the value and what is there instead) and StoreUnreachable.
    """
    require_store(store)
    client = store.client
    tag_filters = {keys.TAG_GROUP: _as_list(group), keys.TAG_VARIANT: _as_list(variant), keys.TAG_ROLE: _as_list(role)}
    try:
        exp_names = {e.experiment_id: e.name for e in pages(client.search_experiments, 100_000)}
        wanted_exps = _as_list(experiments)
        if wanted_exps is not None:
            missing = [n for n in wanted_exps if n not in exp_names.values()]
            if missing:
                have = sorted(exp_names.values())
                raise ExperimentNotFound(
                    f"experiment(s) {missing} not found in the store at {store.uri!r}; it has: "
                    f"{have[:20]}{' ...' if len(have) > 20 else ''}. Check the name or MLFLOW_TRACKING_URI."
                )
        if run_ids:
            runs = [r for r in get_runs(store, run_ids) if r.info.lifecycle_stage == "active"]
            if wanted_exps is not None:
                runs = [r for r in runs if exp_names.get(r.info.experiment_id) in wanted_exps]
        else:
            exp_ids = [i for i, n in exp_names.items() if wanted_exps is None or n in wanted_exps]
            search = partial(client.search_runs, exp_ids, filter_string=_filter_string(tag_filters),
                             order_by=["attributes.start_time DESC"])
            runs = pages(search, max_runs) if exp_ids else []
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - MLflow and connection errors come in many types
        raise StoreUnreachable(f"searching runs in {store.uri!r} failed: {type(e).__name__}: "
                               f"{redact_text(str(e).splitlines()[0]) if str(e) else ''}. Check MLFLOW_TRACKING_URI.") from None

    df = pd.DataFrame([_row(r, exp_names) for r in runs], columns=list(RUN_COLUMNS))
    for col, tag in (("group", keys.TAG_GROUP), ("variant", keys.TAG_VARIANT), ("role", keys.TAG_ROLE)):
        values = tag_filters[tag]
        if values is not None:
            df = df[df[col].isin(values)]
    if df.empty:
        raise NoRunsFound(_no_runs_message(store.uri, experiments, group, variant, role, run_ids))
    df = df.sort_values("start_time", ascending=False, kind="stable").reset_index(drop=True)
    for col in ("start_time", "end_time"):
        df[col] = pd.to_datetime(df[col], unit="ms", utc=True)
    return df


def pages(call, limit: int | None = None, **kwargs) -> list:
    """Every item of a paged MLflow search (`client.search_runs`, `search_experiments`, ...), up to `limit`."""
    out: list = []
    token = None
    while limit is None or len(out) < limit:
        size = 1000 if limit is None else min(1000, limit - len(out))
        page = call(**kwargs, max_results=size, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            break
    return out


def run_labels(names: Mapping[str, str | None]) -> dict[str, str]:
    """A label per run id from `{run_id: run name}`: the name, or where it is empty or used twice, the
    name with the id's first 8 characters ("v1-defaults (3fa2b1c0)"), so every label is unique."""
    counts = Counter(n or "" for n in names.values())
    return {rid: (name if name and counts[name] == 1 else f"{name or 'run'} ({rid[:8]})")
            for rid, name in names.items()}


def get_runs(store: Store, run_ids: Sequence[str]) -> list:
    """MLflow `Run` objects for `run_ids` (fetched in parallel), in that order; RunNotFound names the
    ids the store does not hold."""
    from mlflow.exceptions import MlflowException

    run_ids = list(dict.fromkeys(run_ids))
    if not run_ids:
        return []

    def one(run_id: str):
        try:
            return store.client.get_run(run_id)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    with ThreadPoolExecutor(max_workers=min(8, len(run_ids)), thread_name_prefix="rldiag-runs") as pool:
        got = list(pool.map(one, run_ids))
    missing = [r for r, run in zip(run_ids, got) if run is None]
    if missing:
        raise RunNotFound(f"run id(s) {missing} not found in the store at {redact_uri(store.uri)!r}. Give a run's "
                          "name or id (the first 8 characters are enough; the dashboard's Runs page lists them), "
                          "or check MLFLOW_TRACKING_URI.")
    return got


_HEX = frozenset("0123456789abcdef")


def resolve_run_refs(store: Store, refs: Sequence[str], *, experiments: TagFilter = None) -> list[str]:
    """Run ids for what a user typed: a full id, a unique id prefix (e.g. the 8 characters a report
    prints) or a run name. RunNotFound names the reference that matches no run, or lists the runs an
    ambiguous one matches."""
    refs = list(dict.fromkeys(refs))
    if not refs:
        return []
    full = [r for r in refs if len(r) == 32 and set(r) <= _HEX]
    if len(full) == len(refs):
        return refs  # ids as MLflow prints them: checked where the runs are read
    runs = find_runs(store, experiments=experiments, max_runs=100_000)
    ids, names = runs["run_id"].tolist(), runs["name"].tolist()
    out = []
    for ref in refs:
        if ref in ids:
            out.append(ref)
            continue
        hits = [i for i, n in zip(ids, names) if n == ref] or [i for i in ids if i.startswith(ref.lower())]
        if len(hits) == 1:
            out.append(hits[0])
        elif not hits:
            where = f" of experiment(s) {experiments!r}" if experiments else ""
            raise RunNotFound(f"no run{where} is named {ref!r} or has an id starting with it; give a run's name "
                              "or id (the first 8 characters are enough; the dashboard's Runs page lists them)")
        else:
            shown = ", ".join(f"{n or '(no name)'} ({i[:8]})" for i, n in zip(ids, names) if i in hits[:6])
            raise RunNotFound(f"{ref!r} matches {len(hits)} runs: {shown}{' ...' if len(hits) > 6 else ''}; "
                              "give the id (its first 8 characters are enough) to pick one")
    return out


def _row(run, exp_names: dict[str, str]) -> dict:
    info, tags = run.info, run.data.tags
    metrics = run.to_proto().data.metrics
    logged = [m for m in metrics if not m.key.startswith(keys.INF_FLAG_PREFIX)]
    row = {
        "run_id": info.run_id, "name": info.run_name or "", "experiment": exp_names.get(info.experiment_id, ""),
        "experiment_id": info.experiment_id, "status": info.status, "start_time": info.start_time,
        "end_time": info.end_time,
        "last_step": max((int(m.step) for m in logged), default=None),
        "metrics": tuple(sorted({keys.canonical_key(m.key) for m in logged})),
        "alerts": _int(tags.get(keys.TAG_ALERT_COUNT)) or 0,
        "first_alert_step": _int(tags.get(keys.TAG_ALERT_FIRST_STEP)),
    }
    row.update({col: tags.get(tag) for col, tag in _TAG_COLUMNS.items()})
    return row


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _no_runs_message(uri, experiments, group, variant, role, run_ids) -> str:
    given = {k: v for k, v in {"experiments": experiments, "group": group, "variant": variant, "role": role,
                                "run_ids": run_ids}.items() if v is not None}
    what = ", ".join(f"{k}={v!r}" for k, v in given.items()) or "no filter"
    return (f"no active runs match {what} in the store at {uri!r}. Drop or change a filter, "
            f"or log runs there first (rldiag demo).")


def runs_with_metrics(runs: pd.DataFrame, metric_keys: Sequence[str] = keys.CANONICAL_METRICS) -> pd.Series:
    """True for the runs that logged at least one of `metric_keys` (canonical names)."""
    wanted = set(metric_keys)
    return runs["metrics"].map(lambda ms: bool(wanted.intersection(ms)))
