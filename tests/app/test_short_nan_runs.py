"""Two short stock-TRL runs (GRPOTrainer, `report_to="mlflow"`): 8 steps each, as transformers'
MLflowCallback logs them (TRL's own names, one `log_batch` a step, no rldiag tags), the candidate with a
NaN `grad_norm` from step 4 on and TRL's `kl` and `entropy` rows stopping after step 4.

What a user reads off `rldiag report`: the candidate is headlined "non-finite gradients from step 4"
before anything else, the metrics with fewer compared steps than the detector needs say "not enough
steps", nothing claims "within the reference band", the NaN grad norm prints as NaN, and kl says
where it was last logged. (The dashboard's pages on the same store: tests/app/dashboard/test_pages.py.)
"""

from __future__ import annotations

import re

from rldiag.app.report.build import build_report, departure_lines
from rldiag.collectors import keys as K
from tests.helpers.trl_runs import NAN_FROM, NEEDED, write_trl_runs


def _line_of(markdown: str, label: str) -> str:
    [line] = [ln for ln in markdown.splitlines() if ln.startswith(f"- {label}:")]
    return re.sub(r"\\(.)", r"\1", line[2:])  # "- " and the Markdown escapes undone


def test_report_headlines_nan_first_and_never_within_on_too_few_steps(store_uri):
    ref, cand = write_trl_runs(store_uri)
    report = build_report(store_uri, reference=ref, candidates=cand)
    assert set(report.content.keys) == {K.GRAD_NORM, K.LOSS, K.KL_REF, K.ENTROPY, K.REWARD_MEAN, K.REWARD_STD,
                                        K.canonical_key("clip_ratio/region_mean")}  # TRL's names, mapped
    printed = departure_lines(report)[0]  # what `rldiag report` prints (a likely cause may follow, indented)
    md_line = _line_of(report.markdown, "grpo-nan")
    for line in (printed, md_line):
        assert line.startswith("grpo-nan: non-finite gradients from step 4 (5 steps)"), line
        assert f"not enough steps (4-8 compared, {NEEDED} needed)" in line
        assert f"{K.KL_REF} (last logged at step 4)" in line and f"{K.ENTROPY} (last logged at step 4)" in line
        assert f"{K.GRAD_NORM} leaves the reference band at step 4" in line  # NaN where the reference is finite
        assert "(nonfinite, non-finite where the references are finite)" in line
    assert "<li>grpo-nan: non-finite gradients from step 4" in report.html
    for text in (report.markdown, report.html, printed):
        assert "within the reference band" not in text and "within the band" not in text
    # one reference: the report says what it cannot tell (how far seeds differ), in both renderings
    for text in (report.markdown, report.html):
        assert "One reference run: how far seeds differ cannot be measured" in text
    # every other comparison is thin: 8 steps (or fewer) against the 18 "within" needs
    div = report.divergence.set_index("key")
    assert div.loc[K.GRAD_NORM, "status"] == "diverged" and div.loc[K.GRAD_NORM, "kind"] == "nonfinite"
    assert set(div.drop(K.GRAD_NORM)["status"]) == {"not_enough_steps"}
    assert div.loc[K.KL_REF, "steps_compared"] == 4 and div.loc[K.LOSS, "steps_compared"] == 8
    assert report.summaries[0].status == "nonfinite" and report.summaries[0].first_nonfinite_step == NAN_FROM


def test_report_tables_print_nan_and_mark_the_metric_that_stopped(store_uri):
    ref, cand = write_trl_runs(store_uri)
    report = build_report(store_uri, reference=ref, candidates=cand)
    md = report.markdown
    events = md.split("### Non-finite gradients", 1)[1].split("\n### ", 1)[0]
    [row] = [ln for ln in events.splitlines() if ln.startswith("| grpo-nan")]
    assert [c.strip() for c in row.strip("|").split("|")][1:4] == ["5", "4-8", "NaN"]  # steps, at steps, grad norm
    thin = md.split("### Divergence from the references", 1)[1].split("\n### ", 1)[0]
    [kl] = [ln for ln in thin.splitlines() if ln.startswith("| grpo-nan | policy/kl\\_ref")]
    assert f"not enough steps (4 compared, {NEEDED} needed)" in kl and "last logged at step 4" in kl
    [loss] = [ln for ln in thin.splitlines() if ln.startswith("| grpo-nan | loss")]
    assert f"not enough steps (8 compared, {NEEDED} needed)" in loss
    page = report.html
    nan_rows = page.split('id="nan"', 1)[1].split("</section>", 1)[0]
    assert '<td class="num">NaN</td>' in nan_rows and "None" not in nan_rows and '<td class="num">-</td>' not in nan_rows
    assert "last logged at step 4" in page.split('id="divergence"', 1)[1].split("</section>", 1)[0]
