"""The worst token of each step, written by the collectors and read back: the line the dashboard and the
report show, on a hand-built batch with a known worst token and on a real vLLM engine's step."""

from __future__ import annotations

import pytest
import torch

from rldiag.app.analysis.worst_tokens import WorstToken, worst_of_run, worst_token_lines, worst_tokens
from rldiag.collectors import keys
from rldiag.collectors.metrics import policy_metrics, to_host
from tests.helpers.runs import write_run

# The hand-built batch of tests/collectors/test_metrics.py: the worst token is sample 2, position 1,
# token id 17, |-2.10 - -0.31| = 1.79 (a masked position with |d| = 9 must be ignored).
TRAINER = torch.tensor([[-1.0, -0.5, -9.5], [-0.3, -1.2, -3.0], [-0.7, -2.10, -0.2]])
ENGINE = torch.tensor([[-1.1, -0.5, -0.5], [-0.7, -1.2, -3.05], [-0.7, -0.31, -0.2]])
MASK = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
IDS = torch.tensor([[5, 6, 0], [7, 8, 9], [10, 17, 11]])
LINE = "worst token at step 1: sample 2, position 1, token id 17, trainer -2.10 vs engine -0.31"


def _step(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    return to_host(policy_metrics(trainer, engine, mask, lp_trainer_at_rollout=trainer, token_ids=ids))


def _write(uri: str, name: str, role: str, params: dict | None = None) -> str:
    """Step 0: parity but one small gap (0.05 at sample 0, position 0); step 1: the hand-built batch;
    step 2: nothing valid (logged as sample -1, so not a worst token)."""
    same = torch.where(MASK, TRAINER, ENGINE)
    same[0, 0] = TRAINER[0, 0] - 0.05  # engine -1.05 vs trainer -1.0
    steps = [(0, _step(TRAINER, same, MASK, IDS)), (1, _step(TRAINER, ENGINE, MASK, IDS)),
             (2, _step(TRAINER, ENGINE, torch.zeros_like(MASK), IDS))]
    return write_run(uri, name=name, tags={keys.TAG_GROUP: "g", keys.TAG_ROLE: role}, steps=steps, params=params)


def test_the_stored_worst_token_reads_back_as_the_line_users_see(store_uri: str):
    from rldiag.app import load_histories, open_store

    rid = _write(store_uri, "cand", "candidate")
    h = load_histories(open_store(store_uri), [rid], list(keys.WORST_TOKEN_KEYS))
    tokens = worst_tokens(h, rid)
    assert [w.step for w in tokens] == [0, 1]  # step 2 had no valid token
    assert tokens[0] == WorstToken(0, 0, 0, 5, pytest.approx(-1.0), pytest.approx(-1.05))
    worst = worst_of_run(tokens)
    assert worst.step == 1 and worst.line() == LINE
    assert worst.line(lambda i: f"w{i - 3}") == LINE.replace("token id 17", "token 'w14' (id 17)")
    assert worst_token_lines(h, {rid: "cand"}) == [f"cand: {LINE}"]


def test_report_shows_each_runs_worst_token(store_uri: str, tmp_path):
    from rldiag.app.report.build import build_report

    _write(store_uri, "ref", "reference")
    _write(store_uri, "cand", "candidate")
    report = build_report(store_uri, group="g")
    assert "### Worst tokens (trainer vs engine)" in report.markdown
    assert f"- cand: {LINE}" in report.markdown and f"- ref: {LINE}" in report.markdown
    assert '<section id="worst">' in report.html and LINE in report.html


def test_compare_page_shows_the_worst_token_with_its_text_where_the_tokenizer_is_at_hand(store_uri: str, monkeypatch,
                                                                                         tmp_path):
    from rldiag.experiments.tiny_hf_model import tiny_word_tokenizer
    from tests.helpers.dashboard import app, unescape_md

    tiny_word_tokenizer(64).save_pretrained(tmp_path / "model")  # id 17 is 'w14' (ids 0-2 are special)
    _write(store_uri, "ref", "reference")  # no engine.model param: the id only
    _write(store_uri, "cand", "candidate", params={"engine.model": str(tmp_path / "model")})
    at = app(store_uri, monkeypatch, "compare")
    assert any(s.value == "Worst tokens: trainer vs engine" for s in at.subheader)
    [text] = [unescape_md(m.value) for m in at.markdown if "worst token at step" in m.value]
    assert "**ref**: " + LINE in text
    assert "**cand**: " + LINE.replace("token id 17", "token 'w14' (id 17)") in text


def test_runs_without_worst_tokens_get_no_line(store_uri: str):
    from rldiag.app import load_histories, open_store

    rid = write_run(store_uri, name="plain", steps=[(0, {keys.RATIO_MEAN: 1.0})])
    h = load_histories(open_store(store_uri), [rid], list(keys.WORST_TOKEN_KEYS))
    assert worst_tokens(h, rid) == [] and worst_token_lines(h, {rid: "plain"}) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_engine_step_logs_the_token_where_they_disagree_most(sqlite_uri: str, tmp_path, monkeypatch):
    """A real vLLM engine (raw logprobs, so trainer and engine differ by ~0.3 per token) samples; the
    trainer recomputes with temperature and top-p as the engine-parity experiment does; the Monitor logs
    the step; the stored worst token is the batch's argmax of |d|, with the engine's own logprob."""
    pytest.importorskip("vllm")
    from rldiag.app import load_histories, open_store
    from rldiag.collectors import Monitor
    from rldiag.collectors.integrations.vllm import recompute_logprobs, rollout_from_outputs
    from rldiag.collectors.integrations.vllm_engine import Engine, EngineConfig, engine_kwargs, set_engine_env
    from rldiag.experiments.tiny_hf_model import VLLM_TINY_QWEN2, build_tiny_qwen2, save_tiny_qwen2

    # The engine core in its own process (~20 s to start, not 2-7 s in-process): vLLM's CPU platform scans every
    # module's globals at start (triton_utils/dispatcher.py, hasattr on each), and a werkzeug LocalProxy that an
    # earlier test in this worker imported (flask, through mlflow.server) raises there outside an app context.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    set_engine_env()
    save_tiny_qwen2(tmp_path / "m", 64, 0, initializer_range=0.1, **VLLM_TINY_QWEN2)
    model = build_tiny_qwen2(64, 0, initializer_range=0.1, **VLLM_TINY_QWEN2).float().eval()
    prompts = torch.randint(3, 64, (4, 40), generator=torch.Generator().manual_seed(0)).tolist()
    with Engine(engine_kwargs(tmp_path / "m", EngineConfig(logprobs_mode="raw_logprobs"), max_model_len=56)) as eng:
        batch = rollout_from_outputs(eng.generate(prompts, n=2, max_tokens=16, temperature=0.7, top_p=0.9,
                                                  seeds=[0, 1, 2, 3]))
    lp_graph = recompute_logprobs(model, batch, temperature=0.7, top_p=0.9)
    loss = -torch.where(batch.mask, lp_graph, torch.tensor(0.0)).sum() / batch.mask.sum()
    loss.backward()
    lp = lp_graph.detach()
    with Monitor("worst", tracking_uri=sqlite_uri) as mon:
        mon.step(0, model, loss=loss, metrics=policy_metrics(lp, batch.logprobs, batch.mask, lp_trainer_at_rollout=lp,
                                                             token_ids=batch.token_ids))
    d = torch.where(batch.mask, (lp - batch.logprobs).abs(), torch.tensor(-1.0))
    i, j = divmod(int(d.argmax()), d.shape[1])  # the host-side answer
    assert float(d[i, j]) > 0.1  # raw vs processed: a real gap, not float noise
    h = load_histories(open_store(sqlite_uri), [mon.run_id], list(keys.WORST_TOKEN_KEYS))
    [w] = worst_tokens(h, mon.run_id)
    assert (w.step, w.sample, w.position, w.token_id) == (0, i, j, int(batch.token_ids[i, j]))
    assert w.lp_engine == pytest.approx(float(batch.logprobs[i, j])) and w.lp_trainer == pytest.approx(float(lp[i, j]))
