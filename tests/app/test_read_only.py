"""The read side never writes to a store, and a visitor never picks the store.

- A SQLite store's bytes (sha256), its folder listing and its Alembic schema revision are the same
  after `rldiag report`, `rldiag watch --once` and a dashboard load (AppTest, two pages) read it:
  a store of this MLflow's schema and one ten migrations older (a copy downgraded with Alembic, as
  an older MLflow left it). The control: MLflow's own client upgrades that older copy on open.
- A schema this MLflow does not know reads what it can; a query that does not fit it says which
  revision the store has and which MLflow to read it with, in one line.
- The dashboard has no URI box unless `rldiag app --allow-uri-input` on localhost; with it, an
  unclassified URI is one line on the page, never a traceback. With `--host 0.0.0.0` the flag is
  refused (exit 2, one line).
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import sqlite3
from pathlib import Path

import pytest
import streamlit as st

from rldiag.app.cli.main import main
from rldiag.app.data.readonly_sql import schema_revisions
from rldiag.app.data.store import open_store
from rldiag.app.errors import StoreUnreachable
from rldiag.collectors import keys
from tests.helpers.dashboard import unescape_md
from tests.helpers.read_only import dashboard, downgrade, fingerprint, revision
from tests.helpers.runs import write_run

MIGRATIONS_BACK = 10  # as far back as Alembic downgrades MLflow 3.17's SQLite schema (20 fails on a generated column)


@pytest.fixture(scope="module")
def written(tmp_path_factory, template_db) -> Path:
    """A store with a reference and a candidate that has NaN gradients from step 20 (so the report
    and the watcher have findings to read), written by rldiag, in a folder of its own."""
    root = tmp_path_factory.mktemp("written")
    db = root / "mlruns.db"
    shutil.copyfile(template_db, db)
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    try:
        tags = lambda role: {keys.TAG_GROUP: "g", keys.TAG_ROLE: role}
        for name, role in (("ref", "reference"), ("cand", "candidate")):
            steps = [(s, {keys.RATIO_MEAN: 1.0 + 0.001 * (s % 3), keys.GRAD_NORM: math.nan if role == "candidate"
                          and s >= 20 else 1.0, keys.GRAD_FINITE: 0.0 if role == "candidate" and s >= 20 else 1.0})
                     for s in range(40)]
            write_run(f"sqlite:///{db}", experiment="ro", name=name, tags=tags(role), steps=steps)
    finally:
        mp.undo()
    shutil.rmtree(root / ".rldiag", ignore_errors=True)  # the writer's journal folder, not part of the store
    return db


@pytest.fixture(params=["current", "older"])
def store(request, written, tmp_path) -> Path:
    """A copy of `written` in a folder of its own: as written, or downgraded MIGRATIONS_BACK revisions."""
    folder = tmp_path / "store"
    folder.mkdir()
    db = folder / "mlruns.db"
    shutil.copyfile(written, db)
    if request.param == "older":
        assert downgrade(db, MIGRATIONS_BACK) != schema_revisions()[0]
    return db


@pytest.fixture(autouse=True)
def _restore_server_address():
    old = st.get_option("server.address")
    yield
    st.config.set_option("server.address", old)


def test_report_watch_and_dashboard_leave_the_store_byte_for_byte_unchanged(store, tmp_path, monkeypatch, capsys):
    uri = f"sqlite:///{store}"
    before = fingerprint(store)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)

    assert main(["report", "--tracking-uri", uri, "--group", "g", "--out", str(out), "--quiet"]) == 0
    assert "non-finite gradients from step 20" in (out / "rldiag-report.md").read_text()  # it did read the runs
    assert fingerprint(store) == before

    # exit 1: the watcher found the candidate's NaN steps (it read them); --all: the runs are finished
    assert main(["watch", "--once", "--all", "--tracking-uri", uri, "--state", str(tmp_path / "s.json")]) == 1
    assert fingerprint(store) == before

    for page in ("runs", "compare"):
        at = dashboard(uri, monkeypatch, page)
        assert not at.exception, [e.value for e in at.exception]
        assert not at.error, [e.value for e in at.error]
    assert "cand" in " ".join(str(m.value) for m in at.markdown)  # the Compare page named the candidate
    assert fingerprint(store) == before
    capsys.readouterr()


def test_the_older_store_is_one_that_mlflow_s_own_client_would_migrate(written, tmp_path):
    """The control for the test above: opening the downgraded copy with a plain MlflowClient upgrades it."""
    from mlflow import MlflowClient

    db = tmp_path / "mlruns.db"
    shutil.copyfile(written, db)
    old = downgrade(db, MIGRATIONS_BACK)
    MlflowClient(f"sqlite:///{db}").search_experiments()
    assert revision(db) == schema_revisions()[0] != old


def test_an_unknown_schema_reads_what_fits_and_names_the_mlflow_to_read_the_rest_with(written, tmp_path, capsys):
    db = tmp_path / "mlruns.db"
    shutil.copyfile(written, db)
    with sqlite3.connect(db) as con:  # as a newer MLflow might leave it: an unknown revision, a renamed column
        con.execute("UPDATE alembic_version SET version_num = 'ffffffffffff'")
    store = open_store(f"sqlite:///{db}")
    assert [e.name for e in store.client.search_experiments()] == ["ro", "Default"]  # what fits still reads
    with sqlite3.connect(db) as con:
        con.execute("ALTER TABLE runs RENAME COLUMN lifecycle_stage TO lifecycle")
    before = fingerprint(db)
    assert main(["report", "--tracking-uri", f"sqlite:///{db}", "--group", "g", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for words in ("'ffffffffffff' is unknown to this MLflow", "a newer MLflow wrote it", "pip install -U mlflow"):
        assert words in err, err
    assert fingerprint(db) == before


@pytest.mark.parametrize("uri", ["foo://bar", "mlruns", "file:/no/such/folder", "ftp://host/x"])
def test_an_unclassified_uri_is_one_line_naming_it_and_what_works(uri):
    with pytest.raises(StoreUnreachable) as e:
        open_store(uri)
    text = str(e.value)
    assert len(text.splitlines()) == 1 and repr(uri) in text and "sqlite:///" in text, text


def test_a_bare_postgresql_uri_without_psycopg_3_names_the_psycopg2_spelling():
    pytest.importorskip("psycopg2")
    if importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg 3 is installed: a bare postgresql:// works")
    with pytest.raises(StoreUnreachable) as e:
        open_store("postgresql://reader:s3cret@127.0.0.1:1/mlflow")
    text = str(e.value)
    assert "postgresql+psycopg2://" in text and "s3cret" not in text and len(text.splitlines()) == 1, text


# ---- who picks the store -------------------------------------------------------------------------
@pytest.mark.parametrize("page", ["runs", "compare", "nan-events", "config-diff"])
def test_no_page_has_a_text_box_and_the_sidebar_offers_only_the_store_s_experiments(store, monkeypatch, page):
    at = dashboard(f"sqlite:///{store}", monkeypatch, page)
    assert not at.exception, [e.value for e in at.exception]
    # No widget takes free text, so nothing a visitor types can name a file or a URL.
    assert len(at.text_input) == 0 and len(at.text_area) == 0 and len(at.chat_input) == 0
    assert at.sidebar.selectbox(key="sidebar.experiment").options == ["Default", "ro"]


def test_the_uri_box_stays_closed_on_a_network_address_whatever_the_environment(store, monkeypatch):
    for address in ("0.0.0.0", None, "10.0.0.5"):  # None: Streamlit's default, every interface
        at = dashboard(f"sqlite:///{store}", monkeypatch, allow="1", address=address)
        assert not at.exception and len(at.text_input) == 0, address


def test_with_allow_uri_input_on_localhost_a_typed_bad_uri_is_one_line(store, monkeypatch):
    at = dashboard(f"sqlite:///{store}", monkeypatch, allow="1", address="127.0.0.1")
    box = at.sidebar.text_input(key="sidebar.uri")
    assert box.value == f"sqlite:///{store}"
    at = box.input("foo://bar").run()
    assert not at.exception, [e.value for e in at.exception]
    [error] = at.error
    text = unescape_md(error.value)
    assert "'foo://bar' is not a store rldiag reads" in text and len(text.splitlines()) == 1, text


def test_allow_uri_input_is_refused_beyond_localhost(store, capsys):
    assert main(["app", "--tracking-uri", f"sqlite:///{store}", "--allow-uri-input", "--host", "0.0.0.0",
                 "--no-browser"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "--allow-uri-input" in err and "0.0.0.0" in err and "--host 127.0.0.1" in err
