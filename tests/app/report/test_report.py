"""`rldiag report`: the HTML draws every chart offline with run data as text; the Markdown says what the runs hold.

One real SQLite store for the module, written through rldiag's writer: three reference seeds of group
`g`; a candidate whose ratio mean steps up by 0.08 (8 sigma of the 0.01 noise) at step 120; a candidate
with non-finite gradients at steps 50, 51, 90 (NaN) and 140 (+inf); and a candidate named
`<img src=x onerror=alert(1)>` whose params and tags hold HTML, pipes and backticks.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rldiag.app.analysis.verdicts import when_text
from rldiag.app.data.store import open_store
from rldiag.app.plots.figures import NAN_SUFFIX, POSINF_SUFFIX, trace_names
from rldiag.app.report.build import build_report, render_report
from rldiag.collectors import keys as K
from tests.helpers.runs import T0_MS, log_raw, write_run

STEPS = 200
SHIFT_AT, SHIFT = 120, 0.08
NAN_STEPS, INF_STEPS = (50, 51, 90), (140,)
EVIL = "<img src=x onerror=alert(1)>"
EVIL_NOTE = "a|b `code` <b>bold</b>"
EVIL_VARIANT = "<script>alert(2)</script>|x"
METRICS = (K.CLIP_RATE, K.RATIO_MEAN, K.KL_NEW_OLD, K.GRAD_NORM, K.GRAD_FINITE, K.LOSS)
REPO = Path(__file__).resolve().parents[3]


def _steps(seed: int, *, shift: bool = False, bad: bool = False):
    rng = np.random.default_rng(seed)
    for s in range(STEPS):
        m = {K.RATIO_MEAN: 1.0 + rng.normal(0, 0.01) + (SHIFT if shift and s >= SHIFT_AT else 0.0),
             K.CLIP_RATE: 0.02 + rng.normal(0, 0.002), K.KL_NEW_OLD: 0.001 + abs(rng.normal(0, 3e-4)),
             K.GRAD_NORM: 1.0 + rng.normal(0, 0.05), K.GRAD_FINITE: 1.0, K.LOSS: 0.5 + rng.normal(0, 0.02)}
        if bad and s in NAN_STEPS + INF_STEPS:
            m[K.GRAD_NORM] = float("nan") if s in NAN_STEPS else float("inf")
            m[K.GRAD_FINITE] = 0.0
        yield s, m


@pytest.fixture(scope="module")
def runs(tmp_path_factory, template_db) -> dict:
    """{"uri", "refs", "shifted", "nan", "evil"}: the store described in the module docstring."""
    path = tmp_path_factory.mktemp("report") / "mlruns.db"
    shutil.copyfile(template_db, path)
    uri = f"sqlite:///{path}"
    base = {"engine.logprobs_mode": "raw_logprobs", "engine.enable_prefix_caching": "False", "trainer.batch_size": 8}

    def run(name, role, seed, *, params=None, variant="v0", **kw):
        tags = {K.TAG_GROUP: "g", K.TAG_ROLE: role, K.TAG_SEED: str(seed), K.TAG_VARIANT: variant}
        return write_run(uri, experiment="report", name=name, tags=tags, params={**base, **(params or {})},
                         steps=_steps(seed, **kw))

    refs = [run(f"ref-seed-{i}", "reference", i) for i in range(3)]
    shifted = run("cand-shifted", "candidate", 10, shift=True, variant="v1",
                  params={"engine.logprobs_mode": "processed_logprobs"})
    nan = run("cand-nan", "candidate", 11, bad=True, variant="unmasked")
    evil = run(EVIL, "candidate", 12, variant=EVIL_VARIANT, params={"note": EVIL_NOTE})
    return {"uri": uri, "refs": refs, "shifted": shifted, "nan": nan, "evil": evil}


@pytest.fixture(scope="module")
def report(runs):
    return build_report(runs["uri"], group="g")


# ---- Markdown ------------------------------------------------------------------------------------
def _cells(line: str) -> list[str]:
    """A GFM table row's cells, unescaped back to the text they show (split on unescaped pipes)."""
    inner = line.strip()[1:-1]
    parts = re.split(r"(?<!\\)\|", inner)
    return [html.unescape(re.sub(r"\\(.)", r"\1", p.strip())) for p in parts]


