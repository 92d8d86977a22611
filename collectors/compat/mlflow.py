"""MLflow internals rldiag relies on, in one place, each checked against the installed MLflow by
tests/collectors/test_compat.py (tested range: pyproject's mlflow pin)."""

from __future__ import annotations

from typing import Any


def tracking_store(client: Any) -> Any:
    """The store object behind an `MlflowClient` (`RestStore` for a server, `SqlAlchemyStore` for SQL)."""
    return client._tracking_client.store


def rest_host_creds(client: Any) -> Any | None:
    """The host and credentials an `MlflowClient` of a server sends with (None for a non-REST store):
    what REST calls made outside the client must use (auth, TLS settings, tokens)."""
    from mlflow.store.tracking.rest_store import RestStore

    store = tracking_store(client)
    return store.get_host_creds() if isinstance(store, RestStore) else None
