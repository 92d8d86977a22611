"""A tiny random-init Qwen2 model and a WordLevel tokenizer, built locally (nothing is downloaded).

`save_tiny_qwen2(path)` keeps the small defaults that the transformers tests use (head size 8);
vLLM needs a head size of 32 or more, so `VLLM_TINY_QWEN2` holds sizes that an engine can serve:

    save_tiny_qwen2(model_dir, **VLLM_TINY_QWEN2)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Sizes a vLLM engine accepts (head_dim = 64 / 2 = 32) and still tiny: about 30k parameters.
VLLM_TINY_QWEN2: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                        num_key_value_heads=2, max_position_embeddings=128)


def tiny_word_tokenizer(vocab: int = 64):
    """`<pad>`=0, `<eos>`=1, `<unk>`=2, then words `w0`, `w1`, ... up to `vocab` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 3)]
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=wl, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_qwen2_config(vocab: int = 64, **overrides: Any):
    """A 2-layer `Qwen2Config` (hidden 32, 4 heads unless `overrides` say otherwise), float32, untied head."""
    from transformers import Qwen2Config

    sizes: dict[str, Any] = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=1)
    sizes.update(overrides)
    return Qwen2Config(**sizes)


def build_tiny_qwen2(vocab: int = 64, seed: int = 0, **overrides: Any):
    """A float32 `Qwen2ForCausalLM` with random weights drawn under `torch.manual_seed(seed)`."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_qwen2_config(vocab, **overrides))


def save_tiny_qwen2(path: str | Path, vocab: int = 64, seed: int = 0, **overrides: Any):
    """Save a tiny Qwen2 with random weights and its tokenizer to `path`; returns the tokenizer.

    `overrides`: `Qwen2Config` fields (e.g. `**VLLM_TINY_QWEN2`); without them a 2-layer, hidden-32 model.
    """
    tok = tiny_word_tokenizer(vocab)
    build_tiny_qwen2(vocab, seed, **overrides).save_pretrained(path)
    tok.save_pretrained(path)
    return tok


__all__ = ["VLLM_TINY_QWEN2", "build_tiny_qwen2", "save_tiny_qwen2", "tiny_qwen2_config", "tiny_word_tokenizer"]
