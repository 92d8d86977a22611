"""Peak extra memory and time of entropy, the logits probe and the recompute on bf16 logits at a real
vocabulary (152,064, Qwen2's), rldiag's chunked path against the path before it (a float32 copy of all
the logits, reproduced below as `before_*`).

    python -m bench.logits_memory                  # quick: 2 x 128 tokens (78 MB of logits), ~1 min
    python -m bench.logits_memory --tokens 8192    # the issue's 8 x 1024 tokens (2.5 GB), ~10 min on 2 cores

Each case runs in its own child process on CPU: the logits are made, the kernel's RSS high-water mark
is reset after one warm-up call (`/proc/self/clear_refs`; torch's CPU allocator keeps no statistics),
the function runs `--repeats` times timed (median), and the extra memory is `VmHWM` minus the RSS before the call. A case of
the before path whose peak, estimated from its quick-size ratio, would not fit in half the machine's
available memory is not run at the large size (the JSON says so; its quick-size ratio is the one shown). Goal: <= 0.5x the
logits' own bytes for every rldiag case; time no worse than the before path.

torch runs one intra-op thread by default (`--threads 0` for all cores), as in bench.overhead: on a
shared 2-core machine each parallel region waits for a descheduled thread, and the chunked path has
more (smaller) regions, so multi-threaded times there swing 10x with other processes' load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, summary_row, write_result

NAME = "logits_memory"
VOCAB = 152_064
GOAL = 0.5  # peak extra <= 0.5x the logits' bytes
SEQ = 128  # tokens per row at the quick size; --tokens splits into rows of 1024 when larger
CASES = {  # name: keyword arguments of the recompute (None: not a recompute case)
    "entropy": None, "probe": None, "logprobs": {}, "logprobs_temperature": {"temperature": 0.7},
    "logprobs_top_k": {"temperature": 0.7, "top_k": 50}, "logprobs_top_p": {"temperature": 0.7, "top_p": 0.9},
}


# ---- the path before chunking (rldiag 4472ece^), verbatim --------------------------------------
def before_entropy(logits, mask):
    import torch

    from rldiag.collectors.metrics import _valid, masked_mean

    h = torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(-1)
    return masked_mean(h, _valid(mask, h))


def before_probe(g):
    import torch

    reduced = g.float().sum(dim=tuple(range(2, g.dim()))) if g.dim() > 2 else g.float()
    return ~torch.isfinite(reduced)


def before_logprobs(logits, token_ids, *, temperature=1.0, top_k=None, top_p=1.0):
    import torch

    x = logits.float() / temperature
    use_k = top_k is not None and 0 < top_k < x.shape[-1]
    if use_k or top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=False)
        if use_k:
            kth = srt[..., x.shape[-1] - top_k].unsqueeze(-1)
            srt = srt.masked_fill(srt < kth, float("-inf"))
        if top_p < 1.0:
            cum = srt.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= 1.0 - top_p
            drop[..., -1] = False
            srt = srt.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, idx, srt)
    return torch.log_softmax(x, dim=-1).gather(-1, token_ids.unsqueeze(-1).long()).squeeze(-1)


# ---- one case, in a child process ---------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(case: str, path: str, tokens: int, vocab: int, repeats: int, threads: int) -> dict:
    import torch

    from rldiag.collectors.gradcheck import _nonfinite_positions
    from rldiag.collectors.integrations.vllm import logprobs_from_logits
    from rldiag.collectors.metrics import entropy_from_logits

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    seq = 1024 if tokens >= 1024 else SEQ  # rows of 1024 tokens, as the 8 x 1024
    rows = max(1, tokens // seq)
    logits = torch.empty(rows, tokens // rows, vocab, dtype=torch.bfloat16).normal_(0.0, 3.0)
    mask = torch.ones(logits.shape[:2], dtype=torch.bool)
    ids = torch.randint(0, vocab, logits.shape[:2])
    kw = CASES[case]
    if case == "entropy":
        fn = (lambda: entropy_from_logits(logits, mask)) if path == "rldiag" else (lambda: before_entropy(logits, mask))
    elif case == "probe":
        fn = (lambda: _nonfinite_positions(logits)) if path == "rldiag" else (lambda: before_probe(logits))
    else:
        f = logprobs_from_logits if path == "rldiag" else before_logprobs
        fn = lambda: f(logits, ids, **kw)
    with torch.no_grad():
        fn()  # warm-up: first-call initialisation is not what a training step pays
    with open("/proc/self/clear_refs", "w") as f_:
        f_.write("5")  # reset VmHWM to the current RSS
    rss0 = _status_kb("VmRSS")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn()
        times.append(time.perf_counter() - t0)
        del out
    extra = (_status_kb("VmHWM") - rss0) * 1024  # the highest of the timed calls
    seconds = statistics.median(times)
    nbytes = logits.numel() * logits.element_size()
    return {"case": case, "path": path, "tokens": tokens, "vocab": vocab, "logits_bytes": nbytes,
            "peak_extra_bytes": extra, "peak_extra_x": extra / nbytes, "seconds": seconds, "times_s": times}


def _run(case: str, path: str, tokens: int, vocab: int, repeats: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "bench.logits_memory", "--child", case, path, str(tokens), str(vocab), str(repeats),
           str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"case": case, "path": path, "tokens": tokens, "error": (done.stderr or done.stdout).strip()[-400:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _find(results: list[dict], case: str, path: str, tokens: int) -> dict:
    return next((r for r in results if r["case"] == case and r["path"] == path and r["tokens"] == tokens), {})


def summarize(results: list[dict], sizes: list[int], vocab: int) -> tuple[list[dict], bool]:
    """README rows at the largest size; a before case not run there is compared at the quick size (both
    paths), said in the row."""
    small, big = sizes[0], sizes[-1]
    summary, met_all = [], True
    for case in CASES:
        new, old = _find(results, case, "rldiag", big), _find(results, case, "before", big)
        new_t, at = new, ""
        if "peak_extra_x" not in old:  # not run at the large size: time against rldiag's at the quick size
            old, new_t = _find(results, case, "before", small), _find(results, case, "rldiag", small)
            at = f" (at {small} tokens)"
        if not all("peak_extra_x" in r for r in (new, old, new_t)):
            summary.append(summary_row(f"logits memory: {case}", "error", "error", "-", f"<= {GOAL}x logits", False))
            met_all = False
            continue
        met = new["peak_extra_x"] <= GOAL
        met_all &= met
        summary.append(summary_row(
            f"peak extra memory, {case} (bf16 logits, {big} tokens x {vocab:,}: "
            f"{new['logits_bytes'] / 2**20:,.0f} MiB)",
            f"{new['peak_extra_bytes'] / 2**20:.1f} MiB = {new['peak_extra_x']:.3f}x logits; {new['seconds']:.2f} s",
            f"before: {old['peak_extra_x']:.2f}x logits{at}; {old['seconds']:.2f} s{at}",
            f"{new['peak_extra_x'] / max(old['peak_extra_x'], 1e-9):.4f}x memory; "
            f"{new_t['seconds'] / old['seconds']:.2f}x time{at}",
            f"<= {GOAL}x logits", met))
    return summary, met_all


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2 * SEQ, help="tokens of the large size (8192 = 8 x 1024)")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--quick", action="store_true", help="the default size (kept for run_all)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case at the quick size (median); 1 at the large")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--resummarize", action="store_true", help="rebuild the README rows of the results on disk")
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        case, path, *nums = args.child
        print(json.dumps(_child(case, path, *map(int, nums))))
        return {}
    if args.resummarize:
        from bench._common import RESULTS

        data = json.loads((RESULTS / f"{NAME}.json").read_text())
        data["summary"], data["all_met"] = summarize(data["results"], data["sizes"], data["vocab"])
        print(f"wrote {write_result(NAME, data)}")
        return data

    small = 2 * SEQ
    sizes = [small] if args.tokens <= small else [small, args.tokens]
    results: list[dict] = []
    for tokens in sizes:
        for case in CASES:
            for path in ("rldiag", "before"):
                prior = next((r for r in results if r["case"] == case and r["path"] == path and "error" not in r
                              and "skipped" not in r), None)
                need = prior["peak_extra_x"] * tokens * args.vocab * 2 if prior else 0
                if tokens != small and need > _available_bytes() / 2:
                    results.append({"case": case, "path": path, "tokens": tokens, "skipped":
                                    f"needs ~{need / 2**30:.1f} GiB (from the quick size), "
                                    f"{_available_bytes() / 2**30:.1f} GiB available"})
                else:
                    results.append(_run(case, path, tokens, args.vocab, args.repeats if tokens == small else 1,
                                         args.threads))
                r = results[-1]
                shown = r.get("error") or r.get("skipped") or (
                    f"peak extra {r['peak_extra_bytes'] / 2**20:8.1f} MiB = {r['peak_extra_x']:.2f}x logits, "
                    f"{r['seconds']:.2f} s")
                print(f"{tokens:>6} tokens {case:<22}{path:<7} {shown}", flush=True)

    summary, met_all = summarize(results, sizes, args.vocab)
    big = sizes[-1]
    out = {"benchmark": NAME, "quick": big == small, "env": env_info(), "vocab": args.vocab, "sizes": sizes,
           "torch_threads": args.threads or "default", "repeats": args.repeats,
           "results": results, "all_met": met_all, "summary": summary}
    print(f"wrote {write_result(NAME, out)}")
    return out


if __name__ == "__main__":
    main()
