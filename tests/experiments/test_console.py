"""An experiment's terminal holds rldiag's own lines and progress bars; what libraries print, from Python,
native code or child processes, goes to the log file named in one line. Run in a fresh interpreter, as a
terminal session would: pytest's own capture replaces sys.stdout."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import logging, subprocess, sys, warnings
    from pathlib import Path
    from rldiag.experiments.console import library_output_to, log_file
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # as the rldiag command sets it up
    path = log_file("probe", Path(sys.argv[1]))
    try:
        with library_output_to(path) as term:
            print("a library's print")
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
            logging.getLogger("vllm.probe").warning("a library's log line")
            subprocess.run([sys.executable, "-c", "import os; os.write(2, b'a child process on fd 2\\\\n')"])
            logging.getLogger("rldiag.writer").warning("rldiag: an alert at step 3")
            print("a progress line", file=term)
            if sys.argv[2] == "fail":
                raise RuntimeError("engine died")
    finally:
        print("after", logging.getLogger("rldiag").propagate)  # the descriptors and the logger are back
""")


def probe(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), mode], capture_output=True, text=True,
                         timeout=120)
    [log] = tmp_path.glob("probe-*.log")
    return out, log.read_text()


def test_library_output_goes_to_the_log_and_rldiag_lines_to_the_terminal(tmp_path):
    out, log = probe(tmp_path, "ok")
    assert out.returncode == 0, out.stderr
    for line in ("a library's print", "a library's warning", "a library's log line", "a child process on fd 2"):
        assert line in log and line not in out.stdout + out.stderr, line
    assert out.stderr.startswith("library warnings and logs: ") and out.stderr.count("\n") == 3, out.stderr
    assert "rldiag: an alert at step 3" in out.stderr and "a progress line" in out.stderr and "rldiag:" not in log
    assert out.stdout == "after True\n"


def test_a_failure_inside_names_the_log(tmp_path):
    out, log = probe(tmp_path, "fail")
    assert out.returncode == 1 and "RuntimeError: engine died" in out.stderr  # the traceback, on the terminal
    assert "failed: the libraries' output is in " in out.stderr and "a library's print" in log
