"""collectors/metrics.py against hand-worked numbers, plus the masking edge cases (empty rows, an
all-masked batch, `-inf` sentinels at padding) that must never produce NaN."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from rldiag.collectors import keys
from rldiag.collectors.metrics import (
    clip_active_rate,
    clip_rate,
    entropy_from_logits,
    importance_stats,
    kl_new_old,
    logprob_mismatch,
    low_prob_share,
    masked_max,
    masked_mean,
    pack,
    policy_metrics,
    ratio_stats,
    reward_stats,
    sequence_clip_rate,
    sequence_ratio,
    to_host,
    token_mult_prob_error,
    worst_tokens,
)

INF = float("inf")
PAD = None  # marks a padding position in the tables below


def t(x: float) -> torch.Tensor:
    """A float32 0-d tensor, the dtype every metric returns."""
    return torch.tensor(x, dtype=torch.float32)


def batch_from_ratios(rows: list[list[float | None]], *, pad_new: float = -INF, pad_old: float = -INF):
    """`(lp_new, lp_old, mask)` whose valid tokens have ratio `r = exp(lp_new - lp_old)` as given.

    lp_old is an arbitrary (but fixed) negative logprob per position, lp_new = lp_old + log r; padding
    positions (None) hold the sentinels `pad_new` / `pad_old`, as a trainer padding a ragged batch does.
    """
    width = max(len(r) for r in rows)
    lp_new = torch.full((len(rows), width), pad_new)
    lp_old = torch.full((len(rows), width), pad_old)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        for j, r in enumerate(row):
            if r is None:
                continue
            old = -0.5 - 0.25 * (b + j)
            lp_old[b, j] = old
            lp_new[b, j] = old + math.log(r)
            mask[b, j] = True
    return lp_new, lp_old, mask


# The shared example: three ragged rows and one empty row, with -inf at every padding position.
#   row 0: r = 0.7, 0.7          -> sequence ratio s0 = exp(mean(log 0.7, log 0.7)) = 0.7
#   row 1: r = 1.25, 1.25        -> s1 = 1.25
#   row 2: r = 2.0, 0.5          -> s2 = exp((log 2 + log 0.5) / 2) = exp(0) = 1.0
#   row 3: no valid token        -> excluded from every mean
RAGGED = [[0.7, 0.7, PAD], [1.25, 1.25, PAD], [2.0, 0.5, PAD], [PAD, PAD, PAD]]


# --- clip_rate --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("eps_low", "eps_high", "expected"),
    [
        # band [0.8, 1.2]: outside are 0.7, 0.7, 1.25, 1.25, 2.0, 0.5 -> 6 of 6 valid tokens = 1.0
        (0.2, 0.2, 1.0),
        # band [0.8, 1.28] (clip-higher): 1.25 is now inside -> 0.7, 0.7, 2.0, 0.5 outside = 4/6
        (0.2, 0.28, 4 / 6),
        # band [0.65, 1.2]: 0.7 is now inside -> 1.25, 1.25, 2.0, 0.5 outside = 4/6
        (0.35, 0.2, 4 / 6),
        # band [0.65, 1.28]: only 2.0 and 0.5 are outside = 2/6
        (0.35, 0.28, 2 / 6),
        # band [0.4, 2.5]: nothing outside = 0
        (0.6, 1.5, 0.0),
    ],
)
def test_clip_rate_token_level_with_asymmetric_eps(eps_low, eps_high, expected):
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    assert_close(clip_rate(lp_new, lp_old, mask, eps_low=eps_low, eps_high=eps_high), t(expected))


def test_clip_rate_without_mask_counts_every_position():
    # r = 0.5, 1.0, 1.1, 3.0 with the default band [0.8, 1.2]: 0.5 and 3.0 outside -> 2/4 = 0.5
    lp_new, lp_old, _ = batch_from_ratios([[0.5, 1.0, 1.1, 3.0]])
    assert_close(clip_rate(lp_new, lp_old), t(0.5))


# --- sequence_clip_rate / sequence_ratio ----------------------------------------------------------


def test_sequence_ratio_is_the_geometric_mean_of_each_rows_ratios():
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    # s = 0.7, 1.25, 1.0 (see RAGGED); the empty row gets 1.0 by definition
    assert_close(sequence_ratio(lp_new, lp_old, mask), torch.tensor([0.7, 1.25, 1.0, 1.0]))


@pytest.mark.parametrize(
    ("eps_low", "eps_high", "expected"),
    [
        # band [0.8, 1.2]: s0 = 0.7 and s1 = 1.25 outside, s2 = 1.0 inside -> 2 of 3 non-empty rows
        (0.2, 0.2, 2 / 3),
        # band [0.8, 1.28]: only s0 = 0.7 outside -> 1/3
        (0.2, 0.28, 1 / 3),
        # band [0.65, 1.2]: only s1 = 1.25 outside -> 1/3
        (0.35, 0.2, 1 / 3),
        # band [0.65, 1.28]: none outside -> 0 (at token level 2.0 and 0.5 would still clip)
        (0.35, 0.28, 0.0),
    ],
)
def test_sequence_clip_rate_with_asymmetric_eps(eps_low, eps_high, expected):
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    got = sequence_clip_rate(lp_new, lp_old, mask, eps_low=eps_low, eps_high=eps_high)
    assert_close(got, t(expected))


# --- ratio_stats ------------------------------------------------------------------------------------


def test_ratio_stats_masked_mean_and_max():
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    stats = ratio_stats(lp_new, lp_old, mask)
    # mean = (0.7 + 0.7 + 1.25 + 1.25 + 2.0 + 0.5) / 6 = 6.4 / 6 = 1.0666667
    assert_close(stats.mean, t(6.4 / 6))
    # max = 2.0 (row 2); padding (-inf - -inf) never reaches it
    assert_close(stats.max, t(2.0))


def test_ratio_stats_on_policy_is_exactly_one():
    # lp_new == lp_old everywhere: r = exp(0) = 1 -> mean 1, max 1
    lp = torch.tensor([[-1.0, -2.0], [-0.1, -3.0]])
    stats = ratio_stats(lp, lp.clone())
    assert_close(stats.mean, t(1.0))
    assert_close(stats.max, t(1.0))


# --- kl_new_old -------------------------------------------------------------------------------------


def test_kl_new_old_k3_and_k1():
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    kl = kl_new_old(lp_new, lp_old, mask)
    # k3 per token (r - 1) - log r:
    #   r=0.7:  -0.3  + 0.3566749 = 0.0566749 (x2)
    #   r=1.25:  0.25 - 0.2231436 = 0.0268564 (x2)
    #   r=2.0:   1.0  - 0.6931472 = 0.3068528
    #   r=0.5:  -0.5  + 0.6931472 = 0.1931472
    #   sum = 0.1133499 + 0.0537129 + 0.5 = 0.6670628; / 6 = 0.1111771
    assert_close(kl.k3, t(0.6670627852 / 6))
    # k1 = mean(lp_old - lp_new) = -mean(log r) = -(2 log 0.7 + 2 log 1.25 + log 2 + log 0.5) / 6
    #    = -2 log(0.875) / 6 = 2 * 0.1335314 / 6 = 0.0445105
    assert_close(kl.k1, t(-2 * math.log(0.875) / 6))


def test_kl_k3_is_non_negative_where_k1_is_negative():
    # one token with r = 2: k1 = -log 2 = -0.6931472 (k1 can go negative), k3 = 1 - log 2 = 0.3068528
    lp_new, lp_old, _ = batch_from_ratios([[2.0]])
    kl = kl_new_old(lp_new, lp_old)
    assert_close(kl.k1, t(-math.log(2.0)))
    assert_close(kl.k3, t(1.0 - math.log(2.0)))


# --- entropy_from_logits ----------------------------------------------------------------------------


def test_entropy_of_uniform_logits_is_log_vocab():
    # uniform over V = 8 -> H = log 8 = 2.0794415 at every position, whatever the constant logit
    logits = torch.full((2, 3, 8), 3.7)
    assert_close(entropy_from_logits(logits), t(math.log(8)))


def test_entropy_of_a_near_one_hot_distribution_is_near_zero():
    # logits [30, 0, 0, 0]: p0 = 1/(1 + 3e-30) ~ 1, H ~ 3 * e^-30 * 31 ~ 9e-12 -> 0
    logits = torch.tensor([[[30.0, 0.0, 0.0, 0.0]]])
    assert_close(entropy_from_logits(logits), t(0.0), atol=1e-6, rtol=0)


def test_entropy_of_a_two_point_distribution():
    # logits [log 3, 0]: p = [3/4, 1/4]; H = -(0.75 log 0.75 + 0.25 log 0.25)
    #   = 0.75 * 0.2876821 + 0.25 * 1.3862944 = 0.2157616 + 0.3465736 = 0.5623351
    logits = torch.tensor([[[math.log(3.0), 0.0]]])
    assert_close(entropy_from_logits(logits), t(0.5623351446))


def test_entropy_with_minus_inf_vocab_entries_and_masked_padding_rows():
    # position 0: uniform over 4 -> log 4 = 1.3862944
    # position 1: [log 3, 0, -inf, -inf] -> the masked vocabulary contributes 0: H = 0.5623351
    # position 2: all -inf (padding), masked out
    # mean over the 2 valid positions = (1.3862944 + 0.5623351) / 2 = 0.9743148
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -INF, -INF], [-INF, -INF, -INF, -INF]]]
    )
    mask = torch.tensor([[True, True, False]])
    h = entropy_from_logits(logits, mask)
    assert torch.isfinite(h)
    assert_close(h, t(0.9743147529))


def test_entropy_of_a_single_allowed_token_is_zero_not_nan():
    # [0, -inf, -inf]: p = [1, 0, 0]; 0 * log 0 must count as 0, not NaN -> H = 0
    logits = torch.tensor([[[0.0, -INF, -INF]]])
    assert_close(entropy_from_logits(logits), t(0.0))


def test_entropy_is_computed_in_float32_for_bf16_logits():
    # bf16 logits of a uniform distribution over V = 4 -> log 4 = 1.3862944, returned as float32
    h = entropy_from_logits(torch.zeros(1, 2, 4, dtype=torch.bfloat16))
    assert h.dtype == torch.float32
    assert_close(h, t(math.log(4)))


# --- reward_stats -----------------------------------------------------------------------------------


def test_reward_stats_one_reward_has_std_zero():
    # n = 1: mean = 0.75, std = 0 (the n-1 denominator is clamped to 1, sum of squares is 0)
    stats = reward_stats(torch.tensor([0.75]))
    assert_close(stats.mean, t(0.75))
    assert_close(stats.std, t(0.0))


def test_reward_stats_uses_the_sample_std():
    # [1, 0, 1, 0]: mean = 0.5; squared deviations 4 * 0.25 = 1; / (n - 1 = 3) = 1/3; std = 0.5773503
    # (the population std would be 0.5)
    stats = reward_stats(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert_close(stats.mean, t(0.5))
    assert_close(stats.std, t(math.sqrt(1 / 3)))


def test_reward_stats_flattens_groups():
    # GRPO groups [G=2, n=4]: [[2, 4, 4, 4], [5, 5, 7, 9]] -> mean 40 / 8 = 5
    # squared deviations 9+1+1+1+0+0+4+16 = 32; / 7 -> std = sqrt(32 / 7) = 2.1380899
    stats = reward_stats(torch.tensor([[2, 4, 4, 4], [5, 5, 7, 9]]))
    assert_close(stats.mean, t(5.0))
    assert_close(stats.std, t(math.sqrt(32 / 7)))


def test_reward_stats_lets_a_nan_reward_show():
    # documented: a NaN reward propagates (a reward bug must be visible, not averaged away)
    stats = reward_stats(torch.tensor([1.0, float("nan")]))
    assert torch.isnan(stats.mean) and torch.isnan(stats.std)


# --- logprob_mismatch -------------------------------------------------------------------------------


def test_logprob_mismatch_log_and_prob_space():
    ln = math.log
    lp_trainer = torch.tensor([[ln(0.5), ln(0.02), -INF], [ln(0.25), -INF, -INF]])
    lp_engine = torch.tensor([[ln(0.4), ln(0.01), -INF], [ln(0.25), -INF, -INF]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    mm = logprob_mismatch(lp_trainer, lp_engine, mask)
    # log space |lp_t - lp_e|: ln(0.5/0.4) = ln 1.25 = 0.2231436; ln(0.02/0.01) = ln 2 = 0.6931472; 0
    #   mean = (0.2231436 + 0.6931472 + 0) / 3 = 0.3054302; max = 0.6931472 (the rare token)
    assert_close(mm.logprob_abs_diff_mean, t((ln(1.25) + ln(2.0)) / 3))
    assert_close(mm.logprob_abs_diff_max, t(ln(2.0)))
    # prob space |p_t - p_e|: 0.1, 0.01, 0 -> max = 0.1 (a different token than the log-space max)
    assert_close(mm.prob_abs_diff_max, t(0.1))


def test_logprob_mismatch_is_zero_for_identical_logprobs():
    lp = torch.tensor([[-0.3, -2.0, -7.5]])
    mm = logprob_mismatch(lp, lp.clone())
    for v in mm:
        assert_close(v, t(0.0))


def test_token_mult_prob_error_is_the_mean_of_exp_abs_diff():
    ln = math.log
    lp_trainer = torch.tensor([[ln(0.5), ln(0.02), -INF]])
    lp_engine = torch.tensor([[ln(0.4), ln(0.01), -INF]])
    mask = torch.tensor([[True, True, False]])
    # exp|d|: exp(ln 1.25) = 1.25, exp(ln 2) = 2 -> mean 1.625; the padded -inf pair is left out
    assert_close(token_mult_prob_error(lp_trainer, lp_engine, mask), t(1.625))
    assert_close(token_mult_prob_error(lp_trainer[:, :2], lp_trainer[:, :2].clone()), t(1.0))  # parity: 1


# A hand-built batch of 3 completions whose worst token is sample 2, position 1, token id 17:
# |d| = |-2.10 - -0.31| = 1.79, larger than every other valid |d| (0.1, 0.4, 0, 0.05); the masked
# position (sample 0, position 2) has a larger |d| (9.0) and must be ignored.
WORST_TRAINER = torch.tensor([[-1.0, -0.5, -9.5], [-0.3, -1.2, -3.0], [-0.7, -2.10, -0.2]])
WORST_ENGINE = torch.tensor([[-1.1, -0.5, -0.5], [-0.7, -1.2, -3.05], [-0.7, -0.31, -0.2]])
WORST_MASK = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
WORST_IDS = torch.tensor([[5, 6, 0], [7, 8, 9], [10, 17, 11]])


def test_worst_tokens_finds_the_known_worst_token_and_ranks_the_next():
    w = worst_tokens(WORST_TRAINER, WORST_ENGINE, WORST_MASK, token_ids=WORST_IDS, k=2)
    assert w.sample.tolist() == [2, 1] and w.position.tolist() == [1, 0]  # 1.79, then 0.4 (sample 1, pos 0)
    assert w.token_id.tolist() == [17, 7]
    assert_close(w.lp_trainer, torch.tensor([-2.10, -0.3]))
    assert_close(w.lp_engine, torch.tensor([-0.31, -0.7]))
    assert_close(w.abs_diff, torch.tensor([1.79, 0.4]))


def test_worst_tokens_puts_nan_first_and_says_when_nothing_is_valid():
    nan_trainer = WORST_TRAINER.clone()
    nan_trainer[1, 2] = float("nan")  # a NaN logprob is a worse disagreement than any number
    w = worst_tokens(nan_trainer, WORST_ENGINE, WORST_MASK, token_ids=WORST_IDS)
    assert (w.sample.item(), w.position.item(), w.token_id.item()) == (1, 2, 9)
    empty = worst_tokens(WORST_TRAINER, WORST_ENGINE, torch.zeros_like(WORST_MASK), k=4)  # 4 > 0 valid
    assert empty.sample.tolist() == [-1] * 4 and empty.token_id.tolist() == [-1] * 4
    assert empty.lp_trainer.tolist() == [0.0] * 4  # 0, never NaN: an empty step is not a non-finite one


def test_policy_metrics_carries_the_worst_token_in_the_one_transfer():
    out = policy_metrics(WORST_TRAINER, WORST_ENGINE, WORST_MASK, lp_trainer_at_rollout=WORST_TRAINER,
                         token_ids=WORST_IDS)
    host = to_host(out)  # the one host transfer a step makes: the worst token rides in it
    assert [host[k] for k in keys.WORST_TOKEN_KEYS[:3]] == [2.0, 1.0, 17.0]
    assert host[keys.WORST_LP_TRAINER] == pytest.approx(-2.10) and host[keys.WORST_LP_ENGINE] == pytest.approx(-0.31)
    assert host[keys.MISMATCH_LOGPROB_MAX] == pytest.approx(1.79)  # the same token as the max
    no_ids = to_host(policy_metrics(WORST_TRAINER, WORST_ENGINE, WORST_MASK, lp_trainer_at_rollout=WORST_TRAINER))
    assert no_ids[keys.WORST_TOKEN_ID] == -1.0 and no_ids[keys.WORST_SAMPLE] == 2.0


# --- masked_mean / masked_max -----------------------------------------------------------------------


def test_masked_mean_and_max_ignore_non_finite_masked_values():
    x = torch.tensor([[1.0, 2.0, float("nan")], [6.0, INF, -INF]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # mean = (1 + 2 + 6) / 3 = 3; max = 6
    assert_close(masked_mean(x, mask), t(3.0))
    assert_close(masked_max(x, mask), t(6.0))


def test_masked_mean_and_max_of_nothing():
    x = torch.tensor([[INF, float("nan")]])
    mask = torch.zeros(1, 2, dtype=torch.bool)
    assert_close(masked_mean(x, mask), t(0.0))
    assert_close(masked_max(x, mask), t(0.0))
    assert_close(masked_max(x, mask, empty=1.0), t(1.0))


# --- policy_metrics ---------------------------------------------------------------------------------

BATCH_KEYS = {keys.BATCH_TOKENS, keys.BATCH_SEQUENCES}  # the weights behind the means, always there
BASE_KEYS = BATCH_KEYS | {
    keys.CLIP_RATE,
    keys.CLIP_RATE_SEQ,
    keys.RATIO_MEAN,
    keys.RATIO_MAX,
    keys.RATIO_MIN,
    keys.RATIO_MIN_SEQ,
    keys.RATIO_MEAN_SEQ,
    keys.RATIO_MAX_SEQ,
    keys.POLICY_ESS,
    keys.POLICY_ESS_SEQ,
    keys.KL_NEW_OLD,
    keys.KL_NEW_OLD_K1,
    keys.MISMATCH_LOW_PROB_SHARE,
}
ENTROPY_KEYS = {keys.ENTROPY}
REWARD_KEYS = {keys.REWARD_MEAN, keys.REWARD_STD, keys.BATCH_REWARDS}
MISMATCH_KEYS = {keys.MISMATCH_LOGPROB_MEAN, keys.MISMATCH_LOGPROB_MAX, keys.MISMATCH_PROB_MAX,
                 keys.MISMATCH_TOKEN_MULT_PROB_ERROR, *keys.WORST_TOKEN_KEYS}


@pytest.mark.parametrize(
    ("with_logits", "with_rewards", "with_mismatch"), list(itertools.product([False, True], repeat=3))
)
def test_policy_metrics_returns_exactly_the_keys_its_inputs_allow(with_logits, with_rewards, with_mismatch):
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    lp_new.requires_grad_()  # as in training: the results must still be detached
    logits = torch.zeros(*lp_new.shape, 5, requires_grad=True)
    out = policy_metrics(
        lp_new,
        lp_old,
        mask,
        logits=logits if with_logits else None,
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]) if with_rewards else None,
        lp_trainer_at_rollout=lp_new if with_mismatch else None,
    )
    expected = set(BASE_KEYS)
    if with_logits:
        expected |= ENTROPY_KEYS
    if with_rewards:
        expected |= REWARD_KEYS
    if with_mismatch:
        expected |= MISMATCH_KEYS
    assert set(out) == expected
    assert set(out) <= set(keys.CANONICAL_METRICS) | set(keys.WORST_TOKEN_KEYS)
    for key, value in out.items():
        assert value.dim() == 0, key
        assert not value.requires_grad, key


def test_policy_metrics_values_match_the_single_functions():
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    logits = torch.tensor([0.0, math.log(3.0)]).expand(*lp_new.shape, 2)  # H = 0.5623351 everywhere
    out = policy_metrics(
        lp_new, lp_old, mask, eps_low=0.2, eps_high=0.28, logits=logits,
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), lp_trainer_at_rollout=lp_new,
    )
    assert_close(out[keys.CLIP_RATE], t(4 / 6))  # band [0.8, 1.28], see the clip_rate table
    assert_close(out[keys.CLIP_RATE_SEQ], t(1 / 3))  # only s0 = 0.7 outside
    assert_close(out[keys.RATIO_MEAN], t(6.4 / 6))
    assert_close(out[keys.RATIO_MAX], t(2.0))
    assert_close(out[keys.KL_NEW_OLD], t(0.6670627852 / 6))
    assert_close(out[keys.KL_NEW_OLD_K1], t(-2 * math.log(0.875) / 6))
    assert_close(out[keys.ENTROPY], t(0.5623351446))
    assert_close(out[keys.REWARD_MEAN], t(0.5))
    assert_close(out[keys.REWARD_STD], t(math.sqrt(1 / 3)))
    # lp_trainer_at_rollout vs lp_old: |log r| = log(1/0.7) x2, log 1.25 x2, log 2, log 2
    #   mean = (2 * 0.3566749 + 2 * 0.2231436 + 2 * 0.6931472) / 6 = 0.4243219; max = log 2
    assert_close(out[keys.MISMATCH_LOGPROB_MEAN], t((-math.log(0.7) + math.log(1.25) + math.log(2.0)) / 3))
    assert_close(out[keys.MISMATCH_LOGPROB_MAX], t(math.log(2.0)))
    # exp|log r| = 1/0.7 x2, 1.25 x2, 2 x2 -> (2.8571429 + 2.5 + 4) / 6 = 1.5595238
    assert_close(out[keys.MISMATCH_TOKEN_MULT_PROB_ERROR], t((2 / 0.7 + 2.5 + 4.0) / 6))
    assert_close(out[keys.MISMATCH_TOKEN_MULT_PROB_ERROR], token_mult_prob_error(lp_new, lp_old, mask))
    stats = importance_stats(lp_new, lp_old, mask)
    for key, value in zip(IMPORTANCE_KEYS, stats):
        assert_close(out[key], value, msg=key)
    # batch sizes: valid tokens 2 + 2 + 2 + 0 = 6; sequences with a valid token = 3 (row 3 is empty);
    # rewards = 4
    assert_close(out[keys.BATCH_TOKENS], t(6.0))
    assert_close(out[keys.BATCH_SEQUENCES], t(3.0))
    assert_close(out[keys.BATCH_REWARDS], t(4.0))


# --- importance-sampling health ---------------------------------------------------------------------

IMPORTANCE_KEYS = (keys.RATIO_MIN, keys.RATIO_MEAN, keys.RATIO_MAX, keys.RATIO_MIN_SEQ, keys.RATIO_MEAN_SEQ,
                   keys.RATIO_MAX_SEQ, keys.POLICY_ESS, keys.POLICY_ESS_SEQ)  # ImportanceStats' order


def test_importance_stats_per_token_and_per_sequence_on_the_ragged_batch():
    s = importance_stats(*batch_from_ratios(RAGGED))
    # tokens: r = 0.7, 0.7, 1.25, 1.25, 2.0, 0.5 -> min 0.5, mean 6.4 / 6, max 2.0
    assert_close((s.ratio_min, s.ratio_mean, s.ratio_max), (t(0.5), t(6.4 / 6), t(2.0)))
    # sequences (row 3 empty, left out): s = 0.7, 1.25, 1.0 -> min 0.7, mean 2.95 / 3, max 1.25
    assert_close((s.ratio_min_seq, s.ratio_mean_seq, s.ratio_max_seq), (t(0.7), t(2.95 / 3), t(1.25)))
    # ESS tokens: (sum r)^2 / (n sum r^2) = 6.4^2 / (6 * (2 * 0.49 + 2 * 1.5625 + 4 + 0.25)) = 40.96 / 50.13
    assert_close(s.ess, t(40.96 / 50.13))
    # ESS sequences: 2.95^2 / (3 * (0.49 + 1.5625 + 1.0)) = 8.7025 / 9.1575
    assert_close(s.ess_seq, t(8.7025 / 9.1575))


def test_effective_sample_size_is_one_on_policy_and_one_over_n_for_one_dominant_weight():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.5]])
    on = importance_stats(lp, lp.clone())
    assert_close((on.ess, on.ess_seq, on.ratio_min, on.ratio_max_seq), (t(1.0), t(1.0), t(1.0), t(1.0)))
    # log r = 200 at one token, 0 at three: r = e^200 overflows float32 (r^2 too), yet ESS is scale-free:
    # (e^200 + 3)^2 / (4 (e^400 + 3)) = 1/4 to within e^-200
    lp_new = torch.tensor([[200.0, 0.0], [0.0, 0.0]]) - 5.0
    s = importance_stats(lp_new, torch.full((2, 2), -5.0))
    assert_close(s.ess, t(0.25))
    # sequences: s_0 = e^100 (inf in float32), s_1 = 1 -> ESS (1 + e^-100)^2 / (2 (1 + e^-200)) = 1/2
    assert_close(s.ess_seq, t(0.5))


def test_a_nan_logprob_at_a_valid_token_shows_in_every_importance_statistic():
    # never a false all-clear: one NaN trainer logprob makes r, s_0 and both ESS NaN, not a healthy 1.0
    lp_new, lp_old, mask = batch_from_ratios([[1.0, 1.0], [1.0, PAD]])
    lp_new[0, 1] = float("nan")
    s = importance_stats(lp_new, lp_old, mask)
    for name in ("ratio_min", "ratio_mean", "ratio_max", "ratio_min_seq", "ratio_mean_seq", "ratio_max_seq", "ess",
                 "ess_seq"):
        assert torch.isnan(getattr(s, name)), name
    out = policy_metrics(lp_new, lp_old, mask)
    assert all(torch.isnan(out[k]) for k in IMPORTANCE_KEYS)


def test_low_prob_share_counts_valid_tokens_the_engine_gave_under_1e_3():
    ln = math.log
    lp_engine = torch.tensor([[ln(0.5), ln(0.0009), ln(0.002)], [ln(1e-5), -INF, -INF]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # valid: 0.5, 0.0009 (<1e-3), 0.002, 1e-5 (<1e-3) -> 2 of 4; the masked -inf (p = 0) is not counted
    assert_close(low_prob_share(lp_engine, mask), t(0.5))
    assert_close(low_prob_share(lp_engine, mask, threshold=0.01), t(0.75))  # 0.0009, 0.002, 1e-5
    out = policy_metrics(torch.zeros_like(lp_engine), lp_engine, mask)
    assert_close(out[keys.MISMATCH_LOW_PROB_SHARE], t(0.5))


# --- edge cases: empty rows, all-masked batches, -inf sentinels ---------------------------------------


def _padded_batch(pad_new: float, pad_old: float, pad_logit: float):
    """A ragged [B=4, T=6, V=5] batch: lengths 6, 3, 0 (an empty row) and 1; vocab id 4 is masked to
    -inf at every position; padding positions hold the given sentinels in lp_new, lp_old and logits."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 3, 0, 1])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    logits = torch.randn(4, 6, 5, generator=g)
    logits[..., 4] = -INF
    lp_all = torch.log_softmax(logits, -1)
    tokens = torch.randint(0, 4, (4, 6), generator=g)
    lp_new = lp_all.gather(-1, tokens[..., None]).squeeze(-1)
    lp_old = lp_new + 0.3 * torch.randn(4, 6, generator=g)
    lp_new = torch.where(mask, lp_new, torch.tensor(pad_new))
    lp_old = torch.where(mask, lp_old, torch.tensor(pad_old))
    logits = torch.where(mask[..., None], logits, torch.tensor(pad_logit))
    return lp_new, lp_old, logits, mask


