"""The masked-vs-unmasked reproduction: the loss's mechanism on a hand-built batch, then a short real run
of all six configurations into a SQLite MLflow store, judged from what the store holds, then the CLI."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch.testing import assert_close

from rldiag.app.cli.main import main
from rldiag.collectors import keys
from rldiag.experiments import masked_vs_unmasked as mvu
from rldiag.experiments.distill_loss import (
    TeacherLogprobs,
    add_tail_bucket,
    pad_ragged,
    sparse_top1_divergence,
)
from tests.helpers.experiments import run_mvu

RLDIAG = str(Path(sys.executable).parent / "rldiag")
STEPS = 3
NANS = {"unmasked-b1xa2", "unmasked-b2xa1"}  # batch x accumulation > 1 without the fix
FINITE = {"masked-b1xa1", "masked-b1xa2", "masked-b2xa1", "unmasked-b1xa1"}


# --- the loss on a hand-built ragged batch ------------------------------------------------------------


def ragged_batch():
    """Two samples, completion lengths 3 and 1: row 1 is padded at positions 1 and 2."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3], [4, 0, 0]])
    required = torch.tensor([[True, True, True], [True, False, False]])
    teacher_rows = [torch.log_softmax(torch.randn(3, 5, generator=g), -1), torch.log_softmax(torch.randn(1, 5, generator=g), -1)]
    actual = [lp.gather(-1, t[: len(lp), None]).squeeze(-1) for lp, t in zip(teacher_rows, tokens)]
    top1 = [lp.max(-1) for lp in teacher_rows]
    teacher = TeacherLogprobs(pad_ragged(actual, 3, float("-inf")), pad_ragged([v for v, _ in top1], 3, float("-inf")),
                              pad_ragged([i for _, i in top1], 3, 0))
    return logits, tokens, required, teacher


def test_tail_bucket_of_the_sentinel_is_zero():
    # logsumexp([-inf]) = -inf, clamped stays -inf; tail = log(1 - exp(-inf)) = log(1) = 0: the teacher's
    # "distribution" at padding is [-inf, 0], as the seed's `_add_tail_bucket finite? False` says.
    lp, mask = add_tail_bucket(torch.tensor([[float("-inf")], [math.log(0.25)]]), torch.ones(2, 1, dtype=torch.bool))
    assert_close(lp, torch.tensor([[float("-inf"), 0.0], [math.log(0.25), math.log(0.75)]]))
    assert mask.all()


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_padding_sentinel_gives_finite_loss_and_nan_gradient_only_at_padding(beta):
    logits, tokens, required, teacher = ragged_batch()
    assert torch.isinf(teacher.actual[~required]).all() and torch.isfinite(teacher.actual[required]).all()
    out = {}
    for masked in (False, True):
        logits.grad = None
        div = sparse_top1_divergence(torch.log_softmax(logits, -1), teacher, tokens, required, beta=beta,
                                     mask_padding=masked)
        div.loss.backward()
        out[masked] = (div.loss.detach(), logits.grad.clone(), int(div.teacher_nonfinite))
    (loss_u, grad_u, bad_u), (loss_m, grad_m, bad_m) = out[False], out[True]
    assert torch.isfinite(loss_u) and torch.equal(loss_u, loss_m)  # the fix leaves the forward value alone
    assert bad_u > 0 and bad_m == 0
    assert torch.isfinite(grad_m).all() and (grad_m[~required] == 0).all()  # padding: zero gradient after the fix
    assert_close(grad_u[required], grad_m[required])  # valid positions: the same gradient either way
    if beta == 1.0:  # reverse KL: d/dp_s of p_s * (log p_s - (-inf)) at a dropped position is 0 * inf = NaN
        assert torch.isnan(grad_u[~required]).all()
    else:  # JSD: the -inf teacher slot only meets p_t = 0 terms, whose backward through nan_to_num stays finite
        assert torch.isfinite(grad_u).all()


def test_missing_teacher_logprob_at_a_valid_position_is_an_error():
    logits, tokens, required, teacher = ragged_batch()
    broken = teacher._replace(actual=teacher.actual.clone().index_put_((torch.tensor([0]), torch.tensor([1])),
                                                                      torch.tensor(float("-inf"))))
    with pytest.raises(ValueError, match="missing logprobs at 1 of 4 valid"):
        sparse_top1_divergence(torch.log_softmax(logits, -1), broken, tokens, required, beta=1.0, mask_padding=True)


