"""The Compare page's first load from the store shows a progress bar (runs and points read) while it
reads, and nothing once it is done; a load from memory draws none, nor does a request for keys an entry
in memory already holds (Streamlit's AppTest, real SQLite)."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest


def _bar_script(done: bool, nothing_read: bool = False) -> None:
    from rldiag.app.dashboard import data
    from rldiag.app.data.histories import Progress

    bar = data.ProgressBar()
    bar(Progress(0, 10, None, 0.1))  # no point yet: no bar
    if nothing_read:
        return
    bar(Progress(1_600_000, 10, None, 0.2))
    bar(Progress(3_200_000, 10, None, 0.4))
    if done:
        bar.close()


def test_the_bar_names_the_runs_and_points_read_and_goes_when_done():
    at = AppTest.from_function(_bar_script, kwargs={"done": False}, default_timeout=60).run()
    [bar] = at.get("progress")
    assert bar.proto.value == 40 and "10 runs, 3,200,000 points read" in bar.proto.text
    at = AppTest.from_function(_bar_script, kwargs={"done": True}, default_timeout=60).run()
    assert not at.get("progress")
    at = AppTest.from_function(_bar_script, kwargs={"done": False, "nothing_read": True}, default_timeout=60).run()
    assert not at.get("progress")  # a read of keys nobody logged: "0 points read" would only confuse


def _load_script(uri: str, run_ids: list[str]) -> None:
    import streamlit as st

    from rldiag.app.dashboard import data
    from rldiag.app.data import histories

    slice_rows, histories.SLICE_ROWS = histories.SLICE_ROWS, 100  # several parts, each reported
    data._history_cache.clear()  # nothing in memory from another test
    seen = []
    real = data.ProgressBar.__call__
    data.ProgressBar.__call__ = lambda self, p: (seen.append(p), real(self, p))[1]  # the real bar, reports counted
    try:
        for ks in (["grad/norm", "policy/ratio_mean"], ["grad/norm", "policy/ratio_mean"], ["grad/norm"]):
            # the second from memory, the third from the first's entry (its keys include it): no report
            loaded = data.histories(uri, run_ids, ks)
            st.write(f"reports {len(seen)} last {seen[-1].points if seen else 0} fetched {loaded.histories.fetched}")
            st.session_state.setdefault("stamps", []).append(loaded.stamp)
    finally:
        data.ProgressBar.__call__, histories.SLICE_ROWS = real, slice_rows


def test_a_first_read_reports_its_parts_and_a_read_from_memory_none(dash_store, monkeypatch):
    monkeypatch.setenv("RLDIAG_CACHE_DIR", "off")
    runs = list(dash_store.ids.values())[:3]
    at = AppTest.from_function(_load_script, kwargs={"uri": dash_store.uri, "run_ids": runs},
                               default_timeout=90).run()
    assert not at.exception, [e.value for e in at.exception]
    first, second, third = [m.value for m in at.markdown]
    n, last, fetched = (int(w) for w in first.split()[1::2])
    assert n > 2 and last == fetched > 0
    assert second == first == third  # no report from memory, nor for keys the first entry holds
    assert len(set(at.session_state["stamps"])) == 1  # one entry served all three
    assert not at.get("progress")  # the bar is gone once the read is done
