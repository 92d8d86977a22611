"""A candidate that departs on a mismatch metric other than the mean logprob difference (verl logs only
`training/rollout_probs_diff_max`, read as `mismatch/prob_abs_diff_max`) is never told "no mismatch metric
logged": the likely causes say which metric engine parity is judged on, and which ones the run did log."""

from __future__ import annotations

import random

from rldiag.app.cli.main import main
from rldiag.collectors import keys as K
from tests.helpers.runs import write_run


def verl_steps(seed: int, departs: bool):
    # the probability difference 0.01 (+-0.001), 0.06 from step 61 in the departing run
    rng = random.Random(seed)
    for s in range(1, 121):
        bump = 0.05 if departs and s > 60 else 0.0
        yield s, {"training/rollout_probs_diff_max": 0.01 + rng.gauss(0, 0.001) + bump,
                  "actor/grad_norm": 1.0 + rng.gauss(0, 0.05)}


def test_a_departure_on_the_probability_difference_is_not_told_no_mismatch_logged(store_uri, tmp_path):
    for name, seed, role in (("ref_s1", 1, "reference"), ("ref_s2", 2, "reference"), ("ref_s3", 3, "reference"),
                             ("fix_s1", 4, "candidate")):
        write_run(store_uri, name=name, tags={K.TAG_GROUP: "verl", K.TAG_ROLE: role},
                  steps=verl_steps(seed, role == "candidate"))
    assert main(["report", "--group", "verl", "--out", str(tmp_path), "--quiet", "--tracking-uri", store_uri]) == 0
    md = (tmp_path / "rldiag-report.md").read_text()
    assert "mismatch/prob\\_abs\\_diff\\_max leaves the reference band" in md
    assert "no mismatch metric logged" not in md
    assert ("engine parity is judged on mismatch/logprob\\_abs\\_diff\\_mean, which it did not log (it logged "
            "mismatch/prob\\_abs\\_diff\\_max)") in md