# --- six real runs in a real store --------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mvu")
    uri, summaries = run_mvu(tmp, STEPS, "mvu-test")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("mvu-test")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    return client, runs, summaries, tmp


def history(client, run, key) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def test_one_run_per_variant_and_config_with_its_summary(store):
    client, runs, summaries, _ = store
    assert set(runs) == NANS | FINITE
    by_name = {s.variant: s for s in summaries}
    assert set(by_name) == set(runs)
    for name, s in by_name.items():
        assert s.run_id == runs[name].info.run_id and s.undelivered == 0
        assert s.first_nonfinite_step == (1 if name in NANS else None)
        assert math.isfinite(s.final_reward)  # -reverse KL on sampled tokens: finite in every variant
        assert s.final_reward == pytest.approx(history(client, runs[name], keys.REWARD_MEAN)[STEPS])


def test_unmasked_batches_have_nan_gradients_behind_a_finite_loss(store):
    client, runs, _, _ = store
    for name in NANS:
        run = runs[name]
        assert history(client, run, keys.GRAD_FINITE) == {s: 0.0 for s in range(1, STEPS + 1)}, name
        assert all(math.isnan(v) for v in history(client, run, keys.GRAD_NORM).values()), name
        loss = history(client, run, keys.LOSS)
        assert sorted(loss) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in loss.values()), name
        assert run.data.tags[keys.TAG_ALERT_FIRST_STEP] == "1"


def test_masked_runs_and_the_1x1_run_stay_finite(store):
    client, runs, _, _ = store
    for name in FINITE:
        run = runs[name]
        assert history(client, run, keys.GRAD_FINITE) == {s: 1.0 for s in range(1, STEPS + 1)}, name
        assert all(math.isfinite(v) and v > 0 for v in history(client, run, keys.GRAD_NORM).values()), name
        assert all(math.isfinite(v) for v in history(client, run, keys.LOSS).values()), name
        assert keys.TAG_ALERT_FIRST_STEP not in run.data.tags


def test_the_nan_comes_from_the_padding(store):
    client, runs, _, tmp = store
    for name in runs:
        nonfinite = history(client, runs[name], mvu.TEACHER_NONFINITE)
        padding = history(client, runs[name], mvu.PADDING_TOKENS)
        if name.endswith("b1xa1"):  # one sample per generation batch: nothing to pad
            assert set(padding.values()) == {0.0} and set(nonfinite.values()) == {0.0}
        else:  # lengths differ in every batch; only the unmasked runs let the sentinel reach the math
            assert all(v > 0 for v in padding.values())
            assert nonfinite == (padding if name.startswith("unmasked") else {s: 0.0 for s in padding})
    for name in NANS:  # the alerts name the token positions whose loss gradient is NaN: the padded tails
        run = runs[name]
        path = client.download_artifacts(run.info.run_id, keys.ALERTS_ARTIFACT, str(tmp / name))
        events = [json.loads(line) for line in Path(path).read_text().splitlines()]
        assert [e["step"] for e in events] == list(range(1, STEPS + 1))
        padding, valid = history(client, run, mvu.PADDING_TOKENS), history(client, run, keys.BATCH_TOKENS)
        for e in events:
            width = int(padding[e["step"]] + valid[e["step"]]) // 2  # two samples per generation batch
            assert e["nonfinite_positions"] == padding[e["step"]]
            rows: dict[tuple[int, int], list[int]] = {}
            for p in e["positions"]:
                rows.setdefault((p["micro_batch"], p["sample"]), []).append(p["position"])
            assert len(rows) == 1  # only the shorter sample
            (tail,) = rows.values()
            assert tail == list(range(width - len(tail), width))  # its right-padded tail, nothing else


