"""Full metric histories of many runs, loaded the fastest correct way per store, refreshed incrementally.

    h = load_histories("sqlite:///mlruns.db", run_ids, [keys.GRAD_NORM, keys.RATIO_MEAN])
    h.get(run_id, keys.GRAD_NORM)        # a Trace: steps, values (NaN/+inf/-inf told apart)
    h.frame(keys.GRAD_NORM)              # wide DataFrame: one column per run, index step
    h = load_histories(uri, run_ids, ks, previous=h)   # only what is new since h
    h = load_histories(uri, run_ids, ks, progress=print)  # a Progress after each part read (SQLite)

Every trace is keyed by the canonical metric key: a TRL run's `grad_norm` is `grad/norm` here (the
alias table in `rldiag.collectors.keys`); where a run logged both names, the canonical one wins.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from rldiag.app.data import readers
from rldiag.app.data.readers import Latest, Pair
from rldiag.app.data.store import Store, require_store
from rldiag.app.data.trace import RawSeries, Trace, build_trace
from rldiag.app.errors import RunNotFound
from rldiag.collectors.keys import ALIASES, INF_FLAG_PREFIX, canonical_key, inf_flag_key

Method = Literal["auto", "sql", "pgsql", "rest", "client"]
METHODS: tuple[str, ...] = ("auto", "sql", "pgsql", "rest", "client")
SLICE_ROWS = 1_000_000  # a first read with `progress` reads the table in rowid slices this long (about 1 s each)


class Progress(NamedTuple):
    """How far a first read from SQLite is (`load_histories(..., progress=)`)."""

    points: int  # rows read so far
    runs: int  # runs being read
    runs_done: int | None  # runs read in full (None: read in rowid slices, every run at once)
    fraction: float  # of the read, 0 to 1


def logged_keys_for(keys: Iterable[str]) -> frozenset[str]:
    """The keys to read for canonical `keys`: each key, its aliases, and their inf flags."""
    out: set[str] = set()
    for k in keys:
        c = canonical_key(k)
        names = {c, *(a for a, target in ALIASES.items() if target == c)}
        out |= names | {inf_flag_key(n) for n in names}
    return frozenset(out)


def _priority(logged: str) -> tuple[int, int]:
    """Canonical name first, then aliases in the order of the alias table."""
    if logged not in ALIASES:
        return (0, 0)
    return (1, list(ALIASES).index(logged))


@dataclass(frozen=True, eq=False)
class Histories:
    """Per-run, per-metric traces, plus what an incremental reload needs. Treat as read-only."""

    store_uri: str
    method: str
    traces: dict[tuple[str, str], Trace]  # (run_id, canonical key) -> the trace shown
    run_ids: tuple[str, ...]
    _logged: dict[Pair, Trace] = field(repr=False)  # every logged key, aliases not chosen included
    _flags: dict[Pair, RawSeries] = field(repr=False)  # (run, flagged key) -> its inf-flag rows
    _coverage: dict[str, frozenset[str] | None] = field(repr=False)  # run -> keys loaded (None: all)
    _cursor: int = field(default=0, repr=False)  # SQLite: rows up to this rowid are loaded
    _latest: dict[Pair, Latest] = field(default_factory=dict, repr=False)  # server/client: latest seen
    _rows: dict[Pair, int] = field(default_factory=dict, repr=False)  # server: raw rows loaded
    fetched: int = 0  # rows this load read from the store (small on an incremental reload)

    @property
    def keys(self) -> list[str]:
        """Canonical keys present in at least one run, sorted."""
        return sorted({k for _, k in self.traces})

    def get(self, run_id: str, key: str) -> Trace | None:
        """The trace of `key` (canonical or alias) in `run_id`, or None if the run did not log it."""
        return self.traces.get((run_id, canonical_key(key)))

    def for_key(self, key: str, run_ids: Sequence[str] | None = None) -> dict[str, Trace]:
        """`{run_id: trace}` for one metric, in `run_ids` order (None: every run, in load order), runs without it
        left out. An empty `run_ids` is no run (a group without references has none), never every run."""
        key = canonical_key(key)
        ids = self.run_ids if run_ids is None else run_ids
        return {r: self.traces[(r, key)] for r in ids if (r, key) in self.traces}

    def frame(self, key: str, run_ids: Sequence[str] | None = None):
        """Wide DataFrame for one metric: index step, one column per run (see `rldiag.app.data.align.align_by_step`)."""
        from rldiag.app.data.align import align_by_step

        return align_by_step(self.for_key(key, run_ids)).frame()

    def to_long(self):
        """Long DataFrame: run_id, key, source_key, step, value, timestamp (for export, not for charts)."""
        import pandas as pd

        parts = [pd.DataFrame({"run_id": t.run_id, "key": t.key, "source_key": t.source_key, "step": t.steps,
                               "value": t.values, "timestamp": t.timestamps}) for t in self.traces.values()]
        if not parts:
            return pd.DataFrame(columns=["run_id", "key", "source_key", "step", "value", "timestamp"])
        return pd.concat(parts, ignore_index=True)

    def covers(self, run_id: str, logged: frozenset[str] | None) -> bool:
        have = self._coverage.get(run_id, frozenset())
        return have is None or (logged is not None and logged <= have)


def pick_method(store: Store, method: Method = "auto") -> str:
    """`auto`: SQL for a SQLite file (a server's too, where its backend file is given), REST for a
    server, MLflow's client otherwise."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if method == "auto":
        if store.postgres_dsn is not None:
            return "pgsql"
        return "sql" if store.sqlite_path is not None else {"rest": "rest"}.get(store.kind, "client")
    if method == "sql" and store.sqlite_path is None:
        raise ValueError(f"method='sql' reads SQLite files only; {store.uri!r} is a {store.kind} store"
                         f"{' without a backend file (--backend-store-uri)' if store.kind == 'rest' else ''}: "
                         "use method='auto'")
    if method == "pgsql" and store.postgres_dsn is None:
        raise ValueError(f"method='pgsql' reads a server's PostgreSQL backend, given as --backend-store-uri; "
                         f"{store.uri!r} has none: use method='auto'")
    if method == "rest" and store.kind != "rest":
        raise ValueError(f"method='rest' needs an http(s) tracking server; {store.uri!r} is a {store.kind} "
                         "store: use method='auto'")
    return method


def load_histories(
    store: Store,
    run_ids: Sequence[str],
    keys: Iterable[str] | None = None,
    *,
    previous: Histories | None = None,
    method: Method = "auto",
    max_workers: int = 8,
    progress: Callable[[Progress], None] | None = None,
) -> Histories:
    """Every point of `keys` (canonical or alias names; None: every key) for `run_ids`.

    With `previous` (an earlier result for the same store), only rows written since are fetched for
    the runs and keys it already holds. SQLite: rows after the last rowid read. Server, its PostgreSQL
    backend and client: keys whose latest (step, timestamp) moved; the server and PostgreSQL paths then
    ask only for rows past those already loaded, the client path reloads those keys. (Off SQLite, a point written with an older
    step and timestamp than a key's latest shows up only on a reload without `previous`.)

    `progress` (SQLite, named `keys`): the runs not in `previous` are read in parts, one run at a time
    or, where the reader scans the whole table anyway, in rowid slices of SLICE_ROWS, and `progress`
    gets a `Progress` after each part; the rows read are the same.
    """
    require_store(store)
    how = pick_method(store, method)
    run_ids = tuple(dict.fromkeys(run_ids))
    wanted = None if keys is None else logged_keys_for(keys)
    if previous is not None and (previous.store_uri != store.uri or previous.method != how):
        previous = None
    known = [r for r in run_ids if previous is not None and previous.covers(r, wanted)]
    fresh = [r for r in run_ids if r not in known]

    new: dict[Pair, RawSeries]
    if how == "sql":
        if fresh:
            missing = readers.missing_runs_sql(store, fresh)
            if missing:
                raise RunNotFound(f"run id(s) {missing} are not in the store at {store.uri!r}; "
                                  "check the ids (the dashboard's Runs page lists the runs there)")
        with store.read_only() as con:
            upto = readers.max_rowid(con)
        new = (_read_sql_parts(store, fresh, wanted, upto, progress) if progress is not None and wanted is not None
               else readers.read_sql(store, fresh, wanted, upto=upto)[0])
        if known:
            inc, _ = readers.read_sql(store, known, wanted, after_rowid=previous._cursor, upto=upto)
            new.update(inc)
        latest, rows = {}, {}
    else:
        latest_by_run = readers.latest_client(store, run_ids, max_workers=max_workers)
        latest = {(r, k): v for r, ks in latest_by_run.items() for k, v in ks.items()
                  if wanted is None or k in wanted}
        todo = [p for p in latest if previous is None or p[0] in fresh or previous._latest.get(p) != latest[p]]
        rows = {p: n for p, n in (previous._rows.items() if previous else ()) if p[0] in known}
        if how in ("rest", "pgsql"):
            offsets = [(r, k, rows.get((r, k), 0) if r in known else 0) for r, k in todo]
            read = readers.read_rest if how == "rest" else readers.read_postgres
            new = read(store, offsets, max_workers=max_workers)
            for r, k, off in offsets:
                rows[(r, k)] = off + len(new[(r, k)].steps)
        else:
            new = readers.read_client(store, todo, max_workers=max_workers)
            replace = {p for p in todo if p[0] in known}  # reloaded whole: drop the old rows
            previous = _without(previous, replace) if previous is not None and replace else previous
        upto = 0

    return _assemble(store.uri, how, run_ids, known, wanted, previous, new, upto, latest, rows)


def _read_sql_parts(store: Store, run_ids: Sequence[str], wanted: frozenset[str], upto: int,
                    progress: Callable[[Progress], None]) -> dict[Pair, RawSeries]:
    """`readers.read_sql(store, run_ids, wanted, upto=upto)` in parts, `progress` called after each: rowid
    slices where the reader scans the table in rowid order anyway (`readers._full_scan`), else one run at
    a time (an index lookup each, as one query for them all would do)."""
    if not run_ids or upto <= 0:
        return {}
    with store.read_only() as con:
        by_rowid = readers._full_scan(con, run_ids, sorted(wanted), 0, upto)  # the reader's own rule
    parts: list[dict[Pair, RawSeries]] = []
    points = 0
    if by_rowid:
        bounds = [*range(0, upto, SLICE_ROWS), upto]
        for lo, hi in itertools.pairwise(bounds):
            parts.append(readers.read_sql(store, run_ids, wanted, after_rowid=lo, upto=hi)[0])
            points += sum(len(s.steps) for s in parts[-1].values())
            progress(Progress(points, len(run_ids), None, hi / upto))
    else:
        for i, run in enumerate(run_ids, 1):
            parts.append(readers.read_sql(store, [run], wanted, upto=upto)[0])
            points += sum(len(s.steps) for s in parts[-1].values())
            progress(Progress(points, len(run_ids), i, i / len(run_ids)))
    pairs = dict.fromkeys(p for part in parts for p in part)
    return {p: RawSeries.concat([part[p] for part in parts if p in part]) for p in pairs}


def _without(h: Histories, pairs: set[Pair]) -> Histories:
    flagged = {(r, k[len(INF_FLAG_PREFIX):]) for r, k in pairs if k.startswith(INF_FLAG_PREFIX)}
    return Histories(h.store_uri, h.method, h.traces, h.run_ids,
                     {p: t for p, t in h._logged.items() if p not in pairs},
                     {p: f for p, f in h._flags.items() if p not in flagged},
                     h._coverage, h._cursor, h._latest, h._rows)


def _assemble(uri, how, run_ids, known, wanted, previous, new, cursor, latest, rows) -> Histories:
    keep = set(known)
    logged = {p: t for p, t in (previous._logged.items() if previous else ()) if p[0] in keep
              and (wanted is None or p[1] in wanted)}
    flags = {p: f for p, f in (previous._flags.items() if previous else ()) if p[0] in keep}
    touched: set[Pair] = set()
    for (run, key), series in new.items():
        if key.startswith(INF_FLAG_PREFIX):
            target = (run, key[len(INF_FLAG_PREFIX):])
            flags[target] = RawSeries.concat([flags.get(target, RawSeries.empty()), series])
            touched.add(target)
        else:
            touched.add((run, key))
    for pair in touched:
        old = logged.get(pair)
        raw = RawSeries.concat([old.as_raw() if old else RawSeries.empty(), new.get(pair, RawSeries.empty())])
        if len(raw.steps):
            logged[pair] = build_trace(pair[0], canonical_key(pair[1]), pair[1], raw, flags.get(pair))
    traces: dict[tuple[str, str], Trace] = {}
    for (run, key), trace in sorted(logged.items(), key=lambda kv: _priority(kv[0][1])):
        traces.setdefault((run, canonical_key(key)), trace)
    ordered = {(r, k): traces[(r, k)] for r in run_ids for k in sorted({k for rr, k in traces if rr == r})}
    return Histories(uri, how, ordered, tuple(run_ids), logged, flags, {r: wanted for r in run_ids}, cursor,
                     dict(latest), rows, sum(len(s.steps) for s in new.values()))


def nonfinite_table(h: Histories, run_ids: Sequence[str] | None = None):
    """One row per (run, metric) with any NaN/inf: counts and first steps, for a "NaN events" view."""
    import pandas as pd

    rows = []
    for (run, key), t in h.traces.items():
        if run_ids is not None and run not in run_ids:
            continue
        nf = t.nonfinite()
        if nf.count:
            rows.append({"run_id": run, "key": key, "source_key": t.source_key, "nan": len(nf.nan),
                         "posinf": len(nf.posinf), "neginf": len(nf.neginf), "first_step": nf.first_step,
                         "steps": np.sort(np.concatenate(list(nf))).tolist()})
    return pd.DataFrame(rows, columns=["run_id", "key", "source_key", "nan", "posinf", "neginf", "first_step",
                                       "steps"])

