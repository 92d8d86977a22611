"""The `rldiag` command as a user runs it: the installed console script, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlflow import MlflowClient

from tests.helpers.net import free_port

RLDIAG = str(Path(sys.executable).parent / "rldiag")


def rldiag(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([RLDIAG, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands(tmp_path):
    out = rldiag("--help", cwd=tmp_path)
    assert out.returncode == 0
    for word in ("demo", "sync", "MLFLOW_TRACKING_URI", "mlruns.db"):
        assert word in out.stdout
    demo = rldiag("demo", "--help", cwd=tmp_path)
    assert demo.returncode == 0 and "--nan-at" in demo.stdout and "--policy" in demo.stdout


def test_demo_writes_default_sqlite_store_and_reports_nan(tmp_path):
    out = rldiag("demo", "--steps", "4", "--nan-at", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "mlruns.db").exists()  # the embedded default, in the working directory
    assert "first non-finite step: 3" in out.stdout
    assert "non-finite gradients" in out.stderr and "at step 3" in out.stderr  # the alert, in the log
    run_id = out.stdout.split()[1]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    finite = {m.step: m.value for m in client.get_metric_history(run_id, "grad/finite")}
    assert finite == {s: (0.0 if s == 3 else 1.0) for s in range(8)}  # 4 rollouts x 2 optimizer steps
    run = client.get_run(run_id)
    assert run.data.params["loop.nan_at"] == "3" and run.data.tags["rldiag.alert.first_step"] == "3"


def test_unreachable_server_is_one_clear_line(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    out = rldiag("demo", "--steps", "1", "--tracking-uri", uri, cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert uri in out.stderr and "MLFLOW_TRACKING_URI" in out.stderr


def test_sync_missing_and_foreign_files(tmp_path):
    out = rldiag("sync", str(tmp_path / "nope.jsonl"), cwd=tmp_path)
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr
    foreign = tmp_path / "x.jsonl"
    foreign.write_text('{"hello": 1}\n')
    out = rldiag("sync", str(foreign), cwd=tmp_path)
    # named on its own: exit 2, one line saying why it was skipped, and the user's file as it was
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (out.stdout + out.stderr).strip() == (f"{foreign}: skipped: not an rldiag journal (its first line is not "
                                                 "an rldiag journal header); left as it is")
    assert foreign.read_text() == '{"hello": 1}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]


def test_help_has_an_example_for_every_command(tmp_path):
    from rldiag.app.cli.main import COMMANDS, EPILOG

    shown = {line.split()[1] for line in EPILOG.splitlines() if line.startswith("  rldiag ")}
    assert set(COMMANDS) <= shown, set(COMMANDS) - shown


def test_demo_refuses_a_nan_step_outside_the_run_in_one_line(tmp_path):
    for args, says in [(("--nan-at", "-5"), "-5 is negative"),
                       (("--steps", "4", "--nan-at", "8"), "--nan-at 8 is outside the run's optimizer steps 0-7"),
                       (("--steps", "0"), "0: give 1 or more")]:
        out = rldiag("demo", *args, cwd=tmp_path)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "mlruns.db").exists()  # refused before anything was written


def test_detector_help_is_short_and_lists_on_request(tmp_path):
    out = rldiag("report", "--help", cwd=tmp_path)
    assert "`--detector help` lists every option" in out.stdout and "k_per_halving" not in out.stdout
    listed = rldiag("report", "--detector", "help", cwd=tmp_path)
    assert listed.returncode == 0 and "  k=" in listed.stdout and "  window=" in listed.stdout, listed


HEAVY = ("torch", "mlflow", "pandas", "plotly", "streamlit", "vllm", "transformers", "numpy", "sqlalchemy")


def test_no_command_help_imports_a_heavy_library():
    """`rldiag COMMAND --help` stays instant (bench.cli_help measures it): it imports none of the libraries
    a command needs when it runs."""
    from rldiag.app.cli.main import COMMANDS

    probe = ("import sys, contextlib, io\nfrom rldiag.app.cli.main import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    try:\n        main(sys.argv[1:])\n    except SystemExit:\n        pass\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    for command in ["", *COMMANDS]:
        args = [command, "--help"] if command else ["--help"]
        out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "[]", (command, out.stdout, out.stderr[-500:])


def test_report_into_an_unwritable_folder_fails_before_reading_the_store(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for args in (["--group", "g", "--out", str(blocker / "reports")], ["--all-groups", "--out", str(blocker)]):
        out = rldiag("report", *args, cwd=tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"rldiag report: error: cannot write the report into '{blocker}"), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no store opened, nothing written


def test_watch_help_says_it_tells_an_ess_drop_with_a_rising_mismatch(tmp_path):
    out = rldiag("watch", "--help", cwd=tmp_path)
    assert out.returncode == 0
    assert "is_degenerate" in out.stdout and "policy/ess" in out.stdout and "mismatch/low_prob_share" in out.stdout
