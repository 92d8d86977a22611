"""Likely causes on runs written into a real SQLite store through rldiag's writer, with hand-chosen
values near the thresholds' physical meaning: each cause named only with its signature and its
setting, hints labelled, nothing named for seeds or for a mismatch within parity."""

from __future__ import annotations

import pytest

from rldiag.app.analysis.causes import NO_FINGERPRINT, SAME_ENGINE, SIGNATURE_KEYS, likely_causes
from rldiag.app.analysis.config_diff import load_configs
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys as K
from tests.helpers.runs import write_run

NAN = float("nan")
# An engine that matches a float32 trainer: processed logprobs, no prefix cache, float32.
V0 = {
    "engine.logprobs_mode": "processed_logprobs",
    "engine.enable_prefix_caching": "False",
    "engine.async_scheduling": "False",
    "engine.dtype": "float32",
    "engine.lm_head_dtype": "float32",
    "loop.temperature": "0.7",
    "loop.top_p": "0.9",
    "loop.lr": "0.001",
    "loop.seed": "0",
    "model.dtype": "float32",
}


SHORT = {
    "mm": K.MISMATCH_LOGPROB_MEAN,
    "ratio": K.RATIO_MEAN,
    "k1": K.KL_NEW_OLD_K1,
    "loss": K.LOSS,
    "norm": K.GRAD_NORM,
    "finite": K.GRAD_FINITE,
    "entropy": K.ENTROPY,
}


def series(**metrics: list[float]) -> list[tuple[int, dict[str, float]]]:
    """`[(step, {key: value})]` from per-metric value lists (short names in SHORT), steps from 0."""
    n = max(len(v) for v in metrics.values())
    return [(s, {SHORT[k]: v[s] for k, v in metrics.items() if s < len(v)}) for s in range(n)]


def parity_run(steps: int = 4, mismatch: float = 2e-7) -> list[tuple[int, dict[str, float]]]:
    # at equal weights a float32 recompute matches to ~1e-7 nats: ratio 1, signed mean ~0
    return series(
        mm=[mismatch] * steps,
        ratio=[1.0] * steps,
        k1=[1e-9] * steps,
        loss=[0.1] * steps,
        norm=[1.0] * steps,
        finite=[1.0] * steps,
    )


def judge(uri: str, refs: list[tuple[dict, list]], cands: list[tuple[dict, list]]):
    ref_ids = [
        write_run(uri, name=f"ref{i}", params={**p, "loop.seed": str(i)}, steps=s) for i, (p, s) in enumerate(refs)
    ]
    cand_ids = [write_run(uri, name=f"cand{i}", params=p, steps=s) for i, (p, s) in enumerate(cands)]
    store = open_store(uri)
    h = load_histories(store, ref_ids + cand_ids, list(SIGNATURE_KEYS))
    return likely_causes(h, load_configs(store, ref_ids + cand_ids), ref_ids, cand_ids)


def test_raw_logprobs_ranked_first_with_the_ratio_and_the_fingerprint(store_uri):
    # step 0, same weights: engine raw log_softmax(logits), trainer log_softmax(top_p(logits/0.7)); the
    # sampled tokens' processed logprobs are higher: lp_old - lp_new = -0.24 of a 0.26 mean |delta|
    # (92% one way, above the 50% that splits a shift from rounding noise), ratio mean exp-ish 1.263
    raw = series(
        mm=[0.26, 0.27, 0.25], ratio=[1.263, 1.27, 1.25], k1=[-0.24, -0.25, -0.23], loss=[0.1] * 3, norm=[1.0] * 3
    )
    (rc,) = judge(store_uri, [(V0, parity_run())], [({**V0, "engine.logprobs_mode": "raw_logprobs"}, raw)])
    assert [c.id for c in rc.causes] == ["raw_logprobs"]
    line = rc.line()
    assert line.startswith(
        "likely: raw vs processed logprobs: ratio mean 1.263 at step 0, before any update; mismatch mean 0.26"
    )
    assert "engine.logprobs_mode raw_logprobs vs processed_logprobs" in line
    assert "while sampling with temperature 0.7, top_p 0.9" in line
    assert "fix: start vLLM with logprobs_mode=processed_logprobs" in line
    assert "pipelinerl" in rc.first.source.lower() and not rc.first.hint


