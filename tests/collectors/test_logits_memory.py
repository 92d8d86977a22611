"""Entropy, the logits probe and the recompute in row chunks give what the unchunked formulas give.

The references below are the formulas as they were before chunking (a float32 copy of all the
logits). Most tests shrink `CHUNK_ELEMENTS` so that small tensors split into many chunks, rows larger
than a chunk included; one test runs at the real budget with rows spanning several chunks.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.testing import assert_close

from rldiag.collectors import LogitsProbe, chunks, entropy_from_logits
from rldiag.collectors.chunks import row_chunks
from rldiag.collectors.integrations.vllm import RolloutBatch, logprobs_from_logits, recompute_logprobs
from rldiag.collectors.metrics import masked_mean, token_entropy

NEG_INF = float("-inf")


def ref_entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(-1)


def ref_logprobs(logits, ids, *, temperature=1.0, top_k=None, top_p=1.0):
    x = logits.float() / temperature
    if (top_k is not None and 0 < top_k < x.shape[-1]) or top_p < 1.0:
        srt, idx = x.sort(dim=-1)
        if top_k is not None and 0 < top_k < x.shape[-1]:
            srt = srt.masked_fill(srt < srt[..., x.shape[-1] - top_k].unsqueeze(-1), NEG_INF)
        if top_p < 1.0:
            drop = srt.softmax(-1).cumsum(-1) <= 1.0 - top_p
            drop[..., -1] = False
            srt = srt.masked_fill(drop, NEG_INF)
        x = torch.empty_like(x).scatter_(-1, idx, srt)
    return torch.log_softmax(x, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@pytest.fixture
def small_chunks(monkeypatch):
    # 40 elements: 2 rows of V=16 a chunk; a V=64 row is larger than a chunk (one row each); the CPU's
    # cache-sized chunks too
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 40)
    monkeypatch.setattr(chunks, "CPU_CACHE_ELEMENTS", 40)


def _logits(b, t, v, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, t, v, generator=g) * 3).to(dtype)
    x[0, 1, : v // 2] = NEG_INF  # half the vocabulary masked at one position
    x[1, 0, 3] = NEG_INF
    return x


def test_row_chunks_cover_every_row_once_as_views(small_chunks) -> None:
    x = torch.arange(3 * 5 * 16, dtype=torch.float32).reshape(3, 5, 16)[:, 1:]  # non-contiguous
    seen = torch.zeros(x.shape[:-1], dtype=torch.int64)
    for idx, c in row_chunks(x):
        assert c.numel() <= 40 or c.dim() == 1
        assert c.data_ptr() >= x.data_ptr() and c.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        seen[idx] += 1
    assert bool((seen == 1).all())  # 3 x 4 rows, each exactly once


@pytest.mark.parametrize("v", [16, 64])
def test_entropy_equals_unchunked(small_chunks, v) -> None:
    logits = _logits(3, 7, v)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[2, 4:] = False
    logits[2, 5] = NEG_INF  # an all -inf position, masked: no distribution there
    h = token_entropy(logits)
    ref = ref_entropy(logits)
    assert_close(h, ref, equal_nan=True)
    assert torch.isnan(h[2, 5])
    assert_close(entropy_from_logits(logits, mask), masked_mean(ref, mask))
    # no mask: the all -inf position is left out (no distribution); a non-contiguous view
    assert_close(entropy_from_logits(logits[:, 1:]), ref[:, 1:].nanmean())


def test_entropy_at_the_real_budget_rows_over_several_chunks() -> None:
    # 2 x 8 rows of 150_000: 2.4 M elements > CHUNK_ELEMENTS (1 Mi): chunks of 6 rows
    # float32 sums of 150_000 terms differ by the order they are summed in (the CPU's vector width picks
    # it): both are held to the float64 entropy, the chunked one no further off than the unchunked one
    logits = _logits(2, 8, 150_000, seed=1)
    exact = torch.special.entr(torch.softmax(logits.double(), dim=-1)).sum(-1)
    chunked_err = (token_entropy(logits).double() - exact).abs().max().item()
    unchunked_err = (ref_entropy(logits).double() - exact).abs().max().item()
    assert chunked_err <= max(2 * unchunked_err, 1e-6 * exact.abs().max().item()), (chunked_err, unchunked_err)
    assert unchunked_err < 1e-4 * exact.abs().max().item()  # float32 over V terms: about 1e-5 relative


def test_probe_flags_equal_unchunked(small_chunks) -> None:
    logits = _logits(2, 5, 64).requires_grad_(True)
    probe = LogitsProbe()
    out = probe.watch(logits)
    weight = torch.ones(2, 5, 64, dtype=torch.bfloat16)
    weight[1, 3, 7] = float("nan")  # one NaN gradient element at sample 1, position 3
    weight[0, 2, 0] = float("inf")
    (out.float().nan_to_num(0.0, 0.0, 0.0) * weight.float()).sum().backward()
    g = logits.grad
    expected = ~torch.isfinite(g.float().sum(-1))  # the old hook's formula
    assert_close(probe._flags[0], expected)
    assert [(p.sample, p.position) for p in probe.positions()] == [(0, 2), (1, 3)]


def test_probe_four_dims(small_chunks) -> None:
    from rldiag.collectors.gradcheck import _nonfinite_positions

    g = torch.randn(2, 3, 4, 16).to(torch.bfloat16)
    g[1, 2, 3, 5] = NEG_INF
    assert_close(_nonfinite_positions(g), ~torch.isfinite(g.float().sum(dim=(2, 3))))


CASES = [{}, {"temperature": 0.7}, {"top_k": 5}, {"top_k": 1}, {"top_k": 64}, {"top_p": 0.9},
         {"temperature": 0.6, "top_k": 10, "top_p": 0.8}, {"top_p": 1e-6}]


@pytest.mark.parametrize("v", [16, 64])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_logprobs_and_gradient_equal_unchunked(small_chunks, v, kw) -> None:
    logits = _logits(2, 6, v, seed=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, v, (2, 6), generator=g)
    ids[1, 0] = 3  # the sampled token is a -inf logit there: logprob -inf
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = logprobs_from_logits(a, ids, **kw)
    ref = ref_logprobs(b, ids, **kw)
    assert_close(got, ref)
    assert got[1, 0] == NEG_INF
    w = torch.randn(2, 6, generator=g)
    finite = torch.isfinite(ref)  # as a loss would: mask out the -inf logprobs before summing
    (torch.where(finite, got, 0.0) * w).sum().backward()
    (torch.where(finite, ref, 0.0) * w).sum().backward()
    assert_close(a.grad, b.grad)


class _Table(torch.nn.Module):
    """A causal "LM" whose logits depend on the token and its position: enough to score a batch."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.emb = torch.nn.Parameter((torch.randn(vocab, vocab, generator=g) * 2).to(torch.bfloat16))

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1]).to(torch.bfloat16)[None, :, None]
        return type("Out", (), {"logits": self.emb[input_ids] + pos * 0.1})()


