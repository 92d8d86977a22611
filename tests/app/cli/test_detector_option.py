"""`--detector KEY=VALUE`: one options object for the divergence detector, from the command line, for
`rldiag report` and `rldiag watch` (and, through $RLDIAG_DETECTOR, the dashboard's server)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from rldiag.collectors import keys as K
from tests.helpers.runs import write_run


def _rldiag(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("rldiag")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def _store(uri: str) -> None:
    rng = np.random.default_rng(0)
    for i in range(2):
        write_run(uri, name=f"ref{i}", tags={K.TAG_GROUP: "g", K.TAG_ROLE: "reference"},
                  steps=[(s, {K.RATIO_MEAN: 1.0 + rng.normal(0, 0.01)}) for s in range(200)])
    # 0.05 off from step 100: 5 noise sd (the detector's defaults flag it; a bar of 50 sd does not)
    write_run(uri, name="cand", tags={K.TAG_GROUP: "g", K.TAG_ROLE: "candidate"},
              steps=[(s, {K.RATIO_MEAN: 1.0 + rng.normal(0, 0.01) + (0.05 if s >= 100 else 0.0)}) for s in range(200)])


def test_report_and_watch_take_detector_options(store_uri, tmp_path):
    _store(store_uri)
    default = _rldiag("report", "--group", "g", "--tracking-uri", store_uri, "--quiet", "--out", str(tmp_path), cwd=tmp_path)
    assert default.returncode == 0, default.stderr
    # step 100-ish, alert and onset both: "alerted at step A (started about step O)" or "at step O" where equal
    assert re.search(r"cand: policy/ratio_mean leaves the reference band(, alerted at step \d+ \(started about step 10\d\)"
                     r"| at step 10\d)", default.stdout), default.stdout
    strict = _rldiag("report", "--group", "g", "--tracking-uri", store_uri, "--quiet", "--out", str(tmp_path),
                     "--detector", "k=50", "--detector", "k_change=50", "--detector", "k_change_loo=50", cwd=tmp_path)
    assert strict.returncode == 0, strict.stderr
    assert "leaves" not in strict.stdout and "cand: " in strict.stdout
    jsonl = tmp_path / "alerts.jsonl"
    watch = _rldiag("watch", "--once", "--divergence", "--tracking-uri", store_uri, "--jsonl", str(jsonl),
                    "--state", str(tmp_path / "state.json"), "--detector", "windows=11,21", cwd=tmp_path)
    assert watch.returncode == 1, watch.stderr  # an alert was sent
    # the options that changed the verdicts are named, as the report's header names them
    assert "divergence verdicts with detector options windows=11,21" in watch.stderr, watch.stderr
    events = [json.loads(line) for line in jsonl.read_text().splitlines()]
    [event] = [e for e in events if e.get("kind") == "divergence"]
    assert event["key"] == K.RATIO_MEAN and 95 <= event["step"] <= 105, event


def test_a_bad_detector_option_is_one_line_naming_it(tmp_path):
    r = _rldiag("report", "--detector", "k=big", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--detector: divergence option 'k=big': k takes a float, e.g. k=5.0" in r.stderr
    r = _rldiag("watch", "--detector", "kk=1", cwd=tmp_path)
    assert r.returncode == 2 and "use KEY=VALUE with KEY one of window, k," in r.stderr
