"""`RldiagCallback` with the real transformers `Trainer` and TRL `GRPOTrainer` on tiny random-init
models (nothing is downloaded): metrics and params land in MLflow, the ragged `-inf` padding failure
of `shared/seeds/trl-distillation-nan-pr.txt` is caught at step 1 with the right parameters named,
and the warn/skip/raise policies act before the optimizer step."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import mlflow  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
)

from rldiag.collectors import NonFiniteGradientError, keys  # noqa: E402
from rldiag.collectors.integrations.transformers import (  # noqa: E402
    LOGGED_LOSS,
    REAL_LOSS,
    RldiagCallback,
    _skip_next_step,
)
from rldiag.collectors.session import RunSession  # noqa: E402
from tests.helpers.tiny_hf import T, V, llama_config, lm_dataset, save_tiny_qwen2, training_args  # noqa: E402


# ---- fixtures and builders -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    """One migrated MLflow SQLite file, copied per test (migrations cost seconds each)."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlruns.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def uri(sqlite_uri: str, template_db: Path) -> str:
    shutil.copyfile(template_db, sqlite_uri.removeprefix("sqlite:///"))
    return sqlite_uri


def the_run(uri: str):
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, run


def history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def read_alerts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- the core helper the callback stands on --------------------------------------------------------
def test_accumulated_check_judges_the_accumulated_gradient_before_clipping():
    from rldiag.collectors.gradcheck import AccumulatedGradCheck

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    check = AccumulatedGradCheck(net.named_parameters())
    assert check.collect() == (None, [])  # no backward yet: nothing to judge
    x = torch.ones(2, 3)
    net(x).sum().backward()  # micro-batch 1: finite
    h = net[0](x)
    net[1](h.detach() * float("nan")).sum().backward()  # micro-batch 2: NaN reaches 1.weight only
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)  # now every gradient is NaN
    report, (loss,) = check.collect(torch.tensor(2.5))
    assert not report.finite and report.nonfinite_params == ["1.weight"] and math.isnan(report.norm)
    assert loss == 2.5
    net.zero_grad()
    # |g| = 1e30: the float32 norm overflows, every element is finite -> not reported, the norm in float64
    net[0].weight.sum().mul(1e30).backward()
    report, _ = check.collect()
    assert report.finite and report.norm == pytest.approx(3e30)  # 9 elements of 1e30
    check.remove()
    net(x).sum().backward()
    assert check.collect() == (None, [])  # hooks are off


# ---- a plain Trainer run -----------------------------------------------------------------------------
def test_trainer_metrics_and_params_land_in_mlflow(uri, tmp_path):
    torch.manual_seed(0)
    args = training_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                         hub_token="hf_secret_do_not_log")
    trainer = Trainer(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=lm_dataset(16))
    cb = RldiagCallback(experiment="hf", run_name="trainer", tracking_uri=uri).attach(trainer)
    trainer.train()
    assert cb.session is None  # opened at train begin, closed at train end

    client, run = the_run(uri)
    assert run.info.status == "FINISHED"
    rid = run.info.run_id
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == [1, 2, 3, 4]
    # original keys and their canonical aliases, at state.global_step
    assert history(client, rid, "grad_norm") == pytest.approx({s: h["grad_norm"] for s, h in logged.items()})
    # grad/norm: the callback's own pre-clip norm, every step; Trainer's value to float32 precision
    assert history(client, rid, keys.GRAD_NORM) == pytest.approx(history(client, rid, "grad_norm"), rel=1e-5)
    assert set(history(client, rid, "learning_rate")) == {1, 2, 3, 4}
    # the real per-step loss: finite here, so it equals what the trainer logged (logging_steps=1)
    assert history(client, rid, keys.LOSS) == pytest.approx({s: h["loss"] for s, h in logged.items()}, rel=1e-5)
    assert history(client, rid, LOGGED_LOSS) == pytest.approx({s: h["loss"] for s, h in logged.items()})
    assert history(client, rid, keys.GRAD_FINITE) == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    assert history(client, rid, keys.GRAD_NONFINITE_PARAMS) == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    assert "train_runtime" in run.data.metrics

    p = run.data.params
    assert p["trainer.per_device_train_batch_size"] == "2"
    assert p["trainer.gradient_accumulation_steps"] == "2"
    assert p["trainer.effective_batch_size"] == "4"
    assert float(p["trainer.learning_rate"]) == 1e-3 and float(p["trainer.max_grad_norm"]) == 1.0
    assert p["trainer.seed"] == "0" and p["trainer.optim"] == args.optim.value
    assert run.data.tags[keys.TAG_SEED] == "0"
    assert not any("hub" in k for k in p) and "hf_secret_do_not_log" not in json.dumps(p)


