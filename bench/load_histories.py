"""Full metric histories, 10 runs x 8 metrics x 20k steps (1.6 M points) from one SQLite store.

    python -m bench.load_histories [--runs 10] [--metrics 8] [--steps 20000] [--rounds 3] [--skip-client]
                                   [--server-runs N]

Three ways, each timed to the same end point (every point of every run's 8 metrics in memory as
numbers, NaN as NaN):
- rldiag: `rldiag.app.data.histories.load_histories` (read-only SQL, one query), building per-run, per-metric
  numpy traces with inf restored and steps aligned;
- MLflow: `MlflowClient.get_metric_history` per run per metric (what a user would write);
- raw SQL (the floor): `pandas.read_sql` of the store's `metrics` table for those runs and keys.
Then a warm reload: `load_histories(open_store(...), previous=h)` after 8 new steps were written to one run,
which fetches only the new rows. With `--server-runs N`, a local `mlflow server --workers 1` serves a
copy of the same file and the first N runs are read three ways: rldiag over REST (parallel
`get-history`), rldiag given the server's backend file (`--backend-store-uri`: histories read from
the file, everything else through the server), and `MlflowClient.get_metric_history` over REST.
With `--postgres-runs N`, the same for a server over a real PostgreSQL (Debian's, started on
127.0.0.1 by `tests/helpers/postgres.py`) holding a copy of the first N runs: rldiag over REST, rldiag
reading the database directly (`--backend-store-uri postgresql://...`), and the client.

The store is made once by MLflow (schema, experiment, runs, tags) and filled by direct SQL inserts
(log_batch would take minutes), then cached under /tmp; a NaN, a +inf (with rldiag's flag) and a -inf
are planted in one run's grad/norm.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, metric_store, quiet_mlflow, summary_row, write_result
from rldiag.app.data.store import open_store
from rldiag.collectors import keys

NAME = "load_histories"
GOAL = 1.3  # rldiag <= 1.3x the raw SQL read
WARM_GOAL_S = 0.5
SERVER_GOAL = 5.0  # over a local server: rldiag at least 5x faster than MlflowClient
CACHE = Path(tempfile.gettempdir()) / "rldiag-bench"
METRICS = (keys.CLIP_RATE, keys.RATIO_MEAN, keys.KL_NEW_OLD, keys.ENTROPY, keys.REWARD_MEAN,
           keys.MISMATCH_LOGPROB_MEAN, keys.GRAD_NORM, keys.LOSS)
EXPERIMENT = "bench-load-histories"
T0_MS = 1_700_000_000_000


def _rows(run_id: str, run_no: int, metric_keys: tuple[str, ...], steps: int, start: int = 0):
    rng = np.random.default_rng(run_no)
    step = np.arange(start, start + steps)
    ts = T0_MS + step * 100
    for k_no, key in enumerate(metric_keys):
        vals = np.cumsum(rng.normal(0, 0.01, steps)) + k_no
        for s, t, v in zip(step.tolist(), ts.tolist(), vals.tolist()):
            yield (key, v, t, run_id, s, 0)


def build_store(path: Path, n_runs: int, n_metrics: int, steps: int) -> tuple[str, list[str]]:
    """An MLflow SQLite store at `path` holding the benchmark's runs; returns (uri, run_ids).

    A random walk per run and metric; run 3's grad/norm is NaN at a quarter, +inf at half and -inf at
    three quarters of the steps."""
    bad_run = min(3, n_runs - 1)

    def series(run_no: int, key_no: int, key: str) -> np.ndarray:
        vals = np.cumsum(np.random.default_rng(run_no * 1000 + key_no).normal(0, 0.01, steps)) + key_no
        if run_no == bad_run and key == keys.GRAD_NORM:
            vals[[steps // 4, steps // 2, 3 * steps // 4]] = [np.nan, np.inf, -np.inf]
        return vals

    runs = [(f"run-{i:02d}", {keys.TAG_SEED: str(i)}, {}) for i in range(n_runs)]
    return metric_store(path, EXPERIMENT, runs, METRICS[:n_metrics], steps, series)

def append_steps(path: Path, run_id: str, metric_keys: tuple[str, ...], start: int, n: int) -> None:
    """Write `n` more steps to one run, as a live run would (direct SQL, one transaction)."""
    with sqlite3.connect(path) as con:
        con.executemany("INSERT INTO metrics (key, value, timestamp, run_uuid, step, is_nan) VALUES (?,?,?,?,?,?)",
                        _rows(run_id, 99, metric_keys, n, start=start))


def time_rldiag(uri: str, ids: list[str], metric_keys) -> tuple[float, object]:
    from rldiag.app.data.histories import load_histories

    t0 = time.perf_counter()
    h = load_histories(open_store(uri), ids, metric_keys)
    return time.perf_counter() - t0, h


def time_raw_sql(path: Path, ids: list[str], metric_keys) -> tuple[float, int]:
    import pandas as pd

    t0 = time.perf_counter()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
        q = (f"SELECT run_uuid, key, step, timestamp, value, is_nan FROM metrics "
             f"WHERE run_uuid IN ({','.join('?' * len(ids))}) AND key IN ({','.join('?' * len(metric_keys))})")
        df = pd.read_sql(q, con, params=[*ids, *metric_keys])
    return time.perf_counter() - t0, len(df)


def time_client(uri: str, ids: list[str], metric_keys) -> tuple[float, int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    t0 = time.perf_counter()
    n = sum(len(client.get_metric_history(r, k)) for r in ids for k in metric_keys)
    return time.perf_counter() - t0, n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--metrics", type=int, default=8, choices=range(1, len(METRICS) + 1))
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of rldiag and raw SQL (alternating)")
    ap.add_argument("--skip-client", action="store_true", help="skip MlflowClient (about a minute)")
    ap.add_argument("--server-runs", type=int, default=0, help="also read N runs over a local mlflow server")
    ap.add_argument("--postgres-runs", type=int, default=0,
                    help="also read N runs over a local mlflow server backed by PostgreSQL")
    args = ap.parse_args(argv)
    quiet_mlflow()

    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"histories-{args.runs}x{args.metrics}x{args.steps}.db"
    t0 = time.perf_counter()
    uri, ids = build_store(path, args.runs, args.metrics, args.steps)
    print(f"store {path} ({path.stat().st_size / 1e6:.0f} MB) ready in {time.perf_counter() - t0:.1f} s")
    metric_keys = METRICS[: args.metrics]
    expected = args.runs * args.metrics * args.steps

    time_rldiag(uri, ids, metric_keys)  # page cache warm-up for both readers
    rl, raw = [], []
    for _ in range(args.rounds):
        s, h = time_rldiag(uri, ids, metric_keys)
        rl.append(s)
        s, n_raw = time_raw_sql(path, ids, metric_keys)
        raw.append(s)
    points = sum(len(t) for t in h.traces.values())
    bad = h.get(ids[min(3, args.runs - 1)], keys.GRAD_NORM).nonfinite()
    print(f"rldiag loader     {statistics.median(rl):7.2f} s  ({points} points; run 3 grad/norm NaN at "
          f"{bad.nan.tolist()}, +inf at {bad.posinf.tolist()}, -inf at {bad.neginf.tolist()})")
    print(f"raw pandas SQL    {statistics.median(raw):7.2f} s  ({n_raw} rows)")
    ratio = statistics.median(rl) / statistics.median(raw)
    print(f"ratio rldiag / raw SQL: {ratio:.2f}x (goal <= {GOAL}x)")

    start = args.steps
    append_steps(path, ids[0], metric_keys, start, 8)
    t0 = time.perf_counter()
    h2 = load_histories_again(uri, ids, metric_keys, h)
    warm = time.perf_counter() - t0
    new_points = sum(len(t) for t in h2.traces.values()) - points
    print(f"warm reload       {warm:7.3f} s  ({new_points} new points; goal <= {WARM_GOAL_S} s)")
    with sqlite3.connect(path) as con:  # leave the cached store as it was built
        con.execute("DELETE FROM metrics WHERE step >= ?", (start,))

    client_s = None
    if not args.skip_client:
        client_s, n_client = time_client(uri, ids, metric_keys)
        print(f"MlflowClient      {client_s:7.2f} s  ({n_client} points, get_metric_history per run per metric)")
        print(f"speed-up rldiag vs MlflowClient: {client_s / statistics.median(rl):.1f}x")

    server = time_server(path, ids[: args.server_runs], metric_keys) if args.server_runs else None
    postgres = time_postgres(path, ids[: args.postgres_runs], metric_keys) if args.postgres_runs else None

    result = {
        "server": server, "postgres": postgres,
        "env": env_info(), "runs": args.runs, "metrics": args.metrics, "steps": args.steps, "points": expected,
        "rldiag_s": rl, "raw_sql_s": raw, "ratio_vs_raw_sql": ratio, "warm_reload_s": warm,
        "warm_new_points": new_points, "client_s": client_s, "complete": points == expected,
        "summary": [
            summary_row("full histories, SQLite", f"{statistics.median(rl):.2f} s",
                        f"raw SQL {statistics.median(raw):.2f} s", f"{ratio:.2f}x", f"<= {GOAL}x", ratio <= GOAL),
            summary_row("warm reload, SQLite", f"{warm:.3f} s", "-", "-", f"<= {WARM_GOAL_S} s", warm <= WARM_GOAL_S),
            *(_server_rows(server, "SQLite-backed") if server else []),
            *(_server_rows(postgres, "PostgreSQL-backed") if postgres else []),
        ],
    }
    print(f"results: {write_result(NAME, result)}")
    return result


def time_server(path: Path, ids: list[str], metric_keys) -> dict:
    """rldiag over REST, rldiag on the server's SQLite file, and MlflowClient: one local server over a
    copy of the store."""
    import shutil

    from bench._server import MlflowServer

    root = Path(tempfile.mkdtemp(prefix="rldiag-bench-server-"))
    shutil.copyfile(path, root / "server.db")
    try:
        with MlflowServer(root) as server:
            return _time_reads(server.uri, f"sqlite:///{server.db}", ids, metric_keys, "SQLite-backed server")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _time_reads(uri: str, backend_uri: str, ids: list[str], metric_keys, what: str) -> dict:
    """rldiag over REST, rldiag given the backend store, and MlflowClient, one after the other."""
    from mlflow.tracking import MlflowClient

    from rldiag.app.data.histories import load_histories
    from rldiag.app.data.store import open_store

    load_histories(open_store(uri), ids[:1], metric_keys[:1])  # first request: lazy imports server-side
    t0 = time.perf_counter()
    h = load_histories(open_store(uri), ids, metric_keys)
    rl = time.perf_counter() - t0
    t0 = time.perf_counter()
    hb = load_histories(open_store(uri, backend_store_uri=backend_uri), ids, metric_keys)
    rb = time.perf_counter() - t0
    client = MlflowClient(uri)
    t0 = time.perf_counter()
    n = sum(len(client.get_metric_history(r, k)) for r in ids for k in metric_keys)
    cl = time.perf_counter() - t0
    points = sum(len(t) for t in h.traces.values())
    assert hb.method in ("sql", "pgsql") and points == sum(len(t) for t in hb.traces.values()) == n, \
        "REST, backend-store and client reads differ"
    print(f"{what}, {len(ids)} runs: rldiag REST {rl:.2f} s ({points} points), rldiag on the backend store "
          f"{rb:.2f} s, MlflowClient {cl:.2f} s; speed-up {cl / rl:.1f}x (REST), {cl / rb:.1f}x (backend store)")
    return {"runs": len(ids), "rldiag_s": rl, "rldiag_backend_s": rb, "client_s": cl, "speedup": cl / rl,
            "speedup_backend": cl / rb, "points": points}


def _server_rows(r: dict, backend: str) -> list:
    """Summary rows of `time_server` / `time_postgres`: REST and the backend store read directly."""
    what = f"full histories over a {backend} mlflow server, {r['runs']} runs"
    client = f"MlflowClient {r['client_s']:.2f} s"
    return [
        summary_row(f"{what}: REST", f"{r['rldiag_s']:.2f} s", client, f"{r['speedup']:.1f}x",
                    f">= {SERVER_GOAL:g}x", r["speedup"] >= SERVER_GOAL),
        summary_row(f"{what}: backend store given (--backend-store-uri)", f"{r['rldiag_backend_s']:.2f} s",
                    client, f"{r['speedup_backend']:.1f}x", f">= {SERVER_GOAL:g}x", r["speedup_backend"] >= SERVER_GOAL),
    ]


# MLflow's tables that hold one experiment's runs, copied SQLite -> PostgreSQL (same columns in both).
_COPY_TABLES = ("experiments", "runs", "tags", "params", "metrics", "latest_metrics")


def _copy_runs_to_postgres(path: Path, ids: list[str], dsn: str) -> None:
    """Copy `ids` (and their experiment) from the SQLite store into an MLflow PostgreSQL database whose
    schema a server has just created."""
    import csv
    import io

    import psycopg2

    src = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    exp = src.execute(f"SELECT DISTINCT experiment_id FROM runs WHERE run_uuid IN ({','.join('?' * len(ids))})",
                      ids).fetchall()
    with psycopg2.connect(dsn) as con, con.cursor() as cur:
        for table in _COPY_TABLES:
            if table == "experiments":
                where, params = f"experiment_id IN ({','.join('?' * len(exp))})", [e for (e,) in exp]
            else:
                where, params = f"run_uuid IN ({','.join('?' * len(ids))})", ids
            rows = src.execute(f"SELECT * FROM {table} WHERE {where}", params)
            cols = [d[0] for d in rows.description]
            buf = io.StringIO()
            w = csv.writer(buf)
            for r in rows:
                w.writerow(["\\N" if v is None else v for v in r])
            buf.seek(0)
            cur.copy_expert(f"COPY {table} ({','.join(cols)}) FROM STDIN WITH (FORMAT csv, NULL '\\N')", buf)
        cur.execute("ANALYZE")


def time_postgres(path: Path, ids: list[str], metric_keys) -> dict:
    """rldiag over REST, rldiag on the database, and MlflowClient, against a PostgreSQL-backed server."""
    import shutil

    from bench._server import MlflowServer
    from tests.helpers.postgres import PostgresServer

    root = Path(tempfile.mkdtemp(prefix="rldiag-bench-pg-"))
    try:
        with PostgresServer() as pg, MlflowServer(root, backend_store_uri=pg.url) as server:
            t0 = time.perf_counter()
            _copy_runs_to_postgres(path, ids, pg.dsn_for(pg.database))
            print(f"copied {len(ids)} runs into PostgreSQL in {time.perf_counter() - t0:.1f} s", flush=True)
            return _time_reads(server.uri, pg.url, ids, metric_keys, "PostgreSQL-backed server")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def load_histories_again(uri, ids, metric_keys, previous):
    from rldiag.app.data.histories import load_histories

    return load_histories(open_store(uri), ids, metric_keys, previous=previous)


if __name__ == "__main__":
    main()
