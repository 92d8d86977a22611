"""For the read-only tests: a SQLite store's schema revision and fingerprint (what any write changes), an
Alembic downgrade to an older MLflow's schema, and the dashboard run by AppTest with the settings a
visitor cannot change."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import streamlit as st
from streamlit.testing.v1 import AppTest

from rldiag.app.data.readonly_sql import schema_revisions


def revision(db: Path) -> str:
    with sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True) as con:
        return con.execute("SELECT version_num FROM alembic_version").fetchone()[0]


def fingerprint(db: Path) -> tuple[str, str, list[str]]:
    """(schema revision, sha256 of the file, the files beside it): what a write of any kind changes."""
    return revision(db), hashlib.sha256(db.read_bytes()).hexdigest(), sorted(p.name for p in db.parent.iterdir())


def downgrade(db: Path, steps: int) -> str:
    """Alembic-downgrade the MLflow store `db` by `steps` revisions (in place); returns the revision."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config

    target = schema_revisions()[1][steps]
    url = f"sqlite:///{db}"
    cfg = _get_alembic_config(url)
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as con:
        cfg.attributes["connection"] = con
        command.downgrade(cfg, target)
    engine.dispose()
    return target


def _dashboard(start: str | None) -> None:
    from rldiag.app.dashboard.shell import main as dashboard_main

    dashboard_main(start)


def dashboard(uri: str, monkeypatch, page: str | None = None, *, allow: str = "0",
              address: str | None = None) -> AppTest:
    """The dashboard against `uri` on `page` (AppTest, run once, its exceptions left to the caller), with
    `RLDIAG_ALLOW_URI_INPUT=allow`, Streamlit's server.address set to `address` and its caches cleared."""
    monkeypatch.setenv("RLDIAG_TRACKING_URI", uri)
    monkeypatch.setenv("RLDIAG_ALLOW_URI_INPUT", allow)
    monkeypatch.delenv("RLDIAG_EXPERIMENT", raising=False)
    st.cache_data.clear()
    st.cache_resource.clear()
    st.config.set_option("server.address", address)  # what `streamlit run --server.address` sets
    return AppTest.from_function(_dashboard, kwargs={"start": page}, default_timeout=90).run()