def test_given_session_without_attach(uri, tmp_path):
    # passed in callbacks=[...] and never attached: the gradient check runs, `loss` is the trainer's log
    torch.manual_seed(0)
    session = RunSession("hf", run_name="mine", tracking_uri=uri, params={"lr": 1e-3})
    trainer = Trainer(model=LlamaForCausalLM(llama_config()), train_dataset=lm_dataset(4),
                      args=training_args(tmp_path, per_device_train_batch_size=2, max_steps=2),
                      callbacks=[RldiagCallback(session)])
    trainer.train()
    assert not session._closed  # the caller's session stays open
    session.close()
    client, run = the_run(uri)
    rid = run.info.run_id
    assert run.data.params["lr"] == "0.001" and run.data.params["trainer.max_steps"] == "2"
    assert history(client, rid, keys.GRAD_FINITE) == {1: 1.0, 2: 1.0}
    logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    assert history(client, rid, keys.LOSS) == pytest.approx(logged)
    assert history(client, rid, LOGGED_LOSS) == {}


def test_options_are_checked_before_training():
    with pytest.raises(TypeError, match="unknown option"):
        RldiagCallback(polcy="skip")
    with pytest.raises(ValueError, match="policy='sikp'"):
        RldiagCallback(policy="sikp")


class FailsAtStep2(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.state.global_step == 1:
            raise RuntimeError("data loader broke")
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_an_error_in_training_ends_the_run_as_failed(uri, tmp_path):
    torch.manual_seed(0)
    trainer = FailsAtStep2(model=LlamaForCausalLM(llama_config()), train_dataset=lm_dataset(8),
                           args=training_args(tmp_path, per_device_train_batch_size=2, max_steps=3))
    cb = RldiagCallback(experiment="hf", tracking_uri=uri).attach(trainer)
    with pytest.raises(RuntimeError, match="data loader broke"):
        trainer.train()
    assert cb.session is None and cb._check is None  # run closed, hooks off
    client, run = the_run(uri)
    assert run.info.status == "FAILED"
    assert history(client, run.info.run_id, keys.GRAD_FINITE) == {1: 1.0}


# ---- the seed failure: -inf padding of ragged per-sample terms -------------------------------------
class DistillStudent(LlamaForCausalLM):
    """A tiny LM plus a second head distilled on the backbone's detached features (as Medusa-1 heads
    are): the LM loss trains the backbone and `lm_head`, the distillation loss only `distill_head`, so
    the parameters that truly receive NaN are known: `distill_head.weight`, nothing else."""

    def __init__(self, config):
        super().__init__(config)
        self.distill_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


def ragged_dataset(lengths: list[int], group: int) -> list[dict]:
    """Samples with per-sample teacher logprobs of `lengths[i]` tokens. As in TRL's distillation server
    path, each generation batch of `group` (= batch x accumulation) consecutive samples is made
    rectangular by padding with the `-inf` sentinel to its longest member, so with group 1 nothing
    is padded."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, V, (len(lengths), T), generator=g)
    out = []
    for start in range(0, len(lengths), group):
        width = max(lengths[start:start + group])
        for i in range(start, min(start + group, len(lengths))):
            teacher = torch.full((width,), float("-inf"))
            teacher[: lengths[i]] = -torch.rand(lengths[i], generator=g) - 1.0
            mask = (torch.arange(width) < lengths[i]).float()
            out.append({"input_ids": ids[i], "teacher_lp": teacher, "completion_mask": mask})
    return out


class DistillTrainer(Trainer):
    """LM loss plus a reverse-KL-style distillation term over ragged teacher logprobs.

    `exp(s) * (s - teacher)` is +inf where the teacher holds the -inf sentinel; `nan_to_num` and the
    completion mask keep the forward finite, but backward multiplies the mask's zero by that inf:
    NaN into `distill_head` whenever a micro-batch was padded (the unmasked path of the seed PR).
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids, teacher, mask = inputs["input_ids"], inputs["teacher_lp"], inputs["completion_mask"]
        h = model.model(input_ids=ids).last_hidden_state
        logits = model.lm_head(h)
        lm_loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        width = teacher.shape[1]
        head_lp = model.distill_head(h.detach()).log_softmax(-1)[:, :width]
        s = head_lp.gather(-1, ids[:, 1 : width + 1, None]).squeeze(-1)
        per_token = torch.nan_to_num(s.exp() * (s - teacher))
        kd = (per_token * mask).sum() / mask.sum()
        return lm_loss + kd


LENGTHS = [3, 7, 5, 5, 4, 6, 6, 2]  # the first pair differs: padded as soon as a group holds two samples


def distill_trainer(tmp_path, batch: int, accum: int, max_steps: int = 2, lengths=LENGTHS) -> DistillTrainer:
    torch.manual_seed(0)
    args = training_args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                         max_steps=max_steps)
    return DistillTrainer(model=DistillStudent(llama_config()), args=args,
                          train_dataset=ragged_dataset(lengths, batch * accum))