def test_without_a_fingerprint_the_same_signature_is_a_labelled_hint(store_uri):
    stock = {"temperature": "0.7", "top_p": "0.9", "learning_rate": "0.001"}  # a TRL run: no engine.* params
    raw = series(mm=[0.26], ratio=[1.263], k1=[-0.24], loss=[0.1])
    (rc,) = judge(store_uri, [(stock, parity_run(1))], [(stock, raw)])
    assert [c.id for c in rc.causes] == ["logprob_semantics"]
    assert rc.first.hint == NO_FINGERPRINT
    assert rc.line().startswith(
        "likely: engine and trainer score different distributions (metrics only: the run "
        "logged no engine fingerprint): ratio mean 1.263 at step 0"
    )


def test_trainer_recompute_without_temperature_speaks_through_the_signature_alone(store_uri):
    # same engine settings as the reference (processed logprobs), but the trainer's logprobs are lower:
    # lp_old - lp_new = +0.22 of 0.25 (88% one way), ratio mean 0.80 < 1
    flat = series(mm=[0.25, 0.24], ratio=[0.80, 0.81], k1=[0.22, 0.21], loss=[0.1] * 2)
    (rc,) = judge(store_uri, [(V0, parity_run())], [(V0, flat)])
    assert [c.id for c in rc.causes] == ["recompute_sampling"]
    assert rc.first.hint == SAME_ENGINE
    assert "the trainer's logprobs are below the engine's" in rc.line()
    assert "fix: divide the trainer's logits by the sampling temperature" in rc.line()


@pytest.mark.parametrize(
    ("engine", "head", "cause", "fix"),
    [
        ("bfloat16", "bfloat16", "engine_precision", "at least load the lm_head in float32"),
        ("bfloat16", "float32", "engine_precision", "run the engine in float32 like the trainer"),
        ("float32", "bfloat16", "lm_head_precision", "load the lm_head in float32"),
    ],
)
def test_a_symmetric_step0_mismatch_is_precision_named_by_the_dtype_that_differs(store_uri, engine, head, cause, fix):
    # bf16 rounding: 3e-3 nats mean |delta| but signed mean 2e-4 (7%: symmetric), ratio mean ~1
    noisy = series(mm=[3e-3, 3.1e-3, 2.9e-3], ratio=[1.000005] * 3, k1=[2e-4, -1e-4, 1e-4], loss=[0.1] * 3)
    (rc,) = judge(
        store_uri, [(V0, parity_run())], [({**V0, "engine.dtype": engine, "engine.lm_head_dtype": head}, noisy)]
    )
    assert [c.id for c in rc.causes] == [cause]
    assert ("at step 0, before any update: mismatch mean 0.003, not at parity (tolerance 1e-04), signed mean +0.0002 "
            "(symmetric)") in rc.line()
    assert fix in rc.first.fix


