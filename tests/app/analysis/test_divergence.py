"""Divergence on synthetic runs with a known truth: seeds alone never fire, a real onset fires at once.

The generator (`bench.divergence_data`, which the divergence-quality benchmark uses too): a saturating
trend, per-seed slow wander and per-step noise of sd 1.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rldiag.app.analysis.divergence import (
    DivergenceConfig,
    compare_runs,
    compute_band,
    detect_divergence,
    divergence_frame,
)
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys
from tests.helpers.divergence import ONSET, T, refs, seed_run, trace
from tests.helpers.runs import write_run


@pytest.mark.parametrize("n_seeds, heavy", [(1, False), (3, False), (4, True)])
def test_runs_that_differ_only_in_seed_never_fire(n_seeds, heavy):
    wander = 0.3 if n_seeds > 1 else 0.0  # one reference run cannot know how far seeds wander
    fired = []
    for seed in range(40):
        cand = trace(seed_run(1000 * seed + 999, wander=wander, heavy=heavy))
        d = detect_divergence(refs(seed, n_seeds, wander=wander, heavy=heavy), cand)
        assert d.steps_compared == T
        if d.diverged:
            fired.append((seed, d.onset_step, d.kind))
    assert fired == []


def test_step_change_fires_within_a_few_steps():
    delays = []
    for seed in range(20):
        c = seed_run(1000 * seed + 999)
        c[ONSET:] += 5.0  # five noise sd
        d = detect_divergence(refs(seed, 3), trace(c))
        assert d.kind == "level" and d.end_step is None  # it stays out to the end
        assert d.delta == pytest.approx(5.0, abs=1.0) and d.delta_sigma > 3
        delays.append(d.onset_step - ONSET)
    assert all(-2 <= x <= 5 for x in delays), delays
    # Three noise sd against a single reference: one run cannot say how far seeds drift apart, so the
    # detector assumes a prior spread; where the shift is under what it can see, "within" says so with
    # the smallest shift it would flag (never a bare all-clear).
    late = []
    for seed in range(20):
        c = seed_run(1000 * seed + 999, wander=0.0)
        c[ONSET:] -= 3.0
        d = detect_divergence(trace(seed_run(1000 * seed, wander=0.0)), trace(c))
        if d.diverged:  # the onset is the first point out of a band ~2.9 sd wide: up to 8 steps late here
            assert d.delta < 0 and ONSET - 5 <= d.onset_step <= ONSET + 10
            late.append(d.onset_step - ONSET)
        else:
            assert d.status == "within" and d.detectable > 3.0, d
            assert d.evidence == f"within the band (a lasting shift under {d.detectable:.3g} would not show)"
    assert late and 0 <= np.median(late) <= 2, late


def test_slow_drift_fires_after_it_starts():
    for seed in range(5):
        c = seed_run(1000 * seed + 999)
        c[ONSET:] += 0.02 * np.arange(T - ONSET)  # 0.02 noise sd per step
        d = detect_divergence(refs(seed, 3), trace(c))
        assert d.kind == "level" and ONSET < d.onset_step < ONSET + 250 and d.delta > 0


def test_nan_in_the_candidate():
    r = refs(0, 3)
    c = seed_run(999)
    c[ONSET:] = np.nan  # the run goes NaN and stays NaN
    d = detect_divergence(r, trace(c))
    assert (d.onset_step, d.kind, d.first_nonfinite_step) == (ONSET, "nonfinite", ONSET)
    one = seed_run(999)
    one[ONSET], one[ONSET + 1] = np.nan, np.inf  # two bad steps, then finite again (skip policy)
    d = detect_divergence(r, trace(one))
    # references never go non-finite: two such steps are a departure of their own, with its end
    assert (d.onset_step, d.kind, d.end_step, d.first_nonfinite_step) == (ONSET, "nonfinite", ONSET + 1, ONSET)
    assert [x.kind for x in d.departures] == ["nonfinite"]  # and nothing else: the run is back in the band


def test_a_single_spike_or_a_variance_change():
    r = refs(1, 3)
    c = seed_run(1999)
    c[ONSET] += 100.0
    assert not detect_divergence(r, trace(c)).diverged
    noisy = seed_run(1999)
    noisy[ONSET:] += np.random.default_rng(7).normal(0, 4, T - ONSET)
    d = detect_divergence(r, trace(noisy))
    assert d.kind == "variance" and ONSET - 5 <= d.onset_step <= ONSET + 40


def test_only_common_steps_are_compared_and_the_band_is_drawable():
    r = refs(2, 3)
    live = seed_run(2999, n=400)  # a candidate still running: 400 of the reference's 1000 steps
    d = detect_divergence(r, trace(live))
    assert not d.diverged and d.steps_compared == 400
    band, _, _ = compute_band(r, trace(live))
    assert len(band.steps) == 400 and np.all(band.lower < band.center) and np.all(band.center < band.upper)
    flat = trace(np.zeros(200))  # a reference that is exactly 0 (a clip rate that never clips)
    assert not detect_divergence(flat, trace(np.zeros(200))).diverged
    assert detect_divergence(flat, trace(np.r_[np.zeros(100), np.full(100, 0.2)])).onset_step == 100
    assert not detect_divergence(flat, trace(np.r_[np.zeros(100), np.full(100, 0.2)]),
                                 DivergenceConfig(min_delta=0.5)).diverged
    with pytest.raises(ValueError, match="window=8"):
        DivergenceConfig(window=8)


def test_divergence_table_from_a_store(store_uri):
    """A reference band of three seeds and two candidates, written through rldiag's writer."""
    def steps_of(values: dict[str, np.ndarray]):
        return [(s, {k: float(v[s]) for k, v in values.items()}) for s in range(400)]

    ref_ids = [write_run(store_uri, name=f"ref{i}", steps=steps_of({keys.RATIO_MEAN: seed_run(i, n=400),
                                                                    keys.ENTROPY: seed_run(10 + i, n=400)}))
               for i in range(3)]
    same = write_run(store_uri, name="another seed", steps=steps_of({keys.RATIO_MEAN: seed_run(7, n=400),
                                                                     keys.ENTROPY: seed_run(17, n=400)}))
    shifted = seed_run(8, n=400)
    shifted[250:] += 4.0
    broken = write_run(store_uri, name="v1 defaults", steps=steps_of({keys.RATIO_MEAN: shifted,
                                                                      keys.ENTROPY: seed_run(18, n=400)}))
    h = load_histories(open_store(store_uri), [*ref_ids, same, broken])
    table = divergence_frame(compare_runs(h, ref_ids, [same, broken]))
    quiet = table[table.run_id == same]
    assert sorted(quiet.key) == [keys.ENTROPY, keys.RATIO_MEAN] and quiet.onset_step.isna().all()
    loud = table[table.run_id == broken].set_index("key")
    assert pd.isna(loud.loc[keys.ENTROPY, "onset_step"])
    assert 250 <= loud.loc[keys.RATIO_MEAN, "onset_step"] <= 255 and loud.loc[keys.RATIO_MEAN, "delta"] > 2


