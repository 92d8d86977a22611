"""Team scale: a 2-rank gloo job logs through an `mlflow server` backed by a real PostgreSQL while the
read side loads it; what the read side ends with is exactly what the job logged and the database holds.

The stack is the one `docker-compose.yml` runs, without Docker: PostgreSQL on 127.0.0.1
(`tests.helpers.postgres`), `mlflow server --backend-store-uri postgresql://... --serve-artifacts` (artifacts
uploaded through the server into a local folder), two real processes on gloo with a NaN gradient on
rank 1 at one step (as in `tests/collectors/test_distributed.py`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp

from rldiag.app.data.histories import load_histories, nonfinite_table
from rldiag.app.data.store import open_store
from rldiag.collectors import keys
from tests.helpers.net import MlflowServer, free_port

pytestmark = [pytest.mark.postgres, pytest.mark.server]

STEPS = 60
NAN_STEP = 17
STEP_SLEEP_S = 0.1  # so that the job runs for seconds and the reader sees it grow
POLL_S = 2.0  # the reader's pause between loads while the job runs (a dashboard's refresh)
HALF = 30  # rank 0 flushes after this step and waits until the reader has loaded the half-written run
EXPERIMENT = "team-postgres"


def _worker(rank: int, world: int, port: int, uri: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from rldiag.collectors import Monitor
    from tests.helpers.gloo_job import gloo_step, teardown

    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # same weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    records = []
    with Monitor(EXPERIMENT, run_name="gloo-2-ranks", tracking_uri=uri, policy="skip", per_rank=True,
                 tags={"rldiag.group": "team", "rldiag.variant": "postgres"},
                 params={"steps": STEPS, "nan_step": NAN_STEP, "world_size": world},
                 spill_dir=os.path.join(out_dir, f"spill{rank}"),
                 close_timeout_s=180) as mon:  # a shared 2-core machine under load can take minutes
        if rank == 0:  # tell the reader which run to follow (rename: it never sees half a file)
            Path(out_dir, "run_id.tmp").write_text(mon.run_id)
            os.replace(Path(out_dir, "run_id.tmp"), Path(out_dir, "run_id"))
        for step in range(STEPS):
            loss, stats = gloo_step(model, rank, step, nan_step=NAN_STEP, x_scale=1 + step / STEPS, lp_scale=step % 3)
            go = mon.step(step, model, loss=loss, metrics=stats)
            rep = mon.last_report
            records.append({"step": step, "go": go, "finite": rep.finite, "norm": rep.norm,
                            "names": rep.nonfinite_params})
            model.zero_grad()
            if rank == 0 and step == HALF:  # rank 1 waits in the next step's all-reduce meanwhile
                assert mon.writer.flush(120), "steps up to HALF not delivered within 120 s"
                Path(out_dir, "halfway").touch()
                deadline = time.monotonic() + 120
                while not Path(out_dir, "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
            time.sleep(STEP_SLEEP_S)
    writer = None if mon.writer is None else vars(mon.writer.stats)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"records": records, "run_id": mon.run_id,
                                                             "writer": writer}))
    teardown()


def _db_rows(pg, run_id: str) -> dict[str, dict[int, tuple[float, int]]]:
    """The `metrics` table as MLflow's SQL store wrote it: key -> step -> (value, timestamp)."""
    out: dict[str, dict[int, tuple[float, int]]] = {}
    con = pg.connect()
    try:
        with con.cursor() as cur:
            cur.execute("SELECT key, step, value, is_nan, timestamp FROM metrics WHERE run_uuid = %s", (run_id,))
            rows = cur.fetchall()
    finally:
        con.close()
    for key, step, value, is_nan, ts in rows:
        per_key = out.setdefault(key, {})
        assert step not in per_key, f"duplicate row for {key!r} at step {step}"
        per_key[step] = (math.nan if is_nan else value, ts)
    return out


