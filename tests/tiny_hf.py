"""A tiny random-init Qwen2 model and a WordLevel tokenizer, built locally (nothing is downloaded).

The builder lives in `experiments/tiny_hf_model.py` (experiments must not import tests/); the tests
keep importing it from here.
"""

from rldiag.experiments.tiny_hf_model import save_tiny_qwen2, tiny_word_tokenizer

__all__ = ["save_tiny_qwen2", "tiny_word_tokenizer"]
