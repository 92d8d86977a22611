"""The dashboard's cached loaders: one `Store` per URI, short-lived query caches, and metric histories
kept per selection and refreshed incrementally (`load_histories(..., previous=)`).

Every loader takes the tracking URI (a string) first so that Streamlit's caches key on it. Errors are
`rldiag.app.errors.DataError`s with the user's message; pages show them with `st.error`, never a traceback.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import pandas as pd
import plotly.io
import streamlit as st

from rldiag.app.analysis.comparison import CompareOptions, Comparison, compare, tested_bands
from rldiag.app.analysis.config_diff import RunConfig, config_diff, load_configs
from rldiag.app.analysis.divergence import Divergence, DivergenceConfig, sigma_cell
from rldiag.app.data.alerts import load_alert_events
from rldiag.app.data.disk_cache import DiskCache
from rldiag.app.data.histories import Histories, Progress, load_histories
from rldiag.app.data.readers import row_at
from rldiag.app.data.runs import find_runs
from rldiag.app.data.store import Store, open_store
from rldiag.app.errors import DataError, StoreUnreachable
from rldiag.app.plots.figures import ChartOptions, metric_figure
from rldiag.app.plots.grid_figure import grid_figure
from rldiag.app.report.content import ALERT_TAGS, table_delta
from rldiag.app.report.table_rows import departure_views
from rldiag.collectors import keys
from rldiag.collectors.uri import redact_text

RUNS_TTL_S = 5  # run list and status: short, so that a live run's status and new runs show up
CONFIG_TTL_S = 30
HISTORY_ENTRIES = 4  # selections whose histories stay in memory (10 runs x 8 x 100k points: ~200 MB each)
IDLE_RELOAD_S = 300  # finished runs: check for new rows at most this often (a resumed run)
ALERTS_LIVE_S = 10  # alert events of a RUNNING run: read again at most this often
ENDED = ("FINISHED", "FAILED", "KILLED")

log = logging.getLogger("rldiag.app")


@st.cache_resource(max_entries=8, ttl=3600, show_spinner=False)
def get_store(uri: str) -> Store:
    """The checked store for `uri` (StoreUnreachable is raised, not cached)."""
    return open_store(uri)


def _client_call(uri: str, what: str, fn):
    try:
        return fn()
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - MLflow and connection errors come in many types
        first = redact_text(str(e).splitlines()[0]) if str(e) else ""
        raise StoreUnreachable(f"{what} in {uri!r} failed: {type(e).__name__}: {first}. "
                               "Check the tracking URI (rldiag app --tracking-uri, or MLFLOW_TRACKING_URI).") from None


@st.cache_data(ttl=RUNS_TTL_S, max_entries=16, show_spinner=False)
def experiments(uri: str) -> tuple[list[str], str | None]:
    """Active experiment names (sorted) and the experiment of the newest run (None: no runs at all)."""
    client = get_store(uri).client

    def call():
        exps = client.search_experiments(max_results=10_000)
        newest = client.search_runs([e.experiment_id for e in exps], max_results=1,
                                    order_by=["attributes.start_time DESC"]) if exps else []
        by_id = {e.experiment_id: e.name for e in exps}
        return sorted(by_id.values()), (by_id.get(newest[0].info.experiment_id) if newest else None)

    return _client_call(uri, "listing experiments", call)


@st.cache_data(ttl=RUNS_TTL_S, max_entries=32, show_spinner=False)
def runs(uri: str, experiment: str) -> pd.DataFrame:
    """`rldiag.app.data.runs.find_runs` of one experiment (NoRunsFound when it is empty)."""
    return find_runs(get_store(uri), experiments=experiment)


@st.cache_data(ttl=CONFIG_TTL_S, max_entries=32, show_spinner=False)
def configs(uri: str, run_ids: tuple[str, ...]) -> dict[str, RunConfig]:
    return _client_call(uri, "reading params and tags", lambda: load_configs(get_store(uri), run_ids))


def runs_version(runs_df: pd.DataFrame, run_ids: Sequence[str]) -> tuple:
    """What changes when the runs' alert events can have changed: each run's status and end time, and,
    while one is RUNNING, the clock in ALERTS_LIVE_S steps (finished runs are read once)."""
    wanted = set(run_ids)
    rows = [(r, s, str(e)) for r, s, e in zip(runs_df.run_id.tolist(), runs_df.status.tolist(), runs_df.end_time.tolist())
            if r in wanted]  # plain lists: a pandas comparison on Arrow strings costs 14 ms a column here
    version = tuple(sorted(rows))
    running = any(s == "RUNNING" for _, s, _ in rows) or len(rows) < len(wanted)
    return version + ((int(time.time() // ALERTS_LIVE_S),) if running else ())


def alert_events(uri: str, run_ids: tuple[str, ...], version: tuple = ()) -> dict[str, list[dict]]:
    """The runs' alert events (`rldiag.app.data.alerts`), kept while `version` (`runs_version`) and the
    runs' alert tags hold (`rldiag watch --tag-runs` can tag an ended run later); on disk too once every
    run has ended (their alerts file is uploaded at the end and stays as it is)."""
    tags = {r: c.tags for r, c in configs(uri, run_ids).items()}
    alert_tags = tuple(sorted((r, k, v) for r, t in tags.items() for k, v in t.items() if k in ALERT_TAGS))
    return _alert_events(uri, run_ids, version, alert_tags, tags)


@st.cache_data(ttl=3600, max_entries=32, show_spinner=False)
def _alert_events(uri: str, run_ids: tuple[str, ...], version: tuple, alert_tags: tuple, _tags) -> dict[str, list[dict]]:
    def load() -> dict[str, list[dict]]:
        return load_alert_events(get_store(uri), run_ids, tags=_tags)

    ended = bool(version) and all(isinstance(v, tuple) and v[1] in ENDED for v in version)
    return _persisted("alerts", (uri, run_ids, version, alert_tags), load) if ended else load()


# ---- histories: kept per selection, refreshed incrementally ---------------------------------------

@dataclass(frozen=True)
class Loaded:
    """Histories and a stamp that changes whenever new rows arrived (keys the caches built on them)."""

    histories: Histories
    stamp: tuple
    loaded_at: float


@dataclass(frozen=True)
class Persisted:
    """What the disk cache keeps of a `Loaded`: the histories without the tracking URI (it may carry a
    password), the stamp's token, and the SQLite row the cursor points at (a store replaced at the same
    path holds another row there, or none: the entry is then discarded)."""

    histories: Histories
    token: str
    cursor_row: tuple | None


class _HistoryCache:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: OrderedDict[tuple, Loaded] = OrderedDict()

    def previous(self, uri: str, key_set: tuple[str, ...], exact: tuple) -> Loaded | None:
        """The entry for exactly this selection, else the newest one of the same store and keys."""
        if exact in self.entries:
            return self.entries[exact]
        same = [v for (u, _, ks), v in self.entries.items() if u == uri and ks == key_set]
        return same[-1] if same else None

    def covering(self, exact: tuple) -> tuple | None:
        """The key of the newest entry for the same store and runs whose keys include all of `exact`'s
        (the Compare page's entry holds the worst-token and gradient keys that other sections ask for):
        those are served from it instead of a read of their own (a scan of the whole table on a first load)."""
        uri, runs, wanted = exact
        wider = [k for k in self.entries if k[0] == uri and k[1] == runs and set(wanted) <= set(k[2])]
        return wider[-1] if wider else None


@st.cache_resource(max_entries=1, show_spinner=False)
def _history_cache() -> _HistoryCache:
    return _HistoryCache()


@st.cache_resource(max_entries=1, show_spinner=False)
def disk_cache() -> DiskCache | None:
    """The cache on disk that a restarted dashboard opens from (`rldiag.app.data.disk_cache`)."""
    return DiskCache.from_env()


def _cursor_row(store: Store, h: Histories) -> tuple | None:
    if h.method != "sql" or store.sqlite_path is None or not h._cursor:
        return None
    with store.read_only() as con:
        return row_at(con, h._cursor)


def _from_disk(uri: str, exact: tuple) -> Loaded | None:
    """The histories a previous dashboard process kept for exactly this selection, if still valid for
    the store; they are then brought up to date like any other (only rows written since are read)."""
    disk = disk_cache()
    entry = disk.get("histories", exact) if disk is not None else None
    if not isinstance(entry, Persisted):
        return None
    store = get_store(uri)
    if entry.cursor_row != _cursor_row(store, entry.histories):
        log.info("rldiag: the cached histories of %d run(s) no longer match the store (replaced or rewritten); "
                 "reading them again", len(exact[1]))
        return None
    return Loaded(replace(entry.histories, store_uri=store.uri), (*exact, entry.token), float("-inf"))


def _to_disk(uri: str, exact: tuple, loaded: Loaded) -> None:
    disk = disk_cache()
    if disk is None:
        return
    h = loaded.histories
    disk.put_later("histories", exact, Persisted(replace(h, store_uri="", fetched=0), loaded.stamp[3],
                                                 _cursor_row(get_store(uri), h)))


def histories(uri: str, run_ids: Sequence[str], metric_keys: Sequence[str], *, live: bool = False,
              force: bool = False) -> Loaded:
    """Every point of `metric_keys` for `run_ids`. Served from memory (also from an entry of the same runs
    whose keys include these); new rows are fetched incrementally when `live` (a picked run is RUNNING),
    when `force`, or after IDLE_RELOAD_S. A first read from the store draws a `ProgressBar`."""
    cache = _history_cache()
    exact = (uri, tuple(run_ids), tuple(sorted(metric_keys)))
    with cache.lock:
        exact = cache.covering(exact) or exact
        prev = cache.previous(uri, exact[2], exact)
    if prev is None:
        prev = _from_disk(uri, exact)
    fresh_enough = prev is not None and time.monotonic() - prev.loaded_at < IDLE_RELOAD_S
    if prev is not None and prev.stamp[:3] == exact and fresh_enough and not (live or force):
        return prev
    bar = ProgressBar()
    try:
        h = load_histories(get_store(uri), list(run_ids), list(metric_keys),
                           previous=prev.histories if prev is not None else None, progress=bar)
    finally:
        bar.close()
    unchanged = prev is not None and prev.stamp[:3] == exact and h.fetched == 0
    stamp = prev.stamp if unchanged else (*exact, uuid.uuid4().hex)  # unique across processes: keys the disk too
    loaded = Loaded(h, stamp, time.monotonic())
    with cache.lock:
        cache.entries[exact] = loaded
        cache.entries.move_to_end(exact)
        while len(cache.entries) > HISTORY_ENTRIES:
            cache.entries.popitem(last=False)
    if not unchanged:
        _to_disk(uri, exact, loaded)
    return loaded


class ProgressBar:
    """A `load_histories(progress=)` callback: a progress bar (runs and points read), drawn once a point
    has been read; `close()` removes it. A read from memory, or of new rows only, never calls it, and a
    read that finds no point (keys no picked run logged) draws nothing: nothing shows."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, p: Progress) -> None:
        runs = f"{p.runs_done} of {p.runs} runs" if p.runs_done is not None else f"{p.runs} runs"
        text = (f"Reading metric histories from the store (the first load; later ones are from the cache): "
                f"{runs}, {p.points:,} points read")
        if self.bar is None and p.points:
            self.bar = st.progress(p.fraction, text=text)
        elif self.bar is not None:
            self.bar.progress(p.fraction, text=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.empty()


def _persisted(kind: str, key: tuple, build):
    """`build()`, kept on disk under `key` (which must name everything the value follows from)."""
    disk = disk_cache()
    if disk is not None and (hit := disk.get(kind, key)) is not None:
        return hit
    value = build()
    if disk is not None:
        disk.put_later(kind, key, value)
    return value


COMPARISON_TTL_S = 3600  # a comparison stays in memory this long (and on disk until pruned)
COMPARISON_ENTRIES = 64


def _comparison_inputs(uri: str, loaded: Loaded, reference_ids: tuple[str, ...], candidate_ids: tuple[str, ...],
                       metric_keys: tuple[str, ...], version: tuple) -> tuple[tuple, dict, dict]:
    """The cache key of a `comparison` (everything it follows from), the runs' params and the alerts."""
    cfgs = configs(uri, reference_ids + candidate_ids)
    alerts = alert_events(uri, candidate_ids, version)
    params = {r: dict(c.params) for r, c in cfgs.items()}
    inputs = hashlib.sha256(repr((sorted((r, sorted(p.items())) for r, p in params.items()), alerts)).encode())
    key = (loaded.stamp, reference_ids, candidate_ids, metric_keys, inputs.hexdigest(),
           repr(DivergenceConfig.from_env()))
    return key, params, alerts


@st.cache_resource(max_entries=1, show_spinner=False)
def _compared() -> tuple[threading.Lock, OrderedDict]:
    """The keys of the comparisons in memory (made or read by this process), with since when."""
    return threading.Lock(), OrderedDict()


def comparison_cached(uri: str, loaded: Loaded, reference_ids: tuple[str, ...], candidate_ids: tuple[str, ...],
                      metric_keys: tuple[str, ...], version: tuple = ()) -> bool:
    """Whether `comparison` of the same arguments comes from a cache (this process's memory, or the disk
    cache's file for it): cheap, so the Compare page can draw its charts before a comparison it computes."""
    key = _comparison_inputs(uri, loaded, reference_ids, candidate_ids, metric_keys, version)[0]
    lock, seen = _compared()
    with lock:
        if time.monotonic() - seen.get(key, float("-inf")) < COMPARISON_TTL_S:
            return True
    disk = disk_cache()
    return disk is not None and disk.path("comparison", key).is_file()


def comparison(uri: str, loaded: Loaded, reference_ids: tuple[str, ...], candidate_ids: tuple[str, ...],
               metric_keys: tuple[str, ...], version: tuple = ()) -> Comparison:
    """`rldiag.app.analysis.comparison.compare` of the candidates on `metric_keys`, from `loaded` (loaded
    with `load_keys`), the runs' params and the candidates' alerts (`version`: `runs_version`); kept until
    new rows arrive or any of those changes, and on disk for the next dashboard process."""
    key, params, alerts = _comparison_inputs(uri, loaded, reference_ids, candidate_ids, metric_keys, version)
    # shown only where it takes over half a second (st.spinner's delay): a first load, not one from a cache
    with st.spinner(f"Comparing {len(candidate_ids)} candidate(s) with the reference on {len(metric_keys)} "
                    "metrics (first load; later loads are from the cache)...", show_time=True):
        found = _comparison(key, loaded.histories, params, alerts)
    lock, seen = _compared()
    with lock:  # when it entered the memory cache (_comparison's ttl counts from then)
        now, since = time.monotonic(), seen.pop(key, float("-inf"))
        seen[key] = since if now - since < COMPARISON_TTL_S else now
        while len(seen) > COMPARISON_ENTRIES:
            seen.popitem(last=False)
    return found


@st.cache_data(ttl=COMPARISON_TTL_S, max_entries=COMPARISON_ENTRIES, show_spinner=False)
def _comparison(key: tuple, _h: Histories, _params, _alerts) -> Comparison:
    refs, cands, metric_keys = key[1], key[2], key[3]
    options = CompareOptions(metric_keys, DivergenceConfig.from_env())
    return _persisted("comparison", key, lambda: compare(_h, refs, cands, options, params=_params, alerts=_alerts))


@st.cache_data(ttl=3600, max_entries=256, show_spinner=False)
def figure(stamp: tuple, _h: Histories, key: str, run_ids: tuple[str, ...], labels: tuple[tuple[str, str], ...],
           reference_ids: tuple[str, ...], colors: tuple[tuple[str, str], ...], _divergences: Mapping[str, Divergence],
           options: ChartOptions) -> dict:
    """`metric_figure` of one metric as its plotly dict, kept until new rows arrive (`stamp`): a page
    load after the first redraws decimated figures instead of decimating every point again.
    `_divergences` follow from `stamp` and the references and candidates. A dict, not the `go.Figure`:
    unpickling a figure from the cache validates every property again (0.15 s a chart)."""
    return metric_figure(key, _h.for_key(key, run_ids), labels=dict(labels), reference_ids=reference_ids,
                         colors=dict(colors), divergences=_divergences, options=options,
                         bands=tested_bands(_h, key, reference_ids, _divergences)).to_plotly_json()


@st.cache_data(ttl=3600, max_entries=64, show_spinner=False)
def grid(stamp: tuple, _h: Histories, metric_keys: tuple[str, ...], run_ids: tuple[str, ...],
         labels: tuple[tuple[str, str], ...], reference_ids: tuple[str, ...], colors: tuple[tuple[str, str], ...],
         _divergences: Mapping[str, Mapping[str, Divergence]], options: ChartOptions) -> str:
    """The `figure` of each of `metric_keys` as a panel of one figure (`grid_figure`), as the plotly
    JSON the Compare page draws; `_divergences` maps a key to its `{candidate: Divergence}` (they follow
    from `stamp`, the runs and the detector's options: the disk cache's key names those)."""

    def build() -> str:
        figures = [figure(stamp, _h, key, run_ids, labels, reference_ids, colors, _divergences.get(key, {}), options)
                   for key in metric_keys]
        return plotly.io.to_json(grid_figure(figures), validate=False)

    key = (stamp, metric_keys, run_ids, labels, reference_ids, colors, repr(options), repr(DivergenceConfig.from_env()))
    return _persisted("grid", key, build)


# ---- pure helpers the pages share ---------------------------------------------------------------

def available_metrics(runs_df: pd.DataFrame, run_ids: Sequence[str]) -> list[str]:
    """Canonical keys that any of `run_ids` logged, in the canonical table's order."""
    logged = set().union(*(set(m) for m in runs_df.loc[runs_df.run_id.isin(run_ids), "metrics"]))
    return [k for k in keys.CANONICAL_METRICS if k in logged]


def divergence_rows(divs: Mapping[str, Mapping[str, Divergence]], labels: Mapping[str, str]) -> pd.DataFrame:
    """One row per departure from the reference band, earliest (lead) onset first (the rest,
    within the band or on too few steps, per candidate: `rldiag.app.analysis.divergence.summarize`)."""
    # a metric that left the band twice: a row per departure, the verdict's first, kept together at its onset
    rows = [{"candidate": labels.get(c, c), "metric": key, "onset_step": v.onset_step, "alert_step": v.alert_step,
             "kind": v.kind, "end_step": v.end_step, "delta": table_delta(v.kind, v.delta), "size": v.size or "-",
             "delta_sigma": sigma_cell(v.delta_sigma), "first_nonfinite_step": v.first_nonfinite_step,
             "_at": d.lead.onset_step}
            for key, by_cand in divs.items() for c, d in by_cand.items() if d.diverged for v in departure_views(d)]
    cols = ["candidate", "metric", "onset_step", "alert_step", "kind", "end_step", "delta", "size", "delta_sigma",
            "first_nonfinite_step"]
    return pd.DataFrame(rows, columns=[*cols, "_at"]).sort_values(["_at", "candidate"], kind="stable",
                                                                  ignore_index=True)[cols]


def with_grad_keys(metric_keys: Sequence[str]) -> tuple[str, ...]:
    """`metric_keys` and the metrics behind every "non-finite gradients" headline (grad/norm under any
    trainer's name, grad/finite) and every "no valid tokens" one (batch/valid_tokens, TRL's
    completions/clipped_ratio), loaded whether charted or not."""
    return tuple(dict.fromkeys([*metric_keys, keys.GRAD_NORM, keys.GRAD_FINITE, keys.GRAD_FOUND, keys.BATCH_TOKENS,
                                     keys.TRL_CLIPPED_RATIO]))


def config_rows(cfgs: Mapping[str, RunConfig], labels: Mapping[str, str], *, show_identical: bool) -> pd.DataFrame:
    """`config_diff` rows, differing ones first (engine parity, then batch/accumulation, then the rest),
    then, with `show_identical`, the rows every run agrees on; a `differs` column tells them apart."""
    diff = config_diff(cfgs, labels=labels, only_differing=True)
    diff.insert(0, "differs", True)
    if not show_identical:
        return diff
    full = config_diff(cfgs, labels=labels, only_differing=False)
    same = full[~full.set_index(["kind", "name"]).index.isin(diff.set_index(["kind", "name"]).index)]
    same.insert(0, "differs", False)
    return pd.concat([diff, same], ignore_index=True)


def clear_caches() -> None:
    """Forget cached queries; histories stay in memory but fetch what is new on their next use."""
    for loader in (experiments, runs, configs, alert_events):
        loader.clear()
    cache = _history_cache()
    with cache.lock:
        for k, v in cache.entries.items():
            cache.entries[k] = Loaded(v.histories, v.stamp, float("-inf"))
