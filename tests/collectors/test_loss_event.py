"""A NaN loss beside finite gradients, in a real CPU loop logging to a real SQLite store: what a user sees is
a warning and a `nonfinite_loss` event of its own, never a NaN-gradient alert (no alert tag, no policy: the
optimizer steps on the finite gradients)."""

from __future__ import annotations

import json
import logging
import math

import mlflow
import torch
from torch import nn

from rldiag.collectors import Monitor, keys
from tests.helpers.training import nan_term_loss


def test_a_nan_loss_with_finite_gradients_is_its_own_event_and_the_optimizer_steps(sqlite_uri, tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = tmp_path / "events.jsonl"
    caplog.set_level(logging.INFO, logger="rldiag")
    went, moved = [], []
    with Monitor("loss-event", run_name="nan-loss", tracking_uri=sqlite_uri, policy="raise",
                 alerts_jsonl=events) as mon:
        for step in range(6):
            loss = nan_term_loss(model, step, {2, 3})
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            go = mon.step(step, model, loss=loss)  # policy "raise" would raise on a NaN gradient
            if go:
                opt.step()
            opt.zero_grad()
            went.append(go)
            moved.append(any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())))
    assert went == [True] * 6 and moved == [True] * 6  # finite gradients: nothing to skip or raise on

    client = mlflow.MlflowClient(sqlite_uri)
    loss_h = {m.step: m.value for m in client.get_metric_history(mon.run_id, keys.LOSS)}
    finite_h = {m.step: m.value for m in client.get_metric_history(mon.run_id, keys.GRAD_FINITE)}
    assert [s for s, v in loss_h.items() if math.isnan(v)] == [2, 3]
    assert finite_h == dict.fromkeys(range(6), 1.0)  # the gradients were finite at every step
    assert keys.TAG_ALERT_COUNT not in client.get_run(mon.run_id).data.tags  # no NaN-gradient alert
    assert mon.events == []  # nor in the alerts artifact (the NaN events page reads that one as NaN gradients)

    got = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["kind"], e["step"], e["loss"], e["in_a_row"]) for e in got] == [
        ("nonfinite_loss", 2, "nan", 1), ("nonfinite_loss", 3, "nan", 2)]
    assert "while every gradient is finite" in got[0]["text"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # one warning for the stretch of steps 2-3 (its first step), none that says "non-finite gradient"
    assert len([w for w in warnings if "the loss is nan" in w]) == 1 and "at step 2" in warnings[0]
    assert not [w for w in warnings if "non-finite gradient" in w]


def test_a_step_with_no_valid_tokens_is_warned_once_a_stretch_and_never_alerted(sqlite_uri, tmp_path, caplog):
    # every completion truncated at steps 2-3 and 5: the collectors' own placeholders (ratio 1, KL 0) are
    # logged as they are, and the log says at the first step of each stretch that they measured nothing
    from rldiag.collectors import policy_metrics

    torch.manual_seed(0)
    model = nn.Linear(4, 16)
    caplog.set_level(logging.INFO, logger="rldiag")
    with Monitor("loss-event", run_name="truncated", tracking_uri=sqlite_uri, policy="raise",
                 alerts_jsonl=tmp_path / "events.jsonl") as mon:
        for step in range(7):
            lp_new = torch.log_softmax(model(torch.randn(3, 4)), -1)
            lp_old = lp_new.detach() + 0.05 * torch.randn(3, 16)
            mask = torch.full((3, 16), step not in (2, 3, 5))
            lp_new.sum().backward()
            stats = policy_metrics(lp_new.detach(), lp_old, mask)
            if step < 5:
                assert mon.step(step, model, metrics=stats)
            else:  # the same values logged on their own, after the gradient check
                assert mon.step(step, model)
                mon.log(stats, step)
            model.zero_grad()

    client = mlflow.MlflowClient(sqlite_uri)
    tokens = {m.step: m.value for m in client.get_metric_history(mon.run_id, keys.BATCH_TOKENS)}
    ratio = {m.step: m.value for m in client.get_metric_history(mon.run_id, keys.RATIO_MEAN)}
    assert [s for s, v in tokens.items() if v == 0] == [2, 3, 5]
    assert ratio[2] == ratio[3] == ratio[5] == 1.0  # what the warning is about: a "perfect" step
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "no valid tokens" in r.getMessage()]
    assert [w.split(":")[1].strip() for w in warned] == ["step 2", "step 5"], warned
    assert "check the completion mask" in warned[0]
    assert keys.TAG_ALERT_COUNT not in client.get_run(mon.run_id).data.tags and mon.events == []