def _batch(vocab: int) -> RolloutBatch:
    tok = torch.tensor([[5, 9, 2, 0], [7, 1, 0, 0], [3, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    prompt = torch.tensor([[1, 2, 0], [4, 0, 0], [6, 7, 8]])
    pmask = prompt != 0
    lp = torch.where(mask, torch.zeros(3, 4), NEG_INF)
    n = torch.arange(3)
    return RolloutBatch(token_ids=tok, logprobs=lp, mask=mask, prompt_ids=prompt, prompt_mask=pmask,
                        request_index=n, sample_index=n * 0, num_cached_tokens=n * 0 - 1,
                        weight_versions=None, version_labels=(), finish_reasons=(None,) * 3)


def ref_recompute(model, batch, **kw):
    # the old path: gather [N, T, V] from the logits, then the unchunked formula
    n, t = batch.token_ids.shape
    plen, tlen = batch.prompt_lengths, batch.lengths
    width = int((plen + tlen).max())
    ids = torch.zeros((n, width), dtype=torch.int64)
    att = torch.zeros((n, width), dtype=torch.int64)
    for i in range(n):
        p, c = int(plen[i]), int(tlen[i])
        ids[i, :p], ids[i, p : p + c], att[i, : p + c] = batch.prompt_ids[i, :p], batch.token_ids[i, :c], 1
    logits = model(input_ids=ids, attention_mask=att).logits
    pos = (plen.unsqueeze(-1) - 1 + torch.arange(t)).clamp(max=width - 1)
    picked = logits.gather(1, pos.unsqueeze(-1).expand(n, t, logits.shape[-1]))
    return torch.where(batch.mask, ref_logprobs(picked, batch.token_ids, **kw), batch.logprobs)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.8, "top_p": 0.7}, {"top_k": 4}],
                         ids=["plain", "top_p", "top_k"])
