"""Each page of the dashboard through Streamlit's AppTest, against the real SQLite store of conftest.py:
what a user reads off the page (tables, chart traces, messages)."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest

from rldiag.app.dashboard import chart_grid, data
from rldiag.app.dashboard.selection import ALL_RUNS
from rldiag.collectors import keys
from tests.helpers.dash_store import EVIL, INF_STEP, NAN_STEPS, SHIFT_AT
from tests.helpers.dashboard import app, by_name, chart_specs, figures, html_tables, unescape_md
from tests.helpers.net import free_port
from tests.helpers.runs import write_run
from tests.helpers.trl_runs import NAN_FROM, NEEDED, write_trl_runs

TAGGED = ["v0 ref", "v0 seed1", "v0 seed2", "v1 shifted", "unmasked", EVIL]


def test_overview_lists_every_run_with_status_steps_alerts_and_tags(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch)
    assert at.sidebar.selectbox(key="sidebar.experiment").value == "dash"  # the newest run's experiment
    table = at.dataframe[0].value
    assert sorted(table["run"]) == sorted([*TAGGED, "trl run", "throughput only"])
    for col in ("status", "steps", "alerts", "variant", "role", "group", "started (UTC)", "picked"):
        assert col in table.columns
    row = table.set_index("run").loc
    assert (table["status"] == "FINISHED").all() and row["v0 ref", "steps"] == 299
    assert row["unmasked", "alerts"] == 4 and row["unmasked", "variant"] == "unmasked"
    # defaults from the tags: the newest group's reference and candidates; untagged runs are not picked
    assert row["v0 ref", "picked"] == "reference" and row["v1 shifted", "picked"] == "candidate"
    assert row["trl run", "picked"] == "" and row["trl run", "role"] is None or np.isnan(row["trl run", "role"])
    [warning] = [unescape_md(w.value) for w in at.warning]
    assert "throughput only" in warning and "It has: lr, tokens_per_sec." in warning


def divergence_lines(at) -> dict[str, str]:
    """The Compare page's one line per candidate, `{candidate: line}`, markdown undone."""
    [text] = [unescape_md(m.value) for m in at.markdown if m.value.startswith("- **")]
    # (a candidate's likely-cause line sits under it, indented: not a candidate line)
    return {line[4:].split("**")[0]: line for line in text.splitlines() if line.startswith("- **")}


