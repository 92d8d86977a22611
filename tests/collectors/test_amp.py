"""Mixed precision in real CPU training loops: fp16 autocast with a real `torch.amp.GradScaler("cpu")`
(torch 2.13 scales, unscales, skips and backs off on the CPU), and bf16 (autocast, and bf16 parameters).

What a user checks in MLflow: `grad/norm` is the true (unscaled) norm, whether `scaler.unscale_` ran before
`Monitor.step` or not; a scaler overflow is `grad/scaler_overflow` = 1 with no NaN alert, and the scaler's
own skip and back-off run as without rldiag (policy `skip` adds no skip and zeroes nothing); a NaN the
scaling did not cause (a NaN loss, or still non-finite at loss scale 1) is a NaN alert."""

from __future__ import annotations

import json
import logging
import math

import mlflow
import pytest
import torch
from torch import nn

from rldiag.collectors import Monitor, check_gradients, keys
from tests.helpers.training import cpu_fp16_trainer_class, fp16_loop, mlp, x_batch


def history(client: mlflow.MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def nan_grad_through(x: torch.Tensor) -> torch.Tensor:
    """0 in the forward pass, NaN in the backward pass for `x` (0 * d sqrt(u)/du at u = 0)."""
    return 0.0 * ((x - x.detach()) ** 2).sum().sqrt()


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fp16_norm_is_logged_unscaled_whether_or_not_unscale_ran_first(sqlite_uri, unscale_first):
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with Monitor("amp", run_name=f"unscale_first={unscale_first}", tracking_uri=sqlite_uri, policy="skip") as mon:
        res = fp16_loop(mon, model, 3, scaler=scaler, loss_fn=lambda y, _: y.pow(2).mean(),
                        unscale_first=unscale_first)
    assert all(r["go"] and r["moved"] and r["report"].finite for r in res)
    client = mlflow.MlflowClient(sqlite_uri)
    norms = history(client, mon.run_id, keys.GRAD_NORM)
    for step, r in enumerate(res):
        # the scale is a power of two: unscaling is exact, the float32 norms agree to rounding
        assert norms[step] == pytest.approx(r["true_norm"], rel=1e-6)
        assert norms[step] < r["true_norm"] * 2  # not the scaled norm (1024 times larger)
    assert history(client, mon.run_id, keys.GRAD_LOSS_SCALE) == {0: 1024.0, 1: 1024.0, 2: 1024.0}
    assert history(client, mon.run_id, keys.GRAD_SCALER_OVERFLOW) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_a_scaler_overflow_is_its_own_event_and_the_scaler_skips_and_recovers(sqlite_uri, tmp_path, caplog):
    # loss = 1.5 * y with y the fp16 output of the last Linear (batch 1): the gradient reaching y is
    # 1.5 * scale, cast back to fp16 by autocast's backward. At scale 65536 it is 98304 > 65504 (fp16's max):
    # inf, an overflow of the scaling alone. The scaler skips step 0 and halves to 32768; then 49152 fits.
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    events = tmp_path / "events.jsonl"
    caplog.set_level(logging.INFO, logger="rldiag")
    with Monitor("amp", run_name="overflow", tracking_uri=sqlite_uri, policy="skip", alerts_jsonl=events) as mon:
        res = fp16_loop(mon, model, 3, scaler=scaler, loss_fn=lambda y, _: 1.5 * y.sum())
    r0 = res[0]["report"]
    assert r0.overflow and r0.finite is False and r0.scale == 65536.0
    # rldiag steps on: the scaler's step skipped the update itself, its update() halved the scale, no crash
    assert [r["go"] for r in res] == [True, True, True]
    assert [r["moved"] for r in res] == [False, True, True]
    assert [r["scale"] for r in res] == [65536.0, 32768.0, 32768.0]
    assert res[1]["report"].finite and res[2]["report"].finite

    client = mlflow.MlflowClient(sqlite_uri)
    assert history(client, mon.run_id, keys.GRAD_SCALER_OVERFLOW) == {0: 1.0, 1: 0.0, 2: 0.0}
    assert history(client, mon.run_id, keys.GRAD_LOSS_SCALE) == {0: 65536.0, 1: 32768.0, 2: 32768.0}
    assert set(history(client, mon.run_id, keys.GRAD_FINITE)) == {1, 2}  # the overflow step is no NaN step
    assert set(history(client, mon.run_id, keys.GRAD_NORM)) == {1, 2}
    tags = client.get_run(mon.run_id).data.tags
    assert keys.TAG_ALERT_COUNT not in tags  # no NaN alert
    assert mon.events == []
    [event] = [json.loads(line) for line in events.read_text().splitlines()]
    assert event["kind"] == "scaler_overflow" and event["step"] == 0 and event["loss_scale"] == 65536.0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "non-finite" in r.getMessage()]


