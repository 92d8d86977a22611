"""The Compare page never gives an all-clear it cannot back (issue 15, item 3): "no candidate leaves"
says the shift size it could have missed, and a candidate with too few steps is "cannot tell", never
"within". Real SQLite store through rldiag's writer, the page through Streamlit's AppTest."""

from __future__ import annotations

import numpy as np

from rldiag.app.analysis.divergence import detect_divergence
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys
from tests.helpers.dashboard import app, unescape_md
from tests.helpers.runs import write_run

KEYS = (keys.LOSS, keys.REWARD_MEAN)


def _run(uri: str, name: str, role: str, seed: int, n: int) -> str:
    # loss ~ 1 + N(0, 0.05), reward ~ 0.5 + N(0, 0.1): the same distribution in every run
    rng = np.random.default_rng(seed)
    steps = [(s, {keys.LOSS: 1.0 + 0.05 * rng.standard_normal(), keys.REWARD_MEAN: 0.5 + 0.1 * rng.standard_normal()})
             for s in range(n)]
    return write_run(uri, experiment="verdicts", name=name, steps=steps,
                     tags={keys.TAG_GROUP: "g", keys.TAG_ROLE: role, keys.TAG_SEED: str(seed)})


def _glance(at) -> str:
    """The line above the charts, Markdown (escapes and bold) undone."""
    [line] = [unescape_md(m.value) for m in at.markdown if "below the charts" in m.value]
    return line.replace("**", "")


def _pick(at, ref: str, cands: list[str]):
    at.sidebar.multiselect(key="sidebar.reference").set_value([ref])
    at.sidebar.multiselect(key="sidebar.candidates").set_value(cands)
    at.multiselect(key="compare.metrics").set_value(list(KEYS)).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_no_departure_says_what_it_could_have_missed_and_too_few_steps_cannot_tell(store_uri, monkeypatch):
    ref = _run(store_uri, "ref", "reference", 0, 200)
    seed = _run(store_uri, "seed", "candidate", 1, 200)
    short = _run(store_uri, "short", "candidate", 2, 8)  # 8 steps: fewer than the detector needs (22)
    at = app(store_uri, monkeypatch, "compare")

    # a seed of the reference, 200 steps: no departure; the page says the size a lasting shift must
    # reach to show, per metric, as the detector computes it (one reference: its band carries the prior
    # seed spread, 0.4 noise sd, so that size is a few noise sd: more than 0.05 / 0.1, far under 1)
    _pick(at, ref, [seed])
    h = load_histories(open_store(store_uri), [ref, seed], list(KEYS))
    sizes = {k: detect_divergence([h.get(ref, k)], h.get(seed, k)).detectable for k in KEYS}
    assert 0.05 < sizes[keys.LOSS] < 1 and 0.1 < sizes[keys.REWARD_MEAN] < 1, sizes
    missed = (f"a lasting shift under {sizes[keys.LOSS]:.3g} on {keys.LOSS}, "
              f"{sizes[keys.REWARD_MEAN]:.3g} on {keys.REWARD_MEAN} would not show")
    assert _glance(at).startswith(f"No candidate leaves the reference ({missed})"), _glance(at)
    [banner] = [unescape_md(s.value) for s in at.success]
    assert banner == f"No candidate leaves the reference run on the metrics shown ({missed}).", banner

    # the short run alone: "cannot tell", no all-clear banner, nothing "within"
    _pick(at, ref, [short])
    glance = _glance(at)
    assert glance.startswith("Cannot tell whether a candidate leaves the reference: too few compared steps (22 needed)")
    assert "No candidate leaves" not in glance and not at.success
    [lines] = [unescape_md(m.value) for m in at.markdown if m.value.startswith("- **")]
    assert "not enough steps (8 compared, 22 needed)" in lines and "within" not in lines

    # both: no all-clear banner; the seed's verdict with its size, the short run counted as cannot tell
    _pick(at, ref, [seed, short])
    glance = _glance(at)
    assert glance.startswith(f"No candidate leaves the reference ({missed}); 1 of 2 cannot tell (too few steps)"), glance
    assert not at.success
    # the seed's own line below the charts (the report's words, rldiag.app.report.content) says it too
    [lines] = [unescape_md(m.value) for m in at.markdown if m.value.startswith("- **")]
    assert f"- **seed**: stays within the reference band on 2 metrics compared ({missed})" in lines, lines


def test_a_run_logged_with_no_step_is_compared_in_logging_order_and_the_page_says_so(store_uri, monkeypatch):
    # `mlflow.log_metrics({...})` with no step: every point at step 0. The page compared nothing; it
    # compares the points in logging order, says so above the charts and in the run's line, and shows no
    # all-clear banner (logging order is a step only if each point was logged once a step)
    from mlflow import MlflowClient

    from tests.helpers.runs import T0_MS, log_raw

    ref = _run(store_uri, "ref", "reference", 0, 200)
    client = MlflowClient(store_uri)
    nostep = client.create_run(client.get_experiment_by_name("verdicts").experiment_id, run_name="nostep",
                               tags={keys.TAG_GROUP: "g", keys.TAG_ROLE: "candidate"}).info.run_id
    rng = np.random.default_rng(1)
    log_raw(store_uri, nostep, [(k, float(v), T0_MS + 10 * i, 0) for i in range(200)
                                for k, v in ((keys.LOSS, 1.0 + 0.05 * rng.standard_normal()),
                                             (keys.REWARD_MEAN, 0.5 + 0.1 * rng.standard_normal()))])
    client.set_terminated(nostep)
    at = app(store_uri, monkeypatch, "compare")
    _pick(at, ref, [nostep])
    glance = _glance(at)
    assert glance.startswith("No candidate leaves the reference") and "1 compared in logging order" in glance, glance
    assert not at.success
    [lines] = [unescape_md(m.value) for m in at.markdown if m.value.startswith("- **")]
    assert "stays within the reference band on 2 metrics compared" in lines
    assert "logged with no step (every point at step 0): compared in logging order" in lines, lines