def test_compare_runs_skips_what_one_side_did_not_log(store_uri):
    """The one candidate x metric loop: a metric only the candidate logged, or a candidate without
    points of it, is not compared (no entry), never compared against an empty band."""
    ref = write_run(store_uri, name="ref", steps=[(s, {keys.RATIO_MEAN: 1.0}) for s in range(30)])
    cand = write_run(store_uri, name="cand", steps=[(s, {keys.RATIO_MEAN: 1.0, keys.ENTROPY: 2.0}) for s in range(30)])
    h = load_histories(open_store(store_uri), [ref, cand])
    out = compare_runs(h, [ref], [cand], [keys.RATIO_MEAN, keys.ENTROPY, keys.KL_NEW_OLD])
    assert list(out) == [keys.RATIO_MEAN] and list(out[keys.RATIO_MEAN]) == [cand]
    assert out[keys.RATIO_MEAN][cand].onset_step is None


def test_a_candidate_apart_from_the_first_step_diverges_at_the_first_step():
    # a short run (20 steps, as the engine-parity experiment logs) that is off from step 0 and keeps
    # moving: the onset is step 0, not where the gap grows fastest
    r = refs(3, 3, n=20)
    c = seed_run(3999, n=20) + 10.0 + np.linspace(0, 20, 20) ** 1.5
    d = detect_divergence(r, trace(c))
    assert d.diverged and d.onset_step == 0 and d.kind == "level"