@pytest.mark.parametrize("batch,accum", [(2, 1), (1, 2)])
def test_ragged_inf_padding_alerts_at_step_1_naming_the_head(uri, tmp_path, batch, accum):
    trainer = distill_trainer(tmp_path, batch, accum)
    alerts = tmp_path / "alerts.jsonl"
    RldiagCallback(experiment="distill", tracking_uri=uri, alerts_jsonl=alerts).attach(trainer)
    trainer.train()

    first = read_alerts(alerts)[0]
    assert first["step"] == 1
    # Only the distillation head received NaN; after Trainer's clipping every gradient was NaN.
    assert first["params"] == ["distill_head.weight"]
    client, run = the_run(uri)
    rid = run.info.run_id
    assert history(client, rid, keys.GRAD_FINITE)[1] == 0.0
    assert history(client, rid, keys.GRAD_NONFINITE_PARAMS)[1] == 1.0
    assert math.isnan(history(client, rid, "grad_norm")[1])  # Trainer's own pre-clip norm
    assert math.isnan(history(client, rid, keys.GRAD_NORM)[1]) and first["grad_norm"] == "nan"
    assert run.data.tags[keys.TAG_ALERT_FIRST_STEP] == "1"
    # The forward loss stayed finite (nan_to_num): the recorded loss is the real one.
    step1 = next(h for h in trainer.state.log_history if h.get("step") == 1)
    assert math.isfinite(history(client, rid, keys.LOSS)[1])
    assert history(client, rid, keys.LOSS)[1] == pytest.approx(step1["loss"], rel=1e-5)
    # policy "warn": the NaN update went through and ruined every weight
    assert all(torch.isnan(p).all() for p in trainer.model.parameters())


def test_ragged_inf_padding_is_silent_with_batch_1_accum_1(uri, tmp_path):
    trainer = distill_trainer(tmp_path, 1, 1, max_steps=4)
    alerts = tmp_path / "alerts.jsonl"
    RldiagCallback(experiment="distill", tracking_uri=uri, alerts_jsonl=alerts).attach(trainer)
    trainer.train()
    assert read_alerts(alerts) == []
    client, run = the_run(uri)
    assert history(client, run.info.run_id, keys.GRAD_FINITE) == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    assert keys.TAG_ALERT_COUNT not in run.data.tags
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


class Snapshots(TrainerCallback):
    def __init__(self):
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kw):
        self.after[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}