def test_compare_draws_every_run_nan_markers_and_the_shift_but_not_the_seeds(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch, "compare")
    figs = figures(at)
    assert list(figs) == [keys.RATIO_MEAN, keys.CLIP_RATE, keys.KL_NEW_OLD, keys.ENTROPY, keys.REWARD_MEAN,
                          keys.GRAD_NORM, keys.LOSS]  # the default metrics these runs logged, in order
    escaped = {html.escape(n, quote=False) for n in TAGGED}
    ratio = by_name(figs[keys.RATIO_MEAN])
    lines = [t for t in figs[keys.RATIO_MEAN] if t["mode"] == "lines" and t.get("showlegend") is not False]
    # the band the detector tested the shifted candidate against, drawn beneath the lines (no legend entry)
    assert [t["name"] for t in figs[keys.RATIO_MEAN] if " band (" in t["name"]] in (
        [f"v1 shifted band ({w}-step median)"] for w in (11, 21, 41, 81, 129))
    assert {t["name"] for t in lines} == escaped  # the run named like HTML is escaped text for plotly
    assert lines[-1]["name"] == "v0 ref" and lines[-1]["line"]["width"] == 3.0  # reference on top, wider
    assert len(lines[0]["x"]) == 300  # 300 points fit under the chart's budget: nothing decimated away
    # the level shift is marked within a few steps of its onset; the seed replicates never are
    [marker] = ratio["diverges: v1 shifted"]["x"]  # at the alert (a few steps after the onset), or at the onset
    assert 0 <= marker - SHIFT_AT <= 8 if marker > SHIFT_AT + 3 else abs(marker - SHIFT_AT) <= 3
    assert "diverges: v1 shifted" in by_name(figs[keys.KL_NEW_OLD])
    # v1 shifted leaves the band; unmasked's NaN grad norm where the reference is finite is a nonfinite
    # departure at once (the detector of 6b6419a), on grad/norm only; the seeds never leave it
    onsets = {(title, t["name"]) for title, ts in figs.items() for t in ts if t["name"].startswith("diverges: ")}
    assert {n for _, n in onsets} <= {"diverges: v1 shifted", "diverges: unmasked"}
    assert {title for title, n in onsets if n == "diverges: unmasked"} <= {keys.GRAD_NORM}
    grad = by_name(figs[keys.GRAD_NORM])
    assert grad["unmasked NaN"]["x"].tolist() == list(NAN_STEPS)
    assert grad["unmasked +inf"]["x"].tolist() == [INF_STEP]
    assert not np.isin(grad["unmasked"]["x"], [*NAN_STEPS, INF_STEP]).any()  # the line skips them
    # one line per candidate: where it leaves the reference first; the full table only on request
    summary = divergence_lines(at)
    shifted = summary.pop("v1 shifted")
    assert "at step" in shifted and "2 metrics in all" in shifted
    # alert and onset both ("alerted at step A (started about step O)"), or "at step O" where they are one
    onset = re.search(r"(?:started about step|leaves the reference band at step) (\d+)", shifted)
    assert onset and abs(int(onset.group(1)) - SHIFT_AT) <= 3, shifted
    # NaN first: the run with non-finite gradients is never "within", whatever its bands say
    assert summary.pop("unmasked").startswith(f"- **unmasked**: non-finite gradients from step {NAN_STEPS[0]} (4 steps)")
    assert summary and all("stays within the reference band on 7 metrics compared" in line
                           for line in summary.values())  # the seeds, the run named like HTML
    # before the charts, one row per candidate: verdict, where it departs, likely cause and fix (a static table)
    [verdicts] = [m.value for m in at.html if "<th>departs</th>" in m.value]
    rows = {cells[0]: cells[1:] for cells in table_rows(verdicts)}
    assert rows["unmasked"][:2] == ["non-finite gradients", f"grad/finite 0 at step {NAN_STEPS[0]}"], rows
    assert rows["v1 shifted"][0] == "departs", rows
    # the metric it leaves that lasts and is largest, alert and onset both (verdicts.when_text)
    assert re.fullmatch(rf"({keys.KL_NEW_OLD}|{keys.RATIO_MEAN}) (alerted at step \d+ \(started about step \d+\)|at step \d+)",
                        rows["v1 shifted"][1]), rows
    assert all(r[:2] == ["within the band", "-"] for n, r in rows.items() if n not in ("unmasked", "v1 shifted"))
    assert not at.dataframe
    at.toggle(key="compare.divergence.all").set_value(True).run()
    table = at.dataframe[0].value
    # v1 shifted's two departures, and unmasked's nonfinite one on grad/norm (its NaN where the reference is finite)
    shifted_rows = table[table["candidate"] == "v1 shifted"]
    assert sorted(shifted_rows["metric"]) == [keys.KL_NEW_OLD, keys.RATIO_MEAN]
    assert (abs(shifted_rows["onset_step"] - SHIFT_AT) <= 3).all()
    assert table[table["candidate"] != "v1 shifted"][["candidate", "metric"]].values.tolist() == [
        ["unmasked", keys.GRAD_NORM]]
    assert not at.warning  # every picked run has canonical metrics


def test_compare_without_the_chart_component_sends_the_same_figure_through_plotly_chart(dash_store, monkeypatch):
    """Streamlit without `st.components.v2` (or a missing plotly.js bundle): the grid is an st.plotly_chart."""
    grid = app(dash_store.uri, monkeypatch, "compare")
    assert len(grid.get("bidi_component")) == 1 and not grid.get("plotly_chart")
    monkeypatch.setattr(chart_grid, "_MOUNT", None)
    native = app(dash_store.uri, monkeypatch, "compare")
    assert not native.get("bidi_component") and len(native.get("plotly_chart")) == 1
    assert list(figures(native)) == list(figures(grid)) and len(figures(grid)) == 7
    for traces, native_traces in zip(figures(grid).values(), figures(native).values()):
        assert [t["name"] for t in native_traces] == [t["name"] for t in traces]
        for t, n in zip(traces, native_traces):
            np.testing.assert_array_equal(n["x"], t["x"])
            np.testing.assert_array_equal(n["y"], t["y"])


