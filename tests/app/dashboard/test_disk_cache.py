"""The dashboard's cache on disk (rldiag.app.data.disk_cache, used by rldiag.app.dashboard.data): a
restarted dashboard process opens from it, reads only the rows written since, and never serves what
the store no longer holds. Each "dashboard process" here is a real, separate Python process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rldiag.app.data.disk_cache import DiskCache
from tests.helpers.runs import write_run

REPO = Path(__file__).resolve().parents[3]
KEYS = ["policy/ratio_mean", "loss"]

# One dashboard process: the Compare page's loaders (histories, then the comparison) for `ids`; prints
# what a test checks as JSON. FORBID_COMPUTE=1 makes the detector raise: a result from disk never calls it.
PROCESS = textwrap.dedent("""
    import json, os, sys
    from rldiag.app.dashboard import data
    if os.environ.get("FORBID_COMPUTE") == "1":
        def _no(*a, **k):
            raise AssertionError("compare was called: the comparison was not read from the disk cache")
        data.compare = _no
    uri, refs, cands, keys = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), sys.argv[4].split(",")
    loaded = data.histories(uri, refs + cands, keys)
    h = loaded.histories
    divs = data.comparison(uri, loaded, tuple(refs), tuple(cands), tuple(keys)).divergences
    disk = data.disk_cache()
    if disk is not None:
        assert disk.flush(60), "cache writes did not finish"
    print(json.dumps({
        "fetched": h.fetched,
        "token": loaded.stamp[3],
        "steps": {r: h.get(r, keys[0]).steps.tolist() for r in refs + cands},
        "values": {r: h.get(r, keys[0]).values.tolist() for r in refs + cands},
        "diverged": {c: divs[keys[0]][c].diverged for c in cands},
    }))
""")


def dashboard_process(uri: str, refs: list[str], cands: list[str], cache: Path | str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROCESS, uri, ",".join(refs), ",".join(cands), ",".join(KEYS)],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, RLDIAG_CACHE_DIR=str(cache), **env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"stderr": out.stderr}


def _steps(first: int, last: int, shift: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(s, {KEYS[0]: 1.0 + shift + 0.01 * float(rng.normal()), KEYS[1]: 0.5 + 0.01 * float(rng.normal())})
            for s in range(first, last)]


@pytest.fixture
def two_runs(store_uri):
    """A reference and a candidate of 60 steps each, same noise level, no shift."""
    ref = write_run(store_uri, name="ref", steps=_steps(0, 60, seed=1))
    cand = write_run(store_uri, name="cand", steps=_steps(0, 60, seed=2))
    return store_uri, ref, cand


@pytest.mark.slow
def test_a_restarted_dashboard_reads_only_new_rows_and_recomputes_only_then(two_runs, tmp_path):
    uri, ref, cand = two_runs
    cache = tmp_path / "cache"
    first = dashboard_process(uri, [ref], [cand], cache)
    assert first["fetched"] == 2 * 60 * 2  # 2 runs x 60 steps x 2 keys, every row read once
    assert first["diverged"] == {cand: False}

    # The next process: nothing new in the store, so nothing is read and the detector does not run.
    again = dashboard_process(uri, [ref], [cand], cache, FORBID_COMPUTE="1")
    assert again["fetched"] == 0 and again["token"] == first["token"]
    assert again["steps"] == first["steps"] and again["values"] == first["values"]

    # Both runs go on for 40 steps, the candidate 1.0 higher (about 100 sd of its noise): the next process
    # reads those 160 rows only, and its verdict follows them (a stale cached "within" would be a false
    # all-clear).
    write_run(uri, run_id=ref, steps=_steps(60, 100, seed=3))
    write_run(uri, run_id=cand, steps=_steps(60, 100, shift=1.0, seed=4))
    grown = dashboard_process(uri, [ref], [cand], cache)
    assert grown["fetched"] == 2 * 40 * 2
    assert grown["token"] != first["token"]
    assert grown["steps"][cand] == list(range(100)) == grown["steps"][ref]
    assert grown["diverged"] == {cand: True}
    # and what it shows is what a dashboard without any cache shows
    uncached = dashboard_process(uri, [ref], [cand], "off")
    assert uncached["values"] == grown["values"] and uncached["diverged"] == grown["diverged"]


@pytest.mark.slow
def test_a_store_replaced_at_the_same_path_is_read_again(two_runs, tmp_path):
    """A backup restored over the store (same runs, fewer rows), then written again up to the same row
    count with other values: the cached rows are not the store's any more, in both states."""
    uri, ref, cand = two_runs
    db = Path(uri.removeprefix("sqlite:///"))
    shutil.copyfile(db, tmp_path / "backup.db")
    write_run(uri, run_id=cand, steps=_steps(60, 80, seed=4))
    cache = tmp_path / "cache"
    assert dashboard_process(uri, [ref], [cand], cache)["steps"][cand] == list(range(80))

    # Restored, then written again up to the same row count with other values: the cursor's row exists
    # but holds another point. A check of the row count alone would serve the old 80 steps.
    shutil.copyfile(tmp_path / "backup.db", db)
    write_run(uri, run_id=cand, steps=_steps(60, 80, shift=5.0, seed=5))
    rewritten = dashboard_process(uri, [ref], [cand], cache)
    assert rewritten["fetched"] == 2 * 80 + 2 * 60  # read again in full, not incrementally
    assert min(rewritten["values"][cand][60:]) > 5.0

    shutil.copyfile(tmp_path / "backup.db", db)  # restored only: the cursor's row is gone
    restored = dashboard_process(uri, [ref], [cand], cache)
    assert restored["steps"][cand] == list(range(60)) and restored["fetched"] == 2 * 60 * 2