def test_the_fix_changes_gradients_not_the_loss(store):
    client, runs, _, _ = store
    for cfg in ("b1xa1", "b1xa2", "b2xa1"):  # same seed, same first batch: the same step-1 loss
        assert history(client, runs[f"masked-{cfg}"], keys.LOSS)[1] == history(client, runs[f"unmasked-{cfg}"], keys.LOSS)[1]
    # 1x1 has no padding, so masked and unmasked are the same run
    assert history(client, runs["masked-b1xa1"], keys.LOSS) == history(client, runs["unmasked-b1xa1"], keys.LOSS)
    for name, run in runs.items():  # the logged parts add up to the logged loss
        loss, support, tail = (history(client, run, k) for k in (keys.LOSS, mvu.LOSS_SUPPORT, mvu.LOSS_TAIL))
        for s in loss:
            assert support[s] + tail[s] == pytest.approx(loss[s], rel=1e-5), name


def test_tags_params_and_names(store):
    _, runs, _, _ = store
    for name, run in runs.items():
        variant, config = name.split("-")
        b, a = config[1:].split("xa")
        tags, params = run.data.tags, run.data.params
        assert tags[keys.TAG_GROUP] == "masked_vs_unmasked" and tags[keys.TAG_VARIANT] == variant
        assert tags[keys.TAG_ROLE] == ("reference" if variant == "masked" else "candidate")
        assert tags[keys.TAG_SEED] == "0"
        assert (params["variant"], params["batch_size"], params["accumulation"], params["seed"]) == (variant, b, a, "0")
        assert params["steps"] == str(STEPS) and params["beta"] == "1.0" and params["add_tail"] == "True"
        assert params["policy"] == "skip" and params["model.vocab"] == "64"


# --- the command line ---------------------------------------------------------------------------------


def rldiag(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([RLDIAG, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_prints_one_summary_line_per_run(store):
    client, _, _, tmp = store
    uri = client.tracking_uri  # the fixture's store, another experiment: saves creating a second database
    out = rldiag("experiment", "masked-vs-unmasked", "--steps", "3", "--tracking-uri", uri, "--experiment", "mvu-cli",
                 cwd=tmp)
    assert out.returncode == 0, out.stderr
    summary = out.stdout.split("Logged to", 1)[0]  # the run table; the verdicts table follows
    lines = {line.split()[1]: line.split() for line in summary.splitlines() if "-b" in line and "xa" in line}
    assert set(lines) == NANS | FINITE
    for name, cols in lines.items():
        assert cols[2] == ("1" if name in NANS else "none")  # first non-finite step
    assert uri in out.stdout and "'mvu-cli'" in out.stdout
    assert "non-finite gradients in run unmasked-b1xa2" in out.stderr  # the alert, in the terminal
    # then one verdict per candidate, from the comparison the report and the dashboard make
    table = out.stdout.split("likely cause\n", 1)[1]
    for name in NANS:
        assert re.search(rf"^{name} +non-finite gradients +grad/finite 0 at step 1 +-inf padding", table, re.M), table
    assert "Fixes:\n  unmasked-b1xa2, unmasked-b2xa1: mask padding" in table or len(NANS) != 2, table
    # what the libraries print goes to a log file, named in one line
    log = next(line.split(": ", 1)[1] for line in out.stderr.splitlines() if line.startswith("library warnings"))
    assert (tmp / log).is_file() and "rldiag:" not in (tmp / log).read_text()
    exp = client.get_experiment_by_name("mvu-cli")
    assert {r.info.run_id for r in client.search_runs([exp.experiment_id])} == {c[0] for c in lines.values()}


@pytest.mark.parametrize(("option", "value", "words"), [
    ("--configs", "0x2", ["'0x2'", "--configs 1x1,1x2,2x1"]),
    ("--configs", "abc", ["'abc'", "BATCHxACCUMULATION"]),
    ("--variants", "masked,half", ["'half'", "masked, unmasked"]),
    ("--seeds", "x", ["'x'", "--seeds 0,1,2"]),
    ("--steps", "0", ["steps=0", "--steps 40"]),
])
def test_bad_options_are_one_line_errors(option, value, words, capsys):
    assert main(["experiment", "masked-vs-unmasked", option, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("rldiag experiment: error: ") and all(w in err for w in words), err


def test_bad_option_exit_status_in_a_subprocess(tmp_path):
    out = rldiag("experiment", "masked-vs-unmasked", "--configs", "2x0", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "'2x0'" in out.stderr
    assert not (tmp_path / "mlruns.db").exists()  # nothing ran
