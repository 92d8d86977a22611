"""`rldiag app`: its help, a bad port and a taken port give one clear line, the command it runs."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from rldiag.app.cli.app import streamlit_command
from rldiag.app.cli.main import main
from tests.helpers.net import free_port
from tests.helpers.runs import write_run


def test_help_names_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["app", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "open the dashboard in the browser" in out
    for option in ("--tracking-uri", "--host", "--port", "--no-browser", "--experiment", "default: 8501"):
        assert option in out


@pytest.mark.parametrize("port", ["99999", "0", "eighty"])
def test_bad_port_is_one_line_with_the_allowed_range(port, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["app", "--port", port])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --port: {port!r} is not a TCP port: use a number from 1 to 65535" in err
    assert "Traceback" not in err


def test_taken_port_says_to_pick_another(store_uri, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["app", "--port", str(port), "--no-browser", "--tracking-uri", store_uri]) == 2
    err = capsys.readouterr().err
    assert f"rldiag app: error: cannot serve on 127.0.0.1:{port}" in err and "--port" in err


def test_streamlit_command_is_headless_on_the_given_address():
    cmd = streamlit_command("0.0.0.0", 8600)
    assert cmd[:4] == [sys.executable, "-m", "rldiag.app.dashboard.serve", "run"] and cmd[4].endswith("app/dashboard/streamlit_app.py")
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags == {"--server.headless": "true", "--server.address": "0.0.0.0", "--server.port": "8600",
                     "--browser.gatherUsageStats": "false", "--server.fileWatcherType": "none",
                     "--client.toolbarMode": "viewer"}  # no "Deploy" button on a local read-only tool


def test_a_bad_uri_or_experiment_exits_2_before_serving(store_uri, capsys, tmp_path):
    assert main(["app", "--tracking-uri", "mlruns.db", "--no-browser"]) == 2
    assert "did you mean sqlite:///" in capsys.readouterr().err
    assert main(["app", "--tracking-uri", f"sqlite:///{tmp_path / 'missing.db'}", "--no-browser"]) == 2
    assert "does not exist" in capsys.readouterr().err
    write_run(store_uri, experiment="grpo", name="r")
    assert main(["app", "--tracking-uri", store_uri, "--experiment", "gpro", "--no-browser"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'gpro' is not in the store" in err and "'grpo'" in err


@pytest.mark.slow
def test_sigterm_stops_the_streamlit_server_too(store_uri, tmp_path):
    port = free_port()
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "rldiag.app.cli.main", "app", "--tracking-uri", store_uri,
                             "--port", str(port), "--no-browser"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/_stcore/health"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the dashboard never answered: " + (tmp_path / "app.log").read_text())
        proc.send_signal(signal.SIGTERM)  # what kill, systemd and Kubernetes send
        assert proc.wait(timeout=30) == 0
        with pytest.raises(OSError):  # nothing serves the port any more
            urllib.request.urlopen(url, timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
