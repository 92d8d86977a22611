"""fp16 scaler overflows and a NaN loss with finite gradients, as the report, the NaN events page and the
watcher say them: apart from the NaN gradient steps, never as a NaN alert; a run whose only events are
scaler overflows is never headlined as a NaN run.

The runs are real: a CPU loop under fp16 autocast with a real `torch.amp.GradScaler("cpu")` (its overflows
made by the scaling alone, at known steps), an fp32 loop whose loss has a NaN term with no gradient, and an
fp32 reference, all logged by `Monitor` into a real SQLite store."""

from __future__ import annotations

import pytest
import torch

from rldiag.app.report.build import build_report, departure_lines
from rldiag.app.watch.loop import watch_once
from rldiag.app.watch.state import WatchState
from rldiag.collectors import Monitor, keys
from tests.helpers.dashboard import app, unescape_md
from tests.helpers.training import fp16_loop, mlp, nan_term_loss

STEPS = 12
# loss = c * y.sum() (batch 1): the gradient reaching y, the last Linear's fp16 output, is c * scale. At
# scale 65536, c = 1.5 gives 98304 > 65504 (fp16's max): inf, an overflow -> the scaler halves to 32768.
# Step 1: 32768 fits. Step 2: 2.5 * 32768 = 81920 overflows -> 16384. Step 4: 4.5 * 16384 = 73728 -> 8192.
OVERFLOW_C = {0: 1.5, 2: 2.5, 4: 4.5}
OVERFLOW_LINE = ("fp16: scaler overflow: 3 steps (0, 2, 4; skipped by the GradScaler, loss scale lowered: "
                 "65536 at the first, 16384 at the last); an ordinary fp16 event, not a NaN gradient")
LOSS_LINE = "nan-loss: loss NaN at 2 steps (3-4) while every gradient is finite there"


def _tags(role: str) -> dict[str, str]:
    return {keys.TAG_GROUP: "amp", keys.TAG_ROLE: role}


def _fp32_loop(mon: Monitor, loss_of) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        loss = loss_of(model, step)
        loss.backward()
        if mon.step(step, model, loss=loss):
            opt.step()
        opt.zero_grad()


@pytest.fixture
def amp_runs(store_uri) -> dict[str, str]:
    ids = {}
    with Monitor("amp", run_name="ref", tracking_uri=store_uri, tags=_tags("reference")) as mon:
        _fp32_loop(mon, lambda m, s: nan_term_loss(m, s, set()))
    ids["ref"] = mon.run_id
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with Monitor("amp", run_name="fp16", tracking_uri=store_uri, tags=_tags("candidate"), policy="skip") as mon:
        res = fp16_loop(mon, mlp(), STEPS, scaler=scaler, loss_fn=lambda y, s: OVERFLOW_C.get(s, 1.0) * y.sum())
    assert [r["scale"] for r in res[:6]] == [65536.0, 32768.0, 32768.0, 16384.0, 16384.0, 8192.0]
    assert [i for i, r in enumerate(res) if r["report"].overflow] == [0, 2, 4]
    ids["fp16"] = mon.run_id
    with Monitor("amp", run_name="nan-loss", tracking_uri=store_uri, tags=_tags("candidate")) as mon:
        _fp32_loop(mon, lambda m, s: nan_term_loss(m, s, {3, 4}))
    ids["nan-loss"] = mon.run_id
    return ids


def test_the_report_says_overflows_and_the_nan_loss_apart_and_headlines_no_nan_run(store_uri, amp_runs):
    rep = build_report(store_uri, group="amp")
    assert rep.content.nan_events.empty  # no NaN gradient step in any run
    for text in (rep.markdown, rep.html):
        assert "No step with a non-finite gradient in any run." in text
        assert OVERFLOW_LINE in text
        assert LOSS_LINE in text
    lines = departure_lines(rep)
    fp16 = [line for line in lines if line.startswith("fp16")]
    assert fp16 and not any("non-finite" in line for line in fp16)


def test_the_nan_events_page_counts_overflows_apart_and_warns_of_the_nan_loss(store_uri, amp_runs, monkeypatch):
    at = app(store_uri, monkeypatch, "nan-events")
    summary = at.dataframe[0].value.set_index("run")
    assert summary.loc["fp16", "non-finite steps"] == 0 and summary.loc["fp16", "scaler overflows"] == 3
    assert summary.loc["nan-loss", "non-finite steps"] == 0 and summary.loc["ref", "scaler overflows"] == 0
    assert [s.value for s in at.success]  # no NaN gradient: the all-clear for the gradients stands
    assert [unescape_md(i.value) for i in at.info] == [OVERFLOW_LINE]
    assert any(unescape_md(w.value).startswith(LOSS_LINE) for w in at.warning)


def test_the_watcher_alerts_the_nan_loss_and_tells_overflows_once_never_as_nan(store_uri, amp_runs, tmp_path):
    path = tmp_path / "watch-state.json"
    result, events = watch_once(store_uri, state=WatchState.load(path))
    kinds = sorted(e["kind"] for e in events)
    assert kinds == ["nonfinite_loss", "nonfinite_loss", "scaler_overflow"]  # no "nonfinite_grad"
    [over] = [e for e in events if e["kind"] == "scaler_overflow"]
    assert over["run_id"] == amp_runs["fp16"] and over["steps"] == [0, 2, 4]
    assert "scaler overflow: 3 steps" in over["text"] and "not a NaN gradient" in over["text"]
    loss = [e for e in events if e["kind"] == "nonfinite_loss"]
    assert [(e["run_id"], e["step"], e["loss"], e["grads_checked"]) for e in loss] == [
        (amp_runs["nan-loss"], 3, "nan", True), (amp_runs["nan-loss"], 4, "nan", True)]
    # the loss alerts count (rldiag watch --once exits 1 on them); the overflow note does not
    assert (result.alerts, result.notes) == (2, 1)
    # a restarted watcher reads the state file: nothing is told twice
    again, more = watch_once(store_uri, state=WatchState.load(path))
    assert more == [] and (again.alerts, again.notes) == (0, 0)


