"""A step where every completion token is masked (a truncation or masking bug) logs an empty batch's
policy metrics: ratio 1, KL 0, clip rate 0, the values of a perfect step. The report, its Markdown and
the Compare page say "no valid tokens at step N" before the bands' verdict, and never give an all-clear
on such a run. Runs written from the collectors' own `policy_metrics` on real tensors into a real
SQLite store; the page through Streamlit's AppTest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rldiag.app.report.build import build_report, departure_lines
from rldiag.collectors import keys
from rldiag.collectors.metrics import policy_metrics
from tests.helpers.dashboard import app, unescape_md
from tests.helpers.runs import run_logging_script, write_run

STEPS, EMPTY = 60, (23, 41)
SHOWN = (keys.RATIO_MEAN, keys.KL_NEW_OLD, keys.CLIP_RATE)


def _run(uri: str, name: str, role: str, seed: int, empty: tuple[int, ...] = ()) -> str:
    """A GRPO-like run: 8 completions of 16 tokens, lengths 4-16, logprobs drifting by 0.05 a token
    between rollout and update; at the steps in `empty` the completion mask is all False."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(STEPS):
        lp_old = -torch.rand(8, 16, generator=g) * 3
        lp_new = lp_old + 0.05 * torch.randn(8, 16, generator=g)
        lengths = torch.randint(4, 17, (8,), generator=g)
        mask = torch.arange(16)[None, :] < lengths[:, None]
        if s in empty:
            mask = torch.zeros_like(mask)
        out = policy_metrics(lp_new, lp_old, mask)
        steps.append((s, {k: float(v) for k, v in out.items()}))
    return write_run(uri, experiment="masking", name=name, steps=steps,
                     tags={keys.TAG_GROUP: "g", keys.TAG_ROLE: role, keys.TAG_SEED: str(seed)})


