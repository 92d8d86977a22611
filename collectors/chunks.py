"""Row chunks of `[..., V]` logits, as views: float32 work on a few rows at a time, never on the whole.

A float32 copy of bf16 logits is twice their size (8 x 4096 tokens x 152k vocabulary: 19 GiB bf16,
37 GiB float32). Entropy, the logits probe and the recompute walk the rows in chunks of at most
`CHUNK_ELEMENTS` elements, so their extra memory is a few chunks whatever the batch. Logits that fit
in one chunk (the small case) go through in one piece: no loop, no slower.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# 1 Mi elements: 4 MiB per float32 buffer; top-p's sort, softmax and cumsum hold ~30 bytes an element
# (~32 MiB), 1.3% of bf16 logits of 8 x 1024 x 152k. Rows of a 152k vocabulary: 6 a chunk.
CHUNK_ELEMENTS = 1 << 20

# On the CPU, chunks sized for the core's L2 cache: a per-step metric then reads each chunk from memory
# once and runs its passes in cache (entropy of logits out of cache: 0.80-0.97x the time of 1 Mi-element
# chunks from 4k to 152k vocabularies, `python -m bench.entropy_cache`).
CPU_CACHE_ELEMENTS = 1 << 17

Index = tuple  # a tuple of ints and slices indexing the leading dimensions


def cache_budget(device: torch.device) -> int:
    """Elements per chunk for passes that revisit each chunk: L2-sized on the CPU, else CHUNK_ELEMENTS."""
    return CPU_CACHE_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS


def row_chunks(x: torch.Tensor, budget: int | None = None) -> Iterator[tuple[Index, torch.Tensor]]:
    """`(index, x[index])` over the leading dimensions of `x` (`[..., V]`), each a view of at most
    `budget` elements (one row when a row alone is larger). The indexes cover every row once, in order;
    no copy is made, also for non-contiguous views such as `logits[:, :-1]`. `budget`: `CHUNK_ELEMENTS`."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    if x.dim() <= 1 or x.numel() <= budget:
        yield (), x
        return
    per = x[0].numel() if x.shape[0] else 1
    step = budget // max(per, 1)
    if step >= 1:
        for s in range(0, x.shape[0], step):
            yield (slice(s, s + step),), x[s : s + step]
        return
    for i in range(x.shape[0]):
        for idx, c in row_chunks(x[i], budget):
            yield (i, *idx), c


class Workspace:
    """Named float32 (or other dtype) buffers reused by every chunk of one call: each chunk fills the
    same memory instead of allocating its own (fresh pages per chunk cost more than the arithmetic)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised `shape` view of buffer `name` (grown when a chunk needs more)."""
        n = 1
        for s in shape:
            n *= s
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._bufs[name] = torch.empty(n, dtype=dtype, device=self.device)
        return buf[:n].view(shape)