@pytest.mark.parametrize(
    ("pad_new", "pad_old", "pad_logit"),
    [
        (-INF, -INF, -INF),  # the seed bug: -inf sentinel everywhere (-inf - -inf = NaN if unmasked)
        (-INF, 0.0, -INF),  # r = exp(-inf) = 0 at padding
        (0.0, -INF, 0.0),  # r = exp(+inf) = inf at padding (inf * 0 = NaN if multiplied by the mask)
        (float("nan"), float("nan"), float("nan")),  # garbage at padding: masked means ignore it
    ],
    ids=["all-minus-inf", "new-minus-inf", "old-minus-inf", "nan-padding"],
)
def test_sentinels_at_padding_never_reach_any_metric(pad_new, pad_old, pad_logit):
    lp_new, lp_old, logits, mask = _padded_batch(pad_new, pad_old, pad_logit)
    out = policy_metrics(
        lp_new, lp_old, mask, logits=logits, rewards=torch.tensor([1.0, 0.0, 0.5, 1.0]),
        lp_trainer_at_rollout=lp_new,
    )
    assert set(out) == BASE_KEYS | ENTROPY_KEYS | REWARD_KEYS | MISMATCH_KEYS
    for key, value in out.items():
        assert torch.isfinite(value), f"{key} = {value}"

    # Same values as on the valid tokens alone, flattened into one row: padding changes nothing.
    clean_new, clean_old = lp_new[mask][None, :], lp_old[mask][None, :]
    flat = policy_metrics(clean_new, clean_old, logits=logits[mask][None, :], lp_trainer_at_rollout=clean_new)
    token_level = [keys.CLIP_RATE, keys.RATIO_MEAN, keys.RATIO_MAX, keys.RATIO_MIN, keys.POLICY_ESS,
                   keys.KL_NEW_OLD, keys.KL_NEW_OLD_K1, keys.ENTROPY, keys.BATCH_TOKENS,
                   keys.MISMATCH_LOW_PROB_SHARE, *MISMATCH_KEYS]
    for key in token_level:
        assert_close(out[key], flat[key], msg=key)
    assert_close(out[keys.BATCH_TOKENS], t(6 + 3 + 0 + 1))


