"""Non-finite gradient detection with real models and real backward passes: the check itself, the
logits probe, and the three policies through `Monitor` on a real SQLite MLflow store."""

from __future__ import annotations

import json
import logging
import math

import mlflow
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from rldiag.collectors import GradReport, LogitsProbe, Monitor, NonFiniteGradientError, check_gradients, keys
from rldiag.collectors.gradcheck import NonFinitePosition
from rldiag.collectors.metrics import policy_metrics

V, D = 11, 6  # vocabulary, hidden size of the tiny LM


def nan_grad_through(x: torch.Tensor) -> torch.Tensor:
    """A term that is exactly 0 in the forward pass and NaN in the backward pass, for `x` only.

    `sqrt(sum((x - x.detach())**2))` is sqrt(0) = 0, so `0.0 * term` keeps the loss finite; its
    backward is 0.0 * d sqrt(u)/du at u = 0 = 0.0 * inf = NaN, spread over every element of `x`.
    (`(x - x.detach()).norm()` would not do: torch defines the norm's gradient at 0 as 0.)
    """
    return 0.0 * ((x - x.detach()) ** 2).sum().sqrt()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class TinyLM(nn.Module):
    """Embedding + linear head: `[B, T]` ids -> `[B, T, V]` logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def lm_batch(b: int = 3, t: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits, -1).gather(-1, ids[..., None]).mean()


# --- (a) finite gradients --------------------------------------------------------------------------


def test_total_norm_is_the_l2_norm_over_all_gradients():
    # grads [3, 4] and [12]: total norm = sqrt(9 + 16 + 144) = sqrt(169) = 13
    a = nn.Parameter(torch.zeros(2))
    b = nn.Parameter(torch.zeros(1))
    loss = (a * torch.tensor([3.0, 4.0])).sum() + 12.0 * b.sum()
    loss.backward()
    report = check_gradients([a, b])
    assert report.finite and report.nonfinite_params == []
    assert_close(torch.tensor(report.norm), torch.tensor(13.0))
    assert report.metrics() == {keys.GRAD_NORM: 13.0, keys.GRAD_FINITE: 1.0, keys.GRAD_NONFINITE_PARAMS: 0.0}


def test_finite_gradients_match_torch_total_norm_and_clip_grad_norm():
    model = mlp()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    report = check_gradients(model)
    grads = [p.grad for p in model.parameters()]
    assert report.finite
    assert report.nonfinite_params == [] and report.positions == []
    assert_close(torch.tensor(report.norm), torch.nn.utils.get_total_norm(grads))
    # clip_grad_norm_ returns the total norm before clipping; inf max_norm leaves the grads alone
    assert_close(torch.tensor(report.norm), torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))


def test_parameters_without_a_gradient_are_ignored():
    model = mlp()
    model[0].requires_grad_(False)  # frozen first layer: no .grad
    model(torch.ones(1, 4)).sum().backward()
    report = check_gradients(model.named_parameters())
    assert report.finite
    assert_close(torch.tensor(report.norm), torch.nn.utils.get_total_norm([model[2].weight.grad, model[2].bias.grad]))


def test_no_gradients_at_all_is_unknown_never_a_finite_zero():
    report = check_gradients(mlp())  # no backward: no parameter has a .grad (as under DeepSpeed ZeRO)
    assert report.finite is None and not report.found and math.isnan(report.norm)
    assert not report.finite  # whoever asks "finite?" gets no all-clear
    assert report.metrics() == {keys.GRAD_FOUND: 0.0}  # neither grad/finite = 1 nor grad/norm = 0
    assert keys.GRAD_FOUND not in keys.CANONICAL_METRICS


def test_monitor_without_gradients_logs_unknown_and_warns_once(sqlite_uri, caplog):
    caplog.set_level(logging.WARNING, logger="rldiag")
    model, results = mlp(), []
    with Monitor("gradcheck", run_name="no-grad", tracking_uri=sqlite_uri, policy="skip") as mon:
        for step in range(3):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            if step == 1:  # a real step in between: checked as usual
                loss.backward()
            results.append((mon.step(step, model, loss=loss), mon.last_report))
            model.zero_grad()  # set_to_none: steps 0 and 2 have no .grad at all
    assert [ok for ok, _ in results] == [True, True, True]  # nothing to skip when nothing was checked
    assert [r.found for _, r in results] == [False, True, False]
    assert results[1][1].finite is True and results[0][1].finite is None
    warnings = [r.getMessage() for r in caplog.records if "no parameter has a gradient" in r.getMessage()]
    assert len(warnings) == 1 and "step 0" in warnings[0] and keys.GRAD_FOUND in warnings[0]
    assert mon.events == []  # no alert

    client = mlflow.MlflowClient(sqlite_uri)
    assert history(client, mon.run_id, keys.GRAD_FOUND) == {0: 0.0, 2: 0.0}
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {1: 1.0}
    assert sorted(history(client, mon.run_id, keys.GRAD_NORM)) == [1]
    assert sorted(history(client, mon.run_id, keys.GRAD_NONFINITE_PARAMS)) == [1]
    assert sorted(history(client, mon.run_id, keys.LOSS)) == [0, 1, 2]


# --- sparse gradients (nn.Embedding(sparse=True)) ---------------------------------------------------------


class SparseLM(TinyLM):
    """TinyLM with a sparse embedding: its `.grad` is an uncoalesced sparse COO tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D, sparse=True)


