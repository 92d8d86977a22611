"""MLflow's SQL tracking store opened read-only: no schema migration, no default experiment, no write.

`MlflowClient("sqlite:///...")` builds a `SqlAlchemyStore`, whose constructor upgrades an older
schema in place (`_initialize_tables` runs every Alembic migration when a table of this MLflow is
missing), creates the default experiment when it is absent, and raises on any other revision. The read
side must do none of that to a team's store, so `read_only_client(uri)` gives an `MlflowClient` whose
tracking store is `ReadOnlySqlStore`: the same query code, an engine that cannot write (SQLite opened
with `mode=ro`; PostgreSQL/MySQL sessions `READ ONLY`), and the schema revision only read and compared.
A store of another revision is read as far as this MLflow's queries fit it; when one does not,
the error says which revision the store has and which MLflow to read it with.

MLflow internals used here (the store registry, `SqlAlchemyStore` attributes, the session maker)
are pinned by tests/app/test_read_only.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from pathlib import Path
from urllib.parse import quote

SCHEME = "rldiag-readonly"  # rldiag-readonly+sqlite:///path, rldiag-readonly+postgresql://...
TAG_SCHEME = "rldiag-tagwrite"  # the same store, writable, never migrated (`rldiag watch --tag-runs`)
_registered = threading.Lock()
_schemes: set[str] = set()


def read_only_uri(uri: str) -> str:
    """The URI under which MLflow's client builds `ReadOnlySqlStore` for the SQL store `uri`."""
    return f"{SCHEME}+{uri}"


def read_only_client(uri: str):
    """An `MlflowClient` over the SQL store `uri` that never migrates or writes it."""
    from mlflow.tracking import MlflowClient

    ro = read_only_uri(uri)
    _register(ro.split("://", 1)[0])
    return MlflowClient(ro)


def tag_writer_client(uri: str):
    """An `MlflowClient` over the SQL store `uri` that writes (run tags) but never migrates it or creates the
    default experiment. A store whose schema is not this MLflow's is refused: an MlflowException whose first
    line names both schema revisions (writing into another schema could break it)."""
    from mlflow.tracking import MlflowClient

    w = f"{TAG_SCHEME}+{uri}"
    _register(w.split("://", 1)[0])
    client = MlflowClient(w)
    client._tracking_client.store  # noqa: B018 - built now: a refused schema is an error here, not at a write
    return client


def _register(scheme: str) -> None:
    """Make MLflow's store registry build `ReadOnlySqlStore` for `scheme` (e.g. rldiag-readonly+postgresql+psycopg2:
    the registry keys on the whole scheme, driver included)."""
    with _registered:
        if scheme in _schemes:
            return
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        _tracking_store_registry.register(scheme, _build)
        _schemes.add(scheme)


def _build(store_uri: str, artifact_uri: str | None = None):
    if store_uri.startswith(TAG_SCHEME + "+"):
        return tag_store_class()(store_uri[len(TAG_SCHEME) + 1:], artifact_uri)
    return store_class()(store_uri[len(SCHEME) + 1:], artifact_uri)


def _sqlite_file(db_uri: str) -> Path | None:
    """The file of a SQLite URI as SQLAlchemy parses it (this module sits below `store`, which imports it)."""
    from sqlalchemy.engine import make_url

    url = make_url(db_uri)
    return Path(url.database).resolve() if url.get_backend_name() == "sqlite" and url.database else None


def _engine(db_uri: str):
    """An engine that cannot write: SQLite through a `mode=ro` file URI, any other database with
    every session READ ONLY (MLflow's own engine set-up otherwise: its SQLite functions, pool options)."""
    from mlflow.store.db.utils import create_sqlalchemy_engine
    from sqlalchemy import event

    path = _sqlite_file(db_uri)
    if path is not None:
        # pysqlite's `uri=true`: the file is opened read-only and never created.
        return create_sqlalchemy_engine(f"sqlite:///file:{quote(str(path))}?mode=ro&uri=true")
    engine = create_sqlalchemy_engine(db_uri)

    @event.listens_for(engine, "connect")
    def _read_only(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        if engine.dialect.name == "postgresql":
            cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        elif engine.dialect.name == "mysql":
            cur.execute("SET SESSION TRANSACTION READ ONLY")
        cur.close()

    return engine


def schema_revisions() -> tuple[str, list[str]]:
    """This MLflow's head schema revision and every revision it knows (newest first)."""
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    script = ScriptDirectory.from_config(_get_alembic_config(db_url=""))
    known = [r.revision for r in script.walk_revisions()]
    return script.get_current_head(), known


def schema_note(revision: str | None) -> str | None:
    """None when the store's schema is this MLflow's; else what to read it with."""
    import mlflow

    head, known = schema_revisions()
    if revision == head:
        return None
    if revision in known:
        behind = known.index(revision)
        return (f"the store's schema is revision {revision}, {behind} migration(s) older than this MLflow "
                f"{mlflow.__version__} (revision {head}); rldiag never migrates a store: read it with the MLflow "
                f"that wrote it (pip install 'mlflow<{mlflow.__version__}'), or upgrade the store yourself after a "
                "backup (mlflow db upgrade URI)")
    return (f"the store's schema revision {revision!r} is unknown to this MLflow {mlflow.__version__} (revision "
            f"{head}): a newer MLflow wrote it; upgrade the reading side (pip install -U mlflow)")


def _schema_revision(engine) -> str | None:
    import sqlalchemy

    with engine.connect() as con:
        if not sqlalchemy.inspect(con).has_table("alembic_version"):
            return None
        row = con.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).first()
        return row[0] if row else None


