"""Which tracking store a URI names, checked once, read-only, with an error that says the fix.

Three kinds, each read its fastest way by `rldiag.app.data.histories`:
- `sqlite`: a local MLflow SQLite file (the embedded default); read with read-only SQL.
- `rest`: an `mlflow server` over http(s); read with its REST endpoints in parallel. Where this
  machine can reach the server's own backend store (`--backend-store-uri` or
  $RLDIAG_BACKEND_STORE_URI, what `mlflow server --backend-store-uri` was given: a SQLite file or a
  PostgreSQL database, ideally as a read-only role), metric histories are read from it directly,
  read-only, and everything else still through the server.
- `other`: anything else MLflow's client understands (postgresql://, file:, databricks); read
  through `MlflowClient`.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from rldiag.app.errors import StoreUnreachable, redact, remember_uri
from rldiag.collectors.uri import probe_server, redact_uri

StoreKind = Literal["sqlite", "rest", "other"]
_FIX = "Set MLFLOW_TRACKING_URI (or --tracking-uri) to your store, or unset it to use ./mlruns.db."
BACKEND_ENV = "RLDIAG_BACKEND_STORE_URI"


@dataclass(frozen=True)
class Store:
    """A checked tracking store. `client` is MLflow's client for it, created on first use."""

    uri: str
    kind: StoreKind
    sqlite_path: Path | None = None  # the SQLite file read directly (a server's backend, for `rest`)
    postgres_dsn: str | None = None  # a server's PostgreSQL backend, read directly (libpq URI)
    # This process also writes the SQLite file (through MLflow: Python's sqlite3). Then its metric rows
    # are read with sqlite3 too, never ADBC: ADBC carries its own copy of SQLite, and two copies in one
    # process release each other's POSIX file locks (sqlite.org/howtocorrupt.html, 2.2.1), which a
    # writing process must never risk.
    writes_here: bool = False

    def __repr__(self) -> str:  # never the password: a Store is printed in tracebacks and logs
        return f"Store({redact_uri(self.uri)!r}, {self.kind!r})"

    @cached_property
    def client(self):
        """MLflow's client for reading. A SQL store (SQLite, PostgreSQL, MySQL) is opened read-only:
        never migrated, never written (`rldiag.app.data.readonly_sql`)."""
        from mlflow.tracking import MlflowClient

        if self.kind == "sqlite" or _is_sql_uri(self.uri):
            from rldiag.app.data.readonly_sql import read_only_client

            return read_only_client(self.uri)
        return MlflowClient(self.uri)

    @cached_property
    def write_client(self):
        """A client for the few writes a command is asked for (`rldiag watch --tag-runs`). A SQL store is
        never migrated: one of another schema is refused with a StoreUnreachable naming both revisions."""
        from mlflow.tracking import MlflowClient

        if self.kind == "sqlite" or _is_sql_uri(self.uri):
            from mlflow.exceptions import MlflowException

            from rldiag.app.data.readonly_sql import tag_writer_client

            try:
                return tag_writer_client(self.uri)
            except MlflowException as e:
                raise StoreUnreachable(f"cannot write tags to {redact_uri(self.uri)!r}: "
                                       f"{str(e.message).strip().splitlines()[0]}") from None
        return MlflowClient(self.uri)

    def check(self, *, timeout_s: float = 5.0) -> None:
        """For a server: StoreUnreachable within `timeout_s` when it does not answer (a file needs no check)."""
        if self.kind == "rest":
            _probe(self.uri, timeout_s)

    @contextmanager
    def read_only(self) -> Iterator[sqlite3.Connection]:
        """A read-only connection to the SQLite file (never creates or migrates it), closed after."""
        if self.sqlite_path is None:
            raise ValueError(f"{self.uri!r} is not a SQLite store")
        con = _connect_ro(self.sqlite_path)
        try:
            yield con
        finally:
            con.close()


def require_store(store: object) -> None:
    """TypeError, naming the fix, when a read function is given a URI instead of an opened `Store`."""
    if not isinstance(store, Store):
        raise TypeError(f"expected a Store from rldiag.app.open_store(uri), got {type(store).__name__} "
                        f"{redact_uri(str(store))!r}: open the store once, store = open_store(uri), and pass it")


