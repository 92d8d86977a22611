"""A throwaway PostgreSQL server on 127.0.0.1 (Debian's postgresql), for the team-scale tests.

    with PostgresServer() as pg:         # initdb in a fresh temp dir, postgres on a free port
        pg.url                           # postgresql+psycopg2://rldiag:<random>@127.0.0.1:<port>/mlflow

`initdb` and `postgres` refuse to run as root. As root (CI) the cluster directory belongs to the
`postgres` user that Debian's package creates and the server runs as that user (`Popen(user=...)`,
what `runuser -u postgres --` does); as anyone else it runs as the caller. The cluster is in a new
directory under the system temp dir (not pytest's tmp_path: that is mode 0700 under root's tree,
which the `postgres` user cannot enter) and is removed by `stop()`.

Durability is off (`fsync`, `synchronous_commit`, `full_page_writes`): the data is thrown away and the
machine is shared; nothing a client sees changes. Like `bench/_server.py`, this does not import pytest
(the benchmarks use it too):
a missing binary raises `PostgresMissing`, whose message says `sudo make sysdeps`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.helpers.net import free_port

FIX = "install it with `sudo make sysdeps` (Debian's postgresql package; CI runs it as root via `make test`)"
SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "50",
}


class PostgresMissing(RuntimeError):
    """PostgreSQL's server binaries (or, as root, the `postgres` user) are not installed."""


def find_bindir() -> Path:
    """The folder holding `initdb` and `postgres`: $PATH first, then Debian's /usr/lib/postgresql/<ver>/bin."""
    on_path = shutil.which("initdb"), shutil.which("postgres")
    if all(on_path):
        return Path(on_path[0]).parent
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                    key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    for initdb in reversed(debian):
        if (initdb.parent / "postgres").is_file():
            return initdb.parent
    raise PostgresMissing(f"PostgreSQL server binaries (initdb, postgres) not found on $PATH or under "
                          f"/usr/lib/postgresql/*/bin; {FIX}")


def _server_user() -> tuple[int, int] | None:
    """(uid, gid) to run initdb/postgres as when we are root, else None (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresMissing(f"running as root, and initdb refuses root, but there is no `postgres` user "
                              f"to run it as; {FIX}") from None
    return pw.pw_uid, pw.pw_gid


class PostgresServer:
    """One PostgreSQL cluster: a superuser `user` with a random password and an empty `database`."""

    def __init__(self, *, port: int | None = None, user: str = "rldiag", database: str = "mlflow"):
        self.port = port or free_port()
        self.user, self.database = user, database
        self.password = secrets.token_urlsafe(16)
        self.bindir: Path | None = None
        self.base: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # seconds the last start() took

    @property
    def url(self) -> str:
        """MLflow/SQLAlchemy URI of `database`. The driver is named: SQLAlchemy 2.1 maps a bare
        `postgresql://` to psycopg 3, and the installed driver is psycopg2 (`psycopg2-binary`)."""
        return "postgresql+psycopg2://" + self.dsn_for(self.database).split("://", 1)[1]

    def dsn_for(self, database: str) -> str:
        """libpq URI (what `psycopg2.connect` takes) of `database`."""
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    @property
    def log_path(self) -> Path:
        assert self.base is not None, "start() first"
        return self.base / "postgres.log"

    def _run_as(self) -> dict:
        ids = _server_user()
        return {} if ids is None else {"user": ids[0], "group": ids[1], "extra_groups": []}

    def start(self, timeout: float = 60.0) -> float:
        """initdb, start postgres, create `database`; returns the seconds that took."""
        t0 = time.monotonic()
        self.bindir = find_bindir()
        as_user = self._run_as()  # raises PostgresMissing before anything is created
        self.base = Path(tempfile.mkdtemp(prefix="rldiag-pg-"))
        if as_user:
            os.chown(self.base, as_user["user"], as_user["group"])
        pwfile = self.base / "pwfile"
        pwfile.write_text(self.password + "\n")
        pwfile.chmod(0o600)
        if as_user:
            os.chown(pwfile, as_user["user"], as_user["group"])
        data = self.base / "data"
        init = subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(data), "-U", self.user, f"--pwfile={pwfile}",
             "--auth-host=scram-sha-256", "--auth-local=trust", "--encoding=UTF8", "--locale=C", "--no-sync"],
            cwd=self.base, capture_output=True, text=True, timeout=timeout, **as_user)
        pwfile.unlink()
        if init.returncode != 0:
            self.stop()
            raise RuntimeError(f"initdb failed ({init.returncode}): {init.stderr[-2000:]}")

        settings = {**SERVER_SETTINGS, "port": str(self.port), "unix_socket_directories": str(self.base)}
        cmd = [str(self.bindir / "postgres"), "-D", str(data)]
        for k, v in settings.items():
            cmd += ["-c", f"{k}={v}"]
        with open(self.log_path, "ab") as log:
            if as_user:
                os.chown(self.log_path, as_user["user"], as_user["group"])
            self.proc = subprocess.Popen(cmd, cwd=self.base, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, **as_user)
        self._wait_ready(t0, timeout)
        import psycopg2

        con = psycopg2.connect(self.dsn_for("postgres"))
        try:
            con.autocommit = True  # CREATE DATABASE cannot run inside a transaction
            with con.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{self.database}"')
        finally:
            con.close()
        self.start_s = time.monotonic() - t0
        return self.start_s

    def _wait_ready(self, t0: float, timeout: float) -> None:
        import psycopg2

        while time.monotonic() - t0 < timeout:
            rc = self.proc.poll()
            if rc is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"postgres exited with status {rc}: {tail}")
            try:
                psycopg2.connect(self.dsn_for("postgres"), connect_timeout=2).close()
                return
            except psycopg2.OperationalError:
                time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"postgres did not accept connections within {timeout}s: {tail}")

    def connect(self):
        """A psycopg2 connection to `database` (the caller closes it)."""
        import psycopg2

        return psycopg2.connect(self.dsn_for(self.database))

    def stop(self) -> None:
        """Fast shutdown (SIGINT), SIGKILL after 30 s, then remove the cluster directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.proc = None
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
