"""One non-finite policy (collectors/nonfinite.py) behind both adapters: `Monitor` in a plain loop and
`RldiagCallback` in a real transformers `Trainer`, on the same tiny model with the same NaN, log the same
`grad/*` keys, record the policy as the run param `rldiag.nonfinite_policy`, mark a skipped step
`grad/skipped` 1 with an alert saying so, and log `grad/found` 0 where no gradient was found."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from torch import nn

from rldiag.collectors import Monitor, keys
from rldiag.collectors.alerts import NonFiniteGradAlert
from rldiag.collectors.nonfinite import NonFinitePolicy

NAN_STEP = 2  # the step (counted from 1, as the Trainer's global_step after the update) whose gradient is NaN


def nan_grad_through(x: torch.Tensor) -> torch.Tensor:
    """0 in the forward pass, NaN in the backward pass for `x` only (see tests/collectors/test_gradcheck.py)."""
    return 0.0 * ((x - x.detach()) ** 2).sum().sqrt()


class Net(nn.Module):
    """Two linear layers; `nan=True` makes the second layer's weight gradient NaN (the loss stays finite)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.nan = False

    def forward(self, x: torch.Tensor, **_) -> dict:
        loss = self.b(torch.tanh(self.a(x))).pow(2).mean()
        if self.nan:
            loss = loss + nan_grad_through(self.b.weight)
        return {"loss": loss}


def grad_keys(client, run_id: str) -> dict[int, set[str]]:
    """`{step: grad/* keys logged at that step}`."""
    out: dict[int, set[str]] = {}
    for k in client.get_run(run_id).data.metrics:
        if k.startswith("grad/"):
            for m in client.get_metric_history(run_id, k):
                out.setdefault(m.step, set()).add(k)
    return out


def read_alerts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def monitor_run(uri: str, alerts: Path, policy: str) -> tuple[str, list[torch.Tensor]]:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    weights = []
    with Monitor("policy", tracking_uri=uri, policy=policy, alerts_jsonl=alerts) as mon:
        for step in range(1, 4):
            net.nan = step == NAN_STEP
            loss = net(x)["loss"]
            loss.backward()
            if mon.step(step, net, loss=loss):
                opt.step()
            opt.zero_grad()
            weights.append(net.b.weight.detach().clone())
        return mon.run_id, weights


def trainer_run(uri: str, alerts: Path, policy: str, tmp_path: Path) -> tuple[str, list[torch.Tensor]]:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from rldiag.collectors.integrations.transformers import RldiagCallback

    net = Net()
    weights: list[torch.Tensor] = []

    class NanAt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            net.nan = state.global_step + 1 == NAN_STEP

        def on_step_end(self, args, state, control, **kw):
            weights.append(net.b.weight.detach().clone())

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, logging_steps=1, max_steps=3, per_device_train_batch_size=2,
                             max_grad_norm=0.0, learning_rate=0.1, optim="sgd", remove_unused_columns=False)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    data = [{"x": x[i % 2]} for i in range(6)]
    trainer = Trainer(model=net, args=args, train_dataset=data, callbacks=[NanAt()])
    cb = RldiagCallback(experiment="policy-hf", tracking_uri=uri, policy=policy, alerts_jsonl=alerts).attach(trainer)
    trainer.train()
    assert cb.session is None
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("policy-hf").experiment_id])
    return run.info.run_id, weights