def test_recompute_equals_gather_path_with_gradient(small_chunks, kw) -> None:
    vocab = 16  # 2 positions a chunk: rows of 3 and 4 completion tokens split
    model, batch = _Table(vocab), _batch(vocab)
    got = recompute_logprobs(model, batch, **kw)
    ref = ref_recompute(model, batch, **kw)
    assert_close(got, ref)
    assert bool((got[~batch.mask] == NEG_INF).all())  # padding stays the batch's padding
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    finite = torch.isfinite(ref)
    grad_got = torch.autograd.grad((torch.where(finite, got, 0.0) * w).sum(), model.emb)[0]
    grad_ref = torch.autograd.grad((torch.where(finite, ref, 0.0) * w).sum(), model.emb)[0]
    assert_close(grad_got, grad_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_small_or_float32_one_pass_equals_chunked(small_chunks, dtype) -> None:
    from rldiag.collectors.gradcheck import _nonfinite_positions

    g = torch.randn(2, 5, 64).to(dtype)
    g[0, 4, 9] = float("nan")
    expected = ~torch.isfinite(g.float().sum(-1))
    assert_close(_nonfinite_positions(g), expected)  # float32: one pass; bf16: chunks of one row
    assert _nonfinite_positions(g).nonzero().tolist() == [[0, 4]]


def _peak(case: str, path: str) -> float:
    import json
    import subprocess
    import sys
    from pathlib import Path

    # the benchmark's own child: bf16 logits of 2 x 128 tokens x 152,064 (74 MiB), RSS high-water mark
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "bench.logits_memory", "--child", case, path, "256", "152064", "1",
                          "1"], cwd=root, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_x"]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_peak_extra_memory_at_a_real_vocabulary() -> None:
    # the measurement sees a float32 copy: the unchunked entropy holds two of the logits' size (4x bf16)
    assert _peak("entropy", "before") > 3.5
    for case in ("entropy", "probe", "logprobs_top_p"):
        assert _peak(case, "rldiag") <= 0.5, case  # the issue's bound: 0.5x the logits' bytes


def test_process_logits_of_logits_that_carry_a_gradient():
    # the engine-parity trainer masks logits that require grad: the cut equals the no-grad path's, and a
    # gradient flows to the kept entries only (the out= buffers of the no-grad path cannot carry one)
    from rldiag.collectors.integrations.vllm import process_logits

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 50, requires_grad=True)
    for top_k, top_p in ((10, 0.9), (None, 0.9), (10, 1.0), (None, 1.0)):
        with_grad = process_logits(logits, temperature=0.7, top_k=top_k, top_p=top_p)
        with torch.no_grad():
            plain = process_logits(logits, temperature=0.7, top_k=top_k, top_p=top_p)
        assert torch.equal(with_grad.detach(), plain)
        logits.grad = None
        with_grad.masked_fill(~torch.isfinite(with_grad), 0.0).sum().backward()
        torch.testing.assert_close(logits.grad != 0, torch.isfinite(plain))
