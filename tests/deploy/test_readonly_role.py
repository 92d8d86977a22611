"""The read-only PostgreSQL role of docker-compose.yml, created by its script on a real PostgreSQL.

deploy/postgres/10-rldiag-readonly.sh runs as the postgres image runs it (psql as POSTGRES_USER on
POSTGRES_DB) before MLflow has created any table; then MLflow migrates the empty database as the
owner and logs a run. The role reads every MLflow table (also those made after it existed) through
rldiag's read-only store and as the dashboard's backend connection, and cannot write: INSERT,
UPDATE, CREATE TABLE and MLflow's own create_experiment are refused. Running the script again (on an
existing deployment) keeps working.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psycopg2
import pytest
from psycopg2 import errors

from rldiag.app.data.runs import find_runs
from rldiag.app.data.store import connect_postgres, open_store

pytestmark = [pytest.mark.postgres]

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "postgres" / "10-rldiag-readonly.sh"
RO_USER, RO_PASSWORD = "rldiag_reader", "r3ad-only-Pw"


def run_script(server) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{server.bindir}:{os.environ['PATH']}", PGHOST="127.0.0.1", PGPORT=str(server.port),
               PGPASSWORD=server.password, POSTGRES_USER=server.user, POSTGRES_DB=server.database,
               RLDIAG_DB_USER=RO_USER, RLDIAG_DB_PASSWORD=RO_PASSWORD)
    return subprocess.run(["sh", str(SCRIPT)], check=False, env=env, capture_output=True, text=True, timeout=60)


def ro_dsn(server) -> str:
    return f"postgresql://{RO_USER}:{RO_PASSWORD}@127.0.0.1:{server.port}/{server.database}"


@pytest.fixture(scope="module")
def store_with_a_run(postgres_server):
    """The role first, then MLflow's tables (as the compose start order has it), then one run."""
    from mlflow import MlflowClient

    res = run_script(postgres_server)
    assert res.returncode == 0, res.stderr
    owner = MlflowClient(postgres_server.url)  # migrates the empty database, as `mlflow server` would
    exp = owner.create_experiment("team")
    run = owner.create_run(exp, run_name="r1")
    for step in range(5):
        owner.log_metric(run.info.run_id, "loss", 1.0 / (step + 1), step=step)
    owner.set_terminated(run.info.run_id)
    return run.info.run_id


def test_the_role_reads_every_mlflow_table_through_rldiag(postgres_server, store_with_a_run):
    store = open_store(ro_dsn(postgres_server).replace("postgresql://", "postgresql+psycopg2://"))
    runs = find_runs(store, experiments="team")
    assert runs["run_id"].tolist() == [store_with_a_run]
    with connect_postgres(ro_dsn(postgres_server)) as con, con.cursor() as cur:  # the dashboard's backend read
        cur.execute("SELECT count(*) FROM metrics WHERE run_uuid = %s", (store_with_a_run,))
        assert cur.fetchone()[0] == 5
        cur.execute("SELECT count(*), count(*) FILTER (WHERE NOT has_table_privilege(format('public.%I', tablename), "
                    "'SELECT')) FROM pg_tables WHERE schemaname = 'public'")
        tables, unreadable = cur.fetchone()
        assert tables > 20 and unreadable == 0  # every table MLflow made after the role existed is readable


@pytest.mark.parametrize("sql", [
    "INSERT INTO experiments (name, lifecycle_stage) VALUES ('x', 'active')",
    "UPDATE runs SET status = 'FAILED'",
    "DELETE FROM metrics",
    "CREATE TABLE rldiag_probe (i int)",
])
def test_the_role_cannot_write_even_outside_a_read_only_session(postgres_server, store_with_a_run, sql):
    con = psycopg2.connect(ro_dsn(postgres_server))
    try:
        con.autocommit = True
        with con.cursor() as cur:
            cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE")  # past the role's default
            with pytest.raises(errors.InsufficientPrivilege):  # the grants refuse it, not only the session default
                cur.execute(sql)
    finally:
        con.close()


def test_mlflow_s_own_client_as_the_role_cannot_create_an_experiment(postgres_server, store_with_a_run):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(f"postgresql+psycopg2://{RO_USER}:{RO_PASSWORD}@127.0.0.1:{postgres_server.port}/"
                          f"{postgres_server.database}")
    with pytest.raises(MlflowException, match="read-only transaction|permission denied"):
        client.create_experiment("written by the reader")


def test_running_the_script_again_keeps_the_role(postgres_server, store_with_a_run):
    res = run_script(postgres_server)
    assert res.returncode == 0, res.stderr
    with connect_postgres(ro_dsn(postgres_server)) as con, con.cursor() as cur:
        cur.execute("SELECT count(*) FROM runs")
        assert cur.fetchone()[0] == 1
