"""Loading full histories: the SQLite fast path and the REST path pinned against MLflow's client, NaN
and +-inf told apart, foreign names under canonical keys, runs aligned by step, incremental reloads."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rldiag.app.data.histories import Histories, load_histories, nonfinite_table
from rldiag.app.data.nonfinite import MAX_FLOAT
from rldiag.app.data.store import open_store
from rldiag.app.errors import RunNotFound, StoreUnreachable
from rldiag.collectors import keys
from tests.helpers.runs import T0_MS, log_raw, run_logging_script, write_run

INF, NAN = float("inf"), float("nan")


def _rldiag_run(uri: str, *, name: str = "rldiag", n: int = 200, seed: int = 0, finish: bool = True) -> str:
    """grad/norm NaN at 10, +inf at 20, -inf at 30; a huge finite loss at 40; ratio every 3rd step."""
    rng = np.random.default_rng(seed)
    special = {10: NAN, 20: INF, 30: -INF}
    steps = []
    for s in range(n):
        m = {keys.GRAD_NORM: special.get(s, float(rng.random())), keys.LOSS: 1e300 if s == 40 else float(rng.random())}
        if s % 3 == 0:
            m[keys.RATIO_MEAN] = 1.0 + float(rng.normal(0, 0.01))
        steps.append((s, m))
    return write_run(uri, name=name, steps=steps, finish=finish)


def _trl_run(uri: str) -> str:
    """A run as TRL's `report_to="mlflow"` writes it: its own names, inf stored as max-float, no flag."""
    rid = write_run(uri, name="trl")
    pts = []
    for s in range(1, 30):
        pts += [("grad_norm", 0.1 * s, T0_MS + s, s), ("kl", 0.01 * s, T0_MS + s, s), ("entropy", 2.0 - 0.01 * s, T0_MS + s, s),
                ("clip_ratio/region_mean", 0.001 * s, T0_MS + s, s), ("reward", 0.5 + 0.01 * s, T0_MS + s, s)]
    pts += [("grad_norm", INF, T0_MS + 100, 5), ("grad_norm", -INF, T0_MS + 100, 6)]  # a rewrite, later timestamp
    log_raw(uri, rid, pts)
    return rid


def _assert_same(a: Histories, b: Histories) -> None:
    assert a.traces.keys() == b.traces.keys()
    for k, ta in a.traces.items():
        tb = b.traces[k]
        assert ta.source_key == tb.source_key, k
        np.testing.assert_array_equal(ta.steps, tb.steps, err_msg=str(k))
        np.testing.assert_array_equal(ta.values, tb.values, err_msg=str(k))  # NaN == NaN here
        np.testing.assert_array_equal(ta.timestamps, tb.timestamps, err_msg=str(k))


@pytest.fixture(params=["adbc", "sqlite3"])
def sql_reader(request, monkeypatch):
    """Both SQLite readers: ADBC (the default) and Python's sqlite3 (the fallback)."""
    from rldiag.app.data import readers as history_readers

    monkeypatch.setenv("RLDIAG_SQL_READER", request.param)
    assert (history_readers._adbc_sqlite() is not None) == (request.param == "adbc")  # ADBC is installed
    return request.param


def test_sql_fast_path_equals_mlflow_client(store_uri, sql_reader):
    from mlflow import MlflowClient

    a = _rldiag_run(store_uri)
    write_run(store_uri, run_id=a, t0_ms=T0_MS + 10_000,  # resumed from a checkpoint: steps 50-59 again
              steps=[(s, {keys.GRAD_NORM: 100.0 + s}) for s in range(50, 60)])
    b = _trl_run(store_uri)
    fast = load_histories(open_store(store_uri), [a, b])
    slow = load_histories(open_store(store_uri), [a, b], method="client")
    assert (fast.method, slow.method) == ("sql", "client")
    _assert_same(fast, slow)

    # Every point the client returns is there: one per step, the latest write where a step repeats.
    client = MlflowClient(store_uri)
    for (run, key), trace in fast.traces.items():
        hist = client.get_metric_history(run, trace.source_key)
        latest = {}
        for m in sorted(hist, key=lambda m: (m.step, m.timestamp)):
            latest[m.step] = m.value
        assert trace.steps.tolist() == sorted(latest)
        expected = np.array([latest[s] for s in sorted(latest)])
        expected[expected == MAX_FLOAT], expected[expected == -MAX_FLOAT] = INF, -INF
        np.testing.assert_array_equal(trace.values, expected)
    assert fast.get(a, keys.GRAD_NORM).values[50:60].tolist() == [100.0 + s for s in range(50, 60)]
    assert fast.fetched == slow.fetched