def test_a_candidate_at_parity_for_one_step_then_apart_diverges_at_the_second():
    # engine-parity's prefix cache kept across updates: identical at step 0, apart from step 1
    r = refs(4, 3, n=20)
    c = seed_run(4999, n=20) + 10.0
    c[0] = np.median([t.values[0] for t in r])
    d = detect_divergence(r, trace(c))
    assert d.diverged and d.onset_step == 1


def test_too_few_compared_steps_is_not_enough_steps_never_within():
    config = DivergenceConfig()
    assert config.min_steps == 2 * config.windows[0] == 22  # the shortest window twice
    assert DivergenceConfig(windows=(5, 9)).min_steps == 10
    r = refs(5, 3, n=60)
    short = detect_divergence(r, trace(seed_run(5999, n=10)))  # a seed, 10 steps: nothing to see on so few
    assert (short.diverged, short.status, short.steps_compared) == (False, "not_enough_steps", 10)
    assert short.evidence == "not enough steps (10 compared, 22 needed)"
    enough = detect_divergence(r, trace(seed_run(5999, n=30)))
    assert (enough.status, enough.steps_compared) == ("within", 30)
    assert enough.evidence.startswith("within the band (a lasting shift under ")
    apart = detect_divergence(r, trace(seed_run(5999, n=30) + 10.0))
    assert apart.status == "diverged" and apart.onset_step == 0
    assert detect_divergence(r, trace(seed_run(5999, n=10)), DivergenceConfig(windows=(5, 9))).status == "within"
    empty = detect_divergence(r, trace(seed_run(5999, n=40), steps=np.arange(100, 140) + 1000))  # no common step
    assert (empty.status, empty.steps_compared) == ("not_enough_steps", 0)
    assert empty.evidence == f"not compared (0 steps; the references end at step {len(r[0]) - 1}: 40 later steps not compared)"


def test_summary_per_candidate_nan_first_thin_not_compared_and_stopped_metrics(store_uri):
    """`summarize`: what the report's, the dashboard's and the CLI's headline say per candidate."""
    from rldiag.app.analysis.divergence import summarize

    ref = write_run(store_uri, name="ref", steps=[(s, {keys.RATIO_MEAN: float(v), keys.ENTROPY: 2.0, keys.LOSS: 0.5,
                                                       keys.GRAD_NORM: 1.0})
                                                  for s, v in enumerate(seed_run(1, n=40))])
    cand_steps = []
    for s, v in enumerate(seed_run(2, n=40)):
        m = {keys.RATIO_MEAN: float(v), keys.GRAD_NORM: float("nan") if s == 30 else 1.0, keys.KL_REF: 0.01}
        if s < 10:
            m[keys.ENTROPY] = 2.0  # stops after 10 steps of 40: not enough steps, last logged at 9
        if s % 5 == 0:
            m[keys.LOSS] = 0.5  # every 5th step, to step 35 of 39: not "stopped"; 8 points
        cand_steps.append((s, m))
    cand = write_run(store_uri, name="cand", steps=cand_steps)
    h = load_histories(open_store(store_uri), [ref, cand])
    ks = [keys.RATIO_MEAN, keys.ENTROPY, keys.KL_REF, keys.GRAD_NORM, keys.LOSS]
    [s] = summarize(compare_runs(h, [ref], [cand], ks), h, [ref], [cand], ks)
    assert s.status == "nonfinite" and s.nonfinite_steps == (30,) and s.first_nonfinite_step == 30
    assert [d.key for d in s.within] == [keys.RATIO_MEAN]
    assert [(d.key, d.kind, d.onset_step, d.end_step) for d in s.departures] == [(keys.GRAD_NORM, "nonfinite", 30, 30)]
    assert [(d.key, d.steps_compared) for d in s.thin] == [(keys.ENTROPY, 10), (keys.LOSS, 8)]
    assert s.not_compared == s.no_reference == (keys.KL_REF,)  # the candidate logged it, no reference did
    assert s.last_logged == {keys.ENTROPY: 9} and not s.clean