def test_sparse_gradients_are_checked_with_their_true_norm():
    model = SparseLM()
    ids = torch.tensor([[1, 1, 2, 1], [2, 3, 3, 1]])  # repeated ids: the sparse grad repeats their rows
    lm_loss(model(ids), ids).backward()
    g = model.embed.weight.grad
    assert g.layout == torch.sparse_coo and not g.is_coalesced()
    report = check_gradients(model)
    assert report.finite and report.nonfinite_params == []
    dense = [g.to_dense(), model.head.weight.grad, model.head.bias.grad]
    assert_close(torch.tensor(report.norm), torch.nn.utils.get_total_norm(dense))


def test_a_nan_in_a_sparse_gradient_is_named_and_skip_zeroes_it(sqlite_uri):
    model = SparseLM()
    ids = lm_batch()
    emb = model.embed(ids)
    loss = lm_loss(model.head(emb), ids) + nan_grad_through(emb[1, 2])  # NaN in one embedding row only
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isnan(model.embed.weight.grad.coalesce().values()).any()
    report = check_gradients(model)
    assert not report.finite and report.nonfinite_params == ["embed.weight"]
    with Monitor("gradcheck", run_name="sparse", tracking_uri=sqlite_uri, policy="skip") as mon:
        assert mon.step(0, model, loss=loss) is False
    assert mon.last_report.nonfinite_params == ["embed.weight"]
    assert model.embed.weight.grad.coalesce().values().count_nonzero() == 0
    assert model.head.weight.grad.count_nonzero() == 0
    client = mlflow.MlflowClient(sqlite_uri)
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {0: 0.0}


def test_sparse_gradients_through_the_accumulated_check():
    from rldiag.collectors.gradcheck import AccumulatedGradCheck

    model = SparseLM()
    check = AccumulatedGradCheck(model.named_parameters())
    ids = lm_batch()
    lm_loss(model(ids), ids).backward()
    report, _ = check.collect()
    dense = [model.embed.weight.grad.to_dense(), model.head.weight.grad, model.head.bias.grad]
    assert report.finite
    assert_close(torch.tensor(report.norm, dtype=torch.float32), torch.nn.utils.get_total_norm(dense))
    model.zero_grad()
    emb = model.embed(ids)
    (lm_loss(model.head(emb), ids) + nan_grad_through(emb[0, 0])).backward()
    report, _ = check.collect()
    assert not report.finite and report.nonfinite_params == ["embed.weight"]
    check.remove()


# --- (b) a NaN in one parameter at a known step ------------------------------------------------------


def test_nan_in_one_parameter_is_named_at_exactly_that_step():
    model = mlp()
    target_name, target = "0.bias", model[0].bias
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    nan_step, reports = 3, []
    for step in range(6):
        opt.zero_grad()
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        loss = (model(x) - y).pow(2).mean()
        if step == nan_step:
            loss = loss + nan_grad_through(target)
        assert torch.isfinite(loss), "the injected term must keep the forward loss finite"
        loss.backward()
        if step == nan_step:  # the claim the injection rests on: NaN in that one parameter only
            for name, p in model.named_parameters():
                assert bool(torch.isnan(p.grad).all()) is (name == target_name), name
        report = check_gradients(model)  # after backward, before any clipping
        reports.append(report)
        if report.finite:
            opt.step()

    assert [r.finite for r in reports] == [True, True, True, False, True, True]
    assert [r.nonfinite_params for r in reports] == [[], [], [], [target_name], [], []]
    assert math.isnan(reports[nan_step].norm)
    assert reports[nan_step].metrics()[keys.GRAD_FINITE] == 0.0
    assert reports[nan_step].metrics()[keys.GRAD_NONFINITE_PARAMS] == 1.0
    assert all(math.isfinite(r.norm) for i, r in enumerate(reports) if i != nan_step)