def test_a_nan_loss_under_a_scaler_is_a_nan_alert_at_once(sqlite_uri):
    # sqrt of a negative number: the loss itself is NaN (and its gradient 0.5 / sqrt(-2) too); no scale causes that
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def loss_fn(y, step):
        return y.pow(2).mean() + (torch.sqrt(-y.pow(2).mean() - 1) if step == 1 else 0.0)

    with Monitor("amp", run_name="nan-loss", tracking_uri=sqlite_uri, policy="skip") as mon:
        res = fp16_loop(mon, model, 3, scaler=scaler, loss_fn=loss_fn)
    r1 = res[1]["report"]
    assert r1.finite is False and not r1.overflow
    assert r1.origin["where"] == "loss" and "the loss was NaN" in r1.origin["text"]
    # under a scaler rldiag leaves the skip to scaler.step (zeroed gradients would read finite to it)
    assert [r["go"] for r in res] == [True, True, True] and [r["moved"] for r in res] == [True, False, True]
    client = mlflow.MlflowClient(sqlite_uri)
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {0: 1.0, 1: 0.0, 2: 1.0}
    tags = client.get_run(mon.run_id).data.tags
    assert tags[keys.TAG_ALERT_COUNT] == "1" and tags[keys.TAG_ALERT_FIRST_STEP] == "1"
    assert tags[keys.TAG_ALERT_ORIGIN].startswith("the loss was NaN")


def test_a_nan_gradient_the_scaling_did_not_cause_is_an_alert_once_the_scale_reaches_1(sqlite_uri):
    # A NaN made in backward (finite loss) on every step from init_scale 4: the scaler cannot tell it from an
    # overflow and halves 4 -> 2 -> 1; at scale 1 nothing was scaled, so it is a NaN gradient: the alert.
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with Monitor("amp", run_name="nan-grad", tracking_uri=sqlite_uri, policy="skip") as mon:
        res = fp16_loop(mon, model, 4, scaler=scaler,
                        loss_fn=lambda y, _: y.pow(2).mean() + nan_grad_through(y))
    assert [r["scale"] for r in res] == [4.0, 2.0, 1.0, 0.5]
    assert [r["report"].overflow for r in res] == [True, True, False, False]
    assert not any(r["moved"] for r in res)  # the scaler skipped every step; rldiag added nothing
    client = mlflow.MlflowClient(sqlite_uri)
    assert history(client, mon.run_id, keys.GRAD_SCALER_OVERFLOW) == {0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {2: 0.0, 3: 0.0}
    assert client.get_run(mon.run_id).data.tags[keys.TAG_ALERT_FIRST_STEP] == "2"


def test_bf16_gradients_are_measured_in_float32():
    # bf16 parameters (bf16 gradients): the norm is taken in float32, so it equals the float64 norm of the same
    # bf16 values to float32 rounding; a bf16 norm would round it to 8 bits of mantissa (rel error up to 2^-8).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(torch.bfloat16)
    model(torch.randn(32, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    exact = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])).item()
    report = check_gradients(model)
    assert report.finite and report.norm == pytest.approx(exact, rel=1e-6)
    bf16_norm = torch.nn.utils.get_total_norm(grads).item()  # what torch gives on bf16 gradients
    assert bf16_norm != pytest.approx(exact, rel=1e-6)  # so the float32 norm is what makes the test pass


def test_bf16_autocast_loop_logs_true_norms_and_catches_a_nan(sqlite_uri):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = {}
    with Monitor("amp", run_name="bf16", tracking_uri=sqlite_uri, policy="skip") as mon:
        for step in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x_batch(step, b=4))
            loss = y.float().pow(2).mean() + (nan_grad_through(y) if step == 1 else 0.0)
            loss.backward()
            norms[step] = torch.nn.utils.get_total_norm([p.grad.double() for p in model.parameters()]).item()
            if mon.step(step, model, loss=loss):
                opt.step()
    client = mlflow.MlflowClient(sqlite_uri)
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {0: 1.0, 1: 0.0, 2: 1.0}
    logged = history(client, mon.run_id, keys.GRAD_NORM)
    for step in (0, 2):
        assert logged[step] == pytest.approx(norms[step], rel=1e-6)
    assert math.isnan(logged[1])
    assert keys.GRAD_LOSS_SCALE not in client.get_run(mon.run_id).data.metrics  # no scaler: no scale logged