def test_an_empty_row_counts_for_nothing():
    # Row 1 has no valid token; the results equal those of row 0 alone.
    #   row 0: r = 2.0, 0.5 -> ratio mean 1.25, max 2.0, token clip rate 2/2 = 1.0, s0 = 1.0 (not clipped)
    lp_new, lp_old, mask = batch_from_ratios([[2.0, 0.5], [PAD, PAD]])
    out = policy_metrics(lp_new, lp_old, mask)
    assert_close(out[keys.RATIO_MEAN], t(1.25))
    assert_close(out[keys.RATIO_MAX], t(2.0))
    assert_close(out[keys.CLIP_RATE], t(1.0))
    # one sequence counted (row 0), inside the band: 0/1 = 0, not 0/2 and not a NaN from 0/0
    assert_close(out[keys.CLIP_RATE_SEQ], t(0.0))


def test_all_masked_batch_gives_zero_or_one_never_nan():
    lp_new = torch.full((3, 4), -INF)
    lp_old = torch.full((3, 4), -INF)
    logits = torch.full((3, 4, 6), -INF)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = policy_metrics(lp_new, lp_old, mask, logits=logits, lp_trainer_at_rollout=lp_new)
    expected = {
        keys.BATCH_TOKENS: 0.0,
        keys.BATCH_SEQUENCES: 0.0,
        keys.CLIP_RATE: 0.0,
        keys.CLIP_RATE_SEQ: 0.0,
        keys.RATIO_MEAN: 1.0,  # no evidence of drift
        keys.RATIO_MAX: 1.0,
        keys.RATIO_MIN: 1.0,
        keys.RATIO_MIN_SEQ: 1.0, keys.RATIO_MEAN_SEQ: 1.0, keys.RATIO_MAX_SEQ: 1.0,
        keys.POLICY_ESS: 1.0, keys.POLICY_ESS_SEQ: 1.0,  # no evidence of a degenerate batch
        keys.KL_NEW_OLD: 0.0,
        keys.KL_NEW_OLD_K1: 0.0,
        keys.ENTROPY: 0.0,
        keys.MISMATCH_LOW_PROB_SHARE: 0.0,
        keys.MISMATCH_LOGPROB_MEAN: 0.0,
        keys.MISMATCH_LOGPROB_MAX: 0.0,
        keys.MISMATCH_PROB_MAX: 0.0,
        keys.MISMATCH_TOKEN_MULT_PROB_ERROR: 1.0,  # parity
        # no worst token: -1 for where, 0 (not NaN) for the values
        keys.WORST_SAMPLE: -1.0, keys.WORST_POSITION: -1.0, keys.WORST_TOKEN_ID: -1.0,
        keys.WORST_LP_TRAINER: 0.0, keys.WORST_LP_ENGINE: 0.0,
    }
    assert to_host(out) == expected


