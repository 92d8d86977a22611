"""The likely causes use importance-sampling health (`causes_is`): on runs written into a real SQLite store
with rldiag's exact keys, an ESS drop with a rising mismatch is the cause "importance weights degenerate"
with its numbers, and a train-inference mismatch cause cites it; an ESS drop alone, or no ESS logged, names
nothing of the kind."""

from __future__ import annotations

from rldiag.app.analysis.causes import NO_FINGERPRINT, SIGNATURE_KEYS, likely_causes
from rldiag.app.analysis.causes_is import IS_CAUSE, TITLE
from rldiag.app.analysis.comparison import load_keys
from rldiag.app.analysis.config_diff import load_configs
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys as K
from tests.helpers.runs import write_run

ESS, LOW, MM = K.POLICY_ESS, K.MISMATCH_LOW_PROB_SHARE, K.MISMATCH_LOGPROB_MEAN


def causes_of(uri: str, run: str):
    store = open_store(uri)
    h = load_histories(store, [run], list(SIGNATURE_KEYS))
    (rc,) = likely_causes(h, load_configs(store, [run]), [], [run])
    return rc


def collapse(s: int, *, low_rises: bool = True) -> dict[str, float]:
    # ESS 0.96 -> 0.45 from step 40; the engine gives 0.2% of sampled tokens probability under 1e-3, then 4%
    return {ESS: 0.96 if s < 40 else 0.45, LOW: 0.04 if low_rises and s >= 40 else 0.002,
            K.GRAD_NORM: 1.0, K.LOSS: 0.1}


def test_the_signature_keys_load_the_ess_and_the_low_prob_share():
    assert {ESS, K.POLICY_ESS_SEQ, LOW, K.MISMATCH_TOKEN_MULT_PROB_ERROR} <= set(SIGNATURE_KEYS)
    assert {ESS, LOW} <= set(load_keys([K.GRAD_NORM]))  # what the report, the dashboard and the watcher load


def test_an_ess_drop_with_a_rising_low_prob_share_is_a_cause_with_its_evidence(store_uri):
    run = write_run(store_uri, name="collapse", steps=[(s, collapse(s)) for s in range(60)])
    rc = causes_of(store_uri, run)
    (c,) = rc.causes
    assert (c.id, c.title, c.step) == (IS_CAUSE, TITLE, 40)
    assert c.signature == (("policy/ess 0.96 -> 0.45 from step 40 (median of steps 40-59, against its first 10 logged "
                           "values), while mismatch/low_prob_share rose 0.002 -> 0.04"),)
    assert c.hint == "metrics only: no setting turns the correction off" and c.settings == ()
    assert "truncated importance sampling" in c.fix
    assert rc.line().startswith(f"likely: {TITLE} (metrics only: no setting turns the correction off): policy/ess "
                                "0.96 -> 0.45 from step 40")


def test_trl_with_its_correction_off_is_the_setting_that_confirms_it(store_uri):
    # TRL's GRPOConfig as RldiagCallback logs it (trainer.<name>): the engine/trainer ratio left uncorrected
    run = write_run(store_uri, name="trl", params={"trainer.vllm_importance_sampling_correction": "False"},
                    steps=[(s, collapse(s)) for s in range(60)])
    (c,) = causes_of(store_uri, run).causes
    assert c.id == IS_CAUSE and c.hint == ""
    assert c.settings == (("trainer.vllm_importance_sampling_correction=False: the engine-trainer ratio is not "
                          "corrected"),)


def test_a_mismatch_cause_cites_the_ess_drop_that_follows_it(store_uri):
    # parity at step 0 (1e-6 nats), lost from step 10 on (5e-3 on 50 of 59 later steps: stale KV or weights,
    # no fingerprint); from step 20 the ESS falls 0.97 -> 0.5 as the mismatch has risen 5000x over its own
    # first 10 values' median (1e-6, steps 0-9): both causes, the mismatch one first (earlier) and citing the drop
    def point(s: int) -> dict[str, float]:
        return {MM: 1e-6 if s < 10 else 5e-3, ESS: 0.97 if s < 20 else 0.5, K.GRAD_NORM: 1.0, K.LOSS: 0.1}

    run = write_run(store_uri, name="stale", steps=[(s, point(s)) for s in range(60)])
    rc = causes_of(store_uri, run)
    assert [c.id for c in rc.causes] == ["stale_weights", IS_CAUSE]
    stale, weights = rc.causes
    assert stale.hint == NO_FINGERPRINT and stale.step == 10 and weights.step == 20
    assert weights.signature == (("policy/ess 0.97 -> 0.5 from step 20 (median of steps 20-59, against its first 10 "
                                 "logged values), while mismatch/logprob_abs_diff_mean rose 1e-06 -> 0.005"),)
    assert stale.signature[-1] == f"then the importance weights degenerate: {weights.signature[0]}"


def test_an_ess_drop_alone_or_no_ess_logged_names_no_such_cause(store_uri):
    alone = write_run(store_uri, name="drop-only", steps=[(s, collapse(s, low_rises=False)) for s in range(60)])
    absent = write_run(store_uri, name="no-ess", steps=[(s, {LOW: 0.002 if s < 40 else 0.04, K.GRAD_NORM: 1.0})
                                                        for s in range(60)])
    for run in (alone, absent):
        rc = causes_of(store_uri, run)
        assert rc.causes == () and rc.failed == (), rc