# --- fp16 through transformers' Trainer ---------------------------------------------------------------------


def test_a_trainer_under_skip_trains_through_a_scaler_overflow_without_a_crash_or_a_nan_alert(sqlite_uri, tmp_path):
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    from transformers import LlamaForCausalLM, TrainerCallback

    from rldiag.collectors.integrations.transformers import RldiagCallback
    from tests.helpers.tiny_hf import llama_config, lm_dataset, training_args

    class Weights(TrainerCallback):
        def __init__(self):
            self.sums = {}

        def on_step_end(self, args, state, control, model=None, **kw):
            self.sums[state.global_step] = float(sum(p.detach().double().sum() for p in model.parameters()))

    torch.manual_seed(0)
    try:
        trainer = cpu_fp16_trainer_class()(model=LlamaForCausalLM(llama_config()), train_dataset=lm_dataset(8),
                                           args=training_args(tmp_path, per_device_train_batch_size=2, max_steps=3))
        weights = Weights()
        trainer.add_callback(weights)
        before = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
        RldiagCallback(experiment="amp-trainer", run_name="fp16", tracking_uri=sqlite_uri, policy="skip").attach(trainer)
        trainer.train()  # before: the no-op step skipped scaler.update(), and step 2 raised in unscale_()
        scaler = trainer.accelerator.scaler
    finally:
        AcceleratorState._reset_state(True)  # the fp16 state is this test's only
    assert scaler.get_scale() == 2.0**10  # 2**40 * 2**-30 after the one overflow; no growth in 3 steps
    assert weights.sums[1] == before  # the scaler skipped step 1 itself
    assert weights.sums[2] != weights.sums[1] and weights.sums[3] != weights.sums[2]

    client = mlflow.MlflowClient(sqlite_uri)
    [run] = client.search_runs([client.get_experiment_by_name("amp-trainer").experiment_id])
    rid = run.info.run_id
    assert history(client, rid, keys.GRAD_SCALER_OVERFLOW) == {1: 1.0, 2: 0.0, 3: 0.0}
    assert history(client, rid, keys.GRAD_LOSS_SCALE) == {1: 2.0**40, 2: 2.0**10, 3: 2.0**10}
    assert history(client, rid, keys.GRAD_FINITE) == {2: 1.0, 3: 1.0}  # the overflow step is no NaN step
    assert keys.TAG_ALERT_COUNT not in run.data.tags
    # the unscaled norm: what the Trainer's own clip (after unscale_) logged as grad_norm
    ours, trainers = history(client, rid, keys.GRAD_NORM), history(client, rid, "grad_norm")
    for step in (2, 3):
        assert ours[step] == pytest.approx(trainers[step], rel=1e-5)
        assert ours[step] < 100  # not the scaled norm (x 1024)


def test_a_scaler_that_is_no_gradscaler_is_one_clear_error_and_a_disabled_one_changes_nothing(sqlite_uri):
    model = mlp()
    model(x_batch(0)).sum().backward()
    with Monitor("amp", run_name="bad-scaler", tracking_uri=sqlite_uri) as mon:
        with pytest.raises(TypeError, match=r"scaler=2\.0 is no torch\.amp\.GradScaler"):
            mon.step(0, model, scaler=2.0)
        assert mon.step(1, model, scaler=torch.amp.GradScaler("cpu", enabled=False))
        assert mon.last_report.scale is None and mon.last_report.finite


def test_max_norm_under_a_scaler_clips_by_the_unscaled_norm_before_or_after_unscale(sqlite_uri):
    """Clipping through `Monitor.step(max_norm=...)` with the gradients still scaled trains the same weights
    as the usual unscale_ -> clip_grad_norm_ -> scaler.step."""
    ours, theirs = mlp(), mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    norms = []
    with Monitor("amp", run_name="max_norm", tracking_uri=sqlite_uri, policy="skip") as mon:
        for step in range(4):
            for model, opt, scaler in zip((ours, theirs), opts, scalers):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    y = model(x_batch(step, b=4))
                scaler.scale(y.float().pow(2).mean() * 50).backward()
            assert mon.step(step, ours, scaler=scalers[0], max_norm=0.5)  # clips the scaled gradients
            scalers[1].unscale_(opts[1])
            norms.append(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5).item())
            for opt, scaler in zip(opts, scalers):
                scaler.step(opt)
                scaler.update()
    assert min(norms) > 0.5  # every step did clip
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, msg=name)