def test_zero_sized_batch_gives_zero_or_one():
    lp = torch.zeros(0, 5)
    mask = torch.zeros(0, 5, dtype=torch.bool)
    out = to_host(policy_metrics(lp, lp, mask))
    assert out[keys.RATIO_MEAN] == 1.0 and out[keys.RATIO_MAX] == 1.0
    assert out[keys.CLIP_RATE] == 0.0 and out[keys.CLIP_RATE_SEQ] == 0.0 and out[keys.KL_NEW_OLD] == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda a, m: clip_rate(a, a, m),
        lambda a, m: sequence_clip_rate(a, a, m),
        lambda a, m: ratio_stats(a, a, m),
        lambda a, m: kl_new_old(a, a, m),
        lambda a, m: logprob_mismatch(a, a, m),
        lambda a, m: policy_metrics(a, a, m),
        lambda a, m: entropy_from_logits(torch.zeros(*a.shape, 7), m),
    ],
    ids=["clip_rate", "sequence_clip_rate", "ratio_stats", "kl_new_old", "logprob_mismatch",
         "policy_metrics", "entropy_from_logits"],
)
def test_mask_of_the_wrong_shape_names_both_shapes(call):
    values = torch.zeros(2, 3)
    mask = torch.ones(3, 2, dtype=torch.bool)  # transposed: same numel, wrong shape
    with pytest.raises(ValueError) as err:
        call(values, mask)
    assert "(3, 2)" in str(err.value) and "(2, 3)" in str(err.value)