@pytest.mark.parametrize("policy", ["skip", "warn"])
def test_both_adapters_log_the_same_keys_param_and_alert(sqlite_uri, tmp_path, policy):
    client = mlflow.MlflowClient(sqlite_uri)
    runs = {"monitor": monitor_run(sqlite_uri, tmp_path / "mon.jsonl", policy),
            "trainer": trainer_run(sqlite_uri, tmp_path / "hf.jsonl", policy, tmp_path)}
    logged = {name: grad_keys(client, rid) for name, (rid, _) in runs.items()}
    assert logged["monitor"] == logged["trainer"]
    assert logged["monitor"][NAN_STEP] == {keys.GRAD_NORM, keys.GRAD_FINITE, keys.GRAD_NONFINITE_PARAMS,
                                           keys.GRAD_SKIPPED}
    assert keys.GRAD_SKIPPED not in logged["monitor"][1]
    for name, (rid, weights) in runs.items():
        assert client.get_run(rid).data.params[keys.PARAM_NONFINITE_POLICY] == policy, name
        skipped = {m.step: m.value for m in client.get_metric_history(rid, keys.GRAD_SKIPPED)}
        # warn: the optimizer stepped on NaN, so the weights are NaN and every later step is non-finite too
        after = {s: 0.0 for s in range(NAN_STEP + 1, 4)} if policy == "warn" else {}
        assert skipped == {NAN_STEP: 1.0 if policy == "skip" else 0.0, **after}, name
        # skip: the weights did not change at the NaN step; warn: the optimizer stepped on NaN
        unchanged = torch.equal(weights[NAN_STEP - 1], weights[NAN_STEP - 2])
        assert unchanged == (policy == "skip"), name
    for path in (tmp_path / "mon.jsonl", tmp_path / "hf.jsonl"):
        alert = [a for a in read_alerts(path) if a["kind"] == "nonfinite_grad"][0]
        assert alert["step"] == NAN_STEP and alert["params"] == ["b.weight"]
        assert alert["policy"] == policy and alert["skipped"] is (policy == "skip")
        said = "skipped: the weights did not change" in alert["text"]
        assert said == (policy == "skip"), alert["text"]


class NoGrad(nn.Module):
    """A trainable parameter that the loss never reaches: no gradient is ever found."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))
        self.leaf = torch.zeros(1, requires_grad=True)  # not a parameter: the loss needs a graph

    def forward(self, x: torch.Tensor, **_) -> dict:
        return {"loss": (x.sum() * self.leaf).sum()}


def test_no_gradient_is_grad_found_0_in_both_adapters(sqlite_uri, tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from rldiag.collectors.integrations.transformers import RldiagCallback

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, logging_steps=1, max_steps=2, per_device_train_batch_size=1,
                             remove_unused_columns=False)
    trainer = Trainer(model=NoGrad(), args=args, train_dataset=[{"x": torch.ones(2)}] * 2)
    RldiagCallback(experiment="nograd-hf", tracking_uri=sqlite_uri).attach(trainer)
    trainer.train()
    net = NoGrad()
    with Monitor("nograd", tracking_uri=sqlite_uri) as mon:
        loss = net(torch.ones(2))["loss"]
        loss.backward()
        assert mon.step(1, net, loss=loss) is True
    client = mlflow.MlflowClient(sqlite_uri)
    for exp in ("nograd-hf", "nograd"):
        (run,) = client.search_runs([client.get_experiment_by_name(exp).experiment_id])
        found = client.get_metric_history(run.info.run_id, keys.GRAD_FOUND)
        assert found and all(m.value == 0.0 for m in found), exp
        assert client.get_metric_history(run.info.run_id, keys.GRAD_FINITE) == [], exp
        assert client.get_metric_history(run.info.run_id, keys.GRAD_NORM) == [], exp


def test_an_unknown_policy_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"policy='sometimes' is not one of .*e\.g\. policy='skip'"):
        NonFinitePolicy("sometimes")


def test_the_alert_text_says_what_happened_to_the_weights():
    base = dict(run_id="r", step=3, grad_norm=float("nan"), params=["w"])
    assert "skipped: the weights did not change" in NonFiniteGradAlert(**base, policy="skip", skipped=True).text()
    assert "the optimizer stepped on it" in NonFiniteGradAlert(**base, policy="warn", skipped=False).text()
    assert "skipped" not in NonFiniteGradAlert(**base).text()  # the watcher does not know


def test_run_session_on_nonfinite_is_the_same_alert_and_policy(sqlite_uri):
    from rldiag.collectors.gradcheck import GradReport
    from rldiag.collectors.session import RunSession

    session = RunSession("direct", tracking_uri=sqlite_uri, policy="skip")
    try:
        report = GradReport(norm=float("nan"), finite=False, nonfinite_params=["w"])
        assert session.on_nonfinite(5, report) is False
        (event,) = session.events
        assert (event["step"], event["policy"], event["skipped"]) == (5, "skip", True)
        assert "skipped: the weights did not change" in event["text"]
    finally:
        session.close()