def sqlite_path_of(uri: str) -> Path | None:
    """The file of a `sqlite:///path` URI (relative to the working directory), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0]).resolve()


def _is_sql_uri(uri: str) -> bool:
    return uri.split("://", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "postgres", "mysql", "mssql")


def _connect_ro(path: Path) -> sqlite3.Connection:
    con = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=30, check_same_thread=False)
    con.execute("PRAGMA query_only = 1")
    return con


def open_store(tracking_uri: str | None = None, *, timeout_s: float = 5.0,
               backend_store_uri: str | None = None) -> Store:
    """Check that `tracking_uri` (default: rldiag's default store) answers and return its `Store`.

    For a server, `backend_store_uri` (default: $RLDIAG_BACKEND_STORE_URI; "" for none) names its
    SQLite backend file, to read metric histories from directly.

    Raises StoreUnreachable for a SQLite file that is missing or not an MLflow store, or a server
    that does not answer within `timeout_s`. Nothing is created or written.
    """
    from rldiag.collectors.settings import default_tracking_uri

    uri = tracking_uri or default_tracking_uri()
    backend = os.environ.get(BACKEND_ENV) if backend_store_uri is None else backend_store_uri
    remember_uri(uri, backend)  # their secrets are hidden in every read-side error from now on
    _check_scheme(uri)
    if uri.startswith("sqlite:"):
        return Store(uri, "sqlite", _check_sqlite(uri, "tracking URI"))
    if uri.startswith(("http://", "https://")):
        _probe(uri, timeout_s)
        if not backend:
            return Store(uri, "rest")
        if backend.startswith("sqlite:"):
            return Store(uri, "rest", _check_sqlite(backend, "backend store URI"))
        if backend.startswith("postgresql"):
            return Store(uri, "rest", postgres_dsn=_check_postgres(backend, timeout_s))
        raise StoreUnreachable(
            f"backend store URI {redact_uri(backend)!r}: rldiag reads a server's backend directly when it is a "
            f"SQLite file (sqlite:///path/to/mlflow.db) or PostgreSQL (postgresql://user:password@host:5432/mlflow). Unset "
            f"{BACKEND_ENV} (or drop --backend-store-uri) to read everything through the server."
        )
    return _open_other(uri)


_OTHER_SCHEMES = ("postgresql", "postgres", "mysql", "mssql", "file", "databricks", "databricks-uc", "uc")


def _open_other(uri: str) -> Store:
    """A store MLflow's client reads (a SQL database, a file store, Databricks), opened now so that a
    URI it cannot read is one line here rather than a traceback on first use."""
    shown = redact_uri(uri)
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme not in _OTHER_SCHEMES:
        raise StoreUnreachable(
            f"tracking URI {shown!r} is not a store rldiag reads: use sqlite:///path/to/mlruns.db, "
            f"http://host:5000 (an mlflow server) or postgresql://user:password@host:5432/mlflow. {_FIX}")
    if scheme == "file" and not Path(uri.split(":", 1)[1].removeprefix("//")).is_dir():
        # MLflow's file store creates a missing folder and a default experiment in it: never from here
        raise StoreUnreachable(f"no MLflow file store at {shown!r} (the folder does not exist): point at an existing "
                               f"store, e.g. sqlite:///path/to/mlruns.db. {_FIX}")
    store = Store(uri, "other")
    try:
        store.client  # noqa: B018 - opens it: a missing driver, a refused login, an unknown schema
    except Exception as e:  # noqa: BLE001 - MLflow, SQLAlchemy and driver errors come in many types
        first = redact(str(e).strip().splitlines()[0], uri) if str(e).strip() else ""
        hint = "Check the URI and its credentials."
        if isinstance(e, ModuleNotFoundError) and e.name == "psycopg":  # SQLAlchemy 2.1: bare postgresql:// is psycopg 3
            hint = "Write postgresql+psycopg2://... (with psycopg2-binary installed), or pip install 'psycopg[binary]'."
        raise StoreUnreachable(f"cannot open the tracking store {shown!r} ({type(e).__name__}: {first}). "
                               f"{hint} {_FIX}") from None
    return store


def connect_postgres(dsn: str, timeout_s: float = 10.0):
    """A read-only psycopg2 connection (every transaction READ ONLY, autocommit: no locks held)."""
    import psycopg2

    con = psycopg2.connect(dsn, connect_timeout=max(1, int(timeout_s)), application_name="rldiag")
    con.set_session(readonly=True, autocommit=True)
    return con


def _check_scheme(uri: str) -> None:
    """A bare path (`mlruns.db`, `/data/mlflow.db`) is not a URI: say which one was meant."""
    if "://" in uri or uri.startswith(("sqlite:", "databricks", "file:")):
        return
    path = Path(uri).expanduser()
    if path.suffix in (".db", ".sqlite", ".sqlite3") or path.is_file():
        raise StoreUnreachable(f"tracking URI {uri!r} is a file path, not a URI: did you mean "
                               f"sqlite:///{path.resolve()} ?")
    if path.is_dir():
        raise StoreUnreachable(f"tracking URI {uri!r} is a folder: rldiag reads MLflow's SQLite file "
                               f"(sqlite:///{(path / 'mlruns.db').resolve()}) or a server (http://host:5000)")


def postgres_dsn_of(uri: str) -> str:
    """libpq's URI for an SQLAlchemy one: `postgresql+psycopg2://...` -> `postgresql://...`."""
    scheme, sep, rest = uri.partition("://")
    return f"postgresql{sep}{rest}" if scheme.split("+", 1)[0] in ("postgresql", "postgres") else uri


def _check_postgres(uri: str, timeout_s: float) -> str:
    """The libpq URI of an MLflow PostgreSQL backend, checked by opening a read-only connection."""
    dsn = postgres_dsn_of(uri)
    shown = redact_uri(uri).split("@", 1)[-1]  # never echo the password (nor a ?password= in the query)
    try:
        with closing(connect_postgres(dsn, timeout_s)) as con, con.cursor() as cur:
            cur.execute("SELECT to_regclass('metrics') IS NOT NULL AND to_regclass('runs') IS NOT NULL")
            ok = cur.fetchone()[0]
    except ImportError:
        raise StoreUnreachable("reading a PostgreSQL backend needs psycopg2: pip install psycopg2-binary") from None
    except Exception as e:  # noqa: BLE001 - psycopg2's errors: bad password, no such host or database
        first = redact(str(e).strip().splitlines()[0], uri) if str(e).strip() else type(e).__name__
        raise StoreUnreachable(f"cannot read the backend store at ...@{shown} ({first}). Check the URI and that "
                               f"this machine may connect, or unset {BACKEND_ENV}.") from None
    if not ok:
        raise StoreUnreachable(f"the database at ...@{shown} has no MLflow tables (metrics, runs): is it the "
                               "server's --backend-store-uri?")
    return dsn


def _check_sqlite(uri: str, what: str) -> Path:
    """The file of a `sqlite:///` URI, checked to be a readable MLflow store (nothing is created)."""
    path = sqlite_path_of(uri)
    if path is None:
        raise StoreUnreachable(f"{what} {redact_uri(uri)!r} is not a SQLite file URI; use sqlite:///path/to/mlruns.db. {_FIX}")
    if not path.is_file():
        raise StoreUnreachable(
            f"no MLflow store at {str(path)!r} (from {what} {redact_uri(uri)!r}): the file does not exist. "
            f"Run `rldiag demo` to create one there, or point at your store. {_FIX}"
        )
    try:
        with closing(_connect_ro(path)) as con:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.Error as e:
        raise StoreUnreachable(f"cannot read {str(path)!r} as a SQLite file ({e}). {_FIX}") from None
    if not {"runs", "metrics", "experiments"} <= tables:
        raise StoreUnreachable(
            f"{str(path)!r} is a SQLite file but not an MLflow tracking store (no runs/metrics tables). {_FIX}"
        )
    return path


def _probe(uri: str, timeout_s: float) -> None:
    """Fail in seconds on a server that does not answer (MLflow's client retries for minutes)."""
    why = probe_server(uri, timeout_s)
    if why is not None:
        raise StoreUnreachable(
            f"cannot reach the MLflow tracking server at {redact_uri(uri)!r} ({why}). "
            f"Start it (mlflow server --host 127.0.0.1 --port 5000) or fix the URI. {_FIX}"
        )


def store_errors() -> tuple[type[BaseException], ...]:
    """What an unreachable or failing store raises through MLflow, requests, sqlite3 and our readers."""
    import requests
    from mlflow.exceptions import MlflowException

    from rldiag.app.errors import DataError

    return (DataError, MlflowException, OSError, sqlite3.Error, requests.exceptions.RequestException)
