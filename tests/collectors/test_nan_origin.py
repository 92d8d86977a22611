"""Where the NaN entered, as a user reads it in the alert and in MLflow's `rldiag.alert.origin` tag: from
the loss's backward at the padded tokens (the seed's `-inf`-padded distillation loss), or at the first layer
in backward order when it starts inside the network; computed on the non-finite step only."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch
from torch import nn

from rldiag.collectors import Monitor, keys
from rldiag.collectors import nan_origin as nan_origin_module
from rldiag.collectors.nan_origin import format_positions
from rldiag.experiments.distill_loss import TeacherLogprobs, pad_ragged, sparse_top1_divergence
from rldiag.experiments.tiny_policy import PolicyConfig, TinyPolicy

P, V = 2, 16  # prompt tokens, vocabulary


def distill_step(mon: Monitor, *, mask_padding: bool, lengths=(3, 6)):
    """One micro-batch of the seed's bug: two completions of lengths 3 and 6 padded to width 6, the teacher's
    ragged logprobs padded with -inf, TRL's sparse top-1 reverse KL with a tail bucket, the student's
    completion logits watched. Returns the loss."""
    torch.manual_seed(0)
    student = TinyPolicy(PolicyConfig(vocab=V, d_model=16, n_layers=1, n_heads=2, max_len=32))
    width = max(lengths)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, V, (len(lengths), P), generator=g)
    required = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    comp = torch.where(required, torch.randint(1, V, (len(lengths), width), generator=g), 0)
    rows = [torch.log_softmax(torch.randn(n, V, generator=g), -1) for n in lengths]
    top1 = [r.max(-1) for r in rows]
    teacher = TeacherLogprobs(
        pad_ragged([r.gather(-1, comp[i, :n, None])[:, 0] for i, (r, n) in enumerate(zip(rows, lengths))], width,
                   float("-inf")),
        pad_ragged([t.values for t in top1], width, float("-inf")),
        pad_ragged([t.indices for t in top1], width, 0))
    logits = mon.watch(student(torch.cat([prompts, comp], 1))[:, P - 1 : -1])
    div = sparse_top1_divergence(torch.log_softmax(logits.float(), -1), teacher, comp, required, beta=1.0,
                                 mask_padding=mask_padding)
    div.loss.backward()
    mon.step(1, student, loss=div.loss)
    return div.loss


def test_the_padded_distillation_loss_says_the_nan_entered_from_the_loss_at_the_padding(sqlite_uri, tmp_path):
    with Monitor("origin", run_name="unmasked", tracking_uri=sqlite_uri, policy="skip",
                 alerts_jsonl=tmp_path / "alerts.jsonl") as mon:
        loss = distill_step(mon, mask_padding=False)
    assert torch.isfinite(loss)  # the seed's symptom: a finite loss
    report = mon.last_report
    assert report.finite is False
    # sample 0 has 3 valid tokens of 6: its padded completion positions are 3, 4, 5; sample 1 has none
    assert [(p.sample, p.position) for p in report.positions] == [(0, 3), (0, 4), (0, 5)]
    assert report.origin["where"] == "loss_backward"
    expected = ("NaN entered from the loss's backward (the loss was finite): the logits' gradient is non-finite "
                "at micro-batch 0 sample 0 tokens 3-5")
    assert report.origin["text"] == expected
    # every parameter is NaN; in backward order the head comes first, the embeddings last
    assert report.nonfinite_params[:2] == ["head.bias", "head.weight"]
    assert set(report.nonfinite_params[-2:]) == {"embed.weight", "pos.weight"}

    tags = mlflow.MlflowClient(sqlite_uri).get_run(mon.run_id).data.tags
    assert tags[keys.TAG_ALERT_ORIGIN] == expected
    assert json.loads(tags[keys.TAG_ALERT_LAST])["origin"]["where"] == "loss_backward"
    [event] = [json.loads(x) for x in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert expected in event["text"] and len(event["params"]) == 18  # every name stays in the event


def test_the_masked_loss_is_finite_and_walks_no_graph(sqlite_uri, monkeypatch):
    def walked(*_a, **_k):
        raise AssertionError("a finite step must not walk the autograd graph")

    monkeypatch.setattr("rldiag.collectors.monitor.autograd_order", walked)
    with Monitor("origin", run_name="masked", tracking_uri=sqlite_uri, policy="skip") as mon:
        distill_step(mon, mask_padding=True)
    assert mon.last_report.finite and mon.last_report.origin is None


def test_the_experiment_run_carries_the_origin_tag(sqlite_uri):
    from rldiag.experiments.masked_vs_unmasked import DistillConfig, run_one

    run_one(DistillConfig(variant="unmasked", batch_size=2, accumulation=1, steps=1), tracking_uri=sqlite_uri,
            progress=False)
    client = mlflow.MlflowClient(sqlite_uri)
    [run] = client.search_runs([client.get_experiment_by_name("rldiag-masked-vs-unmasked").experiment_id])
    origin = run.data.tags[keys.TAG_ALERT_ORIGIN]
    assert origin.startswith("NaN entered from the loss's backward (the loss was finite): the logits' gradient "
                             "is non-finite at micro-batch 0 sample ")


class NanBackward(torch.autograd.Function):
    """Identity forward; backward returns NaN: a NaN that starts inside the network, at this point."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


