"""Causes never crash a product: every cause, on histories that show each cause's signature, against
random subsets of params of any type ("None", "auto", a missing partner param, numbers, lists), with
random alert files. A check that raises becomes "cause check failed: ..." and the others still run."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rldiag.app.analysis import causes as C
from rldiag.app.analysis.config_diff import RunConfig
from rldiag.app.data.histories import Histories
from rldiag.app.data.trace import Trace
from rldiag.collectors import keys as K

NAN = float("nan")
N = 6
# Every name a cause reads, under the prefixes runs use (rldiag's experiments, TRL, the engine fingerprint).
NAMES = ["engine.logprobs_mode", "engine.dtype", "engine.lm_head_dtype", "engine.enable_prefix_caching",
         "engine.async_scheduling", "engine.enable_prefix_caching.requested", "engine.attention_backend",
         "engine.kv_cache_dtype", "engine.model", "loop.temperature", "temperature", "top_p", "top_k",
         "batch_size", "per_device_train_batch_size", "gradient_accumulation_steps", "accumulation",
         "model.dtype", "torch_dtype", "logging_nan_inf_filter", "learning_rate", "loop.lr", "max_grad_norm",
         "epsilon", "beta", "seed", "output_dir"]
VALUES = ["None", "auto", "", "1", "0", "-1", "2", "0.7", "1e-06", "inf", "-inf", "nan", "1e400", "True", "False",
          "raw_logprobs", "processed_logprobs", "bfloat16", "float32", "torch.float16", "[1, 2]", "{'a': 1}",
          None, 3, 2.5, True, [1], {"a": 1}, float("nan"), 10**400]
ALERTS = [[], [{"step": 1, "origin": {"where": "loss_backward", "text": "x"}}], [{"origin": "softmax"}],
          [{"origin": {"where": None}}], [{"origin": {"where": 3}}], ["not a dict"], [{}], [None]]


def _series(**metrics: list[float]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, float) for k, v in metrics.items()}


def _ok() -> dict[str, np.ndarray]:
    return _series(**{K.MISMATCH_LOGPROB_MEAN: [2e-7] * N, K.RATIO_MEAN: [1.0] * N, K.KL_NEW_OLD_K1: [1e-9] * N,
                      K.LOSS: [0.1] * N, K.GRAD_NORM: [1.0] * N, K.GRAD_FINITE: [1.0] * N,
                      K.ENTROPY: [3.0 - 0.02 * i for i in range(N)]})


# One candidate per signature, each the way the cause's own tests write it.
CANDIDATES = {
    "one_signed": {**_ok(), **_series(**{K.MISMATCH_LOGPROB_MEAN: [0.26] * N, K.RATIO_MEAN: [1.263] * N,
                                         K.KL_NEW_OLD_K1: [-0.24] * N})},
    "symmetric": {**_ok(), **_series(**{K.MISMATCH_LOGPROB_MEAN: [3e-3] * N, K.KL_NEW_OLD_K1: [1e-5] * N})},
    "after_updates": {**_ok(), **_series(**{K.MISMATCH_LOGPROB_MEAN: [2e-7] + [0.05] * (N - 1)})},
    "padding": {**_ok(), **_series(**{K.GRAD_NORM: [NAN] * N, K.GRAD_FINITE: [0.0] * N, K.LOSS: [0.7] * N})},
    "nan_filter": _series(**{K.GRAD_NORM: [1.0, 1.0, NAN, NAN, NAN, NAN], K.LOSS: [0.5, 0.5, 0, 0, 0, 0]}),
    "optimizer": {**_ok(), **_series(**{K.ENTROPY: [3.0, 2.7, 2.4, 2.1, 1.8, 1.5]})},
}
EXPECTED = {"one_signed": "raw_logprobs", "symmetric": "engine_precision", "after_updates": "prefix_cache",
            "padding": "padding_inf", "nan_filter": "nan_filter", "optimizer": "optimizer"}
GOOD = {"engine.logprobs_mode": "processed_logprobs", "engine.dtype": "float32", "engine.lm_head_dtype": "float32",
        "engine.enable_prefix_caching": "False", "engine.async_scheduling": "False", "loop.temperature": "0.7",
        "model.dtype": "float32", "loop.lr": "0.001", "batch_size": "4", "logging_nan_inf_filter": "True"}
BAD = {"one_signed": {"engine.logprobs_mode": "raw_logprobs"}, "symmetric": {"engine.dtype": "bfloat16"},
       "after_updates": {"engine.enable_prefix_caching": "True"}, "padding": {}, "nan_filter": {},
       "optimizer": {"loop.lr": "0.01"}}


def _histories() -> Histories:
    traces = {}
    refs = {"ref0": _ok(), "ref1": {**_ok(), K.ENTROPY: np.asarray([3.0 - 0.025 * i for i in range(N)])}}
    for run, metrics in {**refs, **CANDIDATES}.items():
        for key, v in metrics.items():
            steps = np.arange(len(v), dtype=np.int64)
            traces[(run, key)] = Trace(run, key, key, steps, v, steps)
    runs = tuple(dict.fromkeys(r for r, _ in traces))
    return Histories("sqlite:///unused.db", "sql", traces, runs, {}, {}, {})


def _random_params(rng: random.Random) -> dict:
    return {name: rng.choice(VALUES) for name in rng.sample(NAMES, rng.randint(0, len(NAMES)))}


def test_each_signature_names_its_cause_with_sane_params():
    # the histories below do reach every rule: the property test is no test of empty checks
    h = _histories()
    configs = {"ref0": GOOD, "ref1": {**GOOD, "seed": "1"}, **{c: {**GOOD, **BAD[c]} for c in CANDIDATES}}
    found = C.likely_causes(h, configs, ["ref0", "ref1"], list(CANDIDATES))
    assert {rc.run_id: rc.first.id if rc.first else None for rc in found} == EXPECTED
    assert all(rc.failed == () for rc in found)


@pytest.mark.parametrize("seed", range(40))
def test_any_params_of_any_type_never_fail_a_check(seed):
    rng = random.Random(seed)
    h = _histories()
    configs = {r: _random_params(rng) for r in ["ref0", "ref1", *CANDIDATES]}
    configs["ref1"] = RunConfig({k: str(v) for k, v in configs["ref1"].items()}, {})  # the loaders' form too
    alerts = {c: rng.choice(ALERTS) for c in CANDIDATES}
    found = C.likely_causes(h, configs, ["ref0", "ref1"], list(CANDIDATES), alerts=alerts)
    assert [rc.run_id for rc in found] == list(CANDIDATES)
    for rc in found:
        assert rc.failed == (), (configs[rc.run_id], rc.failed)
        assert isinstance(rc.line(), str)


@pytest.mark.parametrize(("params", "hint"), [
    ({"batch_size": "4"}, ""),
    ({"gradient_accumulation_steps": "2"}, ""),
    ({"batch_size": "auto"}, "metrics only: batch_size=auto is not a number"),
    ({"batch_size": "None", "accumulation": "None"}, "metrics only: batch_size=None is not a number"),
    ({"per_device_train_batch_size": 2, "grad_accum": None}, "metrics only: grad_accum=None is not a number"),
    ({"lr": "0.1"}, "metrics only: the run logged no batch size or accumulation"),
])
def test_a_missing_or_unreadable_partner_param_is_no_crash(params, hint):
    # distillation-style runs log batch_size without any accumulation param: that once unpacked None
    (rc,) = C.likely_causes(_histories(), {"ref0": params, "padding": params}, ["ref0"], ["padding"])
    assert rc.failed == () and rc.first is not None and rc.first.id == "padding_inf"
    assert rc.first.hint == hint


def test_a_check_that_raises_is_said_and_the_others_still_run(monkeypatch):
    def broken(r):
        raise ValueError("engine.dtype is odd\nsecond line")

    monkeypatch.setattr(C, "RULES", (broken, *C.RULES))
    h = _histories()
    configs = {"ref0": GOOD, "optimizer": {**GOOD, "loop.lr": "0.01"}, "symmetric": GOOD}
    opt, sym = C.likely_causes(h, configs, ["ref0"], ["optimizer", "symmetric"])
    assert opt.failed == ("cause check failed: broken (ValueError: engine.dtype is odd)",)
    assert opt.first.id == "optimizer"
    assert opt.line().startswith("likely: optimizer settings: ")
    assert opt.line().endswith("; cause check failed: broken (ValueError: engine.dtype is odd)")
    assert sym.first.id == "numerics" and sym.failed == opt.failed


def test_a_candidate_whose_signatures_cannot_be_read_is_said_not_dropped(monkeypatch):
    def unreadable(h, run, refs):
        raise ValueError("bad trace")

    monkeypatch.setattr(C, "parity", unreadable)
    (rc,) = C.likely_causes(_histories(), {"ref0": GOOD, "padding": GOOD}, ["ref0"], ["padding"])
    assert rc.causes == () and rc.line() == "cause check failed: reading the metric signatures (ValueError: bad trace)"


def test_runs_without_params_get_no_line_of_their_own():
    # every candidate of runs without params once got "no likely cause: no params to compare"
    h = _histories()
    (none,) = C.likely_causes(h, {}, ["ref0"], ["ref1"])
    assert none.line() == "" and none.notes == ()
    (bare,) = C.likely_causes(h, {"ref0": GOOD}, ["ref0"], ["ref1"])
    assert bare.line() == "no likely cause: it logged no params to compare"