def test_inf_gradient_is_non_finite_too():
    # sqrt(w) at w = 0: forward 0, gradient 1 / (2 sqrt(0)) = +inf
    w = nn.Parameter(torch.zeros(1))
    ok = nn.Parameter(torch.ones(1))
    (w.sqrt() + ok).sum().backward()
    assert torch.isinf(w.grad).all()
    report = check_gradients([("w", w), ("ok", ok)])
    assert not report.finite and report.nonfinite_params == ["w"]


def test_checking_after_clipping_would_blame_every_parameter():
    # Why the check must run before clipping: a NaN total norm scales every gradient by NaN.
    model = mlp()
    (model(torch.ones(2, 4)).sum() + nan_grad_through(model[2].bias)).backward()
    assert check_gradients(model).nonfinite_params == ["2.bias"]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert check_gradients(model).nonfinite_params == ["0.weight", "0.bias", "2.weight", "2.bias"]


# --- (c) the logits probe ------------------------------------------------------------------------------


def test_probe_finds_the_sample_and_token_with_a_nan_logit_gradient():
    model, probe = TinyLM(), LogitsProbe()
    ids = lm_batch()
    logits = probe.watch(model(ids))
    logits.retain_grad()
    s, tok = 1, 3
    loss = lm_loss(logits, ids) + nan_grad_through(logits[s, tok])
    assert torch.isfinite(loss)
    loss.backward()
    # the claim: the loss gradient w.r.t. the logits is NaN at (s, tok) and finite everywhere else
    bad = torch.isnan(logits.grad).any(-1)
    assert bad.nonzero().tolist() == [[s, tok]]

    report = check_gradients(model, probe)
    assert not report.finite
    assert set(report.nonfinite_params) == {"embed.weight", "head.weight", "head.bias"}
    assert report.positions == [NonFinitePosition(micro_batch=0, sample=s, position=tok)]
    assert [p.as_dict() for p in report.positions] == [{"micro_batch": 0, "sample": 1, "position": 3}]
    assert report.nonfinite_positions == 1


@pytest.mark.parametrize(("bad_mb", "s", "tok"), [(0, 0, 4), (1, 2, 0)])
def test_probe_names_the_micro_batch_under_gradient_accumulation(bad_mb, s, tok):
    model, probe = TinyLM(), LogitsProbe()
    for mb in range(2):
        ids = lm_batch(seed=10 + mb)
        logits = probe.watch(model(ids))
        loss = lm_loss(logits, ids) / 2
        if mb == bad_mb:
            loss = loss + nan_grad_through(logits[s, tok])
        loss.backward()  # gradients accumulate in .grad across the two micro-batches
    report = check_gradients(model, probe)
    assert not report.finite
    assert [p.as_dict() for p in report.positions] == [{"micro_batch": bad_mb, "sample": s, "position": tok}]


def test_probe_reports_positions_in_every_micro_batch_and_resets():
    model, probe = TinyLM(), LogitsProbe()
    for mb, (s, tok) in enumerate([(0, 4), (2, 0)]):
        ids = lm_batch(seed=mb)
        logits = probe.watch(model(ids))
        (lm_loss(logits, ids) + nan_grad_through(logits[s, tok])).backward()
    report = check_gradients(model, probe)
    assert [(p.micro_batch, p.sample, p.position) for p in report.positions] == [(0, 0, 4), (1, 2, 0)]
    assert report.nonfinite_positions == 2
    probe.reset()
    assert probe.positions() == [] and probe.count() == 0


def test_probe_caps_the_listed_positions_but_counts_them_all():
    model, probe = TinyLM(), LogitsProbe(max_positions=2)
    ids = lm_batch(t=5)
    logits = probe.watch(model(ids))
    (lm_loss(logits, ids) + nan_grad_through(logits[1])).backward()  # every token of sample 1
    report = check_gradients(model, probe)
    assert [(p.sample, p.position) for p in report.positions] == [(1, 0), (1, 1)]
    assert report.nonfinite_positions == 5


def test_probe_on_a_tensor_without_a_token_dimension_reports_samples():
    model, probe = TinyLM(), LogitsProbe()
    ids = lm_batch()
    per_sample = probe.watch(model(ids).mean(dim=(1, 2)))  # [B]
    (per_sample.sum() + nan_grad_through(per_sample[2])).backward()
    report = check_gradients(model, probe)
    assert [p.as_dict() for p in report.positions] == [{"micro_batch": 0, "sample": 2, "position": None}]


