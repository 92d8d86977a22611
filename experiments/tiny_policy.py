"""A tiny random-init causal transformer policy, built from a config (nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PolicyConfig:
    vocab: int = 64  # token ids 0..vocab-1
    d_model: int = 64  # hidden size
    n_layers: int = 2  # transformer blocks
    n_heads: int = 2  # attention heads (head size 32)
    max_len: int = 256  # longest prompt + completion


class TinyPolicy(nn.Module):
    """Token embedding, learned positions, pre-norm causal transformer blocks, untied LM head."""

    def __init__(self, cfg: PolicyConfig = PolicyConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, dim_feedforward=4 * cfg.d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """`[B, T]` token ids -> `[B, T, vocab]` next-token logits."""
        t = ids.shape[1]
        h = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.blocks(h, mask=causal, is_causal=True)
        return self.head(self.norm(h))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logprob of each `tokens[b, t]` under `logits[b, t]`: `[B, T]`."""
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample(model: TinyPolicy, prompts: torch.Tensor, new_tokens: int, *, temperature: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `new_tokens` after each prompt; returns `(completions [B, N], their logprobs [B, N])`."""
    ids = prompts
    lps = []
    for _ in range(new_tokens):
        logits = model(ids)[:, -1].float() / temperature
        logp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        lps.append(logp.gather(-1, nxt))
        ids = torch.cat([ids, nxt], 1)
    return ids[:, prompts.shape[1]:], torch.cat(lps, 1)
