"""app/dashboard/config_table.py and html_table.py: the config diff marks what differs from the value
the references share, and no table wraps inside a word."""

from __future__ import annotations

import re

import pandas as pd

from rldiag.app.dashboard import config_table, html_table
from rldiag.app.dashboard.config_table import VARIES, config_html, run_order
from rldiag.app.dashboard.html_table import wrap_text

LABELS = ["ref a", "ref b", "cand 1", "cand 2"]


def _rows() -> pd.DataFrame:
    rows = [("other params", "param", "seed", ["0", "1", "2", "3"]),  # every run its own seed
            ("engine parity", "param", "engine.logprobs_mode",
             ["processed_logprobs", "processed_logprobs", "raw_logprobs", "processed_logprobs"]),
            ("other params", "param", "lr", ["1e-06", "1e-06", "1e-06", None])]
    return pd.DataFrame([[g, k, n, True, *v] for g, k, n, v in rows],
                        columns=["group", "kind", "name", "differs", *LABELS], dtype=object)


def _cells(html: str) -> list[list[tuple[str, str]]]:
    """Per body row, each run cell's (class, text) (the name cell left out)."""
    out = []
    for tr in re.findall(r"<tr class=\"\w+\">(.*?)</tr>", html):
        tds = re.findall(r"<td( class=\"\w\")?>(.*?)</td>", tr)[1:]
        out.append([(c.strip()[7:-1] if c else "", re.sub(r"<wbr>", "", t)) for c, t in tds])
    return out


def test_candidates_are_marked_against_the_value_every_reference_shares():
    html = config_html(_rows(), LABELS, ["ref a", "ref b"])
    seed, mode, lr = _cells(html)
    # the references disagree on the seed: the row says so, their cells show it, no candidate is marked
    assert [c for c, _ in seed] == ["v", "v", "", ""]
    assert html.count(VARIES) == 1 and VARIES in html.split("</tr>")[1]
    # the references share processed_logprobs: the candidate with raw_logprobs is marked, the other not
    assert mode == [("", "processed_logprobs"), ("", "processed_logprobs"), ("d", "raw_logprobs"),
                    ("", "processed_logprobs")]
    assert [c for c, _ in lr] == ["", "", "", "d"] and lr[3][1] == "(missing)"  # a missing value differs


def test_one_reference_is_the_base_and_without_any_the_first_run():
    one = _cells(config_html(_rows(), LABELS, ["ref b"]))
    # ref b first, then the candidates that differ most; every other run's seed differs from ref b's
    assert run_order(_rows(), LABELS, ["ref b"]) == ["ref b", "cand 1", "cand 2", "ref a"]
    assert [c for c, _ in one[0]] == ["", "d", "d", "d"] and VARIES not in config_html(_rows(), LABELS, ["ref b"])
    none = _cells(config_html(_rows(), LABELS, []))
    assert run_order(_rows(), LABELS, []) == ["ref a", "cand 1", "cand 2", "ref b"]  # ties: as picked
    assert [c for c, _ in none[1]] == ["", "d", "", ""]


def test_no_table_wraps_inside_a_word():
    for css in (config_table.CSS, html_table.CSS):
        assert "anywhere" not in css and "break-all" not in css and "overflow-x: auto" in css
        assert "word-break: normal; overflow-wrap: normal" in css
    assert "th { background: #f5f5f5; white-space: nowrap; }" in html_table.CSS  # "ste ps" never
    # "(reference)" never splits; names wrap after separators before a letter, numbers never
    assert "<span class=role>(reference)</span>" in config_html(_rows(), LABELS, ["ref a"])
    assert wrap_text("model.layers.0.self_attn.q_proj") == "model.<wbr>layers.0.<wbr>self_<wbr>attn.<wbr>q_<wbr>proj"
    assert wrap_text("1.5e-3, <b>") == "1.5e-3, &lt;b&gt;"
    table = html_table.html_table(pd.DataFrame({"steps": ["40-41, 200"], "steps (count)": [3]}),
                                  numeric=("steps (count)",))
    assert "<td>40-41, 200</td>" in table and '<td class="num">3</td>' in table


def test_shared_values_is_what_the_references_hold_in_common():
    from rldiag.app.analysis.config_diff import RunConfig, config_diff, shared_values, value_key

    configs = {"a": RunConfig({"seed": "0", "lr": "1e-06"}, {}), "b": RunConfig({"seed": "1", "lr": "1e-06"}, {}),
               "c": RunConfig({"seed": "2", "lr": "2e-06"}, {})}
    diff = config_diff(configs)
    got = dict(zip(diff["name"], shared_values(diff, ["a", "b"])))
    assert got == {"lr": "1e-06", "seed": None}  # the references disagree on the seed
    assert shared_values(diff, []) == [None, None] and value_key(None) != value_key("None")