def test_probe_sees_nothing_when_the_nan_does_not_come_through_the_logits():
    model, probe = TinyLM(), LogitsProbe()
    ids = lm_batch()
    logits = probe.watch(model(ids))
    (lm_loss(logits, ids) + nan_grad_through(model.head.bias)).backward()
    report = check_gradients(model, probe)
    assert report.nonfinite_params == ["head.bias"]
    assert report.positions == [] and report.nonfinite_positions == 0


def test_probe_ignores_tensors_that_need_no_gradient():
    probe = LogitsProbe()
    x = torch.zeros(2, 3, 4)
    assert probe.watch(x) is x
    assert probe.positions() == [] and probe.count() == 0


# --- (d) through Monitor, on a real SQLite MLflow store ------------------------------------------------


def run_steps(mon: Monitor, model: TinyLM, nan_steps: set[int], n_steps: int, results: list, *, update: bool = True):
    """A short GRPO-shaped loop: watch the logits, backward, `mon.step` before clipping and stepping.

    `update=False` never steps the optimizer (under "warn" a NaN step would turn the weights to NaN).
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(n_steps):
        opt.zero_grad()
        ids = lm_batch(seed=100 + step)
        logits = mon.watch(model(ids))
        lp_new = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
        lp_old = lp_new.detach() + 0.01
        loss = -(torch.exp(lp_new - lp_old)).mean()
        if step in nan_steps:
            loss = loss + nan_grad_through(logits[2, 1])  # sample 2, token 1
        assert torch.isfinite(loss)  # the seed case: finite loss, NaN gradient
        loss.backward()
        stats = policy_metrics(lp_new, lp_old, logits=logits)
        ok = mon.step(step, model, loss=loss, metrics=stats)
        results.append((ok, {n: p.grad.clone() for n, p in model.named_parameters()}))
        if ok and update:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


def history(client: mlflow.MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_monitor_skip_returns_false_and_zeroes_the_gradients(sqlite_uri):
    model, results = TinyLM(), []
    with Monitor("gradcheck", run_name="skip", tracking_uri=sqlite_uri, policy="skip") as mon:
        run_steps(mon, model, {1}, 3, results)
    assert [ok for ok, _ in results] == [True, False, True]
    for name, grad in results[1][1].items():
        assert torch.count_nonzero(grad) == 0, f"{name} was not zeroed"
    assert mon.last_report is not None and mon.last_report.finite
    client = mlflow.MlflowClient(sqlite_uri)
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {0: 1.0, 1: 0.0, 2: 1.0}
    assert client.get_run(mon.run_id).info.status == "FINISHED"


def test_monitor_raise_keeps_the_failing_steps_metrics_and_alert(sqlite_uri, tmp_path):
    model, results = TinyLM(), []
    mon = Monitor("gradcheck", run_name="raise", tracking_uri=sqlite_uri, policy="raise",
                  alerts_jsonl=tmp_path / "alerts.jsonl")
    with pytest.raises(NonFiniteGradientError) as err:
        with mon:
            run_steps(mon, model, {2}, 4, results)
    assert len(results) == 2  # steps 0 and 1 stepped; step 2 raised
    alert = err.value.alert
    assert alert.step == 2 and alert.run_id == mon.run_id
    # in backward order, from the loss's autograd graph: the head first (its bias feeds the addmm node, its
    # weight through the transpose node made before it), the embedding last
    assert alert.params == ["head.bias", "head.weight", "embed.weight"]
    assert alert.origin["where"] == "loss_backward" and "sample 2 token 1" in alert.origin["text"]
    assert alert.positions == [{"micro_batch": 0, "sample": 2, "position": 1}]
    assert "step 2" in str(err.value)

    client = mlflow.MlflowClient(sqlite_uri)
    run = client.get_run(mon.run_id)
    assert run.info.status == "FAILED"
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {0: 1.0, 1: 1.0, 2: 0.0}
    assert history(client, mon.run_id, keys.GRAD_NONFINITE_PARAMS) == {0: 0.0, 1: 0.0, 2: 3.0}
    losses = history(client, mon.run_id, keys.LOSS)
    assert sorted(losses) == [0, 1, 2] and all(math.isfinite(v) for v in losses.values())
    assert math.isnan(history(client, mon.run_id, keys.GRAD_NORM)[2])
    assert sorted(history(client, mon.run_id, keys.RATIO_MEAN)) == [0, 1, 2]

    assert run.data.tags[keys.TAG_ALERT_COUNT] == "1"
    assert run.data.tags[keys.TAG_ALERT_FIRST_STEP] == "2"
    assert json.loads(run.data.tags[keys.TAG_ALERT_LAST])["step"] == 2
    artifact = client.download_artifacts(mon.run_id, keys.ALERTS_ARTIFACT, str(tmp_path / "dl"))
    events = [json.loads(line) for line in open(artifact, encoding="utf-8")]
    assert [(e["step"], e["params"]) for e in events] == [(2, ["head.bias", "head.weight", "embed.weight"])]
    assert [json.loads(line)["step"] for line in open(tmp_path / "alerts.jsonl", encoding="utf-8")] == [2]


def test_monitor_warn_alerts_and_steps_anyway(sqlite_uri, caplog):
    caplog.set_level(logging.WARNING, logger="rldiag.alerts")
    model, results = TinyLM(), []
    with Monitor("gradcheck", run_name="warn", tracking_uri=sqlite_uri, policy="warn") as mon:
        run_steps(mon, model, {1, 2}, 3, results, update=False)
    assert [ok for ok, _ in results] == [True, True, True]
    assert [e["step"] for e in mon.events] == [1, 2]
    texts = [r.getMessage() for r in caplog.records if r.name == "rldiag.alerts"]
    assert len(texts) == 2
    assert f"run warn ({mon.run_id})" in texts[0] and "step 1" in texts[0] and "head.weight" in texts[0] and "sample 2 token 1" in texts[0]

    client = mlflow.MlflowClient(sqlite_uri)
    run = client.get_run(mon.run_id)
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {0: 1.0, 1: 0.0, 2: 0.0}
    assert run.data.tags[keys.TAG_ALERT_COUNT] == "2"
    assert run.data.tags[keys.TAG_ALERT_FIRST_STEP] == "1"
    assert [a.path for a in client.list_artifacts(mon.run_id, "rldiag")] == [keys.ALERTS_ARTIFACT]


def test_monitor_rejects_an_unknown_policy_before_opening_a_run():
    with pytest.raises(ValueError, match="policy='ignore'.*'warn', 'skip', 'raise'"):
        Monitor(policy="ignore")  # type: ignore[arg-type]


def test_grad_report_is_importable_from_the_package():
    assert GradReport(norm=1.0, finite=True).metrics()[keys.GRAD_FINITE] == 1.0


def test_probe_reset_between_watch_and_backward_does_not_crash_backward():
    probe = LogitsProbe()
    x = torch.randn(2, 3, 4, requires_grad=True)
    y = probe.watch(x * 2)
    probe.reset()
    y.sum().backward()  # the hook belongs to no checked step any more: it must stay silent
    assert probe.positions() == [] and x.grad is not None


# --- clipping with the checked norm -------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "under-the-norm"])
def test_max_norm_clips_as_clip_grad_norm_would_with_the_norm_just_checked(sqlite_uri, max_norm):
    ids = lm_batch()
    ours, theirs = TinyLM(), TinyLM()
    for m in (ours, theirs):
        lm_loss(m(ids), ids).backward()
    with Monitor("gradcheck", run_name="max_norm", tracking_uri=sqlite_uri, policy="skip") as mon:
        assert mon.step(0, ours, max_norm=max_norm)
    pre_clip = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    assert mon.last_report.norm == pytest.approx(pre_clip.item(), rel=1e-6)  # logged before clipping
    assert (max_norm < pre_clip.item()) == (max_norm == 0.05)  # the first case does clip
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert_close(a.grad, b.grad, msg=name)
    assert history(mlflow.MlflowClient(sqlite_uri), mon.run_id, keys.GRAD_NORM)[0] == pytest.approx(pre_clip.item(),
                                                                                                   rel=1e-6)


def test_max_norm_leaves_a_non_finite_step_alone_and_a_bad_value_is_refused_before_logging(sqlite_uri):
    model, ids = TinyLM(), lm_batch()
    with Monitor("gradcheck", run_name="max_norm-nan", tracking_uri=sqlite_uri, policy="warn") as mon:
        (lm_loss(model(ids), ids) + nan_grad_through(model.head.weight)).backward()
        before = model.embed.weight.grad.clone()
        assert mon.step(0, model, max_norm=1e-3)  # warn: the step goes on, unclipped (no coefficient to take)
        assert_close(model.embed.weight.grad, before)
        assert torch.isnan(model.head.weight.grad).all()
        for bad in (0.0, -1.0, float("nan"), float("inf"), "1.0"):
            with pytest.raises(ValueError, match=r"max_norm=.*positive finite total norm"):
                mon.step(1, model, loss=torch.tensor(2.0), max_norm=bad)
    client = mlflow.MlflowClient(sqlite_uri)
    assert history(client, mon.run_id, keys.GRAD_FINITE) == {0: 0.0}  # step 1 never logged half a step
    assert history(client, mon.run_id, keys.LOSS) == {}
