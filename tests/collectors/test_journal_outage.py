"""bench.journal_scale's outage run at a small size: the store down mid-run, every point delivered once,
the journal no bigger than the backlog's lines plus one segment, the journal gone after close."""

from __future__ import annotations

from argparse import Namespace

from tests.helpers.bench_code import ENVELOPE, SEGMENT, child_outage


def test_outage_run_delivers_every_point_once_and_the_journal_follows_the_backlog(tmp_path):
    # 2000 steps x 50 metrics = 100,000 points; the store refuses steps 800-1199, spread over 2 s
    # (200 steps/s). The sample at step 1000 sees the 200 outage steps logged so far, less what ingest
    # (a 50 ms poll, ~10 steps) has not taken yet: a backlog of at least 9,000 points.
    out = child_outage(Namespace(steps=2000, outage_s=2.0, spill=str(tmp_path / "spill")))
    assert out["points"] == 100_000 and out["outage_steps"] == 400
    assert out["distinct"] == 100_000 and out["duplicated"] == 0 and out["stored"] == 100_000
    assert out["undelivered"] == 0 and out["lost"] == 0 and out["send_failures"] > 0
    assert out["balance"] == 0 and out["ledger"].startswith("logged 100000 = stored 100000 + journaled 0 + 0 lost")
    assert out["peak_backlog"] >= 9_000
    assert out["journal_excess_max_bytes"] <= SEGMENT + ENVELOPE * out["journal_peak_bytes"]
    assert not list((tmp_path / "spill").glob("*.jsonl"))  # all delivered: no segment left
