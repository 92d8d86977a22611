"""Fixtures for the team-scale tests: a real PostgreSQL server on 127.0.0.1 (`tests.helpers.postgres`).

Without PostgreSQL's binaries the tests FAIL (never skip) with the fix: `sudo make sysdeps`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.postgres import PostgresMissing, PostgresServer


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    """A fresh PostgreSQL cluster with an empty database `mlflow`; removed after the module."""
    server = PostgresServer()
    try:
        server.start()
    except PostgresMissing as e:
        pytest.fail(str(e), pytrace=False)
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """`postgresql+psycopg2://rldiag:<password>@127.0.0.1:<port>/mlflow`, what `mlflow server --backend-store-uri` takes."""
    return postgres_server.url