def _make_store_class() -> type:
    from mlflow.exceptions import MlflowException
    from mlflow.store.db.utils import _get_managed_session_maker
    from mlflow.store.tracking.abstract_store import AbstractStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.utils.uri import extract_db_type_from_uri, resolve_uri_if_local
    from sqlalchemy.orm import sessionmaker

    class ReadOnlySqlStore(SqlAlchemyStore):
        """`SqlAlchemyStore` without its constructor's writes (migrations, default experiment)."""

        def __init__(self, db_uri: str, default_artifact_root: str | None = None):
            AbstractStore.__init__(self)
            self.db_uri = db_uri
            self.db_type = extract_db_type_from_uri(db_uri)
            # Only new experiments use the root (never created here); runs carry their own artifact URI.
            self.artifact_root_uri = resolve_uri_if_local(default_artifact_root or "./mlruns")
            self.engine = _engine(db_uri)
            self.read_engine = None
            self.schema_revision = _schema_revision(self.engine)
            self.schema_note = schema_note(self.schema_revision)
            managed = _get_managed_session_maker(sessionmaker(bind=self.engine), self.db_type)
            note = self.schema_note

            def session(read_only: bool = True):
                # A query that this MLflow's schema no longer fits says why, not only SQLAlchemy's words.
                return _explained(managed(read_only=read_only), note, MlflowException)

            self.ManagedSessionMaker = session

    return ReadOnlySqlStore


_quiet = threading.local()


class _DropWhileQuiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_quiet, "on", False)


@functools.cache
def _install_filter() -> None:
    logging.getLogger("mlflow.store.db.utils").addFilter(_DropWhileQuiet())


@contextlib.contextmanager
def _quiet_session_errors():
    """MLflow logs a database error with its traceback before raising it; the read side raises it
    as one line instead (on this thread only: a writer's errors in the same process still log)."""
    _install_filter()
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = False


class _explained:
    """A session context whose database errors carry the schema note (when the schema differs)."""

    def __init__(self, ctx, note: str | None, error_type):
        self.ctx, self.note, self.error_type = ctx, note, error_type

    def __enter__(self):
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        try:
            with _quiet_session_errors():
                return self.ctx.__exit__(*exc)
        except self.error_type as e:
            if self.note is None:
                raise
            first = str(e.message).strip().splitlines()[0] if str(e.message).strip() else type(e).__name__
            from rldiag.app.errors import redact

            first = redact(first)
            raise self.error_type(f"{first}: {self.note}", error_code=e.error_code) from None


@functools.cache
def store_class() -> type:
    """`ReadOnlySqlStore`, built on first use: importing this module loads no mlflow."""
    return _make_store_class()


@functools.cache
def tag_store_class() -> type:
    """`TagWriteSqlStore`: `ReadOnlySqlStore` with a writable engine, refusing any schema but this MLflow's."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.db.utils import _get_managed_session_maker, create_sqlalchemy_engine
    from sqlalchemy.orm import sessionmaker

    base = store_class()

    class TagWriteSqlStore(base):
        def __init__(self, db_uri: str, default_artifact_root: str | None = None):
            super().__init__(db_uri, default_artifact_root)
            self.engine.dispose()
            if self.schema_note is not None:
                raise MlflowException(f"rldiag watch --tag-runs writes tags without migrating the store, and "
                                      f"{self.schema_note}; or leave out --tag-runs (alerts still go to the log, "
                                      "file and webhook)")
            self.engine = create_sqlalchemy_engine(db_uri)  # MLflow's own engine: no migration happens here
            self.ManagedSessionMaker = _get_managed_session_maker(sessionmaker(bind=self.engine), self.db_type)

    return TagWriteSqlStore