@pytest.mark.slow
def test_no_password_or_store_path_lands_in_the_cache(store_uri, tmp_path):
    """The tracking URI is part of every key but only as a hash: a store whose path holds a secret
    leaves no trace of it in any cache file."""
    secret_dir = tmp_path / "pw-hunter2-secret"
    secret_dir.mkdir()
    db = secret_dir / "mlruns.db"
    shutil.copyfile(store_uri.removeprefix("sqlite:///"), db)
    uri = f"sqlite:///{db}"
    ref = write_run(uri, name="ref", steps=_steps(0, 30, seed=1))
    cand = write_run(uri, name="cand", steps=_steps(0, 30, seed=2))
    cache = tmp_path / "cache"
    dashboard_process(uri, [ref], [cand], cache)
    files = [f for f in cache.rglob("*") if f.is_file()]
    assert len(files) >= 2  # the histories and the divergences at least
    assert not [f for f in files if b"hunter2" in f.read_bytes()]
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    assert cache.stat().st_mode & 0o777 == 0o700


def test_an_entry_in_a_directory_others_can_write_to_is_not_loaded(tmp_path, caplog):
    cache = DiskCache(tmp_path / "c", max_bytes=10**9)
    assert cache.put("k", ("a",), {"x": 1})
    assert cache.get("k", ("a",)) == {"x": 1}
    os.chmod(cache.root, 0o777)  # anyone could have put a pickle there: it would run their code
    assert cache.get("k", ("a",)) is None
    assert "not a private file of this user" in caplog.text
    os.chmod(cache.root, 0o700)
    assert cache.get("k", ("a",)) == {"x": 1}


def test_a_torn_entry_is_a_miss_and_is_removed(tmp_path, caplog):
    cache = DiskCache(tmp_path / "c", max_bytes=10**9)
    cache.put("k", ("a",), list(range(1000)))
    path = cache.path("k", ("a",))
    path.write_bytes(path.read_bytes()[:100])  # a process killed mid-write without the atomic rename
    assert cache.get("k", ("a",)) is None
    assert not path.exists() and "unreadable" in caplog.text


def test_least_recently_used_entries_go_beyond_the_size_cap(tmp_path):
    one = len(__import__("pickle").dumps(bytes(100_000), protocol=5))
    cache = DiskCache(tmp_path / "c", max_bytes=int(2.5 * one))  # room for two entries
    for i, name in enumerate("abc"):
        cache.put("k", (name,), bytes(100_000))
        os.utime(cache.path("k", (name,)), (1_000 + i, 1_000 + i))  # a, then b, then c: by age
        if name == "b":
            assert cache.get("k", ("a",)) is not None  # a is used again: b is now the oldest
    cache.prune()
    assert [cache.get("k", (n,)) is not None for n in "abc"] == [True, False, True]


def test_off_means_no_cache(monkeypatch):
    monkeypatch.setenv("RLDIAG_CACHE_DIR", "off")
    assert DiskCache.from_env() is None


def test_alert_events_are_kept_on_disk_only_once_every_run_has_ended():
    """A RUNNING run can still alert: its version carries the clock, so its events are read again
    every ALERTS_LIVE_S and never taken from disk; ended runs' versions are their status and end time."""
    import pandas as pd

    from rldiag.app.dashboard.data import runs_version

    df = pd.DataFrame({"run_id": ["a", "b"], "status": ["FINISHED", "RUNNING"], "end_time": [1_700_000_000_000, None]})
    live = runs_version(df, ["a", "b"])
    assert isinstance(live[-1], int)
    assert runs_version(df, ["a"]) == (("a", "FINISHED", str(df.end_time[0])),)  # no clock: kept
    assert isinstance(runs_version(df, ["a", "gone"])[-1], int)  # a run the list does not hold: not known to have ended


ALERTS_PROCESS = textwrap.dedent("""
    import json, sys
    from rldiag.app.dashboard import data
    uri, run = sys.argv[1], sys.argv[2]
    version = data.runs_version(data.runs(uri, "exp"), [run])
    events = data.alert_events(uri, (run,), version)
    assert data.disk_cache().flush(60)
    print(json.dumps({"version_ended": all(isinstance(v, tuple) for v in version), "events": events[run]}))
""")


@pytest.mark.slow
def test_an_alert_tag_set_after_a_run_ended_is_not_hidden_by_the_cache(store_uri, tmp_path):
    """An ended run's alert events are kept on disk; `rldiag watch --tag-runs` can still tag it later
    (a NaN it found in a run rldiag's collectors never watched): the next dashboard process shows it."""
    from mlflow import MlflowClient

    from rldiag.collectors import keys

    run = write_run(store_uri, name="trl-run", steps=_steps(0, 10, seed=1))
    cache = tmp_path / "cache"

    def read() -> dict:
        out = subprocess.run([sys.executable, "-c", ALERTS_PROCESS, store_uri, run], cwd=REPO, capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, RLDIAG_CACHE_DIR=str(cache)))
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    before = read()
    assert before == {"version_ended": True, "events": []}  # ended, nothing to say: kept on disk
    alert = {"kind": "nonfinite_grad", "run_id": run, "step": 7, "grad_norm": "nan", "params": []}
    MlflowClient(store_uri).set_tag(run, keys.TAG_ALERT_LAST, json.dumps(alert))
    after = read()
    assert [e["step"] for e in after["events"]] == [7] and after["events"][0]["source"] == "tag"