def test_prefix_cache_parity_at_step0_then_mismatch_after_the_first_update(store_uri):
    # step 0: 2e-7 (parity, below 1e-4); steps 1-3: 4e-3..6e-3, every later step out
    stale = series(mm=[2e-7, 4e-3, 5e-3, 6e-3], ratio=[1.0] * 4, k1=[0.0, 1e-4, -2e-4, 1e-4], loss=[0.1] * 4)
    cache = {**V0, "engine.enable_prefix_caching": "True"}
    stale_rc, reset_rc = judge(store_uri, [(V0, parity_run())], [(cache, stale), (cache, parity_run())])
    assert [c.id for c in stale_rc.causes] == ["prefix_cache"]
    assert stale_rc.first.step == 1
    assert ("at step 0, before any update: at parity (mismatch mean 2e-07, within the 1e-04 tolerance); then 0.005 "
            "(median) from step 1 on: 3 of 3 later steps above the tolerance") in stale_rc.line()
    assert "engine.enable_prefix_caching True vs False" in stale_rc.line()
    # the control: the same setting with parity at every step (cache reset on every push): no cause,
    # the setting listed as differing without a signature of its own
    assert reset_rc.causes == () and reset_rc.line() == ""
    assert reset_rc.also_differs == ("engine.enable_prefix_caching True vs False",)


def test_thresholds_are_parity_not_an_experiments_numbers(store_uri):
    # 5e-5 nats is above float32 rounding but below the 1e-4 parity tolerance: no cause. References that
    # are themselves bf16 (3e-3 each step) set the tolerance to 10x theirs: a 4e-3 candidate is parity too.
    bf16 = {**V0, "engine.dtype": "bfloat16", "engine.lm_head_dtype": "bfloat16"}
    (near,) = judge(
        store_uri, [(V0, parity_run())], [({**V0, "engine.logprobs_mode": "raw_logprobs"}, parity_run(mismatch=5e-5))]
    )
    assert near.causes == ()
    (alike,) = judge(store_uri, [(bf16, parity_run(mismatch=3e-3))], [(bf16, parity_run(mismatch=4e-3))])
    assert alike.causes == ()


def test_two_seeds_of_one_configuration_get_no_cause(store_uri):
    (rc,) = judge(store_uri, [(V0, parity_run())], [({**V0, "loop.seed": "7"}, parity_run())])
    assert rc.causes == () and rc.also_differs == ()
    assert rc.line() == "no likely cause: its params differ from the references' only in seed"


def _entropy_runs(cand: list[float]):
    # two reference seeds drift down 0.02 a step (their range 0.01, wiggle = median |step diff| = 0.02)
    refs = [series(entropy=e, mm=[2e-7] * 5) for e in ([3.0, 2.98, 2.96, 2.94, 2.92], [3.0, 2.97, 2.95, 2.93, 2.91])]
    return refs, series(entropy=cand, mm=[2e-7] * 5)


def test_learning_rate_after_parity_is_the_optimizer_cause(store_uri):
    # step 1: refs 2.98 and 2.97, widened by 2 x 0.02 (the wiggle) each side: 2.93..3.02; the candidate at 2.7, 2.4, 2.1
    refs, fast = _entropy_runs([3.0, 2.7, 2.4, 2.1, 1.8])
    (rc,) = judge(store_uri, [(V0, r) for r in refs], [({**V0, "loop.lr": "0.01"}, fast)])
    assert [c.id for c in rc.causes] == ["optimizer"]
    assert rc.first.signature[0] == (
        "at step 0, before any update: at parity (mismatch mean 2e-07, within the 1e-04 tolerance)")
    assert rc.first.signature[1].startswith(
        "policy/entropy leaves the reference seeds' range at step 1 (2.7 vs 2.93 to 3.02"
    )
    assert rc.first.settings == ("loop.lr 0.01 vs 0.001",)


def test_a_departure_without_a_differing_setting_names_no_optimizer_cause(store_uri):
    refs, fast = _entropy_runs([3.0, 2.7, 2.4, 2.1, 1.8])
    (rc,) = judge(store_uri, [(V0, r) for r in refs], [(V0, fast)])
    assert rc.causes == ()


def _nan_from_step1(n: int = 4):
    # NaN gradients at every step from the first, the (real, rldiag-logged) loss finite throughout
    return [(s, {K.GRAD_NORM: NAN, K.GRAD_FINITE: 0.0, K.LOSS: 0.7}) for s in range(1, n + 1)]


