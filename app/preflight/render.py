"""`rldiag preflight`'s outputs: a JSON record and a Markdown summary of one `PreflightResult`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rldiag.app.preflight.check import Measurement, PreflightResult
from rldiag.app.preflight.config import TRAINER_LOGPROBS

JSON_NAME, MARKDOWN_NAME = "preflight.json", "preflight.md"


def _num(x: float) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:.3g}"


def to_json(result: PreflightResult) -> str:
    """The whole result (config, verdict, every engine's numbers and fingerprint) as JSON; NaN as null."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(asdict(result)), indent=2, default=str)


def _row(m: Measurement) -> str:
    if m.status != "measured":
        return f"| {m.label} | {m.status.replace('_', ' ')}: {m.note} |  |  |  |  |  |  |  |"
    return (f"| {m.label} | {m.tokens} | {_num(m.mean)} | {_num(m.max)} | {_num(m.token_mult_prob_error)} | "
            f"{_num(m.kl_k3)} | {m.ratio_mean:.4f} | {m.outside_trainer_support} | {m.cached_prompt_tokens} |")


def _token(text: str) -> str:
    return repr(text).replace("|", "\\|")


def to_markdown(result: PreflightResult) -> str:
    """The verdict first, then one row per engine and the worst tokens of the user's engine."""
    c, b = result.config, result.baseline
    fp = b.fingerprint
    lines = [
        "# rldiag preflight: engine vs trainer logprobs at equal weights", "",
        f"**{result.verdict}**", "",
        (f"- model: `{c['model']}`; vLLM {fp.get('engine.version', '?')} ({fp.get('engine.build', '?')} on "
        f"{fp.get('engine.platform', '?')}), engine dtype {fp.get('engine.dtype', '?')}, lm_head "
        f"{fp.get('engine.lm_head_dtype', '?')}, logprobs_mode {fp.get('engine.logprobs_mode', '?')}, prefix caching "
        f"{fp.get('engine.enable_prefix_caching', '?')}, async scheduling {fp.get('engine.async_scheduling', '?')}"),
        (f"- sampling: temperature {c['temperature']}, top_p {c['top_p']}, top_k {c['top_k']}; trainer logprobs: "
        f"{c['trainer_logprobs']} = {TRAINER_LOGPROBS[c['trainer_logprobs']]}"),
        (f"- {c['num_prompts']} prompts x {c['samples']} samples x {c['max_tokens']} tokens, measured after one "
        f"weight push (matrices + N(0, ({c['push_scale']} std)^2), prefix cache "
        f"{'reset' if c['reset_cache_on_push'] else 'kept'}); at the checkpoint's weights the mean was "
        f"{_num(b.mean_before_push)}"),
        "",
        ("| engine | tokens | mean abs Δ logprob | max abs Δ | token_mult_prob_error | k3 KL | ratio mean | "
        "outside trainer support | cached prompt tokens |"),
        "|---|---|---|---|---|---|---|---|---|",
        _row(b), *(_row(m) for m in result.flips), "",
    ]
    if b.worst:
        lines += ["## Worst tokens (your engine arguments)", "",
                  "| sample | prompt | position | token | trainer logprob | engine logprob | abs Δ |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {w['sample']} | {w['prompt']} | {w['position']} | {_token(w['token'])} (id {w['token_id']}) | "
                  f"{w['lp_trainer']:.4g} | {w['lp_engine']:.4g} | {w['abs_diff']:.3g} |" for w in b.worst]
        lines.append("")
    if result.notes:
        lines += ["## Notes", "", *(f"- {n}" for n in result.notes), ""]
    return "\n".join(lines)


def write(result: PreflightResult, out: Path) -> tuple[Path, Path]:
    """`preflight.json` and `preflight.md` in `out` (created); returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    j, md = out / JSON_NAME, out / MARKDOWN_NAME
    j.write_text(to_json(result) + "\n", encoding="utf-8")
    md.write_text(to_markdown(result), encoding="utf-8")
    return j, md


__all__ = ["JSON_NAME", "MARKDOWN_NAME", "to_json", "to_markdown", "write"]
