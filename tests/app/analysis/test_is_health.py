"""Importance-sampling health (`is_health`) on runs written into a real SQLite store through rldiag's writer,
under rldiag's keys and under the frameworks' own names: an ESS drop with a rising mismatch is an event with
its numbers; an ESS drop alone is none; keys that are not logged are said, never read as healthy."""

from __future__ import annotations

import statistics

import pytest

from rldiag.app.analysis.is_health import BASE, IS_KEYS, NOT_LOGGED, is_health
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys as K
from tests.helpers.runs import write_run

ESS, LOW, MM, KL = K.POLICY_ESS, K.MISMATCH_LOW_PROB_SHARE, K.MISMATCH_LOGPROB_MEAN, K.KL_NEW_OLD


def wiggle(s: int, size: float) -> float:
    """A small deterministic step-to-step wiggle (+-size), so no series is flat."""
    return size * ((s * 7919) % 11 - 5) / 5


def steps(n: int, **series) -> list[tuple[int, dict[str, float]]]:
    """`[(step, {key: f(step)})]` for keys given as callables of the step."""
    return [(s, {k: f(s) for k, f in series.items()}) for s in range(n)]


def load(uri: str, *ids: str):
    return load_histories(open_store(uri), list(ids), list(IS_KEYS))


def collapse(s: int, at: int = 40) -> dict[str, float]:
    # ESS 0.95 -> 0.50 at `at` (a 47% drop, past the 20% that makes one); the low-prob share 0.2% -> 2% (10x,
    # 1.8 points over the 0.1-point floor); the logprob difference stays 1e-3 (no rise); KL 1e-3 flat
    return {ESS: (0.95 if s < at else 0.50) + wiggle(s, 0.01), LOW: (0.002 if s < at else 0.02) + wiggle(s, 2e-4),
            MM: 1e-3 + wiggle(s, 1e-5), KL: 1e-3 + wiggle(s, 1e-5)}


def medians(at: int = 40, n: int = 60) -> tuple[str, str]:
    """The ESS baseline (median of the first BASE values) and the median after `at`, as the text gives them."""
    ess = [collapse(s, at)[ESS] for s in range(n)]
    return f"{statistics.median(ess[:BASE]):.3g}", f"{statistics.median(ess[at:]):.3g}"


def test_an_ess_drop_with_a_rising_low_prob_share_is_an_event_with_its_numbers(store_uri):
    run = write_run(store_uri, name="collapse", steps=[(s, collapse(s)) for s in range(60)])
    health = is_health(load(store_uri, run), run)
    (ev,) = health.events
    assert (ev.step, ev.last_step, ev.ess_key) == (40, 59, ESS)
    # baseline: the median of the first 10 values, 0.95 + the wiggle's median; after: the median from step 40
    assert ev.ess_before == pytest.approx(0.95, abs=0.01) and ev.ess_after == pytest.approx(0.50, abs=0.01)
    assert ev.against == f"its first {BASE} logged values"
    (rise,) = ev.rises  # only the low-prob share rose; the logprob difference and KL stayed put
    assert rise.key == LOW and rise.before == pytest.approx(0.002, abs=3e-4) and rise.after == pytest.approx(0.02, abs=3e-4)
    line = health.line()
    before, after = medians()  # 0.951 and 0.499 with the wiggle
    assert line.startswith(f"importance weights degenerate: policy/ess {before} -> {after} from step 40 (median of "
                           "steps 40-59, against its first 10 logged values), while "), line
    assert line.endswith(f"mismatch/low_prob_share rose {rise.before:.3g} -> {rise.after:.3g}"), line  # 0.00202 -> 0.02


def test_an_ess_drop_without_a_mismatch_rise_is_no_event(store_uri):
    # the same ESS drop, every mismatch metric flat: a large update or stale rollouts, not the mismatch event
    flat = [(s, {**collapse(s), LOW: 0.002 + wiggle(s, 2e-4)}) for s in range(60)]
    run = write_run(store_uri, name="drop-only", steps=flat)
    health = is_health(load(store_uri, run), run)
    assert health.events == () and health.logged
    before, after = medians()
    assert health.line().startswith(f"policy/ess drops {before} -> {after} from step 40 (against its first 10")
    assert "with no rise of mismatch/low_prob_share, mismatch/logprob_abs_diff_mean, policy/kl_new_old" in health.line()