def test_the_collectors_log_an_empty_batch_as_a_perfect_step():
    # what the read side must not be fooled by: the placeholders themselves
    out = policy_metrics(torch.zeros(2, 3), -torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert float(out[keys.RATIO_MEAN]) == 1.0 and float(out[keys.KL_NEW_OLD]) == 0.0
    assert float(out[keys.CLIP_RATE]) == 0.0 and float(out[keys.BATCH_TOKENS]) == 0.0


def test_steps_with_no_valid_tokens_lead_the_report_and_the_page(store_uri, monkeypatch):
    refs = [_run(store_uri, f"ref{i}", "reference", i) for i in range(3)]
    bad = _run(store_uri, "truncated", "candidate", 10, EMPTY)
    good = _run(store_uri, "seed", "candidate", 11)

    report = build_report(store_uri, group="g", keys=list(SHOWN))
    lines = dict(zip(["truncated", "seed"], departure_lines(report)))
    said = "truncated: no valid tokens at steps 23, 41 (2 steps with every completion token masked"
    assert lines["truncated"].startswith(said), lines
    assert "no valid tokens" not in lines["seed"], lines
    assert said.split(": ", 1)[1] in report.markdown
    summary = {s.run_id: s for s in report.content.summaries}
    assert summary[bad].empty_steps == EMPTY and not summary[bad].clean
    assert summary[good].empty_steps == ()

    at = app(store_uri, monkeypatch, "compare")
    at.sidebar.multiselect(key="sidebar.reference").set_value(refs)
    at.sidebar.multiselect(key="sidebar.candidates").set_value([bad])
    at.multiselect(key="compare.metrics").set_value(list(SHOWN)).run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.success  # no "No candidate leaves the band" banner
    [glance] = [unescape_md(m.value).replace("**", "") for m in at.markdown if "below the charts" in m.value]
    assert "truncated: no valid tokens at steps 23, 41" in glance, glance
    [line] = [unescape_md(m.value).replace("**", "") for m in at.markdown if m.value.startswith("- **")]
    assert line.startswith("- truncated: no valid tokens at steps 23, 41"), line


def test_a_reference_with_no_valid_tokens_is_said_where_the_band_is(store_uri, monkeypatch):
    # the reference's placeholders enter the band: the report and the page say so, whatever the verdict
    refs = [_run(store_uri, "ref0", "reference", 0, (30,)),
            *(_run(store_uri, f"ref{i}", "reference", i) for i in (1, 2))]
    cand = _run(store_uri, "seed", "candidate", 11)

    report = build_report(store_uri, group="g", keys=list(SHOWN))
    said = "No valid tokens in reference ref0 at step 30: every completion token masked"
    assert said in report.content.reference_note, report.content.reference_note
    assert said in unescape_md(report.markdown)
    assert "ref1" not in report.content.reference_note

    at = app(store_uri, monkeypatch, "compare")
    at.sidebar.multiselect(key="sidebar.reference").set_value(refs)
    at.sidebar.multiselect(key="sidebar.candidates").set_value([cand])
    at.multiselect(key="compare.metrics").set_value(list(SHOWN)).run()
    assert not at.exception, [e.value for e in at.exception]
    assert [w.value for w in at.warning if w.value.startswith(said)], [w.value for w in at.warning]


TRL_SCRIPT = """
import json, sys
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from tests.helpers.tiny_hf import save_tiny_qwen2
tok = save_tiny_qwen2("tiny")
prompts = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(24)]})
def reward_len(completions, **kw):
    return [float(len(c)) for c in completions]
logs = {}
for name, mask in (("unmasked", False), ("masked", True)):
    # 2 new tokens from a random 64-word model: nearly every completion is cut at the limit
    args = GRPOConfig(output_dir="out", per_device_train_batch_size=4, num_generations=4, max_completion_length=2,
                      max_steps=6, logging_steps=1, report_to="mlflow", run_name=name, use_vllm=False, beta=0.1,
                      mask_truncated_completions=mask, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args, train_dataset=prompts, processing_class=tok)
    trainer.train()
    logs[name] = [h for h in trainer.state.log_history if "completions/clipped_ratio" in h]
print("LOGS=" + json.dumps(logs))
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_trl_masking_every_truncated_completion_is_told_as_no_valid_tokens(store_uri, tmp_path, monkeypatch):
    # stock TRL GRPOTrainer with mask_truncated_completions=True: at a step where every completion hit
    # max_completion_length, TRL masks them all and logs loss, kl, entropy and clip ratios of 0
    pytest.importorskip("trl")
    logs = run_logging_script(TRL_SCRIPT, store_uri, "trl-trunc", tmp_path)
    cut = [h["step"] for h in logs["masked"] if h["completions/clipped_ratio"] == 1.0]
    assert cut, logs  # TRL's own log: the steps it masked whole
    assert all(h["clip_ratio/region_mean"] == 0.0 and h["loss"] == 0.0 for h in logs["masked"] if h["step"] in cut)

    from mlflow import MlflowClient

    runs = {r.info.run_name: r.info.run_id for r in MlflowClient(store_uri).search_runs(
        [MlflowClient(store_uri).get_experiment_by_name("trl-trunc").experiment_id])}
    report = build_report(store_uri, reference=runs["unmasked"], candidates=runs["masked"])
    [line] = departure_lines(report)[:1]
    steps = ", ".join(map(str, cut)) if len(cut) < 3 else None
    assert line.startswith(f"masked: no valid tokens at step{'s' if len(cut) > 1 else ''} "), line
    assert "completions/clipped_ratio 1) and mask_truncated_completions=True" in line, line
    assert "raise max_completion_length" in line
    [s] = report.content.summaries
    assert s.empty_steps == tuple(cut) and not s.clean
    if steps:
        assert steps in line
    at = app(store_uri, monkeypatch, "compare")
    at.sidebar.multiselect(key="sidebar.reference").set_value([runs["unmasked"]])
    at.sidebar.multiselect(key="sidebar.candidates").set_value([runs["masked"]]).run()
    assert not at.exception, [e.value for e in at.exception]
    [page_line] = [unescape_md(m.value).replace("**", "") for m in at.markdown if m.value.startswith("- **")]
    assert page_line.startswith("- " + line.split(" (")[0]), (page_line, line)
    assert "raise max_completion_length" in page_line and not at.success
    # the same runs the other way round: the unmasked run's steps are measurements, the masked reference's are not
    back = build_report(store_uri, reference=runs["masked"], candidates=runs["unmasked"])
    assert "no valid tokens" not in departure_lines(back)[0]
    assert back.content.reference_note.startswith("One reference run")
    assert "No valid tokens in reference masked at step" in back.content.reference_note

    state = tmp_path / "watch-state.json"
    events = tmp_path / "events.jsonl"
    watch = [str(Path(sys.executable).parent / "rldiag"), "watch", "--once", "--all", "--tracking-uri", store_uri,
             "--state", str(state), "--jsonl", str(events)]
    res = subprocess.run(watch, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    told = [json.loads(x) for x in events.read_text().splitlines()]
    told = [e for e in told if e["kind"] == "no_valid_tokens"]
    assert [(e["run_name"], e["steps"]) for e in told] == [("masked", cut)], told
    assert "raise max_completion_length" in told[0]["text"]