def test_nan_and_infinities_told_apart(store_uri):
    a = _rldiag_run(store_uri)
    b = _trl_run(store_uri)
    c = write_run(store_uri, name="flags")
    # A store that kept some finite stand-in: the rldiag flag (same step and timestamp) restores -inf;
    # a flag from an earlier write of the step does not apply to its rewrite.
    log_raw(store_uri, c, [(keys.ENTROPY, 3.0, T0_MS, 7), (keys.inf_flag_key(keys.ENTROPY), -1.0, T0_MS, 7),
                           (keys.ENTROPY, 4.0, T0_MS, 8), (keys.inf_flag_key(keys.ENTROPY), 1.0, T0_MS, 8),
                           (keys.ENTROPY, 5.0, T0_MS + 5, 8)])
    h = load_histories(open_store(store_uri), [a, b, c])
    nf = h.get(a, keys.GRAD_NORM).nonfinite()
    assert (nf.nan.tolist(), nf.posinf.tolist(), nf.neginf.tolist()) == ([10], [20], [30])
    assert h.get(a, keys.LOSS).values[40] == 1e300  # huge but finite stays finite
    trl = h.get(b, keys.GRAD_NORM)
    assert trl.values[trl.steps == 5][0] == INF and trl.values[trl.steps == 6][0] == -INF
    assert h.get(c, keys.ENTROPY).values.tolist() == [-INF, 5.0]
    assert not any(k.startswith(keys.INF_FLAG_PREFIX) for _, k in h.traces)  # flags are not metrics

    table = nonfinite_table(h).set_index(["run_id", "key"])
    assert table.loc[(a, keys.GRAD_NORM), ["nan", "posinf", "neginf", "first_step"]].tolist() == [1, 1, 1, 10]
    assert table.loc[(b, keys.GRAD_NORM), "source_key"] == "grad_norm"


def test_foreign_names_show_up_under_canonical_keys(store_uri):
    b = _trl_run(store_uri)
    both = write_run(store_uri, name="both", steps=[(s, {keys.GRAD_NORM: 1.0}) for s in range(3)])
    log_raw(store_uri, both, [("grad_norm", 9.0, T0_MS, s) for s in range(3)])
    wanted = [keys.GRAD_NORM, keys.KL_REF, keys.ENTROPY, keys.CLIP_ACTIVE_RATE, keys.REWARD_MEAN]
    h = load_histories(open_store(store_uri), [b, both], wanted)
    assert {k for r, k in h.traces if r == b} == set(wanted)
    assert h.get(b, keys.CLIP_ACTIVE_RATE).source_key == "clip_ratio/region_mean"
    assert h.get(b, "kl") is h.get(b, keys.KL_REF)  # TRL kl: KL to the reference model
    np.testing.assert_allclose(h.get(b, keys.REWARD_MEAN).values, [0.5 + 0.01 * s for s in range(1, 30)])
    assert h.get(both, keys.GRAD_NORM).values.tolist() == [1.0, 1.0, 1.0]  # the canonical name wins
    assert h.for_key(keys.GRAD_NORM).keys() == {b, both}