def test_compare_band_of_seeds_trl_aliases_and_a_run_without_canonical_metrics(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch, "compare")
    at.sidebar.selectbox(key="sidebar.group").set_value(ALL_RUNS).run()
    ids = dash_store.ids
    at.sidebar.multiselect(key="sidebar.reference").set_value([ids["v0 ref"], ids["v0 seed1"], ids["v0 seed2"]])
    at.sidebar.multiselect(key="sidebar.candidates").set_value(
        [ids["v1 shifted"], ids["trl run"], ids["throughput only"]]).run()
    assert not at.exception
    [warning] = [unescape_md(w.value) for w in at.warning]
    assert "throughput only" in warning and "lr, tokens_per_sec" in warning
    figs = figures(at)
    grad = {t["name"] for t in figs[keys.GRAD_NORM] if t["mode"] == "lines"}
    assert grad == {"v0 ref", "v0 seed1", "v0 seed2", "v1 shifted", "trl run"}  # TRL's grad_norm, mapped
    assert "trl run" not in {t["name"] for t in figs[keys.KL_NEW_OLD]}  # TRL's kl is KL to the reference
    at.multiselect(key="compare.metrics").select(keys.KL_REF).run()  # its own chart, on request
    assert {t["name"] for t in figures(at)[keys.KL_REF]} == {"trl run"}
    assert "trl run" not in {t["name"] for t in figs[keys.RATIO_MEAN]}  # TRL logged no ratio
    lines = divergence_lines(at)  # the band of 3 seeds: only the shift departs
    assert "leaves the reference band" in lines["v1 shifted"] and "stays within the reference band" in lines["trl run"]
    assert f"not compared: {keys.KL_REF} (no reference logged it)" in lines["trl run"]
    assert any("band of 3 reference runs" in c.value for c in at.caption)
    assert not any("One reference run" in c.value for c in at.caption)  # 3 seeds measure their spread


def test_compare_headlines_nan_first_on_two_short_trl_runs(store_uri, monkeypatch):
    """Two stock TRL runs of 8 steps (no rldiag tags: the oldest is the reference), the candidate NaN
    from step 4: never "No candidate leaves the reference run", never "within" on 8 steps."""
    write_trl_runs(store_uri)
    at = app(store_uri, monkeypatch, "compare")
    assert not [s for s in at.success if "No candidate leaves" in s.value]
    line = divergence_lines(at)["grpo-nan"]
    assert line.startswith(f"- **grpo-nan**: non-finite gradients from step {NAN_FROM} (5 steps)")
    assert f"not enough steps (4-8 compared, {NEEDED} needed)" in line and "within" not in line
    assert f"{keys.KL_REF} (last logged at step 4)" in line
    assert any(c.value.startswith("One reference run: how far seeds differ cannot be measured") for c in at.caption)
    # without the grad norm charted the headline still knows: the gradient metrics load regardless
    at.multiselect(key="compare.metrics").set_value([keys.REWARD_MEAN, keys.LOSS]).run()
    line = divergence_lines(at)["grpo-nan"]
    assert line.startswith(f"- **grpo-nan**: non-finite gradients from step {NAN_FROM}") and "within" not in line
    assert list(figures(at)) == [keys.REWARD_MEAN, keys.LOSS]


def test_nan_events_of_a_trl_run_print_nan_not_none(store_uri, monkeypatch):
    write_trl_runs(store_uri)
    at = app(store_uri, monkeypatch, "nan-events")
    summary = at.dataframe[0].value
    assert summary.set_index("run").loc["grpo-nan", "first step"] == str(NAN_FROM)
    # steps 4-8 are one episode: one row, its grad norm NaN at each of them
    episodes, events = html_tables(at.markdown)  # the episodes, then the expander's table of every step
    [episode] = episodes.to_dict("records")
    assert (episode["run"], episode["steps"], episode["steps (count)"], episode["grad norm"]) == (
        "grpo-nan", "4-8", "5", "NaN")
    assert episode["source"] == "metrics" and episode["parameters"].startswith("not named")
    assert events["step"].tolist() == ["4", "5", "6", "7", "8"] and events["grad norm"].tolist() == ["NaN"] * 5