def test_skip_policy_leaves_weights_unchanged_on_the_nonfinite_step(uri, tmp_path):
    # step 1: samples 0, 1 (lengths 3, 7: padded, NaN); step 2: samples 2, 3 (5, 5: finite)
    trainer = distill_trainer(tmp_path, 2, 1, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    snaps = Snapshots()
    trainer.add_callback(snaps)
    RldiagCallback(experiment="distill", tracking_uri=uri, policy="skip").attach(trainer)
    trainer.train()

    for name, value in before.items():
        torch.testing.assert_close(snaps.after[1][name], value, rtol=0, atol=0, msg=name)
    after_2 = snaps.after[2]
    assert all(torch.isfinite(v).all() for v in after_2.values())
    assert not torch.equal(after_2["lm_head.weight"], before["lm_head.weight"])  # step 2 did update
    client, run = the_run(uri)
    assert history(client, run.info.run_id, keys.GRAD_FINITE) == {1: 0.0, 2: 1.0}


def test_skip_next_step_is_one_shot_and_restores_what_was_there():
    class Opt:
        calls = 0

        def step(self):
            self.calls += 1

    opt = Opt()
    _skip_next_step(opt)
    opt.step()
    opt.step()
    assert opt.calls == 1 and "step" not in vars(opt)
    wrapper = opt.step  # an instance attribute, as torch's LR scheduler installs
    opt.step = wrapper
    restore = _skip_next_step(opt)
    restore()
    assert vars(opt)["step"] is wrapper
    opt.step()
    assert opt.calls == 2


def test_raise_policy_stops_training_and_fails_the_run(uri, tmp_path):
    trainer = distill_trainer(tmp_path, 2, 1)
    cb = RldiagCallback(experiment="distill", tracking_uri=uri, policy="raise").attach(trainer)
    before = trainer.model.distill_head.weight.detach().clone()
    with pytest.raises(NonFiniteGradientError) as e:
        trainer.train()
    assert e.value.alert.step == 1 and e.value.alert.params == ["distill_head.weight"]
    assert torch.equal(trainer.model.distill_head.weight, before)  # raised before the optimizer step
    assert cb.session is None
    _, run = the_run(uri)
    assert run.info.status == "FAILED"


# ---- the real loss behind logging_nan_inf_filter ---------------------------------------------------
class NanLossAtStep2(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * float("nan") if self.state.global_step == 1 else loss


def test_real_loss_is_recorded_where_the_nan_filter_hides_it(uri, tmp_path):
    torch.manual_seed(0)
    trainer = NanLossAtStep2(model=LlamaForCausalLM(llama_config()), train_dataset=lm_dataset(8),
                             args=training_args(tmp_path, per_device_train_batch_size=2, max_steps=2))
    RldiagCallback(experiment="hf", tracking_uri=uri).attach(trainer)
    trainer.train()
    logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    assert math.isfinite(logged[2])  # what the trainer shows: the filter replaced the NaN
    client, run = the_run(uri)
    rid = run.info.run_id
    assert math.isnan(history(client, rid, keys.LOSS)[2])
    assert history(client, rid, LOGGED_LOSS)[2] == pytest.approx(logged[2])
    assert history(client, rid, keys.GRAD_FINITE) == {1: 1.0, 2: 0.0}


class NanTermAtStep2(Trainer):
    """A NaN term with no gradient (detached) added to the loss at step 2: the loss is NaN, the gradients
    are the finite ones of the plain loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss + loss.detach() * float("nan") if self.state.global_step == 1 else loss


def test_a_nan_loss_beside_finite_gradients_is_its_own_event_not_a_nan_alert(uri, tmp_path):
    torch.manual_seed(0)
    events = tmp_path / "events.jsonl"
    trainer = NanTermAtStep2(model=LlamaForCausalLM(llama_config()), train_dataset=lm_dataset(8),
                             args=training_args(tmp_path, per_device_train_batch_size=2, max_steps=3))
    RldiagCallback(experiment="hf", tracking_uri=uri, policy="raise", alerts_jsonl=events).attach(trainer)
    trainer.train()  # policy "raise" would stop at a NaN gradient: there is none
    client, run = the_run(uri)
    rid = run.info.run_id
    assert math.isnan(history(client, rid, keys.LOSS)[2])
    assert history(client, rid, keys.GRAD_FINITE) == {1: 1.0, 2: 1.0, 3: 1.0}
    assert keys.TAG_ALERT_COUNT not in run.data.tags
    got = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["kind"], e["step"], e["loss"]) for e in got] == [("nonfinite_loss", 2, "nan")]


# ---- TRL GRPOTrainer ---------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")
def test_grpo_metrics_under_trl_names_and_canonical_keys(uri, tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer


    model_dir = tmp_path / "tiny-qwen2"  # beta > 0 loads the reference model from a path
    tok = save_tiny_qwen2(model_dir, vocab=V)

    def reward_len(completions, **kw):
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=2, logging_steps=1, report_to="none",
                      use_vllm=False, beta=0.1, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    prompts = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(8)]})
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=args, train_dataset=prompts,
                          processing_class=tok)
    RldiagCallback(experiment="grpo", tracking_uri=uri).attach(trainer)
    trainer.train()

    client, run = the_run(uri)
    rid = run.info.run_id
    logs = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    for trl_name, canonical in [("reward", keys.REWARD_MEAN), ("reward_std", keys.REWARD_STD),
                                ("kl", keys.KL_REF), ("entropy", keys.ENTROPY),
                                ("clip_ratio/region_mean", keys.CLIP_ACTIVE_RATE), ("grad_norm", keys.GRAD_NORM)]:
        expected = {s: h[trl_name] for s, h in logs.items()}
        assert history(client, rid, trl_name) == pytest.approx(expected), trl_name
        assert history(client, rid, canonical) == pytest.approx(expected, rel=1e-5), canonical
    assert set(history(client, rid, "completions/mean_length")) == {1, 2}
    assert history(client, rid, keys.GRAD_FINITE) == {1: 1.0, 2: 1.0}
    assert set(history(client, rid, keys.LOSS)) == {1, 2}
    p = run.data.params
    assert p["trainer.args_class"] == "GRPOConfig"
    # the versions the run trained with (.venv: TRL 1.16; .venv-trl11: TRL 1.1.0, the seed bug's release)
    import transformers
    import trl

    assert p["trainer.version.trl"] == trl.__version__
    assert p["trainer.version.transformers"] == transformers.__version__
    assert p["trainer.beta"] == "0.1" and p["trainer.num_generations"] == "4"
    assert p["trainer.loss_type"] == args.loss_type and float(p["trainer.epsilon"]) == args.epsilon


class NanThroughLogits(Trainer):
    """Finite loss; NaN backward into logits[1, 3] of the second micro-batch of step 1."""

    micro = 0

    def compute_loss(self, model, inputs, return_outputs=False, **kw):
        out = model(**inputs)
        loss = out.loss
        if self.state.global_step == 0:
            if self.micro == 1:
                x = out.logits[1, 3]
                loss = loss + 0.0 * ((x - x.detach()) ** 2).sum().sqrt()
            self.micro += 1
        return (loss, out) if return_outputs else loss


def test_alert_names_the_sample_and_token_whose_logits_went_non_finite(uri, tmp_path):
    torch.manual_seed(0)
    args = training_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2)
    trainer = NanThroughLogits(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=lm_dataset(16))
    alerts = tmp_path / "alerts.jsonl"
    RldiagCallback(experiment="hf", tracking_uri=uri, alerts_jsonl=alerts, policy="skip").attach(trainer)
    trainer.train()
    (event,) = read_alerts(alerts)  # step 1 only: step 2 is finite, and the probe was reset between
    assert event["step"] == 1
    assert event["positions"] == [{"micro_batch": 1, "sample": 1, "position": 3}]
    assert event["nonfinite_positions"] == 1
    assert "sample 1 token 3" in event["text"]


def test_stock_script_with_report_to_mlflow_makes_one_run(uri, tmp_path, monkeypatch):
    """transformers' own MLflowCallback (report_to="mlflow") starts the run; rldiag logs into it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "stock")
    torch.manual_seed(0)
    args = training_args(tmp_path, per_device_train_batch_size=2, max_steps=3, report_to="mlflow", run_name="stock-run")
    trainer = Trainer(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=lm_dataset(8))
    RldiagCallback(tracking_uri=uri).attach(trainer)
    trainer.train()
    client, run = the_run(uri)  # exactly one run in the store
    assert run.info.run_name == "stock-run" and client.get_experiment(run.info.experiment_id).name == "stock"
    rid = run.info.run_id
    assert set(history(client, rid, keys.GRAD_NORM)) == {1, 2, 3}  # rldiag's check, in the trainer's run
    assert history(client, rid, keys.GRAD_FINITE) == {1: 1.0, 2: 1.0, 3: 1.0}
    # `loss` is MLflowCallback's (once a step, not twice); rldiag's unfiltered loss sits beside it
    assert [m.step for m in client.get_metric_history(rid, keys.LOSS)] == [1, 2, 3]
    assert history(client, rid, REAL_LOSS) == pytest.approx(history(client, rid, keys.LOSS), rel=1e-5)
    assert run.data.params["trainer.per_device_train_batch_size"] == "2"


def test_a_nan_loss_the_trainers_filter_hides_is_seen_by_the_watcher(uri, tmp_path, monkeypatch):
    """In the trainer's own run (report_to="mlflow") `loss` is the filtered one; the watcher reads rldiag's
    unfiltered loss beside it: a nonfinite_loss alert at the step, not a NaN-gradient one."""
    from rldiag.app.watch.loop import watch_once

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "stock")
    torch.manual_seed(0)
    args = training_args(tmp_path, per_device_train_batch_size=2, max_steps=3, report_to="mlflow", run_name="stock-nan")
    trainer = NanTermAtStep2(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=lm_dataset(8))
    RldiagCallback(tracking_uri=uri).attach(trainer)
    trainer.train()
    client, run = the_run(uri)
    rid = run.info.run_id
    assert math.isfinite(history(client, rid, keys.LOSS)[2]) and math.isnan(history(client, rid, REAL_LOSS)[2])
    _, events = watch_once(uri)
    assert [(e["kind"], e["step"], e["grads_checked"]) for e in events] == [("nonfinite_loss", 2, True)]


def test_callback_in_callbacks_list_honours_run_name_and_experiment_env(uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    args = training_args(tmp_path, per_device_train_batch_size=2, max_steps=2, run_name="named-run")
    trainer = Trainer(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=lm_dataset(4),
                      callbacks=[RldiagCallback(tracking_uri=uri)])
    trainer.train()
    client, run = the_run(uri)
    assert run.info.run_name == "named-run" and client.get_experiment(run.info.experiment_id).name == "from-env"
    assert set(history(client, run.info.run_id, keys.GRAD_NORM)) == {1, 2}


def test_stock_trl_script_with_report_to_mlflow_makes_one_run(uri, tmp_path, monkeypatch):
    """A stock TRL GRPO script (report_to="mlflow", TRL's usual integration) with the two added lines."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer


    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # MLflowCallback takes mlflow's process-wide active experiment otherwise: an earlier test's id
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "stock-trl")
    tok = save_tiny_qwen2(tmp_path / "tiny-qwen2", vocab=V)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=2, logging_steps=1, report_to="mlflow", run_name="grpo-v1",
                      use_vllm=False, beta=0.0, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    prompts = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(8)]})
    def reward_len(completions, **kw):  # a named function: MLflow refuses "<lambda>" in TRL's profiling keys
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(model=str(tmp_path / "tiny-qwen2"), reward_funcs=reward_len, args=args,
                          train_dataset=prompts, processing_class=tok)
    RldiagCallback().attach(trainer)
    trainer.train()
    client, run = the_run(uri)  # one run: TRL's, with rldiag's checks in it
    assert run.info.run_name == "grpo-v1"
    assert history(client, run.info.run_id, keys.GRAD_FINITE) == {1: 1.0, 2: 1.0}
    assert set(history(client, run.info.run_id, "reward")) == {1, 2}  # logged by MLflowCallback