def test_a_float_mask_works_like_a_bool_mask():
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    assert_close(clip_rate(lp_new, lp_old, mask.float()), clip_rate(lp_new, lp_old, mask))


# --- to_host ----------------------------------------------------------------------------------------


def test_to_host_returns_python_floats_in_key_order():
    values = {
        "a": torch.tensor(0.25),
        "b": 3,  # python numbers pass through as floats
        "c": torch.tensor([1.5], dtype=torch.float64),  # one element is a scalar too
        "d": torch.tensor(float("nan")),  # a NaN stays NaN: it is the thing to see
        "e": torch.tensor(7, dtype=torch.int64),
    }
    out = to_host(values)
    assert list(out) == ["a", "b", "c", "d", "e"]
    assert all(type(v) is float for v in out.values())
    assert out["a"] == 0.25 and out["b"] == 3.0 and out["c"] == 1.5 and out["e"] == 7.0
    assert math.isnan(out["d"])


def test_to_host_of_policy_metrics_is_one_flat_dict():
    lp_new, lp_old, mask = batch_from_ratios(RAGGED)
    out = to_host(policy_metrics(lp_new, lp_old, mask))
    assert set(out) == BASE_KEYS
    assert out[keys.RATIO_MAX] == pytest.approx(2.0, rel=1e-6)