def test_compare_controls_delta_step_range_and_metric_choice(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch, "compare")
    at.multiselect(key="compare.metrics").set_value([keys.RATIO_MEAN, keys.GRAD_NORM])
    at.toggle(key="compare.delta").set_value(True)
    at.slider(key="compare.steps").set_value((100, 220)).run()
    figs = figures(at)
    assert list(figs) == [f"{keys.RATIO_MEAN} (minus reference)", f"{keys.GRAD_NORM} (minus reference)"]
    ratio = by_name(figs[f"{keys.RATIO_MEAN} (minus reference)"])
    assert ratio["v0 ref"]["y"].max() == 0 and ratio["v1 shifted"]["x"].min() == 100
    assert ratio["v1 shifted"]["x"].max() == 220 and np.median(ratio["v1 shifted"]["y"][-50:]) > 0.03
    grad = by_name(figs[f"{keys.GRAD_NORM} (minus reference)"])
    assert grad["unmasked NaN"]["x"].tolist() == [200]  # only the NaN inside the step range


def test_nan_events_lists_steps_parameters_and_tokens(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch, "nan-events")
    summary = at.dataframe[0].value
    assert summary.set_index("run").loc["unmasked", "non-finite steps"] == 4
    assert summary.set_index("run")["non-finite steps"].drop("unmasked").eq(0).all()
    # NaN at 40, 41, 200 and inf at 250 with finite steps between: three episodes, one row each
    episodes = html_tables(at.markdown)[0]
    assert episodes["run"].unique().tolist() == ["unmasked"]
    assert episodes["steps"].tolist() == ["40-41", "200", "250"]
    assert episodes["steps (count)"].tolist() == ["2", "1", "1"]
    assert episodes["grad norm"].tolist() == ["NaN", "NaN", "inf"]  # never None
    tagged = episodes.set_index("steps").loc["200"]
    assert tagged["source"] == "tag" and tagged["parameters"] == "2 parameter tensors, at this step"
    assert tagged["samples / tokens"] == "sample 1: 1 token position"
    # every step on demand: one expander per episode, the tag's parameter names and token in step 200's
    assert [e.label for e in at.expander] == ["unmasked, steps 40-41: every step", "unmasked, step 200: every step",
                                              "unmasked, step 250: every step"]
    assert "model.embed.weight, model.lm_head.weight" in unescape_md(at.expander[1].caption[0].value)
    step200 = html_tables(at.expander[1].markdown)[0]
    assert step200["step"].tolist() == ["200"] and step200["samples / tokens"].tolist() == ["sample 1 token 3"]


def test_config_diff_puts_engine_parity_knobs_and_differing_runs_first(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch, "config-diff")
    table = _config_rows(at)
    # the reference first, then the runs that differ from it on most rows: v1 shifted differs on the
    # logprobs mode, prefix caching and three tags (5 rows), unmasked on lr and three tags (4)
    assert table["columns"][:3] == ["v0 ref (reference)", "v1 shifted", "unmasked"]
    names = [r[0] for r in table["rows"]]
    assert names[:2] == ["engine.logprobs_mode", "engine.enable_prefix_caching"]
    assert all(cls == "differs" for cls in table["classes"])
    row = {r[0]: dict(zip(table["columns"], r[1:])) for r in table["rows"]}
    assert row["engine.logprobs_mode"]["v1 shifted"] == "raw_logprobs"
    assert row["engine.logprobs_mode"]["v0 ref (reference)"] == "processed_logprobs"
    assert row["lr"]["unmasked"] == "2e-06" and row["lr"]["v0 ref (reference)"] == "1e-06"
    assert "engine.name" not in row and "trainer.gradient_accumulation_steps" not in row  # identical: hidden
    assert not [n for n in names if n.startswith("rldiag.alert")]  # alert state is no config (a JSON blob)
    at.toggle(key="config.all").set_value(True).run()
    full = _config_rows(at)
    assert len(full["rows"]) > len(table["rows"])  # the toggle shows the identical rows, after, greyed
    assert full["classes"] == sorted(full["classes"])  # "differs" < "same": differing rows first
    same = {r[0]: dict(zip(full["columns"], r[1:])) for r, c in zip(full["rows"], full["classes"]) if c == "same"}
    assert same["engine.name"]["v1 shifted"] == "vllm" and same["trainer.gradient_accumulation_steps"][EVIL] == "2"


