"""`rldiag app`: its help, a bad port and a taken port give one clear line, the command it runs."""

from __future__ import annotations

import socket
import sys

import pytest

from rldiag.app.cli.app import streamlit_command
from rldiag.app.cli.main import main


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


def test_taken_port_says_to_pick_another(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["app", "--port", str(port), "--no-browser", "--tracking-uri", "sqlite:///x.db"]) == 2
    err = capsys.readouterr().err
    assert f"rldiag app: error: cannot serve on 127.0.0.1:{port}" in err and "--port" in err


def test_streamlit_command_is_headless_on_the_given_address():
    cmd = streamlit_command("0.0.0.0", 8600)
    assert cmd[:4] == [sys.executable, "-m", "streamlit", "run"] and cmd[4].endswith("app/dashboard/streamlit_app.py")
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags == {"--server.headless": "true", "--server.address": "0.0.0.0", "--server.port": "8600",
                     "--browser.gatherUsageStats": "false", "--server.fileWatcherType": "none"}
