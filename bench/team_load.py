"""Team-scale load: many training processes into one PostgreSQL-backed `mlflow server`, killed once.

    python -m bench.team_load                                  # 16 writers x 50 metrics x 5 steps/s, 60 s
    python -m bench.team_load --rate 50 --seconds 120          # the issue's size (40k points/s offered)
    python -m bench.team_load --quick                          # 4 writers, 15 s

A real PostgreSQL (tests/helpers/postgres.py) behind a real `mlflow server --workers 2`; `--writers` child
processes, each a `MetricWriter` over REST logging `--metrics` keys a step at `--rate` steps/s, paced
by the clock, for `--seconds`. Halfway through, the server's process group is SIGKILLed and started
again `--down-s` later (its start-up adds to the outage). Each child then closes (waits up to
`--close-timeout` s) and reports its own figures: peak backlog (points waiting, in memory or in the
journal), peak RSS, the log call. Counted afterwards, per (key, step) pair, in PostgreSQL and in what
is left in the writers' journals (read back as `rldiag sync` would): stored; not yet delivered = in a
journal and not stored (a close that timed out leaves them there, for the next start of the run or
`rldiag sync`); lost = expected and in neither; duplicated = rows beyond one per (key, step). The rate
the server sustained = points stored over the time from the first step to the last writer's close,
less the outage. When the server cannot keep up with what is offered, the close timeout decides how
much is stored and how much waits in the journals; neither is lost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, summary_row, write_result

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from rldiag.collectors.mlflow_store import make_sender, open_run
    from rldiag.collectors.writer import MetricWriter
    from rldiag.collectors.limits import MAX_BATCH

    uri, name, n_keys, rate, seconds, close_timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
        float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
    def rss_mb(field="VmHWM"):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return 0.0
    for _ in range(60):  # the server may be restarting when a late child starts
        try:
            _, run = open_run(uri, experiment="team-load", run_name=name)
            break
        except Exception:
            time.sleep(1.0)
    w = MetricWriter(run.info.run_id, make_sender(uri, request_timeout_s=30), tracking_uri=uri, spill_dir="spill",
                     backoff_s=(0.25, 5.0))
    print("start", flush=True)
    keys = [f"team/m{i:02d}" for i in range(n_keys)]
    t0 = time.monotonic()
    steps = int(rate * seconds)
    calls, peak_backlog, next_sample = [], 0, 0.0
    for step in range(steps):
        slot = t0 + step / rate
        now = time.monotonic()
        if slot > now:
            time.sleep(slot - now)
        values = {k: step + i * 1e-3 for i, k in enumerate(keys)}
        c0 = time.perf_counter()
        w.log_metrics(values, step)
        calls.append(time.perf_counter() - c0)
        if now >= next_sample:  # points waiting: queued, in memory or in the journal, in flight
            peak_backlog = max(peak_backlog, w.stats.enqueued - w.stats.delivered)
            next_sample = now + 0.5
    logged_s = time.monotonic() - t0
    st = w.close(timeout=close_timeout)
    calls.sort()
    print(json.dumps({"run_id": run.info.run_id, "steps": steps, "points": steps * n_keys,
                      "delivered": st.delivered, "undelivered": st.undelivered, "spilled": st.spilled,
                      "send_failures": st.send_failures, "peak_backlog": peak_backlog, "rss_peak_mb": rss_mb(),
                      "logged_s": logged_s, "closed_s": time.monotonic() - t0,
                      "log_call_p99_ms": calls[int(0.99 * (len(calls) - 1))] * 1e3,
                      "log_call_max_ms": calls[-1] * 1e3}), flush=True)
""")


def _key_no(key: str, n_keys: int) -> int:
    """The writers' key `team/mNN` -> NN; -1 for any other key."""
    tail = key.removeprefix("team/m")
    return int(tail) if tail != key and tail.isdigit() and int(tail) < n_keys else -1


def stored_pairs(dsn: str, run_id: str, n_keys: int, steps: int):
    """(rows, a [n_keys, steps] bool array of the (key, step) pairs stored) of a run, read from PostgreSQL."""
    import numpy as np
    import psycopg2

    seen = np.zeros((n_keys, steps), bool)
    with psycopg2.connect(dsn) as con, con.cursor() as cur:
        cur.execute("SELECT key, step FROM metrics WHERE run_uuid = %s", (run_id,))
        rows = cur.fetchall()
    for key, step in rows:
        k = _key_no(key, n_keys)
        if k >= 0 and 0 <= step < steps:
            seen[k, step] = True
    return len(rows), seen


def journal_pairs(spill: Path, run_id: str, n_keys: int, steps: int):
    """A [n_keys, steps] bool array of the (key, step) pairs still undelivered in the run's journals
    (every stem of the run: `<run_id>`, `<run_id>-2`, ...), read batch by batch."""
    import numpy as np

    from rldiag.collectors.journal_read import iter_pending, journal_stems, scan_journal

    left = np.zeros((n_keys, steps), bool)
    for stem in journal_stems(spill):
        if stem != run_id and not stem.startswith(run_id + "-"):
            continue
        for b in iter_pending(scan_journal(spill, stem)):
            for key, _v, _ts, step in (b.metrics if b is not None else ()):
                k = _key_no(key, n_keys)
                if k >= 0 and 0 <= step < steps:
                    left[k, step] = True
    return left