def _config_rows(at) -> dict:
    """The config diff table as the page sends it: column headers, rows (name, values) and row classes."""
    import html as html_mod
    import re

    [page] = [m.value for m in at.markdown if "rldiag-config" in m.value]
    page = re.sub(r"<wbr>|</?span[^>]*>(?=\(reference\))|(?<=\(reference\))</span>", "", page)  # text as read
    heads = [html_mod.unescape(h) for h in re.findall(r"<th[^>]*>(.*?)</th>", page)][1:]
    rows, classes = [], []
    for cls, body in re.findall(r'<tr class="(\w+)">(.*?)</tr>', page):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", body)
        name = html_mod.unescape(re.search(r"<code>(.*?)</code>", cells[0]).group(1))
        rows.append([name, *(html_mod.unescape(c) for c in cells[1:])])
        classes.append(cls)
    return {"columns": heads, "rows": rows, "classes": classes}


def test_unreachable_store_is_an_error_message_not_a_traceback(tmp_path, monkeypatch):
    at = app(f"sqlite:///{tmp_path / 'nowhere.db'}", monkeypatch)
    [error] = at.error
    assert "Cannot read the tracking store" in error.value and "does not exist" in unescape_md(error.value)
    at = app(f"http://127.0.0.1:{free_port()}", monkeypatch)
    assert "cannot reach the MLflow tracking server" in unescape_md(at.error[0].value)


def test_empty_experiment_and_no_runs_picked_say_so(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch, "compare")
    at.sidebar.multiselect(key="sidebar.reference").set_value([])
    at.sidebar.multiselect(key="sidebar.candidates").set_value([]).run()
    assert "No runs picked" in at.info[0].value and not chart_specs(at)
    at.sidebar.selectbox(key="sidebar.experiment").set_value("empty").run()
    assert not at.exception and "has no runs yet" in at.info[0].value
    at = app(dash_store.uri, monkeypatch, "runs")
    at.sidebar.selectbox(key="sidebar.experiment").set_value("empty").run()
    assert "has no runs yet" in at.info[0].value and not at.dataframe


def test_live_run_is_reloaded_incrementally(store_uri, monkeypatch):
    rid = write_run(store_uri, experiment="live", name="live", finish=False,
                    tags={keys.TAG_ROLE: "reference"}, steps=[(s, {keys.RATIO_MEAN: 1.0}) for s in range(50)])
    at = app(store_uri, monkeypatch, "compare")
    assert at.toggle(key="compare.live").value  # a RUNNING run: live refresh is on by default
    [line] = figures(at)[keys.RATIO_MEAN]
    assert line["x"].max() == 49
    write_run(store_uri, run_id=rid, finish=False, steps=[(s, {keys.RATIO_MEAN: 1.0}) for s in range(50, 80)])
    at.run()
    [line] = figures(at)[keys.RATIO_MEAN]
    assert line["x"].max() == 79
    # the charts' entry (the page may keep others, e.g. the worst-token keys)
    [loaded] = [v for (_, _, ks), v in data._history_cache().entries.items() if keys.RATIO_MEAN in ks]
    assert loaded.histories.fetched == 30  # only the new rows were read


