"""`rldiag report` on runs whose params a cause once choked on: a distillation-style group that logs
`batch_size` but no accumulation param (the -inf padding cause unpacked None and the report died with a
traceback; `--all-groups` stopped there). Real runs in a SQLite store, the real CLI."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from rldiag.collectors import keys as K
from tests.helpers.runs import write_run


def _group(uri: str, group: str, params: dict, nan: bool) -> None:
    for i in range(2):
        write_run(uri, name=f"{group}-ref{i}", tags={K.TAG_GROUP: group, K.TAG_ROLE: "reference"},
                  params={**params, "seed": str(i)},
                  steps=[(s, {K.GRAD_NORM: 1.0, K.GRAD_FINITE: 1.0, K.LOSS: 0.7}) for s in range(1, 25)])
    bad = {K.GRAD_NORM: math.nan, K.GRAD_FINITE: 0.0, K.LOSS: 0.7} if nan else {K.GRAD_NORM: 1.0, K.GRAD_FINITE: 1.0,
                                                                                K.LOSS: 0.7}
    write_run(uri, name=f"{group}-cand", tags={K.TAG_GROUP: group, K.TAG_ROLE: "candidate"},
              params={**params, "seed": "9"}, steps=[(s, bad) for s in range(1, 25)])


def test_all_groups_reports_every_group_with_batch_size_only(store_uri, tmp_path):
    # "a_distill" sorts first: before the fix its traceback left "b_plain" without a report
    _group(store_uri, "a_distill", {"batch_size": "4", "temperature": "None", "lr": "auto"}, nan=True)
    _group(store_uri, "b_plain", {"batch_size": "4", "gradient_accumulation_steps": "2"}, nan=False)
    exe = Path(sys.executable).with_name("rldiag")
    r = subprocess.run([str(exe), "report", "--all-groups", "--tracking-uri", store_uri, "--out", str(tmp_path),
                        "--quiet"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "cause check failed" not in r.stdout
    for g in ("a_distill", "b_plain"):
        assert (tmp_path / g / "rldiag-report.html").exists() and (tmp_path / g / "rldiag-report.md").exists()
    distill = r.stdout.split("## group a_distill")[1].split("## group")[0]
    assert "a_distill-cand: non-finite gradients from step 1 (24 steps)" in distill
    assert "likely: -inf padding reaching the loss's backward" in distill
    assert "batch_size=4 = 4 samples per step" in distill
    md = (tmp_path / "a_distill" / "rldiag-report.md").read_text()
    assert "4 samples per step" in md


def test_all_groups_goes_on_past_a_group_it_cannot_report(store_uri, tmp_path):
    # "a_empty" (no metric logged) sorts first: it gets a one-line reason, the next group its report, exit 1
    for role in ("reference", "candidate"):
        write_run(store_uri, name=f"empty-{role}", tags={K.TAG_GROUP: "a_empty", K.TAG_ROLE: role})
    _group(store_uri, "b_plain", {"batch_size": "4"}, nan=False)
    exe = Path(sys.executable).with_name("rldiag")
    r = subprocess.run([str(exe), "report", "--all-groups", "--tracking-uri", store_uri, "--out", str(tmp_path),
                        "--quiet"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "rldiag report: group 'a_empty': no report: none of the runs" in r.stderr
    assert "1 of 2 groups got no report: a_empty" in r.stderr
    assert (tmp_path / "b_plain" / "rldiag-report.html").exists() and not (tmp_path / "a_empty").exists()
