"""Where the NaN entered, said on a non-finite step: the loss, the loss's backward, or a layer.

Once the loss's backward is non-finite, every gradient is, and a list of the guilty parameters names the
whole model. What a researcher needs is the entry point:
- `loss`: the loss value itself is non-finite;
- `loss_backward`: the loss is finite but the gradient w.r.t. the watched logits is already non-finite
  (at these micro-batches, samples and tokens): the NaN comes from the loss's own backward (the `-inf`
  padding of a distillation loss);
- `layer`: the logits' gradient is finite: the first parameter, in backward order, whose gradient is
  non-finite is the layer closest to where the NaN started;
- `parameter`: the logits were not watched, so the two above cannot be told apart; the first parameter in
  backward order is named.

Backward order comes from the loss's autograd graph (each parameter ranked by the sequence number of the
node that consumes it: autograd runs later-created nodes first), or from the order in which gradients
arrived (`AccumulatedGradCheck`), else from the reversed registration order. All of it runs on the
non-finite step only, from what the check already holds: a finite step pays nothing. ("NaN" stands for
NaN or inf.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from rldiag.collectors.compat.torch import clean_fqn

MAX_GRAPH_NODES = 2_000_000  # a bound on the walk over a (huge) autograd graph, failure path only


def autograd_order(loss: object, model: nn.Module | None) -> tuple[list[str], str]:
    """`(parameter names in backward order, how it was found)`: from `loss`'s autograd graph when `loss`
    is a tensor with one (the graph's nodes outlive `backward()` as long as `loss` does), else the
    model's registration order reversed ("registration"), else `([], "unknown")`."""
    names = {id(p): clean_fqn(n) for n, p in model.named_parameters()} if model is not None else {}
    fn = getattr(loss, "grad_fn", None) if isinstance(loss, torch.Tensor) else None
    if fn is not None and names:
        rank: dict[str, int] = {}
        seen, stack = {id(fn)}, [fn]
        while stack and len(seen) < MAX_GRAPH_NODES:
            node = stack.pop()
            seq = node._sequence_nr()
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)  # an AccumulateGrad node: a leaf, i.e. a parameter
                if var is not None:
                    name = names.get(id(var))
                    if name is not None and seq > rank.get(name, -1):
                        rank[name] = seq  # its earliest use in backward: the consumer autograd runs first
                elif id(nxt) not in seen:
                    seen.add(id(nxt))
                    stack.append(nxt)
        if rank:
            return sorted(rank, key=lambda n: -rank[n]), "autograd"
    if names:
        return list(reversed(list(names.values()))), "registration"
    return [], "unknown"


def in_order(names: Sequence[str], order: Sequence[str]) -> list[str]:
    """`names` sorted by `order`; a `rank<r>:` prefix (a rank's own tensor) is ignored for the lookup, and
    names `order` lacks keep their place after the others."""
    at = {n: i for i, n in enumerate(order)}

    def key(item: tuple[int, str]) -> tuple[int, int]:
        i, name = item
        bare = name.split(":", 1)[1] if name.startswith("rank") and ":" in name else name
        return (at.get(bare, len(at)), i)

    return [n for _, n in sorted(enumerate(names), key=key)]


def nan_origin(names: Sequence[str], *, loss_value: float | None, positions: list[dict], watched: bool,
               how: str) -> dict:
    """`{"where", "param", "order", "text"}` for a non-finite step: `names` are the non-finite parameters
    in backward order (`in_order`), `loss_value` the step's loss, `positions` the non-finite places of the
    logits' gradient (`NonFinitePosition.as_dict()`), `watched` whether the logits were watched at all,
    `how` the source of the order."""
    first = names[0] if names else None
    if loss_value is not None and not math.isfinite(loss_value):
        where, text = "loss", f"the loss was {_word(loss_value)}, so every gradient is"
    elif positions:
        where, text = "loss_backward", ("NaN entered from the loss's backward (the loss was finite): the logits' "
                                        f"gradient is non-finite at {format_positions(positions)}")
    elif watched:
        where, text = "layer", (f"NaN entered at {first} (the first non-finite gradient in backward order; the "
                                "logits' gradient was finite)")
    else:
        where, text = "parameter", (f"first non-finite gradient in backward order: {first} (the logits were not "
                                    "watched, so the loss's backward cannot be told from this layer: "
                                    "Monitor.watch(logits))")
    if how == "registration" and where in ("layer", "parameter"):
        text += "; order: registration, reversed (pass loss= as the tensor for autograd's order)"
    return {"where": where, "param": first, "order": how, "text": text}


def _word(v: float) -> str:
    return "NaN" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def format_positions(positions: list[dict], limit: int = 4) -> str:
    """`micro-batch 0 sample 0 tokens 4-14, 17` ...: positions grouped by rank, micro-batch and sample, tokens
    as ranges; at most `limit` groups, then how many more."""
    groups: dict[tuple, list[int]] = {}
    for p in positions:
        key = (p.get("rank"), p.get("micro_batch", 0), p["sample"])
        groups.setdefault(key, [])
        if p.get("position") is not None:
            groups[key].append(p["position"])
    parts = []
    for (rank, mb, sample), toks in list(groups.items())[:limit]:
        where = (f"rank {rank} " if rank is not None else "") + f"micro-batch {mb} sample {sample}"
        if toks:
            where += (" token " if len(toks) == 1 else " tokens ") + _ranges(sorted(set(toks)))
        parts.append(where)
    more = len(groups) - limit
    return ", ".join(parts) + (f" and {more} more sample(s)" if more > 0 else "")


def _ranges(xs: list[int]) -> str:
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if x is not None:
            start = prev = x
    return ", ".join(out)