def _assert_same_traces(a, b) -> None:
    assert set(a.traces) == set(b.traces)
    for pair, t in a.traces.items():
        u = b.traces[pair]
        np.testing.assert_array_equal(t.steps, u.steps, err_msg=str(pair))
        np.testing.assert_array_equal(t.values, u.values, err_msg=str(pair))  # NaN == NaN here
        np.testing.assert_array_equal(t.timestamps, u.timestamps, err_msg=str(pair))


@pytest.mark.timeout(600)
def test_gloo_job_through_postgres_backed_server(tmp_path, postgres_server, postgres_url):
    server = MlflowServer(tmp_path, backend_store_uri=postgres_url, serve_artifacts=True)
    server_start_s = server.start()  # includes MLflow's schema migrations on the empty database
    try:
        t0 = time.monotonic()
        ctx = mp.start_processes(_worker, args=(2, free_port(), server.uri, str(tmp_path)), nprocs=2,
                                 join=False, start_method="spawn")
        # The read side follows the run while the job writes: incremental reloads over REST, and
        # straight from the server's database (--backend-store-uri, a read-only connection).
        via_db = open_store(server.uri, backend_store_uri=postgres_url)
        h, hdb, polls, halfway_steps = None, None, 0, None
        while not ctx.join(timeout=POLL_S):
            if (tmp_path / "run_id").exists():
                run_id = (tmp_path / "run_id").read_text()
                paused = (tmp_path / "halfway").exists() and halfway_steps is None
                h = load_histories(open_store(server.uri), [run_id], previous=h)
                hdb = load_histories(via_db, [run_id], previous=hdb)
                polls += 1
                if paused:  # the job is held after HALF with everything up to it delivered
                    halfway_steps = {k: t.steps.tolist() for (_, k), t in h.traces.items()}
                    (tmp_path / "go").touch()
        job_s = time.monotonic() - t0

        r0 = json.loads((tmp_path / "rank0.json").read_text())
        r1 = json.loads((tmp_path / "rank1.json").read_text())
        run_id = r0["run_id"]
        assert r1["run_id"] is None and r1["writer"] is None  # only rank 0 opens the run and writes
        for r in (r0, r1):  # both ranks agreed: skip at NAN_STEP only
            assert [x["go"] for x in r["records"]] == [s != NAN_STEP for s in range(STEPS)]
            assert r["records"][NAN_STEP]["names"] == ["rank1:1.bias"]
        w = r0["writer"]
        assert w["undelivered"] == 0 and w["rejected"] == 0, w

        t1 = time.monotonic()
        full = load_histories(open_store(server.uri), [run_id])  # a fresh load over the server's REST API
        full_s = time.monotonic() - t1
        incremental = load_histories(open_store(server.uri), [run_id], previous=h)  # the followed load, caught up
        direct = load_histories(open_store(postgres_url), [run_id])  # MlflowClient straight on the database
        db_full = load_histories(via_db, [run_id])  # rldiag's PostgreSQL reader, fresh
        db_followed = load_histories(via_db, [run_id], previous=hdb)  # ...and followed, caught up
        db = _db_rows(postgres_server, run_id)

        # What the database holds is every point the writer was told was delivered, once.
        # (`delivered` counts the run tags the writer sent too: here the 3 `rldiag.alert.*` tags.)
        tags = server_client(server).get_run(run_id).data.tags
        alert_tags = [t for t in tags if t.startswith("rldiag.alert.")]
        n_db = sum(len(v) for v in db.values())
        assert not any(k.startswith(keys.INF_FLAG_PREFIX) for k in db)  # NaN only: no inf flags
        assert n_db == w["enqueued"] == w["delivered"] - len(alert_tags), (n_db, len(alert_tags), w)
        for key, per_step in db.items():
            # every step, but grad/skipped: logged at the non-finite steps only (1: the weights did not change)
            steps = [NAN_STEP] if key == keys.GRAD_SKIPPED else list(range(STEPS))
            assert sorted(per_step) == steps, f"{key}: steps {sorted(per_step)}"
        # ...and the read side loaded exactly that, however it got there.
        assert full.method == "rest" and direct.method == "client"
        assert {k for _, k in full.traces} == set(db), set(db) ^ {k for _, k in full.traces}
        assert sum(len(t) for t in full.traces.values()) == n_db
        for (_, key), t in full.traces.items():
            values = np.array([db[key][s][0] for s in t.steps])
            stamps = np.array([db[key][s][1] for s in t.steps])
            np.testing.assert_array_equal(t.values, values, err_msg=key)
            np.testing.assert_array_equal(t.timestamps, stamps, err_msg=key)
        _assert_same_traces(full, incremental)
        _assert_same_traces(full, direct)
        assert db_full.method == db_followed.method == "pgsql"
        _assert_same_traces(full, db_full)
        _assert_same_traces(full, db_followed)
        assert db_followed.fetched < n_db  # caught up from where it was: only the newest rows

        # The NaN: grad/finite 0 at the injected step only, grad/norm NaN there, as rank 0 saw it.
        finite = full.get(run_id, keys.GRAD_FINITE)
        assert finite.steps.tolist() == list(range(STEPS))
        assert finite.values.tolist() == [0.0 if s == NAN_STEP else 1.0 for s in range(STEPS)]
        assert finite.values.tolist() == [float(x["finite"]) for x in r0["records"]]
        norm = full.get(run_id, keys.GRAD_NORM)
        np.testing.assert_array_equal(norm.values, [x["norm"] for x in r0["records"]])
        assert norm.nonfinite().nan.tolist() == [NAN_STEP]
        nan_rows = nonfinite_table(full)
        assert nan_rows.loc[nan_rows.key == keys.GRAD_NORM, "first_step"].tolist() == [NAN_STEP]

        # Tags and the alerts artifact went through the server: into PostgreSQL and the artifact folder.
        assert tags["rldiag.alert.first_step"] == str(NAN_STEP) and "rank1:1.bias" in tags["rldiag.alert.last"]
        alerts = list((tmp_path / "artifacts").rglob("alerts.jsonl"))
        assert len(alerts) == 1 and run_id in str(alerts[0]), alerts
        events = [json.loads(line) for line in alerts[0].read_text().splitlines()]
        assert [e["step"] for e in events] == [NAN_STEP]

        # The watcher, one poll cycle over the same server: it finds the NaN step (exit 1: alerts sent),
        # and a second cycle with the same state file finds nothing new (exit 0).
        watch = [str(Path(sys.executable).with_name("rldiag")), "watch", "--once", "--tracking-uri", server.uri,
                 "--experiment", EXPERIMENT, "--state", str(tmp_path / "watch-state.json"),
                 "--jsonl", str(tmp_path / "watch-alerts.jsonl")]
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
        env.pop("RLDIAG_WEBHOOK_URL", None)
        t2 = time.monotonic()
        first = subprocess.run(watch, check=False, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        watch_s = time.monotonic() - t2
        assert first.returncode == 1, first.stdout + first.stderr
        seen = [json.loads(line) for line in (tmp_path / "watch-alerts.jsonl").read_text().splitlines()]
        assert [(e["run_id"], e["step"]) for e in seen] == [(run_id, NAN_STEP)], seen
        assert f"at step {NAN_STEP}" in first.stdout + first.stderr
        again = subprocess.run(watch, check=False, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        assert len((tmp_path / "watch-alerts.jsonl").read_text().splitlines()) == 1

        # The reader really read while the job wrote: mid-run it saw exactly steps 0..HALF of every key.
        assert halfway_steps is not None, "the reader never saw the job paused at HALF"
        assert halfway_steps == {k: sorted(s for s in db[k] if s <= HALF) if k == keys.GRAD_SKIPPED else list(range(HALF + 1))
                                 for k in db}, halfway_steps
        print(f"\npostgres start {postgres_server.start_s:.1f}s, mlflow server start {server_start_s:.1f}s, "
              f"job {job_s:.1f}s, {polls} incremental reads during the job, "
              f"{n_db} points in {len(db)} keys x {STEPS} steps, fresh REST load {full_s:.2f}s, "
              f"watch --once {watch_s:.1f}s")
    finally:
        server.kill()


def server_client(server: MlflowServer):
    from mlflow import MlflowClient

    return MlflowClient(server.uri)