class Deep(nn.Module):
    def __init__(self, bad_layer: int | None):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, V)
        self.bad_layer = bad_layer

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == self.bad_layer:
                x = NanBackward.apply(x)
        return self.head(x)


@pytest.mark.parametrize("bad", [1, 2])
def test_a_nan_made_inside_a_middle_layer_names_that_layer_first(sqlite_uri, bad):
    model = Deep(bad)
    with Monitor("origin", run_name=f"layer{bad}", tracking_uri=sqlite_uri, policy="skip") as mon:
        logits = mon.watch(model(torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))))
        loss = logits.logsumexp(-1).mean()
        loss.backward()
        mon.step(0, model, loss=loss)
    r = mon.last_report
    # the head and the layers after `bad` have finite gradients; `bad` and every layer before it are NaN,
    # and in backward order `bad`'s bias (fed to its addmm) comes first
    assert sorted(r.nonfinite_params) == sorted(f"layers.{i}.{w}" for i in range(bad + 1) for w in ("weight", "bias"))
    assert r.nonfinite_params[:2] == [f"layers.{bad}.bias", f"layers.{bad}.weight"]
    assert r.origin == {"where": "layer", "param": f"layers.{bad}.bias", "order": "autograd",
                        "text": f"NaN entered at layers.{bad}.bias (the first non-finite gradient in backward order; "
                                "the logits' gradient was finite)"}
    tags = mlflow.MlflowClient(sqlite_uri).get_run(mon.run_id).data.tags
    assert tags[keys.TAG_ALERT_ORIGIN].startswith(f"NaN entered at layers.{bad}.bias")


def test_without_the_loss_tensor_or_the_logits_it_says_what_it_cannot_tell(sqlite_uri):
    model = Deep(2)
    with Monitor("origin", run_name="blind", tracking_uri=sqlite_uri, policy="skip") as mon:
        loss = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(0))).logsumexp(-1).mean()
        loss.backward()
        mon.step(0, model, loss=loss.item())  # a float: no graph; the logits were not watched
    o = mon.last_report.origin
    # the reversed registration order: head, layers.3, layers.2 (bias registered after weight, so first)
    assert o["where"] == "parameter" and o["order"] == "registration" and o["param"] == "layers.2.bias"
    assert "the logits were not watched" in o["text"] and "registration, reversed" in o["text"]


def test_positions_read_as_ranges_per_micro_batch_and_sample():
    pos = [{"micro_batch": 1, "sample": 0, "position": t} for t in (4, 5, 6, 9)] + [
        {"micro_batch": 1, "sample": 2, "position": 0}, {"micro_batch": 0, "sample": 3, "position": None}]
    assert format_positions(pos) == "micro-batch 1 sample 0 tokens 4-6, 9, micro-batch 1 sample 2 token 0, micro-batch 0 sample 3"
    assert nan_origin_module.in_order(["rank1:b", "a", "c"], ["c", "b", "a"]) == ["c", "rank1:b", "a"]