def test_report_downloads_are_built_on_request(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch, "compare")
    assert not at.get("download_button")  # nothing rendered until asked
    at.multiselect(key="compare.metrics").set_value([keys.RATIO_MEAN]).run()  # a small report: a quick test
    at.button(key="compare.report.build").click().run()
    assert not at.exception and not at.error
    labels = sorted(b.proto.label for b in at.get("download_button"))
    assert labels == ["Download HTML report", "Download Markdown summary"]


def test_nan_events_page_gives_no_all_clear_for_unchecked_gradients(store_uri, monkeypatch):
    # the reference's gradients are finite; the candidate's collector found none (grad/found = 0)
    write_run(store_uri, experiment="zero", name="ref", tags={keys.TAG_GROUP: "z", keys.TAG_ROLE: "reference"},
              steps=[(s, {keys.RATIO_MEAN: 1.0, keys.GRAD_NORM: 1.0, keys.GRAD_FINITE: 1.0}) for s in range(20)])
    write_run(store_uri, experiment="zero", name="zero3", tags={keys.TAG_GROUP: "z", keys.TAG_ROLE: "candidate"},
              steps=[(s, {keys.RATIO_MEAN: 1.0, keys.GRAD_FOUND: 0.0}) for s in range(20)])
    at = app(store_uri, monkeypatch, "nan-events")
    assert not at.success  # no green "No non-finite gradient in the picked runs"
    assert any("not checked" in unescape_md(w.value) and "zero3" in unescape_md(w.value) for w in at.warning)


def test_a_run_keeps_its_colour_when_the_picked_runs_change(dash_store, monkeypatch):
    at = app(dash_store.uri, monkeypatch, "compare")
    six = {t["name"]: t["line"]["color"] for t in figures(at)[keys.RATIO_MEAN]
           if t.get("mode") == "lines" and t.get("showlegend") is not False}  # runs' lines, not a tested band
    assert len(six) == 6 and len(set(six.values())) == 6  # the reference and five candidates, six colours
    # With only v1 shifted picked it was the first candidate (another colour before); now it keeps its own.
    at.multiselect(key="sidebar.candidates").set_value([dash_store.ids["v1 shifted"]]).run()
    two = {t["name"]: t["line"]["color"] for t in figures(at)[keys.RATIO_MEAN]
           if t.get("mode") == "lines" and t.get("showlegend") is not False}
    assert set(two) == {"v0 ref", "v1 shifted"} and two == {n: six[n] for n in two}


@pytest.mark.slow
def test_a_group_of_a_hundred_runs_opens_on_the_newest_picks_and_offers_the_rest(store_uri, monkeypatch):
    """100 tagged runs in one group (4 references, 96 candidates): the page opens on the references
    and the 12 newest candidates (a first load of 100 runs x 10 metrics would take minutes), says so in
    the sidebar, and every run stays a pick away."""
    name_of = {}
    for i in range(100):
        role = "reference" if i < 4 else "candidate"
        rid = write_run(store_uri, experiment="sweep", name=f"{role[:3]}-{i:03d}",
                        tags={keys.TAG_GROUP: "g", keys.TAG_ROLE: role, keys.TAG_SEED: str(i)},
                        steps=[(s, {keys.RATIO_MEAN: 1.0 + 0.001 * i}) for s in range(3)])
        name_of[rid] = f"{role[:3]}-{i:03d}"
    at = app(store_uri, monkeypatch, "compare")
    refs = sorted(name_of[r] for r in at.session_state["sidebar.reference"])
    cands = sorted(name_of[r] for r in at.session_state["sidebar.candidates"])
    assert refs == ["ref-000", "ref-001", "ref-002", "ref-003"]
    assert cands == [f"can-{i:03d}" for i in range(88, 100)]  # the 12 started last
    assert len(at.multiselect(key="sidebar.candidates").options) == 96  # the rest stay in the list
    captions = [c.value for c in at.sidebar.caption]
    assert any("the newest 12 of 96 candidates" in c for c in captions), captions


def table_rows(markup: str) -> list[list[str]]:
    """The text of each body row's cells of one `html_table` (tags and <wbr> dropped, entities decoded)."""
    import html
    import re

    body = markup.split("<tbody>", 1)[1]
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)]