@pytest.mark.parametrize("seed", range(20))
def test_rounding_under_float32_resolution_is_not_a_departure_but_a_shift_above_it_is(seed):
    # engine-parity's GSPO loss on-policy: advantages with zero mean times ratios of 1 give 0 up to
    # float32 rounding, a few multiples of 2**-26 either way; the reference seed's groups all had equal
    # rewards from step 12 on, so it logs exactly 0 there. A seed's rounding is not a departure; a shift
    # of 1e-6 from step 12 (17 units of float32 roundoff) is, and at step 12, not at an earlier step of
    # rounding (a 1e-9 floor on the noise sd flagged steps 2 and 9 of two such seeds at 5.6 and 131 sd)
    rng = np.random.default_rng(seed)
    u = float(np.float32(2.0**-26))
    ref = u * rng.integers(-3, 4, 20).astype(float)
    ref[12:] = 0.0
    cand = u * rng.integers(-3, 4, 20).astype(float)
    assert detect_divergence([trace(ref, "ref")], trace(cand, "cand")).departures == ()
    cand[12:] += 1e-6
    apart = detect_divergence([trace(ref, "ref")], trace(cand, "cand"))
    assert apart.status == "diverged" and [d.onset_step for d in apart.departures] == [12]


@pytest.mark.parametrize("scale", [1e-12, 1e-7, 1.0, 1e6])
def test_a_metric_at_any_scale_is_judged_in_its_own_units(scale):
    # A learning rate of 1e-7, a parity mismatch of 1e-8: float32 rounds a value relative to its size, so
    # a one-signed metric far under 1 is compared as one near 1 would be (a floor of 3e-7 in metric units
    # called a 3x rise at 1e-12 and a 1e-7 -> 2e-7 learning rate "within the band").
    r = [trace(scale * (10 + seed_run(1000 + i, wander=0.0)), f"ref{i}") for i in range(3)]
    same = detect_divergence(r, trace(scale * (10 + seed_run(1999, wander=0.0))))
    assert same.status == "within" and same.detectable < 2 * scale, same
    c = 10 + seed_run(1999, wander=0.0)
    c[ONSET:] += 3.0
    d = detect_divergence(r, trace(scale * c))
    assert d.kind == "level" and ONSET - 2 <= d.onset_step <= ONSET + 5 and d.delta == pytest.approx(3 * scale, rel=0.3)
    lr = [trace(np.full(T, 1e-7 * scale), f"ref{i}") for i in range(3)]
    assert detect_divergence(lr, trace(np.full(T, 1e-7 * scale))).departures == ()
    doubled = detect_divergence(lr, trace(np.full(T, 2e-7 * scale)))
    assert doubled.kind == "level" and doubled.onset_step == 0 and doubled.end_step is None


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_a_candidate_scaled_up_noise_and_all_is_a_lasting_level_departure(factor):
    # factor x the references' values (their level and noise with it): the level departure from
    # step 0 to the end is reported, not dropped as the noisier candidate's own wobble (it was: a variance
    # departure that ended at step 49 and no level departure, as if the run had come back)
    r = [trace(10 + seed_run(1000 + i, wander=0.0), f"ref{i}") for i in range(3)]
    d = detect_divergence(r, trace(factor * (10 + seed_run(1999, wander=0.0))))
    level = [x for x in d.departures if x.kind == "level"]
    assert d.onset_step == 0 and len(level) == 1 and level[0].onset_step == 0 and level[0].end_step is None, d.departures
    assert level[0].delta == pytest.approx((factor - 1) * np.median(r[0].values), rel=0.15)
