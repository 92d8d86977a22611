"""Every way a training process ends also ends its MLflow run, with every point logged before it.

Each test runs a real training process (`subprocess`: a small torch loop under `Monitor`, or a
`RunSession`) against a real SQLite store: SIGTERM and SIGINT mid-run (the run ends KILLED, then the
process goes on with its own handling of the signal), interpreter exit without `close()` (FINISHED),
and `os.fork()` (the child has no writer of its parent).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

REPO = Path(__file__).resolve().parents[2]
CLOSE_TIMEOUT = 120  # RLDIAG_CLOSE_TIMEOUT in the child: a hang until it would show

TRAINER = textwrap.dedent("""
    import signal, sys, time
    import torch
    from rldiag.collectors import Monitor

    uri, mode = sys.argv[1], sys.argv[2]
    # as a trainer started from a terminal has them: a suite run as a background job of a non-interactive
    # shell (`make test &`) hands its children SIGINT ignored, which rldiag rightly leaves alone
    # ("no-close" checks that for SIGTERM), and Ctrl-C would then test nothing
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if mode == "trainer-handler":  # the trainer's own handler, installed before rldiag's
        def mine(signum, frame):
            print("trainer handler", signum, flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)
    if mode == "no-close":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignored on purpose: rldiag must leave it so
    model = torch.nn.Linear(2, 1)
    mon = Monitor("exit-paths", run_name=mode, tracking_uri=uri, policy="warn")
    print("run", mon.run_id, flush=True)
    print("handlers", signal.getsignal(signal.SIGTERM) is signal.SIG_IGN,
          getattr(signal.getsignal(signal.SIGINT), "__module__", None), flush=True)
    step = 0
    while True:
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        if step == 3:
            model.weight.grad.fill_(float("nan"))  # an alert fires: the alerts artifact must be stored
        mon.step(step, model, loss=loss)
        model.zero_grad()
        print("logged", step, flush=True)
        step += 1
        if mode == "no-close" and step == 300:
            break  # the script ends without close(): interpreter exit must end the run
        time.sleep(0.002)
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "RLDIAG_CLOSE_TIMEOUT": str(CLOSE_TIMEOUT),
            "MLFLOW_DISABLE_TELEMETRY": "true"}


def _trainer(uri: str, mode: str, cwd: Path, sig: int | None = None, after_step: int = 60):
    """Run TRAINER; with `sig`, send it once `after_step` is logged. Returns (proc, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, uri, mode], cwd=cwd, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = []
    try:
        if sig is not None:
            for line in proc.stdout:
                head.append(line)
                if line.strip() == f"logged {after_step}":
                    proc.send_signal(sig)  # mid-run: the loop keeps logging until the handler runs
                    break
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, "".join(head) + out, err


def _check_run(uri: str, out: str, status: str, tmp_path: Path) -> None:
    run_id = re.search(r"^run (\w+)$", out, re.MULTILINE).group(1)
    printed = [int(s) for s in re.findall(r"^logged (\d+)$", out, re.MULTILINE)]
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == status
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    # every point logged before the process ended is stored, once (and nothing it never logged)
    assert steps == list(range(len(steps))) and len(steps) >= len(printed) > 0
    assert sorted(m.step for m in client.get_metric_history(run_id, "grad/finite")) == steps
    local = client.download_artifacts(run_id, "rldiag/alerts.jsonl", str(tmp_path))
    events = [json.loads(line) for line in Path(local).read_text().splitlines()]
    assert [e["step"] for e in events] == [3] and events[0]["params"] == ["weight"]


@pytest.mark.slow
@pytest.mark.parametrize("mode,sig,rc", [
    ("default", signal.SIGTERM, -signal.SIGTERM),  # default action again: killed by SIGTERM
    ("default", signal.SIGINT, -signal.SIGINT),  # Python's KeyboardInterrupt, uncaught: killed by SIGINT
    ("trainer-handler", signal.SIGTERM, 7),  # the trainer's own handler runs after rldiag's
], ids=["sigterm", "sigint", "sigterm-trainer-handler"])
def test_signal_mid_run_drains_ends_killed_and_chains(sqlite_uri, tmp_path, mode, sig, rc):
    proc, out, err = _trainer(sqlite_uri, mode, tmp_path, sig)
    assert proc.returncode == rc, err[-3000:]
    assert "ending run(s)" in err and "KILLED" in err
    assert ("trainer handler 15" in out) == (mode == "trainer-handler")
    assert "not delivered" not in err
    _check_run(sqlite_uri, out, "KILLED", tmp_path)


@pytest.mark.slow
def test_exit_without_close_ends_the_run_finished(sqlite_uri, tmp_path):
    proc, out, err = _trainer(sqlite_uri, "no-close", tmp_path)
    assert proc.returncode == 0, err[-3000:]
    # an ignored SIGTERM stays ignored; SIGINT's Python default handler is chained by rldiag's
    assert "handlers True rldiag.collectors.session" in out
    _check_run(sqlite_uri, out, "FINISHED", tmp_path)
    printed = re.findall(r"^logged (\d+)$", out, re.MULTILINE)
    run_id = re.search(r"^run (\w+)$", out, re.MULTILINE).group(1)
    assert len(MlflowClient(sqlite_uri).get_metric_history(run_id, "loss")) == len(printed) == 300


FORK = textwrap.dedent("""
    import os, sys, time
    from rldiag.collectors.session import RunSession

    s = RunSession("exit-paths", run_name="fork", tracking_uri=sys.argv[1])
    for step in range(100):
        s.writer.log_metrics({"m": float(step)}, step)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: it must not drain, end or log to its parent's run
        try:
            s.writer.log_metrics({"m": -1.0}, 1000)
        except Exception as e:
            print("child error:", type(e).__name__, e, flush=True)
        s.close()
        sys.exit(0)  # a normal exit: the atexit handlers run
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), "after", time.monotonic() - t0, flush=True)
    for step in range(100, 200):
        s.writer.log_metrics({"m": float(step)}, step)
    st = s.close()
    print("parent", s.run_id, st.delivered, st.undelivered, flush=True)
""")


@pytest.mark.slow
def test_forked_child_has_no_writer_of_its_parent(sqlite_uri, tmp_path):
    proc = subprocess.run([sys.executable, "-c", FORK, sqlite_uri], cwd=tmp_path, env=_env(), text=True,
                          capture_output=True, timeout=2 * CLOSE_TIMEOUT + 60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = re.search(r"^child exit (-?\d+) after ([\d.]+)$", proc.stdout, re.MULTILINE)
    assert child is not None and child.group(1) == "0", proc.stdout
    # the child returned promptly: far from the close timeout it would have waited for its parent's threads
    assert float(child.group(2)) < CLOSE_TIMEOUT / 2
    assert "not delivered" not in proc.stderr and "undelivered" not in proc.stderr
    assert "child error: ForkedWriterError" in proc.stdout and "was forked from pid" in proc.stdout
    run_id, delivered, undelivered = re.search(r"^parent (\w+) (\d+) (\d+)$", proc.stdout, re.MULTILINE).groups()
    assert (delivered, undelivered) == ("200", "0")
    client = MlflowClient(sqlite_uri)
    assert sorted(m.step for m in client.get_metric_history(run_id, "m")) == list(range(200))  # not the child's
    assert client.get_run(run_id).info.status == "FINISHED"
