"""The likely cause where the divergence is shown: the Compare page (line and ranked list), the HTML report
and the Markdown summary (line and section), the watcher's divergence alert. One reference and one raw-
logprobs candidate written into a real SQLite store with rldiag's writer, tagged as rldiag tags them."""

from __future__ import annotations

import html

import pytest

from rldiag.app.report.build import build_report
from rldiag.app.watch.loop import watch_once
from rldiag.collectors import keys as K
from tests.helpers.dashboard import app, unescape_md
from tests.helpers.runs import write_run

STEPS = 30  # enough for any band test to call a 0.26-nat offset a departure
V0 = {"engine.logprobs_mode": "processed_logprobs", "engine.dtype": "float32", "loop.temperature": "0.7",
      "loop.top_p": "0.9"}
# what the line must say: the step-0 ratio (hand-set 1.263, as the engine-parity run measured), the
# fingerprint entry against the reference's, the fix
LINE = ("likely: raw vs processed logprobs: ratio mean 1.263 at step 0, before any update; mismatch mean 0.26, not at "
        "parity (tolerance 1e-04), signed mean -0.2 (one way); engine.logprobs_mode raw_logprobs vs processed_logprobs")


def _steps(mm: float, ratio: float, k1: float):
    # a little per-step wobble so that the band has noise to measure
    return [(s, {K.MISMATCH_LOGPROB_MEAN: mm * (1 + 0.01 * (s % 3)), K.RATIO_MEAN: ratio + 1e-3 * (s % 2),
                 K.KL_NEW_OLD_K1: k1, K.CLIP_RATE: 0.01 * (s % 4), K.GRAD_NORM: 1.0 + 0.01 * (s % 5),
                 K.GRAD_FINITE: 1.0, K.LOSS: 0.1}) for s in range(STEPS)]


@pytest.fixture
def raw_store(store_uri: str) -> str:
    tags = {K.TAG_GROUP: "g"}
    write_run(store_uri, name="v0", tags={**tags, K.TAG_ROLE: "reference"}, params=V0, steps=_steps(2e-7, 1.0, 0.0))
    write_run(store_uri, name="raw", tags={**tags, K.TAG_ROLE: "candidate"},
              params={**V0, "engine.logprobs_mode": "raw_logprobs"}, steps=_steps(0.26, 1.263, -0.2))
    return store_uri


def test_report_html_and_markdown_show_the_line_and_the_ranked_list(raw_store):
    report = build_report(raw_store, group="g")
    md = unescape_md(report.markdown)
    assert f"  - {LINE}" in md  # under the candidate's headline
    section = md[md.index("### Likely causes"):]
    assert "1. **raw vs processed logprobs**" in section
    assert "   - fix: start vLLM with logprobs_mode=processed_logprobs" in section
    assert "   - source: PipelineRL's vLLM V0 -> V1 migration" in section
    page = html.unescape(report.html)
    causes = page[page.index('<section id="causes">'):]
    assert f"<b>raw</b>: {LINE}" in causes and "1 likely cause(s), ranked" in causes


def test_compare_page_shows_the_line_and_the_ranked_list_on_demand(raw_store, monkeypatch):
    at = app(raw_store, monkeypatch, "compare")
    [text] = [unescape_md(m.value) for m in at.markdown if m.value.startswith("- **")]
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("- **raw**"))
    assert lines[i + 1].startswith(f"  - {LINE}")  # the signatures' own metrics loaded, whatever is charted
    [exp] = [e for e in at.expander if e.label == "Likely causes, ranked, with their evidence"]
    ranked = unescape_md(exp.markdown[0].value)
    assert ranked.startswith("**raw**\n1. **raw vs processed logprobs**: ratio mean 1.263 at step 0")
    assert "Fix: start vLLM with logprobs_mode=processed_logprobs" in ranked


def test_watch_divergence_alert_carries_the_cause(raw_store):
    _, events = watch_once(raw_store, divergence=True)
    div = [e for e in events if e["kind"] == "divergence"]
    assert div, "a 0.26-nat mismatch over 30 steps leaves any band"
    for e in div:
        assert e["cause"].startswith(LINE) and e["text"].endswith(e["cause"])