def test_runs_aligned_by_step(store_uri):
    a = write_run(store_uri, name="every step", steps=[(s, {keys.RATIO_MEAN: 1.0 + s}) for s in range(6)])
    b = write_run(store_uri, name="every 2nd, NaN at 4",
                  steps=[(s, {keys.RATIO_MEAN: NAN if s == 4 else 2.0 + s}) for s in range(0, 9, 2)])
    h = load_histories(open_store(store_uri), [a, b], [keys.RATIO_MEAN])
    frame = h.frame(keys.RATIO_MEAN)
    assert frame.index.tolist() == [0, 1, 2, 3, 4, 5, 6, 8] and frame.columns.tolist() == [a, b]
    assert frame[a].tolist()[:6] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    from rldiag.app.data.align import align_by_step

    al = align_by_step(h.for_key(keys.RATIO_MEAN))
    col = al.labels.index(b)
    # Step 3: b logged nothing; step 4: b logged NaN. Both read NaN, `present` tells them apart.
    assert np.isnan(al.values[3, col]) and not al.present[3, col]
    assert np.isnan(al.values[4, col]) and al.present[4, col]
    inner = align_by_step(h.for_key(keys.RATIO_MEAN), how="inner")
    assert inner.steps.tolist() == [0, 2, 4]
    delta = al.delta(a)
    assert delta.values[2, col] == (2.0 + 2) - (1.0 + 2) and not delta.present[3, col]


@pytest.mark.parametrize("full_scan", [True, False])
def test_sql_table_scan_and_index_read_the_same_rows(store_uri, sql_reader, monkeypatch, full_scan):
    from rldiag.app.data import readers as history_readers

    a, b = _rldiag_run(store_uri, name="a"), _trl_run(store_uri)
    for i in range(7):  # most of the store: a and b are read through the index
        _rldiag_run(store_uri, name=f"not loaded {i}", n=3, seed=3)
    with open_store(store_uri).read_only() as con:
        logged = [k for (k,) in con.execute("SELECT DISTINCT key FROM metrics")]
        assert not history_readers._full_scan(con, [a, b], logged, 0, history_readers.max_rowid(con))
        assert history_readers._full_scan(con, [a, b], logged, 1, history_readers.max_rowid(con))  # incremental
    expected = load_histories(open_store(store_uri), [a, b], method="client")
    monkeypatch.setattr(history_readers, "_full_scan", lambda *args: full_scan)
    _assert_same(load_histories(open_store(store_uri), [a, b]), expected)


