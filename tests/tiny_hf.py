"""A tiny random-init Qwen2 model and a WordLevel tokenizer, built locally (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path


def tiny_word_tokenizer(vocab: int = 64):
    """`<pad>`=0, `<eos>`=1, `<unk>`=2, then words `w0`, `w1`, ... up to `vocab` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 3)]
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=wl, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_tiny_qwen2(path: str | Path, vocab: int = 64, seed: int = 0):
    """Save a 2-layer, hidden-32 Qwen2 with random weights and its tokenizer to `path`; returns the tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tiny_word_tokenizer(vocab)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=1)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return tok