def test_to_host_rejects_a_non_scalar_tensor_by_name():
    with pytest.raises(ValueError) as err:
        to_host({"policy/ok": torch.tensor(1.0), "policy/per_token": torch.ones(2, 3)})
    assert "'policy/per_token'" in str(err.value)
    assert "(2, 3)" in str(err.value)


def test_to_host_rejects_a_value_that_is_not_a_number_by_name():
    with pytest.raises(ValueError, match="'policy/label'"):
        to_host({"policy/ok": 1.0, "policy/label": "high"})


def test_to_host_of_nothing_is_empty():
    assert to_host({}) == {}


def test_pack_keeps_order_on_the_tensors_device_without_leaving_it():
    # [0.5, 2 (python int), 0.25] -> one float64 vector in key order
    v = pack({"a": torch.tensor(0.5), "b": 2, "c": torch.tensor([0.25], dtype=torch.float32)})
    assert v.dtype == torch.float64 and v.device == torch.device("cpu")
    assert_close(v, torch.tensor([0.5, 2.0, 0.25], dtype=torch.float64))
    assert pack({}).numel() == 0


# --- clip_active_rate: the clip binds only on the side the advantage's sign makes binding -------------

def test_clip_active_rate_counts_only_the_binding_side():
    # ratios exp(lp_new - lp_old) per token: [1.5, 0.5, 1.0, 1.5] and [0.5, 1.5, 1.0, pad]; eps 0.2.
    # Outside the band: 1.5 and 0.5 -> 5 of the 7 valid tokens (clip_rate 5/7).
    # Advantages +1 for row 0, -1 for row 1: binding where r > 1.2 in row 0 (tokens 0, 3) and
    # r < 0.8 in row 1 (token 0) -> 3 of 7 (TRL's clip_ratio/region_mean, verl's pg_clipfrac).
    r = torch.tensor([[1.5, 0.5, 1.0, 1.5], [0.5, 1.5, 1.0, 1.0]])
    lp_old = torch.zeros(2, 4)
    lp_new = r.log()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    assert_close(clip_rate(lp_new, lp_old, mask), torch.tensor(5 / 7))
    assert_close(clip_active_rate(lp_new, lp_old, adv, mask), torch.tensor(3 / 7))
    token_adv = adv[:, None].expand(2, 4)  # [B, T] advantages give the same
    assert_close(clip_active_rate(lp_new, lp_old, token_adv, mask), torch.tensor(3 / 7))
    stats = policy_metrics(lp_new, lp_old, mask, advantages=adv)
    assert_close(stats[keys.CLIP_ACTIVE_RATE], torch.tensor(3 / 7))
    assert keys.CLIP_ACTIVE_RATE not in policy_metrics(lp_new, lp_old, mask)  # needs the advantages