def test_a_rise_below_the_floor_or_no_drop_is_no_event(store_uri):
    # the low-prob share doubles 0.0002 -> 0.0005: RISE x, but 0.03 points is under the 0.1-point floor
    tiny = write_run(store_uri, name="tiny", steps=[(s, {**collapse(s), LOW: 0.0002 if s < 40 else 0.0005})
                                                    for s in range(60)])
    # the share rises 10x, the ESS only 0.95 -> 0.80 (16%, under the 20% drop)
    mild = write_run(store_uri, name="mild", steps=[(s, {**collapse(s), ESS: 0.95 if s < 40 else 0.80})
                                                    for s in range(60)])
    h = load(store_uri, tiny, mild)
    assert is_health(h, tiny).events == () and is_health(h, mild).events == ()
    assert is_health(h, mild).line() == ("no policy/ess drop with a rising mismatch (mismatch/low_prob_share, "
                                         "mismatch/logprob_abs_diff_mean, policy/kl_new_old) over 60 steps")


def test_keys_not_logged_are_said_never_an_all_clear(store_uri):
    nothing = write_run(store_uri, name="grad-only", steps=steps(60, **{K.GRAD_NORM: lambda s: 1.0}))
    ess_only = write_run(store_uri, name="ess-only", steps=steps(60, **{ESS: lambda s: 0.95 if s < 40 else 0.3}))
    short = write_run(store_uri, name="short", steps=[(s, collapse(s, at=5)) for s in range(8)])
    h = load(store_uri, nothing, ess_only, short)
    none, alone, few = is_health(h, nothing), is_health(h, ess_only), is_health(h, short)
    assert none.events == () and not none.logged
    assert none.line() == f"{NOT_LOGGED}: no effective sample size (policy/ess)"
    assert alone.events == () and not alone.logged and alone.line().startswith(f"{NOT_LOGGED}: policy/ess without")
    assert few.events == () and few.line() == "importance-sampling health: too few steps (8 policy/ess values, 13 needed)"


def test_against_the_references_a_drop_from_the_first_step_is_seen(store_uri):
    # references (two seeds) hold ESS 0.90-0.92 and a low-prob share of 0.2-0.3%; the candidate starts at
    # ESS 0.55 with a 3% share at step 0 already: against its own first steps nothing moves, against the
    # references' lowest ESS (0.90; 0.55 is 39% under) and highest share (0.3%: 10x) it is an event from step 0
    refs = [write_run(store_uri, name=f"ref{i}", steps=steps(
        30, **{ESS: lambda s, i=i: 0.90 + 0.02 * i, LOW: lambda s, i=i: 0.002 + 0.001 * i})) for i in range(2)]
    cand = write_run(store_uri, name="cand", steps=steps(30, **{ESS: lambda s: 0.55 + wiggle(s, 0.01),
                                                                LOW: lambda s: 0.03 + wiggle(s, 1e-3)}))
    h = load(store_uri, *refs, cand)
    assert is_health(h, cand).events == ()  # alone: no drop against its own start
    (ev,) = is_health(h, cand, refs).events
    assert (ev.step, ev.last_step, ev.against) == (0, 29, "the references")
    assert ev.ess_before == pytest.approx(0.90) and ev.ess_after == pytest.approx(0.55, abs=0.01)
    assert [(r.key, r.before) for r in ev.rises] == [(LOW, pytest.approx(0.003))]
    assert is_health(h, refs[0], refs).events == ()  # a reference against the others: within them


def test_the_frameworks_names_are_read_pipelinerl_ess_and_nemo_rl_token_mult_prob_error(store_uri):
    # PipelineRL logs rl/ess; NeMo-RL logs train/token_mult_prob_error (1.0 at parity): 1.001 -> 1.02 is an
    # excess 0.001 -> 0.02 (20x), its rise
    run = write_run(store_uri, name="foreign", steps=steps(
        50, **{"rl/ess": lambda s: 0.97 if s < 30 else 0.40, "train/token_mult_prob_error":
               lambda s: 1.001 if s < 30 else 1.02}))
    (ev,) = is_health(load(store_uri, run), run).events
    assert (ev.step, ev.ess_key) == (30, ESS)
    (rise,) = ev.rises
    assert rise.key == K.MISMATCH_TOKEN_MULT_PROB_ERROR
    assert (rise.before, rise.after) == (pytest.approx(1.001), pytest.approx(1.02))


def test_two_stretches_are_two_events_and_a_blip_is_none(store_uri):
    # down at 20-24 (5 steps), a 2-step blip at 33-34 (under PERSIST), down again from 45
    def down(s: int) -> bool:
        return 20 <= s < 25 or 33 <= s < 35 or s >= 45

    run = write_run(store_uri, name="twice", steps=steps(
        60, **{ESS: lambda s: 0.4 if down(s) else 0.95, LOW: lambda s: 0.05 if down(s) else 0.002}))
    assert [(e.step, e.last_step) for e in is_health(load(store_uri, run), run).events] == [(20, 24), (45, 59)]