def _trainer_run(store_uri: str, tmp_path, monkeypatch, name: str, role: str, *, fp16: bool, nan_at: int | None = None
                 ) -> str:
    """A stock transformers Trainer with `report_to="mlflow"` (its own MLflowCallback, no rldiag), fp16 as on a
    GPU (`tests.helpers.training.cpu_fp16_trainer_class`: the first step overflows for real, the next
    fit), or fp32. `nan_at`: a weight set to NaN at that step (a real NaN: the loss is NaN from then on)."""
    import json

    import mlflow
    from accelerate.state import AcceleratorState
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback

    from tests.helpers.tiny_hf import llama_config, lm_dataset, training_args
    from tests.helpers.training import cpu_fp16_trainer_class

    class PoisonWeight(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == nan_at:
                with torch.no_grad():
                    model.model.norm.weight[0] = float("nan")  # every position's logits

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-fp16")
    monkeypatch.setenv("MLFLOW_TAGS", json.dumps({keys.TAG_GROUP: "hf-fp16", keys.TAG_ROLE: role}))
    torch.manual_seed(0)
    cls = cpu_fp16_trainer_class() if fp16 else Trainer
    try:
        trainer = cls(model=LlamaForCausalLM(llama_config()), train_dataset=lm_dataset(16),
                      args=training_args(tmp_path / name, per_device_train_batch_size=2, max_steps=8,
                                         report_to=["mlflow"], run_name=name),
                      callbacks=[PoisonWeight()] if nan_at is not None else None)
        trainer.train()
    finally:
        AcceleratorState._reset_state(True)
        mlflow.end_run()
    client = mlflow.MlflowClient(store_uri)
    [run] = client.search_runs([client.get_experiment_by_name("hf-fp16").experiment_id],
                               f"attributes.run_name = '{name}'")
    return run.info.run_id


def test_an_fp16_trainer_rldiag_did_not_watch_gets_an_overflow_hint_beside_its_nan_events(store_uri, tmp_path,
                                                                                            monkeypatch):
    # stock Trainers logging through transformers' MLflowCallback only: the fp16 one's first step overflows
    # (a real GradScaler), which it logs as a non-finite grad_norm. The hint never clears it: the step stays
    # a NaN event. A real NaN (a weight NaN from step 4 on; the Trainer's NaN filter keeps the logged loss
    # finite) gets no hint: its non-finite steps last to the end.
    from rldiag.app.analysis.step_events import likely_overflows
    from rldiag.app.data.histories import load_histories
    from rldiag.app.data.store import open_store

    ids = {name: _trainer_run(store_uri, tmp_path, monkeypatch, name, role, fp16=fp16, nan_at=nan_at)
           for name, role, fp16, nan_at in (("ref", "reference", False, None), ("fp16", "candidate", True, None),
                                            ("nan", "candidate", True, 4))}
    hint = ("fp16: non-finite grad norm at 1 step (1) of an fp16 run (fp16=True), at most 1 in a row, each followed "
            "by finite steps, with a finite loss: likely loss-scaler overflows")
    rep = build_report(store_uri, group="hf-fp16")
    ev = rep.content.nan_events
    assert ev[ev.run_id == ids["fp16"]]["step"].tolist() == [1]  # still a NaN event
    assert len(ev[ev.run_id == ids["nan"]]) >= 4
    for text in (rep.markdown, rep.html):
        assert hint in text
        assert "nan: non-finite grad norm" not in text and "ref: non-finite grad norm" not in text
    # the headline: non-finite gradients first, and for the fp16 run what they likely are
    said = "non-finite gradients from step 1 (1 step; an fp16 run: likely loss-scaler overflows, see the NaN events)"
    assert any(line.startswith("fp16") and said in line for line in departure_lines(rep))
    assert any(line.startswith("nan") and "non-finite gradients from step 1" in line and "likely" not in line
               for line in departure_lines(rep))
    assert said in rep.markdown
    h = load_histories(open_store(store_uri), [ids["fp16"]], [keys.GRAD_NORM, keys.LOSS])
    assert likely_overflows(h, ids["fp16"], {"fp16": "False"}) is None  # no fp16, no hint
    at = app(store_uri, monkeypatch, "nan-events")
    infos = [unescape_md(i.value) for i in at.info]
    assert len(infos) == 1 and infos[0].startswith(hint), infos
    assert not at.success  # no all-clear
    compare = " ".join(unescape_md(m.value) for m in app(store_uri, monkeypatch, "compare").markdown)
    assert said in compare and compare.count("likely loss-scaler overflows") == compare.count(said) >= 1
    # the watcher goes by streak: both fp16 runs' first-step overflow is told as a likely one, not alerted;
    # the real NaN (from step 4 to the end) is alerted at each of its steps
    from rldiag.app.watch.loop import watch_once

    res, events = watch_once(store_uri)
    notes = {e["run_id"]: e["steps"] for e in events if e["kind"] == "likely_scaler_overflow"}
    assert notes == {ids["fp16"]: [1], ids["nan"]: [1]}
    alerted = sorted(e["step"] for e in events if e["kind"] == "nonfinite_grad" and e["run_id"] == ids["nan"])
    assert alerted == [s for s in ev[ev.run_id == ids["nan"]]["step"].tolist() if s >= 4] and alerted[-1] == 8
    assert res.alerts == len(alerted) and res.pending == 0