def test_trl_verl_and_openrlhf_clip_names_alias_the_active_rate_not_the_band_rate():
    for name in ("clip_ratio/region_mean", "actor/pg_clipfrac", "ppo_clip_ratio"):
        assert keys.canonical_key(name) == keys.CLIP_ACTIVE_RATE
    assert keys.canonical_key("clamp_log_ratio_new_old_indicator") == keys.CLIP_RATE  # PipelineRL: every token
    assert "clip_ratio/region_mean" in keys.ALIAS_NOTES  # GSPO's sequence level is said


def test_inputs_of_the_wrong_shape_get_an_error_that_names_them_and_the_fix():
    # torch's own messages ("Dimension out of range", "The size of tensor a (5) must match ...") said
    # neither which argument nor what to pass
    lp = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"lp_new has shape \(3, 5\) but lp_old has shape \(3, 4\); .*same completion tokens"):
        policy_metrics(lp, torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"logprobs of shape \(5,\): .*\[B, T\].*lp.unsqueeze\(0\)"):
        policy_metrics(lp[0], lp[0])  # a flat token list (one sequence, or packed ones)
    assert float(clip_rate(lp[0], lp[0])) == 0.0  # a token-level metric alone takes any shape
    with pytest.raises(ValueError, match=r"advantages have shape \(4,\) but the logprobs \(3, 5\); .*\(3,\).*\(3, 5\)"):
        policy_metrics(lp, lp, advantages=torch.ones(4))
    for adv in (torch.ones(3), torch.ones(3, 1), torch.ones(3, 5)):  # per sequence, broadcast, per token
        assert float(policy_metrics(lp, lp, advantages=adv)[keys.CLIP_ACTIVE_RATE]) == 0.0
    with pytest.raises(ValueError, match=r"logits have shape \(3, 6, 11\) but the logprobs \(3, 5\); .*\[3, 5, vocab\]"):
        policy_metrics(lp, lp, logits=torch.zeros(3, 6, 11))