@pytest.mark.parametrize("many_runs", [False, True])
def test_a_read_with_progress_reads_the_same_rows_in_parts(store_uri, sql_reader, monkeypatch, many_runs):
    """With `progress`, a first read comes in parts (rowid slices where the table is scanned, else one run
    at a time), each reported with the points read so far; the histories are those of one read."""
    from rldiag.app.data import histories as histories_module

    a, b = _rldiag_run(store_uri, name="a"), _trl_run(store_uri)
    c = _rldiag_run(store_uri, name="c", n=150, seed=2)
    for i in range(10 if many_runs else 0):  # most of the store: a, b and c are read through the index
        _rldiag_run(store_uri, name=f"not loaded {i}", n=3, seed=3)
    ks = [keys.GRAD_NORM, keys.LOSS, keys.RATIO_MEAN, keys.ENTROPY]
    expected = load_histories(open_store(store_uri), [a, b, c], ks)
    monkeypatch.setattr(histories_module, "SLICE_ROWS", 97)  # several slices, not on a run's boundary
    seen = []
    got = load_histories(open_store(store_uri), [a, b, c], ks, progress=seen.append)
    _assert_same(got, expected)
    assert got.fetched == expected.fetched
    with open_store(store_uri).read_only() as con:
        rows = con.execute("SELECT MAX(rowid) FROM metrics").fetchone()[0]
    assert len(seen) == (3 if many_runs else -(-rows // 97)) and len(seen) > 2
    assert [p.runs for p in seen] == [3] * len(seen)
    assert [p.runs_done for p in seen] == ([1, 2, 3] if many_runs else [None] * len(seen))
    points = [p.points for p in seen]
    assert points == sorted(points) and points[-1] == expected.fetched
    assert seen[-1].fraction == 1.0 and all(0 < p.fraction <= 1 for p in seen)


_HOLD_LOCK = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(1.5)
con.execute("COMMIT")
"""


def test_sql_read_waits_for_a_writers_lock(store_uri, sql_reader, monkeypatch):
    """A training job (another process) committing to the same SQLite file holds its lock for a
    moment: the read of the rows waits for it instead of failing with "database is locked"."""
    from rldiag.app.data import readers as history_readers

    a = _rldiag_run(store_uri, n=50)
    expected = load_histories(open_store(store_uri), [a], method="client")
    path = str(open_store(store_uri).sqlite_path)
    holders = []
    full_scan = history_readers._full_scan

    def lock_then_decide(*args):  # the lock is taken right before the rows are read
        scan = full_scan(*args)
        holders.append(subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, path], stdout=subprocess.PIPE, text=True))
        assert holders[-1].stdout.readline().strip() == "locked"
        return scan

    monkeypatch.setattr(history_readers, "_full_scan", lock_then_decide)
    try:
        _assert_same(load_histories(open_store(store_uri), [a]), expected)
    finally:
        for p in holders:
            p.wait(30)
    assert len(holders) == 1 and holders[0].returncode == 0


def test_a_process_that_writes_the_file_reads_it_with_sqlite3(store_uri, tmp_path, monkeypatch):
    """ADBC links its own SQLite, whose file locks a second copy in the same process cannot see: a
    process that writes the file (the watcher tagging runs) reads it with Python's sqlite3 only."""
    from dataclasses import replace

    from rldiag.app.data import readers as history_readers
    from rldiag.app.watch.loop import Watcher
    from rldiag.app.watch.state import WatchState

    a = _rldiag_run(store_uri, n=30)

    def no_adbc(*args):
        raise AssertionError("ADBC used in a process that writes the file")

    monkeypatch.setattr(history_readers, "_read_sql_arrow", no_adbc)
    writing = replace(open_store(store_uri), writes_here=True)
    _assert_same(load_histories(writing, [a]), load_histories(open_store(store_uri), [a], method="client"))
    assert Watcher(open_store(store_uri), WatchState(tmp_path / "s.json"), [], tag_runs=True).store.writes_here
    assert not Watcher(open_store(store_uri), WatchState(tmp_path / "t.json"), []).store.writes_here


def test_incremental_reload_fetches_only_new_rows(store_uri, sql_reader):
    live = _rldiag_run(store_uri, name="live", n=50, finish=False)
    h1 = load_histories(open_store(store_uri), [live])
    assert h1.fetched == 50 * 2 + 17 + 2  # grad/norm, loss, ratio every 3rd step, 2 inf flags
    write_run(store_uri, run_id=live, steps=[(s, {keys.GRAD_NORM: INF if s == 52 else 0.5, keys.ENTROPY: 1.0})
                                             for s in range(50, 55)], finish=False)
    other = _rldiag_run(store_uri, name="started later", n=5)
    h2 = load_histories(open_store(store_uri), [live, other], previous=h1)
    assert h2.fetched == 5 * 2 + 1 + (5 * 2 + 2)  # 5 new steps x 2 keys + 1 flag, and the new run in full
    assert h2.get(live, keys.GRAD_NORM).last_step == 54 and h2.get(live, keys.GRAD_NORM).nonfinite().posinf.tolist() == [20, 52]
    assert h2.get(live, keys.ENTROPY).steps.tolist() == [50, 51, 52, 53, 54]
    _assert_same(h2, load_histories(open_store(store_uri), [live, other]))
    again = load_histories(open_store(store_uri), [live, other], previous=h2)
    assert again.fetched == 0
    _assert_same(again, h2)


def test_unknown_run_and_method(store_uri):
    a = _rldiag_run(store_uri, n=3)
    with pytest.raises(RunNotFound, match="0123456789abcdef0123456789abcdef"):
        load_histories(open_store(store_uri), [a, "0123456789abcdef0123456789abcdef"])
    with pytest.raises(ValueError, match="method='rest' needs an http"):
        load_histories(open_store(store_uri), [a], method="rest")


@pytest.mark.server
def test_tracking_server_rest_path_equals_client_and_sql(mlflow_server, monkeypatch):
    from rldiag.app.data import readers as history_readers

    uri = mlflow_server.uri
    a = _rldiag_run(uri, n=120, finish=False)
    b = _trl_run(uri)
    rest = load_histories(open_store(uri), [a, b])
    assert rest.method == "rest"
    client = load_histories(open_store(uri), [a, b], method="client")
    _assert_same(rest, client)
    _assert_same(rest, load_histories(open_store(f"sqlite:///{mlflow_server.db}"), [a, b]))  # the server's own file
    # The server with its backend file given (--backend-store-uri): histories straight from the file.
    monkeypatch.setenv("RLDIAG_BACKEND_STORE_URI", f"sqlite:///{mlflow_server.db}")
    direct = load_histories(open_store(uri), [a, b])
    assert direct.method == "sql" and open_store(uri).kind == "rest"
    _assert_same(direct, client)
    monkeypatch.setenv("RLDIAG_BACKEND_STORE_URI", "postgresql+psycopg2://rl:s3cret@127.0.0.1:1/mlflow")
    with pytest.raises(StoreUnreachable, match="cannot read the backend store at ...@127.0.0.1:1/mlflow") as e:
        open_store(uri)
    assert "s3cret" not in str(e.value)  # the password is never echoed
    monkeypatch.setenv("RLDIAG_BACKEND_STORE_URI", "mysql://u@db/mlflow")
    with pytest.raises(StoreUnreachable, match="a SQLite file .* or PostgreSQL .*Unset RLDIAG_BACKEND_STORE_URI"):
        open_store(uri)
    with pytest.raises(StoreUnreachable, match="no MLflow store at .*nowhere.db"):
        open_store(uri, backend_store_uri="sqlite:///nowhere.db")
    monkeypatch.delenv("RLDIAG_BACKEND_STORE_URI")
    monkeypatch.setattr(history_readers, "_BULK_MAX", 37)  # the bulk endpoint's cap, hit: continued by offset
    _assert_same(load_histories(open_store(uri), [a, b]), client)

    write_run(uri, run_id=a, steps=[(s, {keys.GRAD_NORM: NAN if s == 121 else 0.25}) for s in range(120, 124)],
              finish=False)
    inc = load_histories(open_store(uri), [a, b], previous=rest)
    assert inc.fetched == 4  # only grad/norm moved, and only its 4 new rows came over the wire
    assert inc.get(a, keys.GRAD_NORM).nonfinite().nan.tolist() == [10, 121]
    _assert_same(inc, load_histories(open_store(uri), [a, b], method="client"))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_trl_grpo_report_to_mlflow_shows_canonical_keys(store_uri, tmp_path):
    """TRL's GRPOTrainer on a tiny random model with transformers' own MLflow integration."""
    pytest.importorskip("trl")
    script = textwrap.dedent("""
        import json
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
        from tests.helpers.tiny_hf import save_tiny_qwen2
        tok = save_tiny_qwen2("tiny")
        args = GRPOConfig(output_dir="out", per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=4, max_steps=3, logging_steps=1, report_to="mlflow",
                          use_vllm=False, beta=0.1, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
        prompts = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(12)]})
        def reward_len(completions, **kw):  # a named function: TRL logs its name as a metric key
            return [float(len(c)) for c in completions]
        trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args, train_dataset=prompts, processing_class=tok)
        trainer.train()
        print("LOGS=" + json.dumps([h for h in trainer.state.log_history if "reward" in h]))
    """)
    logs = run_logging_script(script, store_uri, "trl-grpo", tmp_path)

    from rldiag.app.data.runs import find_runs

    runs = find_runs(open_store(store_uri), experiments="trl-grpo")
    rid = runs.run_id.iloc[0]
    assert {keys.GRAD_NORM, keys.KL_REF, keys.ENTROPY, keys.CLIP_ACTIVE_RATE, keys.REWARD_MEAN} <= set(runs.metrics.iloc[0])
    h = load_histories(open_store(store_uri), [rid], [keys.GRAD_NORM, keys.KL_REF, keys.ENTROPY, keys.CLIP_ACTIVE_RATE, keys.REWARD_MEAN])
    for trl_name, canonical in [("grad_norm", keys.GRAD_NORM), ("kl", keys.KL_REF), ("entropy", keys.ENTROPY),
                                ("clip_ratio/region_mean", keys.CLIP_ACTIVE_RATE), ("reward", keys.REWARD_MEAN)]:
        t = h.get(rid, canonical)
        assert t.source_key == trl_name
        assert t.steps.tolist() == [entry["step"] for entry in logs]
        np.testing.assert_allclose(t.values, [entry[trl_name] for entry in logs], rtol=1e-6)


def test_a_run_logged_with_no_step_is_kept_whole_in_logging_order(store_uri, sql_reader):
    # `mlflow.log_metric("loss", v)` in a loop with no step: MLflow logs every point at step 0. Keeping the
    # latest point per step left 1 of 40 (the report said "not compared (0 steps)"); the points are kept
    # whole, in logging order, their steps 0, 1, 2, ... and `logged_at` the step they were logged at.
    from mlflow import MlflowClient

    client = MlflowClient(store_uri)
    rid = client.create_run(client.create_experiment("nostep")).info.run_id
    values = np.linspace(2.0, 1.0, 40)
    log_raw(store_uri, rid, [(keys.LOSS, float(v), T0_MS + 10 * i, 0) for i, v in enumerate(values)][::-1])  # rows in any order
    h = load_histories(open_store(store_uri), [rid])
    t = h.get(rid, keys.LOSS)
    assert t.logged_at == 0 and t.steps.tolist() == list(range(40))
    np.testing.assert_array_equal(t.values, values)  # by timestamp, not by row
    log_raw(store_uri, rid, [(keys.LOSS, 0.5, T0_MS + 1000 + i, 0) for i in range(5)])
    again = load_histories(open_store(store_uri), [rid], previous=h)
    assert again.fetched == 5 and again.get(rid, keys.LOSS).steps.tolist() == list(range(45))
    _assert_same(again, load_histories(open_store(store_uri), [rid]))
    # a step logged twice (a resumed run) is still one point, the latest: not a run with no steps
    two = client.create_run(client.get_experiment_by_name("nostep").experiment_id).info.run_id
    log_raw(store_uri, two, [(keys.LOSS, 1.0, T0_MS, 3), (keys.LOSS, 2.0, T0_MS + 5, 3)])
    t2 = load_histories(open_store(store_uri), [two]).get(two, keys.LOSS)
    assert t2.logged_at is None and t2.steps.tolist() == [3] and t2.values.tolist() == [2.0]


def test_for_key_of_no_run_is_no_trace_and_none_is_every_run(store_uri):
    from rldiag.app.data.histories import load_histories
    from rldiag.app.data.store import open_store
    from rldiag.collectors import keys as K

    ids = [write_run(store_uri, experiment="fk", name=f"r{i}", steps=[(s, {K.LOSS: 1.0}) for s in range(3)])
           for i in range(2)]
    h = load_histories(open_store(store_uri), ids, [K.LOSS])
    assert h.for_key(K.LOSS, ()) == {} and h.for_key(K.LOSS, []) == {}  # a group without references: none
    assert list(h.for_key(K.LOSS)) == ids and list(h.for_key(K.LOSS, ids[1:])) == ids[1:]
