"""Entropy of CPU logits taken cold (as after a backward pass): chunks sized for the L2 cache
(`chunks.CPU_CACHE_ELEMENTS`, what `token_entropy` uses on the CPU) against the 1 Mi-element chunks it
used before (`chunks.CHUNK_ELEMENTS`, still the budget on other devices).

    python -m bench.entropy_cache                # ~1 min
    python -m bench.entropy_cache --repeats 400  # steadier medians

Both paths are `token_entropy`'s own row loop with one budget or the other (same values, checked). Before
each call a 64 MiB buffer is written, which pushes the logits out of the caches as a backward pass does;
the two paths alternate call by call, so machine noise hits them alike. One torch thread, as in
bench.overhead. Shapes: bench.overhead's logits (8 x 128 x 512 float32), a 152k vocabulary in bf16
(2 x 32 x 152,064) and two in between.
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, summary_row, write_result

NAME = "entropy_cache"
SHAPES = (((8, 128, 512), "float32"), ((8, 128, 4096), "float32"), ((8, 128, 32000), "bfloat16"),
          ((2, 32, 152_064), "bfloat16"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=0, help="calls per path and shape (default: 200 for the "
                    "smallest shape, fewer for the larger)")
    args = ap.parse_args(argv)

    import torch

    from rldiag.collectors import chunks
    from rldiag.collectors.metrics import _entropy_rows

    torch.set_num_threads(1)

    def entropy(x: torch.Tensor, budget: int) -> torch.Tensor:  # token_entropy's loop, the budget given
        h = torch.empty(x.shape[:-1], dtype=torch.float32)
        ws = chunks.Workspace(x.device)
        for idx, rows in chunks.row_chunks(x, max(budget, x.shape[-1])):
            h[idx] = _entropy_rows(rows, ws)
        return h

    evict = torch.zeros(16 * 1024 * 1024)
    rows, summary = [], []
    for shape, dtype in SHAPES:
        x = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3).to(getattr(torch, dtype))
        paths = {"L2-sized chunks": chunks.CPU_CACHE_ELEMENTS, "1 Mi-element chunks (before)": chunks.CHUNK_ELEMENTS}
        a, b = (entropy(x, n) for n in paths.values())
        assert torch.equal(a, b) or torch.allclose(a, b, rtol=1e-6, atol=1e-6), "the two paths disagree"
        n = args.repeats or max(10, int(200 * 512 * 1024 / x.numel()) if x.numel() > 512 * 1024 else 200)
        times: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(n):
            for name, budget in paths.items():
                evict.add_(1.0)
                t0 = time.perf_counter()
                entropy(x, budget)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        new, old = med["L2-sized chunks"], med["1 Mi-element chunks (before)"]
        label = f"{'x'.join(map(str, shape))} {dtype}"
        rows.append({"shape": shape, "dtype": dtype, "calls": n, "median_ms": med, "ratio": new / old})
        print(f"{label:<24} L2-sized {new:8.2f} ms   before {old:8.2f} ms   {new / old:.2f}x  ({n} calls each)")
        summary.append(summary_row(f"entropy of cold CPU logits, {label}", f"{new:.2f} ms",
                                   f"1 Mi-element chunks (before): {old:.2f} ms", f"{new / old:.2f}x", "-", None))
    out = {"benchmark": NAME, "env": env_info(), "cases": rows, "summary": summary}
    print(f"wrote {write_result(NAME, out)}")
    return out


if __name__ == "__main__":
    main()
