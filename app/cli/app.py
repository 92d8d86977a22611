"""`rldiag app`: serve the dashboard with Streamlit against the tracking store, print its URL.

    rldiag app                                   # ./mlruns.db (or $MLFLOW_TRACKING_URI), http://127.0.0.1:8501
    rldiag app --tracking-uri http://mlflow:5000 --host 0.0.0.0 --port 8600 --no-browser
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from rldiag.app.cli.options import CliError, add_detector_option, add_tracking_option, store_failed
from rldiag.app.dashboard import LOCAL_HOSTS, RLDIAG_ALLOW_URI_INPUT, RLDIAG_EXPERIMENT, RLDIAG_TRACKING_URI
from rldiag.collectors.uri import redact_uri

if importlib.util.find_spec("streamlit") is None:  # `rldiag app` names the [app] extra (rldiag.app.cli.main)
    raise ModuleNotFoundError("No module named 'streamlit'", name="streamlit")

APP = Path(__file__).resolve().parents[1] / "dashboard" / "streamlit_app.py"


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: use a number from 1 to 65535, e.g. 8501")
    return port


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_tracking_option(p, read=True)
    add_detector_option(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default: 127.0.0.1; 0.0.0.0 serves the whole network)")
    p.add_argument("--port", type=_port, default=8501, help="TCP port (default: 8501)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    p.add_argument("--experiment", default=None, metavar="NAME", help="experiment to open with (default: the newest)")
    p.add_argument("--allow-uri-input", action="store_true",
                   help="let the sidebar take a typed tracking URI (localhost only: whoever can type it makes "
                        "the server open that file or URL with this machine's credentials)")


def streamlit_command(host: str, port: int) -> list[str]:
    """The `streamlit run` command line of the dashboard (headless: the URL is printed, not prompted),
    through `rldiag.app.dashboard.serve` (it pays the first page load's imports while the server starts)."""
    return [sys.executable, "-m", "rldiag.app.dashboard.serve", "run", str(APP), "--server.headless", "true",
            "--server.address", host, "--server.port", str(port), "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--client.toolbarMode", "viewer"]


def _check_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise CliError(f"cannot serve on {host}:{port} ({e.strerror or e}): pick another with --port, "
                           "e.g. --port 8502, or another --host") from None


def _open_when_up(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    import webbrowser

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url + "_stcore/health", timeout=2).close()
            webbrowser.open(url)
            return
        except OSError:
            time.sleep(0.3)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_store(uri: str, experiment: str | None) -> None:
    """CliError when the store does not answer or has no experiment `experiment`."""
    from rldiag.app.data.runs import pages
    from rldiag.app.data.store import open_store, store_errors
    from rldiag.app.errors import DataError

    try:
        store = open_store(uri)
        if experiment is not None and store.client.get_experiment_by_name(experiment) is None:
            names = sorted(e.name for e in pages(store.client.search_experiments))
            raise CliError(f"--experiment {experiment!r} is not in the store; it has {', '.join(map(repr, names)) or 'none'}"
                           "; pick one of them, or leave --experiment out to open the newest")
    except DataError as e:
        raise CliError(str(e)) from None
    except store_errors() as e:
        raise store_failed(uri, e) from None


def run(args: argparse.Namespace) -> int:
    from rldiag.collectors.settings import default_tracking_uri

    uri = args.tracking_uri or default_tracking_uri()
    if args.allow_uri_input and args.host not in LOCAL_HOSTS:
        raise CliError(f"--allow-uri-input with --host {args.host}: anyone who can reach the page could make this "
                       "server open any file or URL; serve on --host 127.0.0.1 with it, or drop --allow-uri-input")
    _check_store(uri, args.experiment)  # a bad URI or experiment: exit 2 now, not a page that says so later
    _check_free(args.host, args.port)
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", **{RLDIAG_TRACKING_URI.name: uri})
    if args.experiment:
        env[RLDIAG_EXPERIMENT.name] = args.experiment
    env[RLDIAG_ALLOW_URI_INPUT.name] = "1" if args.allow_uri_input else "0"  # never inherited from the shell
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{'[' + shown_host + ']' if ':' in shown_host else shown_host}:{args.port}/"
    print(f"rldiag dashboard: {url}  (store {redact_uri(uri)}; Ctrl+C stops it)", flush=True)
    proc = subprocess.Popen(streamlit_command(args.host, args.port), env=env)
    if not args.no_browser:
        threading.Thread(target=_open_when_up, args=(url, proc), daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (kill, systemd, Kubernetes) stops the Streamlit server too, as Ctrl+C does
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 0