def _table(md: str, heading: str) -> list[list[str]]:
    """The rows (as cells, header first, separator dropped) of the first table after `heading`."""
    section = md.split(heading, 1)[1].split("\n### ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    width = len(_cells(lines[0]))
    rows = [_cells(ln) for ln in lines if not re.fullmatch(r"\|(-+:?\|)+", ln)]
    assert all(len(r) == width for r in rows), rows  # no value broke out of its cell
    return rows


def test_markdown_says_where_the_shifted_candidate_diverges(report, runs):
    div = report.divergence
    onset = div[(div.run_id == runs["shifted"]) & (div.key == K.RATIO_MEAN)].onset_step.item()
    assert abs(onset - SHIFT_AT) <= 3  # the shift starts at 120; the band test places it within a few steps
    # The other candidates are further seeds of the same configuration: no level departure anywhere.
    others = div[div.run_id.isin([runs["nan"], runs["evil"]]) & (div.kind == "level")]
    assert others.empty, others
    rows = _table(report.markdown, "### Divergence from the references")
    header, body = rows[0], rows[1:]
    hit = [dict(zip(header, r)) for r in body if r[0] == "cand-shifted" and r[1] == K.RATIO_MEAN]
    assert len(hit) == 1 and hit[0]["onset step"] == str(onset) and hit[0]["kind"] == "level"
    assert 0.06 < float(hit[0]["delta"]) < 0.10  # + 0.08
    alert = div[(div.run_id == runs["shifted"]) & (div.key == K.RATIO_MEAN)].alert_step.item()
    when = when_text(onset, alert)  # alert and onset, as the Compare page and the watcher say them
    lead = f"- cand-shifted: policy/ratio\\_mean leaves the reference band{' ' if alert == onset else ', '}{when} "
    assert lead in report.markdown
    # magnitudes in metric units first, relative to the reference, sd last: "delta 0.08: 1.08 vs 1 (+8%, +7.9 sd)"
    assert re.search(re.escape(lead) + r"\(level, delta 0\.0[6-9]\d*: 1\.0[6-9]\d* "
                     r"vs (1|0\.99\d*|1\.00\d*) \(\+[6-9]%, \+\d+\.\d sd\)\)", report.markdown), report.markdown


def test_the_band_drawn_is_the_band_tested(report, runs):
    # the shifted candidate's ratio-mean chart shades the band its level departure was tested against, with
    # its trailing median dotted: that median leaves the shaded band at the step the report says it alerted
    div = report.divergence
    alert = div[(div.run_id == runs["shifted"]) & (div.key == K.RATIO_MEAN)].alert_step.item()
    fig = report.figures[K.RATIO_MEAN]
    band = [t for t in fig.data if re.fullmatch(r"cand-shifted (band \(\d+-step median\)|\d+-step median)", t.name)]
    shape, median = band  # the window whose median crossed at the alert: an 8-sd step, the shortest
    assert shape.name == f"cand-shifted band ({median.name.split()[1]} median)", [t.name for t in band]
    assert shape.fill == "toself" and median.line.dash == "dot"
    n = len(median.x)  # the shape: the upper edge forward, the lower edge back
    x, med = np.asarray(median.x, float), np.asarray(median.y, float)
    hi, lo = np.asarray(shape.y[:n], float), np.asarray(shape.y[n:][::-1], float)
    out = (med < lo - 1e-9) | (med > hi + 1e-9)
    assert x[np.flatnonzero(out)[0]] == alert and alert >= SHIFT_AT
    assert (x >= alert).sum() > 10 and out[x >= alert].all()  # a lasting shift: out to the end
    # no band for a candidate without a level departure, nor on a metric no candidate left
    assert not [t for t in fig.data if t.fill and t.legendgroup != runs["shifted"]]
    assert not [t for t in report.figures[K.LOSS].data if t.fill]


def test_markdown_lists_nonfinite_gradient_steps(report):
    rows = _table(report.markdown, "### Non-finite gradients")
    by_run = {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert list(by_run) == ["cand-nan"]
    assert by_run["cand-nan"]["at steps"] == "50-51, 90, 140" and by_run["cand-nan"]["steps"] == "4"
    assert by_run["cand-nan"]["grad norm at the first"] == "NaN"  # as logged, never "-" or None
    # NaN first: the candidate is headlined by its gradients, never as within the band
    assert ("- cand-nan: non-finite gradients from step 50 (4 steps); grad/norm leaves the reference band at step 50, "
            "came back after step 51 (nonfinite") in report.markdown  # a NaN grad norm where the references are finite
    values = _table(report.markdown, "### Non-finite metric values")
    assert [r[:6] for r in values[1:]] == [["cand-nan", K.GRAD_NORM, "3", "1", "0", "50-51, 90, 140"]]


def test_markdown_config_diff_and_escaping(report, runs):
    rows = _table(report.markdown, "### Config differences")
    header = rows[0]
    assert header[:2] == ["kind", "name"] and header[2:5] == ["ref-seed-0", "ref-seed-1", "ref-seed-2"]
    assert header[5:] == ["cand-shifted", "cand-nan", EVIL]  # round-trips through the escaping
    by_name = {r[1]: r for r in rows[1:]}
    assert by_name["engine.logprobs_mode"][2:] == ["raw_logprobs"] * 3 + ["processed_logprobs"] + ["raw_logprobs"] * 2
    assert by_name["note"][2:] == ["(missing)"] * 5 + [EVIL_NOTE]
    assert by_name[K.TAG_VARIANT][-1] == EVIL_VARIANT
    assert "trainer.batch_size" not in by_name and K.TAG_GROUP not in by_name  # equal everywhere
    md = report.markdown
    assert "<img" not in md and "<script" not in md and "<b>" not in md
    assert "&lt;img src=x onerror=alert(1)&gt;" in md and "a\\|b \\`code\\` &lt;b&gt;bold&lt;/b&gt;" in md


# ---- HTML, without a browser -------------------------------------------------------------------
def test_html_is_self_contained_and_escapes_run_data(report):
    from rldiag.app.report.html import plotly_js

    page = report.html
    banner = plotly_js()[:40]
    assert page.count(banner) == 1  # plotly.js embedded once
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", page, re.IGNORECASE)  # nothing to fetch
    assert "https://" not in page.replace(plotly_js(), "")  # no URL outside the bundle (it names its own site)
    assert EVIL not in page and "<script>alert(2)" not in page and "<b>bold" not in page
    assert html.escape(EVIL) in page and html.escape(EVIL_NOTE) in page
    assert page.count("</script>") == page.count("<script") == 1 + len(report.figures) + 1


def test_render_report_on_loaded_histories(runs):
    """What the dashboard calls: chosen ids and metrics, its chart options (delta mode)."""
    from rldiag.app.data.histories import load_histories
    from rldiag.app.plots.figures import ChartOptions

    ids = [*runs["refs"][:1], runs["shifted"]]
    h = load_histories(open_store(runs["uri"]), ids, [K.RATIO_MEAN, K.GRAD_NORM])
    rep = render_report(h, open_store(runs["uri"]), runs["refs"][:1], [runs["shifted"]], keys=[K.RATIO_MEAN],
                        options=ChartOptions(delta=True))
    assert list(rep.figures) == [K.RATIO_MEAN] and len(rep.divergence) == 1
    assert trace_names(rep.figures[K.RATIO_MEAN])[:2] == ["cand-shifted", "ref-seed-0"]
    assert "(minus reference)" in rep.figures[K.RATIO_MEAN].layout.title.text
    with pytest.raises(ValueError, match=r"not in the loaded histories"):
        render_report(h, open_store(runs["uri"]), runs["refs"], [runs["shifted"]])
    with pytest.raises(ValueError, match="both reference and candidate"):
        render_report(h, open_store(runs["uri"]), ids, [runs["shifted"]])


def test_bad_selection_names_the_value_and_the_fix(runs):
    from rldiag.app.errors import DataError, RunNotFound

    with pytest.raises(RunNotFound, match=r"no run is named 'no-such-run'"):
        build_report(runs["uri"], reference="no-such-run", candidates=runs["shifted"])
    with pytest.raises(DataError, match=r"group=.*nope"):
        build_report(runs["uri"], group="nope")
    with pytest.raises(ValueError, match=r"--reference RUN_ID .* or --group G"):
        build_report(runs["uri"], candidates=[runs["shifted"]])
    with pytest.raises(ValueError, match=r"metric\(s\) \['nope/x'\] were logged by none"):
        build_report(runs["uri"], group="g", keys=["nope/x"])


# ---- HTML in a real browser ---------------------------------------------------------------------
@pytest.mark.browser
def test_html_draws_every_chart_offline_in_chromium(report, runs, tmp_path):
    from tests.helpers.browser import chromium, screenshot

    path = tmp_path / "report.html"
    report.write(path)
    url = path.as_uri()
    requests, dialogs, errors = [], [], []

    def route(r):
        if r.request.url == url:
            r.continue_()
        else:
            r.abort()

    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.on("request", lambda req: requests.append(req.url))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.route("**/*", route)
        page.goto(url)
        n = len(report.figures)
        page.wait_for_function(
            f"document.querySelectorAll('.js-plotly-plot').length === {n} && "
            "[...document.querySelectorAll('.js-plotly-plot')].every(d => d._fullData && d._fullData.length)",
            timeout=60_000)
        drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(d => ({
            key: d.dataset.key, svg: d.querySelectorAll('.scatterlayer .trace').length,
            traces: d._fullData.map(t => ({name: t.name, x: Array.from(t.x || []), n: (t.x || []).length}))}))""")
        text = page.inner_text("body")
        imgs = page.evaluate("document.querySelectorAll('img').length")
        shot = screenshot(page, "report")
    assert not errors, errors
    assert requests == [url], requests  # the file itself, nothing else
    assert dialogs == []  # no alert() from a run name, a param or a tag
    assert imgs == 0 and EVIL in text and EVIL_NOTE in text and EVIL_VARIANT in text  # shown as typed
    assert [d["key"] for d in drawn] == list(report.figures)
    for d in drawn:
        names = [html.unescape(t["name"]) for t in d["traces"]]
        assert names == trace_names(report.figures[d["key"]]), d["key"]
        assert {"ref-seed-0", "cand-shifted", "cand-nan", EVIL} <= set(names)
        assert d["svg"] == len(d["traces"])  # every trace drawn into the SVG
        if d["key"] == K.GRAD_NORM:
            marks = {html.unescape(t["name"]): t["x"] for t in d["traces"]}
            assert marks["cand-nan" + NAN_SUFFIX] == list(NAN_STEPS)
            assert marks["cand-nan" + POSINF_SUFFIX] == list(INF_STEPS)
        if d["key"] == K.RATIO_MEAN:
            div = report.divergence
            row = div[(div.run_id == runs["shifted"]) & (div.key == K.RATIO_MEAN)]
            # the chart's marker: at the alert (the onset in its words), or at the onset
            marker = next(t["x"] for t in d["traces"] if t["name"] == "diverges: cand-shifted")
            assert marker in ([row.alert_step.item()], [row.onset_step.item()]), marker
    assert shot.exists()


# ---- the command line -----------------------------------------------------------------------------
def _rldiag(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("rldiag")
    return subprocess.run([str(exe), "report", *args], cwd=cwd, capture_output=True, text=True, timeout=180)


def test_cli_writes_both_files(runs, tmp_path):
    p = _rldiag("--tracking-uri", runs["uri"], "--group", "g", "--metrics", f"{K.RATIO_MEAN},{K.GRAD_NORM}",
                "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    html_file, md_file = tmp_path / "out" / "rldiag-report.html", tmp_path / "out" / "rldiag-report.md"
    assert html_file.stat().st_size > 4_000_000 and "Plotly.newPlot" in html_file.read_text()
    assert "cand-shifted" in md_file.read_text()
    assert "loading 2 metric(s) of 6 runs" in p.stderr and "report built in" in p.stderr  # progress
    assert "cand-shifted: policy/ratio_mean leaves the reference band" in p.stdout
    assert re.search(r"policy/ratio_mean leaves the reference band(, alerted at step \d+ \(started about step \d+\)| at "
                     r"step \d+) \(level", p.stdout), p.stdout


@pytest.mark.parametrize("args, says", [
    (["--reference", "deadbeef", "--candidate", "REF"], "no run is named 'deadbeef' or has an id starting with it"),
    (["--reference", "d" * 32, "--candidate", "REF"], f"run id(s) ['{'d' * 32}'] not found in the store at 'sqlite:///"),
    (["--group", "g", "--experiment", "nope"], "experiment(s) ['nope'] not found"),
    (["--reference", "REF", "--candidate", "REF"], "are given as both reference and candidate; keep each in one role"),
    (["--candidate", "REF"], "say which runs to compare: --reference RUN_ID (repeatable) or --group G"),
    (["--group", "solo"], "group 'solo' has no run tagged rldiag.role=reference"),
    (["--group", "g", "--metrics", "policy/ratio_mean,nope/x"], "metric(s) ['nope/x'] were logged by none"),
    (["--group", "g", "--tracking-uri", "sqlite:///TMP/nowhere.db"], "/nowhere.db' (from tracking URI"),
])
def test_cli_bad_input_says_the_value_and_the_fix(runs, tmp_path, capsys, args, says):
    """The same entry point in-process (a subprocess costs seconds of imports): exit 2, one line, no traceback."""
    from mlflow import MlflowClient

    from rldiag.app.cli.main import main

    client = MlflowClient(runs["uri"])
    solo = client.create_run(client.get_experiment_by_name("report").experiment_id, run_name="solo",
                             tags={K.TAG_GROUP: "solo", K.TAG_ROLE: "candidate"}).info.run_id
    try:
        args = [runs["refs"][0] if a == "REF" else a.replace("TMP", str(tmp_path)) for a in args]
        rc = main(["report", "--tracking-uri", runs["uri"], "--out", str(tmp_path), *args])
    finally:
        client.delete_run(solo)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("rldiag report: error: ") and says in err[-1], err
    assert not (tmp_path / "rldiag-report.html").exists()


def test_runs_can_be_named_by_name_or_id_prefix(runs, tmp_path, capsys):
    """What a user copies from a report or the dashboard: a run's name, or the 8 characters of its id."""
    from rldiag.app.cli.main import main

    rc = main(["report", "--tracking-uri", runs["uri"], "--out", str(tmp_path), "--quiet", "--metrics",
               K.RATIO_MEAN, "--reference", "ref-seed-0", "--reference", runs["refs"][1][:8],
               "--candidate", "cand-shifted"])
    out = capsys.readouterr().out
    assert rc == 0 and "cand-shifted" in out and (tmp_path / "rldiag-report.md").exists()
    md = (tmp_path / "rldiag-report.md").read_text()
    assert "ref-seed-0" in md and "ref-seed-1" in md and "ref-seed-2" not in md
    # a name no run has, and a prefix that several runs share, are one line each naming the value
    assert main(["report", "--tracking-uri", runs["uri"], "--out", str(tmp_path), "--reference", "ref-seed-9",
                 "--candidate", "cand-shifted"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no run is named 'ref-seed-9' or has an id starting with it" in err and "find_runs" not in err
    assert main(["report", "--tracking-uri", runs["uri"], "--out", str(tmp_path), "--reference", "",
                 "--candidate", "cand-shifted"]) == 2
    assert "matches 6 runs" in capsys.readouterr().err


def test_steps_whose_gradients_were_not_found_are_unknown_not_clean(store_uri, tmp_path):
    """A run whose collector found no gradient (grad/found = 0: ZeRO, a call after zero_grad) logs no
    grad/finite: the report must say those steps were not checked, never "no non-finite gradient"."""
    ref = write_run(store_uri, experiment="zero", name="ref", tags={K.TAG_GROUP: "z", K.TAG_ROLE: "reference"},
                    steps=[(s, {K.RATIO_MEAN: 1.0, K.GRAD_NORM: 1.0, K.GRAD_FINITE: 1.0}) for s in range(20)])
    zero = write_run(store_uri, experiment="zero", name="zero3", tags={K.TAG_GROUP: "z", K.TAG_ROLE: "candidate"},
                     steps=[(s, {K.RATIO_MEAN: 1.0, K.GRAD_FOUND: 0.0}) for s in range(20)])
    rep = build_report(store_uri, group="z")
    assert rep.content.unchecked == {zero: list(range(20))} and ref not in rep.content.unchecked
    for text in (rep.markdown, rep.html):
        assert "Gradients not checked (no gradient found, so unknown, not finite): zero3 at steps 0-19" in text
        assert "No step with a non-finite gradient in any run" not in text


def test_runs_logged_with_no_step_are_compared_in_logging_order_and_the_report_says_so(store_uri):
    # A plain loop's `mlflow.log_metrics({...})` with no step (MLflow logs step 0): the report compared
    # nothing ("not compared (0 steps)"); it compares them point by point in logging order and says so
    from mlflow import MlflowClient

    from rldiag.app.report.build import departure_lines

    client = MlflowClient(store_uri)
    exp = client.create_experiment("nostep")
    rng = np.random.default_rng(0)
    ids = {}
    for name, offset in (("ref", 0.0), ("cand", 1.0)):
        ids[name] = client.create_run(exp, run_name=name).info.run_id
        log_raw(store_uri, ids[name], [(k, float(v), T0_MS + 10 * i, 0) for i in range(60)
                                       for k, v in ((K.LOSS, 1 + offset + 0.1 * rng.standard_normal()),
                                                    (K.REWARD_MEAN, 0.5 + 0.1 * rng.standard_normal()))])
    report = build_report(store_uri, reference=ids["ref"], candidates=ids["cand"])
    (s,) = report.content.summaries
    assert s.by_order == {K.LOSS: 0, K.REWARD_MEAN: 0} and not s.clean
    assert [d.key for d in s.departures] == [K.LOSS] and s.first.onset_step == 0
    assert [d.steps_compared for d in s.within] == [60]
    line = departure_lines(report)[0]  # its headline (its likely cause under it)
    lead = s.first.lead
    assert f"loss leaves the reference band{' ' if lead.alert_step == 0 else ', '}{when_text(0, lead.alert_step)}" in line
    assert "logged with no step (every point at step 0): compared in logging order" in line, line
    assert "logged with no step (every point at step 0): compared in logging order" in report.markdown
    from rldiag.app.dashboard.compare import summary_line  # the dashboard's Compare page, the same words

    assert "logged with no step (every point at step 0): compared in logging order" in summary_line(s, "cand").replace("\\", "")  # Markdown-escaped
