"""Fixtures for the dashboard tests: one SQLite store (`tests.helpers.dash_store`: its runs and the
constants that describe them), and Streamlit's caches cleared before every test."""

from __future__ import annotations

import shutil

import pytest
import streamlit as st

from tests.helpers.dash_store import DashStore, write_dash_store


@pytest.fixture(scope="package")
def dash_store(tmp_path_factory, template_db) -> DashStore:
    root = tmp_path_factory.mktemp("dash")
    path = root / "mlruns.db"
    shutil.copyfile(template_db, path)
    uri = f"sqlite:///{path}"
    mp = pytest.MonkeyPatch()
    mp.chdir(root)  # artifacts and journals land beside the store
    try:
        ids = write_dash_store(uri)
    finally:
        mp.undo()
    return DashStore(uri, ids)


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Streamlit's caches live in the process: every test starts without them."""
    st.cache_data.clear()
    st.cache_resource.clear()
    yield
