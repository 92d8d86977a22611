"""Token text for the read side: a decoder from the tokenizer a run's params name, when it is at hand.

The collectors log token ids (metrics are numbers); a run's `engine.model` param (the engine
fingerprint) names the model the engine served. Where that is a local directory with a tokenizer and
transformers is installed, ids read as text; otherwise the read side shows the id and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path

from rldiag.collectors.import_utils import is_transformers_available

Decoder = Callable[[int], str]
MODEL_PARAMS = ("engine.model",)  # params that name a model directory, first found wins


@lru_cache(maxsize=8)
def token_decoder(path: str) -> Decoder | None:
    """`decode(token_id)` with the tokenizer saved at `path`; None when it is not a local tokenizer."""
    if not path or not Path(path).is_dir() or not is_transformers_available():
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - any unreadable tokenizer just means ids stay ids
        return None
    return lambda token_id: tok.decode([token_id])


def decoders_for(params: Mapping[str, Mapping[str, str]]) -> dict[str, Decoder]:
    """`{run_id: decoder}` for the runs whose params name a local tokenizer (`params`: run id -> params)."""
    out = {}
    for run_id, p in params.items():
        path = next((p[k] for k in MODEL_PARAMS if p.get(k)), "")
        decode = token_decoder(path)
        if decode is not None:
            out[run_id] = decode
    return out


__all__ = ["decoders_for", "token_decoder"]
