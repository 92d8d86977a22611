"""A real `mlflow server --workers 1` (`workers=N`) on 127.0.0.1 over a SQLite file, which can be killed and restarted.

`MlflowServer(root, backend_store_uri=..., serve_artifacts=True)` puts it over another store (the
PostgreSQL tests) and proxies artifacts (`--serve-artifacts --artifacts-destination root/artifacts`).

Also the dashboard's server (`start_dashboard`), process groups (`stop_group`) and the CPU seconds processes
used, from /proc (`group_cpu_s`; `others_cpu`: every process but this one and its descendants).

Shared by the benchmarks and the tests (`tests/helpers/net.py` imports it); it does not import pytest.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None, *, backend_store_uri: str | None = None,
                 serve_artifacts: bool = False, workers: int = 1):
        self.root = root
        self.port = port or free_port()
        self.db = root / "server.db"
        self.backend_store_uri = backend_store_uri or f"sqlite:///{self.db}"
        self.serve_artifacts = serve_artifacts  # clients upload through the server, as a team's would
        self.workers = workers  # uvicorn workers (bench.team_load runs 2, as a team's server would)
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> float:
        """Start and wait for a 200 on /health; returns the seconds that took."""
        t0 = time.monotonic()
        cmd = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", str(self.workers), "--backend-store-uri", self.backend_store_uri,
        ]
        if self.serve_artifacts:
            cmd += ["--serve-artifacts", "--artifacts-destination", str(self.root / "artifacts")]
        else:
            cmd += ["--default-artifact-root", str(self.root / "artifacts")]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
        log.close()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"mlflow server did not answer /health within {timeout}s; see {self.root / 'server.log'}")

    def signal(self, sig: int) -> None:
        """Send `sig` to the server's process group (SIGSTOP/SIGCONT freeze and thaw it)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the server's whole process group (the server and its worker)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


REPO = Path(__file__).resolve().parent.parent


def start_dashboard(uri: str, log: Path, *, env: dict[str, str] | None = None,
                    timeout: float = 240) -> tuple[subprocess.Popen, str, float]:
    """`rldiag app --tracking-uri uri` on a free port in its own process group, output to `log`;
    returns the process, its URL and the seconds until /_stcore/health said ok (RuntimeError, with
    the log's tail, when it did not)."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "rldiag.app.cli.main", "app", "--tracking-uri", uri,
                             "--port", str(port), "--no-browser"], cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", **(env or {})))
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "_stcore/health", timeout=2) as r:
                if r.read() == b"ok":
                    return proc, url, time.perf_counter() - t0
        except OSError:
            time.sleep(0.1)
    stop_group(proc, timeout=0)
    raise RuntimeError(f"the dashboard did not come up: {log.read_text()[-2000:]}")


def stop_group(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM `proc`'s process group, SIGKILL after `timeout` s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM if timeout else signal.SIGKILL)
            proc.wait(timeout=timeout or 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def _proc_stats() -> dict[int, tuple[int, int, float]]:
    """Every live process's (parent, process group, CPU seconds so far: user + system), from Linux /proc."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process ended meanwhile
            continue
        # after the name: state, ppid, pgrp, ..., utime (12th), stime (13th)
        out[int(stat.parent.name)] = (int(fields[1]), int(fields[2]),
                                      (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def group_cpu_s(group: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `group` (Linux /proc)."""
    return sum(cpu for _, pgrp, cpu in _proc_stats().values() if pgrp == group)


def others_cpu() -> dict[int, float]:
    """CPU seconds so far of every live process that is not this one or its descendants (the server, the
    browser, Playwright's driver, the busy core): other work on the machine (Linux /proc)."""
    stats = _proc_stats()
    me, out = os.getpid(), {}
    for pid, (_, _, cpu) in stats.items():
        p, seen = pid, 0
        while p in stats and p != me and seen < 64:  # up the parents to init, or to this process
            p, seen = stats[p][0], seen + 1
        if p != me:
            out[pid] = cpu
    return out


def others_cpu_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds other work used between two `others_cpu` snapshots (processes alive at the second; one that
    started and ended between them is missed)."""
    return round(sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items()), 1)
