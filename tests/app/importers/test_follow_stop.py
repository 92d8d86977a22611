"""`rldiag import --follow` stopped by SIGTERM (`kill`, systemd, Kubernetes; a backgrounded `... --follow &` does
not get Ctrl-C) ends its MLflow runs as Ctrl-C does, never leaving them RUNNING for the watcher."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.helpers.importers import imported_runs, write_tensorboard


def test_sigterm_ends_the_followed_runs_finished(store_uri, tmp_path):
    logdir = tmp_path / "tb"
    write_tensorboard(logdir / "run1", [(s, {"actor/grad_norm": 1.0}) for s in range(5)])
    proc = subprocess.Popen([sys.executable, "-m", "rldiag.app.cli.main", "import", "tensorboard", str(logdir),
                             "--follow", "--interval", "0.2", "--tracking-uri", store_uri],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not imported_runs(store_uri) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        (run,) = imported_runs(store_uri)
        assert run.info.status == "RUNNING"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "stopped following" in out and "ended FINISHED" in out, out
    (run,) = imported_runs(store_uri)
    assert run.info.status == "FINISHED"
