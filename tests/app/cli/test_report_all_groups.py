"""`rldiag report --all-groups`: a store-wide run, one report per group that has references and candidates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from rldiag.collectors import keys as K
from tests.helpers.runs import write_run


def test_one_report_per_comparable_group(store_uri, tmp_path):
    rng = np.random.default_rng(2)
    for group, shift in (("v0_vs_v1", 0.05), ("masked_vs_unmasked", 0.0)):
        for i in range(2):
            write_run(store_uri, name=f"{group}-ref{i}", tags={K.TAG_GROUP: group, K.TAG_ROLE: "reference"},
                      steps=[(s, {K.RATIO_MEAN: 1.0 + rng.normal(0, 0.01)}) for s in range(120)])
        write_run(store_uri, name=f"{group}-cand", tags={K.TAG_GROUP: group, K.TAG_ROLE: "candidate"},
                  steps=[(s, {K.RATIO_MEAN: 1.0 + rng.normal(0, 0.01) + (shift if s >= 60 else 0)}) for s in range(120)])
    write_run(store_uri, name="lonely", tags={K.TAG_GROUP: "refs-only", K.TAG_ROLE: "reference"},
              steps=[(s, {K.RATIO_MEAN: 1.0}) for s in range(10)])
    exe = Path(sys.executable).with_name("rldiag")
    r = subprocess.run([str(exe), "report", "--all-groups", "--tracking-uri", store_uri, "--out", str(tmp_path),
                        "--quiet"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "v0_vs_v1" / "rldiag-report.html").exists()
    assert (tmp_path / "masked_vs_unmasked" / "rldiag-report.md").exists()
    assert not (tmp_path / "refs-only").exists()  # no candidate: nothing to compare
    # plotly.js once beside the group folders; each group's page refers to it and stays small
    assert (tmp_path / "plotly.min.js").stat().st_size > 3_000_000
    for group in ("v0_vs_v1", "masked_vs_unmasked"):
        page = (tmp_path / group / "rldiag-report.html").read_text()
        assert len(page.encode()) < 500_000 and '<script src="../plotly.min.js"></script>' in page, len(page)
    drawn = _charts_drawn(tmp_path / "v0_vs_v1" / "rldiag-report.html")
    assert drawn >= 1, drawn  # opened from disk, the shared plotly.js loads under the page's CSP and draws
    v1 = r.stdout.split("## group v0_vs_v1")[1]
    assert "v0_vs_v1-cand: policy/ratio_mean leaves the reference band" in v1
    assert "\n  no likely cause: " in v1 or "\n  likely: " in v1  # its cause line, indented under it
    masked = r.stdout.split("## group masked_vs_unmasked")[1].split("## group")[0]
    assert "masked_vs_unmasked-cand: " in masked and "leaves" not in masked
    bad = subprocess.run([str(exe), "report", "--all-groups", "--group", "x", "--tracking-uri", store_uri],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "drop --group" in bad.stderr and "Traceback" not in bad.stderr


def _charts_drawn(path: Path) -> int:
    """How many of the page's charts plotly drew, opened from disk in Chromium."""
    from tests.helpers.browser import chromium

    with chromium() as browser:
        page = browser.new_page()
        page.goto(path.as_uri())
        page.wait_for_function("() => [...document.querySelectorAll('.chart')].every(c => c._fullLayout)",
                               timeout=120_000)
        return page.evaluate("() => [...document.querySelectorAll('.chart')].filter(c => c._fullLayout).length")