@pytest.mark.parametrize(
    ("params", "expected", "hint"),
    [
        ({"batch_size": "2", "accumulation": "1"}, ["padding_inf"], ""),
        ({"per_device_train_batch_size": "1", "gradient_accumulation_steps": "2"}, ["padding_inf"], ""),
        ({"batch_size": "1", "accumulation": "1"}, [], None),  # nothing to pad
        ({"lr": "0.003"}, ["padding_inf"], "metrics only: the run logged no batch size or accumulation"),
    ],
)
def test_padding_needs_nan_from_the_first_step_with_a_finite_loss_and_more_than_one_sample(
    store_uri, params, expected, hint
):
    ok = [(s, {K.GRAD_NORM: 1.0, K.GRAD_FINITE: 1.0, K.LOSS: 0.7}) for s in range(1, 5)]
    (rc,) = judge(store_uri, [(params, ok)], [(params, _nan_from_step1())])
    assert [c.id for c in rc.causes] == expected
    if expected:
        assert rc.first.hint == hint
        assert rc.first.signature[0] == (
            "non-finite gradients from step 1 (the first step), 4 of 4 steps, while the loss stays finite"
        )
        assert "mask padding before the divergence math" in rc.first.fix
    else:
        assert rc.notes == (
            "its params equal the references' (it logged no seed)",
            ("non-finite gradients from step 1: no known signature fits; the NaN events page names the parameters"),
        )


def test_a_trainer_nan_filter_is_named_where_the_logged_loss_hides_the_nan(store_uri):
    # a stock transformers run (TRL names, no grad/finite): grad_norm NaN at step 3, loss logged 0.0 there,
    # kl last logged at step 2 while the run goes on to step 5
    stock = {"logging_nan_inf_filter": "True", "learning_rate": "1e-06"}
    ok = [(s, {"grad_norm": 1.0, "loss": 0.5, "kl": 0.01}) for s in range(1, 6)]
    bad = [
        (s, {"grad_norm": NAN if s >= 3 else 1.0, "loss": 0.0 if s >= 3 else 0.5, **({"kl": 0.01} if s < 3 else {})})
        for s in range(1, 6)
    ]
    (rc,) = judge(store_uri, [(stock, ok)], [(stock, bad)])
    assert [c.id for c in rc.causes] == ["nan_filter"]
    assert rc.first.signature == (
        "loss logged as exactly 0.0 at step 3 where the gradients are non-finite",
        "metrics stop with the first non-finite gradient: policy/kl_ref last logged at step 2",
    )
    assert rc.first.settings == ("logging_nan_inf_filter=True",) and not rc.first.hint


def test_a_long_run_of_seed_noise_is_no_optimizer_departure():
    # 100k steps of the same N(1, 0.01) noise in three seeds and the candidate: somewhere 3 steps in a row
    # fall outside the seeds' range widened by 1x their spread by chance (that named the optimizer), never
    # outside 2x. In-memory traces: 100k steps x 4 runs is minutes through a store.
    import numpy as np

    from rldiag.app.data.histories import Histories
    from rldiag.app.data.trace import Trace

    n, rng = 100_000, np.random.default_rng(0)
    steps = np.arange(n, dtype=np.int64)
    traces = {(r, k): Trace(r, k, k, steps, v, steps) for r in ("a", "b", "c", "cand")
              for k, v in ((K.ENTROPY, rng.normal(1.0, 0.01, n)), (K.MISMATCH_LOGPROB_MEAN, np.full(n, 2e-7)))}
    h = Histories("sqlite:///unused.db", "sql", traces, ("a", "b", "c", "cand"), {}, {}, {})
    configs = {**{r: {"loop.lr": "0.001", "loop.seed": str(i)} for i, r in enumerate("abc")}, "cand": {"loop.lr": "0.01"}}
    (rc,) = likely_causes(h, configs, ["a", "b", "c"], ["cand"])
    assert rc.causes == ()
