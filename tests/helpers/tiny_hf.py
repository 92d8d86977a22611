"""A tiny HF setup built locally (nothing is downloaded): a random-init Qwen2 model and a WordLevel
tokenizer, and a 2-layer Llama with its data and Trainer arguments for CPU Trainer runs.

The Qwen2 builder lives in `experiments/tiny_hf_model.py` (experiments must not import tests/); the tests
import it from here. transformers is imported when a builder runs.
"""

from __future__ import annotations

from pathlib import Path

from rldiag.experiments.tiny_hf_model import save_tiny_qwen2, tiny_word_tokenizer

__all__ = ["T", "V", "llama_config", "lm_dataset", "save_tiny_qwen2", "tiny_word_tokenizer", "training_args"]

V, T = 64, 12  # vocabulary, sequence length


def llama_config():
    """A 2-layer Llama config over the V-token vocabulary (a transformers `LlamaConfig`)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=0, bos_token_id=1, eos_token_id=1)


def training_args(tmp_path: Path, **kw):
    """CPU `TrainingArguments` into tmp_path/out, no reporting, every step logged; `kw` overrides."""
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path / "out"), report_to="none", save_strategy="no", use_cpu=True,
                disable_tqdm=True, logging_steps=1, learning_rate=1e-3, max_grad_norm=1.0, seed=0,
                train_sampling_strategy="sequential", remove_unused_columns=False)
    base.update(kw)
    return TrainingArguments(**base)


def lm_dataset(n: int) -> list[dict]:
    """`n` random sequences of T tokens (seeded), labels = inputs."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (n, T), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]
