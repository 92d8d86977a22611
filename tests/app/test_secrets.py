"""Secrets are never shown on the read side, and `rldiag watch --tag-runs` never migrates a store.

- Every read-side error (`rldiag.app.errors.DataError`: a store that does not open or answer, a run not
  found) hides URL passwords, secret query values and the secrets of the store URIs opened; so does the
  `Store`'s repr and a backend store URI named in an error.
- The dashboard, given a tracking URI with a password that cannot be read, shows the error without it.
- `--tag-runs` on a store of this MLflow's schema writes the tags and leaves the schema revision alone; on
  an older store it exits 2 with one line naming both revisions, and the file is byte-for-byte unchanged.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import mlflow
import pytest

from rldiag.app.cli.main import main
from rldiag.app.data.readonly_sql import schema_revisions
from rldiag.app.data.runs import get_runs
from rldiag.app.data.store import open_store
from rldiag.app.errors import RunNotFound, StoreUnreachable
from rldiag.collectors import keys
from tests.helpers.read_only import dashboard, downgrade, fingerprint
from tests.helpers.runs import write_run

SECRET = "hunter2-Secret"
TOKEN = "tok-98765"


def test_a_data_error_never_holds_a_password_or_a_secret_query_value():
    uri = f"mysql+pymysql://alice:{SECRET}@db.internal:3306/mlflow?token={TOKEN}&charset=utf8"
    e = StoreUnreachable(f"searching runs in {uri!r} failed")
    assert SECRET not in str(e) and TOKEN not in str(e)
    assert "alice:***@db.internal:3306/mlflow?token=***&charset=utf8" in str(e)


def test_a_store_that_cannot_be_opened_and_its_repr_hide_the_password():
    uri = f"mysql+pymysql://alice:{SECRET}@127.0.0.1:1/mlflow"
    with pytest.raises(StoreUnreachable) as err:
        open_store(uri)
    assert SECRET not in str(err.value) and "alice:***@127.0.0.1:1" in str(err.value)
    with pytest.raises(StoreUnreachable) as err:  # a backend of a kind rldiag does not read directly
        open_store("http://127.0.0.1:1", backend_store_uri=uri, timeout_s=1)
    assert SECRET not in str(err.value)


def test_the_backend_store_uri_is_never_echoed(monkeypatch, tmp_path):
    from rldiag.app.data import store as store_mod

    monkeypatch.setattr(store_mod, "_probe", lambda uri, timeout_s: None)  # a server that answers
    uri = f"mysql+pymysql://alice:{SECRET}@127.0.0.1:1/mlflow"
    with pytest.raises(StoreUnreachable) as err:
        open_store("http://127.0.0.1:5000", backend_store_uri=uri)
    assert SECRET not in str(err.value) and "mysql+pymysql://alice:***@127.0.0.1:1/mlflow" in str(err.value)


def test_a_run_not_found_in_a_store_whose_uri_holds_a_token(store_uri):
    write_run(store_uri, name="r", steps=[(0, {keys.GRAD_NORM: 1.0})])
    store = open_store(f"{store_uri}?token={TOKEN}")
    assert TOKEN not in repr(store)
    with pytest.raises(RunNotFound) as err:
        get_runs(store, ["0123456789abcdef0123456789abcdef"])
    assert TOKEN not in str(err.value)


def test_the_dashboard_shows_an_unreadable_store_without_its_password(monkeypatch):
    at = dashboard(f"mysql+pymysql://alice:{SECRET}@127.0.0.1:1/mlflow", monkeypatch)
    elements = [*at.error, *at.warning, *at.info, *at.markdown, *at.caption, *at.sidebar.markdown, *at.sidebar.caption]
    shown = " ".join(str(e.value) for e in elements)  # what a visitor sees (session state stays on the server)
    assert at.error and "alice" in shown
    assert SECRET not in shown


# ---- --tag-runs writes tags, never schemas ----------------------------------------------------------
@pytest.fixture
def foreign_run_store(store_uri) -> Path:
    """A store with a run that rldiag's collectors did not watch (only the trainer's `grad_norm`, NaN at 3)."""
    steps = [(s, {"grad_norm": math.nan if s == 3 else 1.0}) for s in range(5)]
    write_run(store_uri, experiment="ext", name="foreign", steps=steps, finish=False)
    db = Path(store_uri.removeprefix("sqlite:///"))
    shutil.rmtree(db.parent / ".rldiag", ignore_errors=True)
    return db


def test_tag_runs_writes_the_alert_tags_and_leaves_the_schema(foreign_run_store, tmp_path, capsys):
    before = fingerprint(foreign_run_store)[0]
    code = main(["watch", "--once", "--tag-runs", "--tracking-uri", f"sqlite:///{foreign_run_store}",
                 "--state", str(tmp_path / "state.json")])
    assert code == 1, capsys.readouterr().err  # --once: 1 when it alerted
    assert fingerprint(foreign_run_store)[0] == before == schema_revisions()[0]
    (run,) = mlflow.MlflowClient(f"sqlite:///{foreign_run_store}").search_runs(
        [mlflow.MlflowClient(f"sqlite:///{foreign_run_store}").get_experiment_by_name("ext").experiment_id])
    assert run.data.tags.get(keys.TAG_ALERT_COUNT) == "1"


def test_tag_runs_on_an_older_store_is_one_line_naming_both_revisions(foreign_run_store, tmp_path, capsys):
    old = downgrade(foreign_run_store, 10)
    before = fingerprint(foreign_run_store)
    code = main(["watch", "--once", "--tag-runs", "--tracking-uri", f"sqlite:///{foreign_run_store}",
                 "--state", str(tmp_path / "state.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert old in err and schema_revisions()[0] in err and "--tag-runs" in err
    assert fingerprint(foreign_run_store) == before