def run_load(*, writers: int, metrics: int, rate: float, seconds: float, down_s: float, close_timeout: float,
             workers: int = 2) -> dict:
    """Run the load once; returns every child's figures and the totals (see the module docstring)."""
    from bench._server import MlflowServer
    from tests.helpers.postgres import PostgresServer

    root = Path(tempfile.mkdtemp(prefix="rldiag-team-load-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_DISABLE_TELEMETRY": "true"}
    try:
        with PostgresServer() as pg, MlflowServer(root, backend_store_uri=pg.url, workers=workers) as server:
            t0 = time.monotonic()
            procs = [subprocess.Popen([sys.executable, "-c", CHILD, server.uri, f"w{i:02d}", str(metrics), str(rate),
                                       str(seconds), str(close_timeout)], cwd=root, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(writers)]
            for p in procs:  # every writer is logging before the clock of the kill starts
                line = p.stdout.readline()
                if not line.startswith("start"):
                    raise SystemExit(f"a writer did not start: {p.stderr.read()[-2000:]}")
            started = time.monotonic()
            time.sleep(max(0.0, seconds / 2 - (time.monotonic() - started)))
            server.kill()
            killed = time.monotonic()
            time.sleep(down_s)
            restart_s = server.start()
            outage_s = time.monotonic() - killed
            outs = []
            for p in procs:
                out, err = p.communicate(timeout=seconds + close_timeout + 300)
                lines = [x for x in out.splitlines() if x.startswith("{")]
                if p.returncode != 0 or not lines:
                    raise SystemExit(f"a writer failed ({p.returncode}): {err[-2000:]}")
                outs.append(json.loads(lines[-1]))
            wall = time.monotonic() - t0
            for o in outs:  # each (key, step): stored, still in a journal, or neither
                rows, stored = stored_pairs(pg.dsn_for(pg.database), o["run_id"], metrics, o["steps"])
                left = journal_pairs(root / "spill", o["run_id"], metrics, o["steps"])
                o.update({"rows": rows, "stored_distinct": int(stored.sum()),
                          "not_yet_delivered": int((left & ~stored).sum()),
                          "lost": int((~stored & ~left).sum())})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    expected = sum(o["points"] for o in outs)
    stored = sum(o["stored_distinct"] for o in outs)
    return {"writers": outs, "expected": expected, "stored_distinct": stored,
            "not_yet_delivered": sum(o["not_yet_delivered"] for o in outs), "lost": sum(o["lost"] for o in outs),
            "duplicated": sum(o["rows"] for o in outs) - stored, "close_timeout_s": close_timeout,
            "wall_s": wall, "outage_s": outage_s, "server_restart_s": restart_s,
            "offered_points_per_s": writers * metrics * rate,
            # over the time the server was up: from the first step to the last close, less the outage
            "sustained_points_per_s": stored / max(1e-9, max(o["closed_s"] for o in outs) - outage_s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--metrics", type=int, default=50)
    ap.add_argument("--rate", type=float, default=5.0, help="steps/s per writer (default 5)")
    ap.add_argument("--seconds", type=float, default=60.0, help="logging time per writer (default 60)")
    ap.add_argument("--down-s", type=float, default=10.0, help="seconds the server stays killed, before its restart")
    ap.add_argument("--close-timeout", type=float, default=900.0)
    ap.add_argument("--quick", action="store_true", help="4 writers, 15 s")
    args = ap.parse_args(argv)
    if args.quick:
        args.writers, args.seconds, args.down_s = 4, 15.0, 3.0
    r = run_load(writers=args.writers, metrics=args.metrics, rate=args.rate, seconds=args.seconds,
                 down_s=args.down_s, close_timeout=args.close_timeout)
    peak_backlog = max(o["peak_backlog"] for o in r["writers"])
    peak_rss = max(o["rss_peak_mb"] for o in r["writers"])
    what = f"{args.writers} writers x {args.metrics} metrics x {args.rate:g} steps/s, {args.seconds:g} s"
    r.update({"env": env_info(), "quick": args.quick, "args": vars(args), "summary": [
        summary_row(f"team load ({what}), server killed {r['outage_s']:.0f} s: lost / duplicated",
                    f"{r['lost']} lost, {r['duplicated']} dup of {r['expected']}"
                    + (f"; {r['not_yet_delivered']} not yet delivered (in the journals after a "
                       f"{args.close_timeout:g} s close timeout)" if r["not_yet_delivered"] else ""),
                    "-", "-", "0 lost, 0 duplicated", r["lost"] == 0 and r["duplicated"] == 0),
        summary_row("team load: rate the PostgreSQL-backed server sustained (2 workers)",
                    f"{r['sustained_points_per_s']:.0f} points/s (offered {r['offered_points_per_s']:.0f})",
                    "-", "-", "-", None),
        summary_row("team load: a writer's peak backlog and RSS", f"{peak_backlog} points, {peak_rss:.0f} MB",
                    "-", "-", "RSS < 200 MB", peak_rss < 200),
    ]})
    path = write_result("team_load", r)
    print(json.dumps({k: v for k, v in r.items() if k != "writers"}, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
