"""The Compare page shows importance-sampling health: `policy/ess` (here under PipelineRL's `rl/ess`) and
`mismatch/low_prob_share` are offered under Chart options and charted when picked, and a candidate whose ESS
drops with a rising low-probability share gets the likely cause "importance weights degenerate" with its
numbers. Streamlit's AppTest against a real SQLite store."""

from __future__ import annotations

from rldiag.app.analysis.causes_is import TITLE
from rldiag.collectors import keys
from tests.helpers.dashboard import app, figures, unescape_md
from tests.helpers.runs import write_run


def point(s: int, collapse: bool) -> dict[str, float]:
    down = collapse and s >= 40
    return {"rl/ess": 0.45 if down else 0.96, keys.MISMATCH_LOW_PROB_SHARE: 0.04 if down else 0.002,
            keys.GRAD_NORM: 1.0 + 0.01 * (s % 5), keys.LOSS: 0.5}


def test_compare_offers_charts_and_explains_an_ess_drop(store_uri, monkeypatch):
    group = {keys.TAG_GROUP: "is"}
    write_run(store_uri, name="ref", tags={**group, keys.TAG_ROLE: "reference"},
              steps=[(s, point(s, False)) for s in range(60)])
    write_run(store_uri, name="cand", tags={**group, keys.TAG_ROLE: "candidate"},
              steps=[(s, point(s, True)) for s in range(60)])
    at = app(store_uri, monkeypatch, "compare")
    pick = at.multiselect(key="compare.metrics")
    assert {keys.POLICY_ESS, keys.MISMATCH_LOW_PROB_SHARE} <= set(pick.options)  # offered, rl/ess by its key
    assert keys.POLICY_ESS not in pick.value  # not in the default set: a pick away
    pick.set_value([keys.POLICY_ESS, keys.MISMATCH_LOW_PROB_SHARE]).run()
    assert list(figures(at)) == [keys.POLICY_ESS, keys.MISMATCH_LOW_PROB_SHARE]
    text = "\n".join(unescape_md(m.value) for m in at.markdown)
    assert TITLE in text, text
    assert ("policy/ess 0.96 -> 0.45 from step 40 (median of steps 40-59, against the references), while "
            "mismatch/low_prob_share rose 0.002 -> 0.04") in text, text
