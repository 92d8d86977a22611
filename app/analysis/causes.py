"""Likely causes of a candidate's departure or NaN, ranked, each with its evidence, its fix and its source.

    found = likely_causes(histories, configs, reference_ids, candidate_ids)   # one RunCauses per candidate
    found[0].line()     # "likely: raw vs processed logprobs: ratio mean 1.263 at step 0, ...; fix: ..."
    found[0].causes     # the full ranked list, each a Cause with .signature, .settings, .fix, .source

A cause is named only when its metric signature is there (`causes_signatures`: step-0 parity, a
one-signed or symmetric mismatch, parity lost after updates, non-finite gradients from the first step
with a finite loss, a departure after updates); the params then say which setting explains it: the
engine fingerprint entries that differ from the references or are risky in themselves. A run without
an engine fingerprint (stock TRL, verl) gets signature-only hints, labelled so; a run whose engine
settings match its references gets the trainer-side reading. Settings that differ without a signature
of their own are listed apart (`also_differs`), never as a cause. Nothing here depends on the
divergence detector's thresholds: its departures (`summaries`) only add evidence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from rldiag.app.analysis import causes_settings as S
from rldiag.app.analysis import verdicts as V
from rldiag.app.analysis.causes_is import is_cause, with_is_evidence
from rldiag.app.analysis.causes_signatures import (
    SIGNATURE_KEYS,
    NonFiniteSignature,
    Parity,
    departures_after_updates,
    first_step,
    nonfinite_signature,
    parity,
    parity_unknown,
)
from rldiag.app.data.histories import Histories

SEED_PIPELINERL, SEED_TRL = V.SOURCE_PIPELINERL, V.SOURCE_TRL  # cited by what they say, never by a path
VLLM_LOGPROBS = "vLLM docs: LLM(logprobs_mode=...), raw_logprobs is the V1 default"
VLLM_PREFIX = "vLLM docs: automatic prefix caching, LLM.reset_prefix_cache()"
HF_FILTER = "transformers docs: TrainingArguments.logging_nan_inf_filter (on by default)"
NO_FINGERPRINT = "metrics only: the run logged no engine fingerprint"
SAME_ENGINE = "metrics only: the engine settings match the references'"
__all__ = ["SIGNATURE_KEYS", "Cause", "RunCauses", "likely_causes"]


@dataclass(frozen=True)
class Cause:
    """One likely cause: what matched in the metrics, which settings explain it, the fix, the source."""

    id: str  # raw_logprobs, recompute_sampling, logprob_semantics, engine_precision, lm_head_precision,
    # numerics, prefix_cache, stale_weights, padding_inf, nan_filter, optimizer, is_degenerate
    title: str
    signature: tuple[str, ...]  # the metric evidence, in metric units
    settings: tuple[str, ...]  # params / fingerprint entries that differ or are risky in themselves
    fix: str
    source: str
    hint: str = ""  # non-empty: no setting confirms it (why: NO_FINGERPRINT, SAME_ENGINE, ...)
    step: int = 0  # where its signature starts (ranks earlier causes first)

    def text(self) -> str:
        """ "raw vs processed logprobs: <signature>; <settings>; fix: <fix>" (plain text)."""
        lead = f"{self.title} ({self.hint})" if self.hint else self.title
        return f"{lead}: " + "; ".join([*self.signature, *self.settings, f"fix: {self.fix}"])


@dataclass(frozen=True)
class RunCauses:
    """The ranked likely causes of one candidate, the settings that differ without a signature of
    their own, and notes (why there is none, what could not be told)."""

    run_id: str
    causes: tuple[Cause, ...]
    also_differs: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()  # "cause check failed: <check> (<error>)", one per check that raised

    @property
    def first(self) -> Cause | None:
        return self.causes[0] if self.causes else None

    def line(self) -> str:
        """One plain-text line: "likely: <first cause>" (+N more), or "no likely cause: <notes>", then each
        failed check; or "". A failed check never leaves "no likely cause" unqualified."""
        parts = list(self.failed)
        if self.first is not None:
            more = f" (+{len(self.causes) - 1} more)" if len(self.causes) > 1 else ""
            parts.insert(0, f"likely: {self.first.text()}{more}")
        elif self.notes:
            lead = "no likely cause among the checks that ran" if self.failed else "no likely cause"
            parts.insert(0, f"{lead}: {'; '.join(self.notes)}")
        return "; ".join(parts)


@dataclass(frozen=True)
class _Run:
    """What the rules read about one candidate."""

    h: Histories
    run: str
    refs: tuple[str, ...]
    params: Mapping[str, str]
    ref_params: tuple[Mapping[str, str], ...]
    diffs: dict[str, tuple[str | None, str | None]]
    parity: Parity | None
    nonfinite: NonFiniteSignature | None
    departures: tuple[str, ...]  # the detector's departures after the first step, as text
    alerts: tuple[dict, ...]
    cited: set[str] = field(default_factory=set)  # settings keys a cause used

    @property
    def fingerprint(self) -> bool:
        return S.has_fingerprint(self.params)

    def setting(self, key: str) -> str | None:
        return self.params.get(key)

    def differs(self, key: str) -> str | None:
        """ "key mine vs theirs" where the references hold another value, else None; marks it cited."""
        self.cited.add(key)
        return S.vs(key, self.diffs[key]) if key in self.diffs else None


def _g(x: float) -> str:
    return f"{x:.4g}"


def _step0(p: Parity) -> str:
    return f"at step {p.step}" + (", before any update" if p.before_update else "")


# ---- rules: each returns the causes its signature supports ------------------------------------------
def _semantics(r: _Run) -> list[Cause]:
    """A one-signed mismatch at equal weights: the two sides score different distributions."""
    p = r.parity
    if p is None or p.holds or p.one_signed is not True or not p.before_update:
        return []
    signed = f", signed mean {p.signed:+.3g} (one way)" if p.signed is not None else ""
    ratio = f"ratio mean {p.ratio:.4g} {_step0(p)}; " if p.ratio is not None else f"{_step0(p)}: "
    sig = (f"{ratio}{V.parity_text(p.mean, p.tol)}{signed}",)
    mode = r.setting("engine.logprobs_mode")
    samp = S.sampling(r.params)
    samp_text = ", ".join(f"{k} {_g(v)}" for k, v in samp.items())
    if mode is None:
        return [Cause("logprob_semantics", "engine and trainer score different distributions", sig, (),
                      "score both sides the same way: the engine's processed logprobs (vLLM logprobs_mode="
                      "processed_logprobs) against the trainer's logits / temperature with the same top-k/top-p",
                      f"{SEED_PIPELINERL}; {VLLM_LOGPROBS}", hint=NO_FINGERPRINT, step=p.step)]
    if mode.startswith("raw") and (samp or not S.sampling_known(r.params)):
        settings = [d for d in [r.differs("engine.logprobs_mode")] if d]
        settings.append(f"engine.logprobs_mode={mode} while sampling with {samp_text}" if samp
                        else f"engine.logprobs_mode={mode} (logprobs before temperature and top-k/top-p)")
        return [Cause("raw_logprobs", "raw vs processed logprobs", sig, tuple(settings),
                      "start vLLM with logprobs_mode=processed_logprobs (the sampler's distribution, as the "
                      "trainer scores it)", f"{SEED_PIPELINERL}; {VLLM_LOGPROBS}", step=p.step)]
    r.cited.add("engine.logprobs_mode")
    lower = p.ratio is not None and p.ratio < 1
    where = ("the trainer's logprobs are below the engine's (a flatter distribution on the trainer's side)"
             if lower else "the trainer's logprobs differ from the engine's one way")
    named = [S.vs(k, v) for k, v in r.diffs.items() if any(w in k.lower() for w in ("temperature", "top_p", "top_k",
                                                                                     "logprobs"))]
    return [Cause("recompute_sampling", "the trainer's recompute does not apply the sampling settings",
                  (*sig, where), (f"engine.logprobs_mode={mode}" + (f" with {samp_text}" if samp_text else ""), *named),
                  "divide the trainer's logits by the sampling temperature and apply the same top-k/top-p "
                  "before log_softmax (or let both sides use raw logprobs)", f"{SEED_PIPELINERL}; {VLLM_LOGPROBS}",
                  hint="" if named else SAME_ENGINE, step=p.step)]


def _precision(r: _Run) -> list[Cause]:
    """A symmetric mismatch at equal weights: rounding, i.e. precision or kernels."""
    p = r.parity
    if p is None or p.holds or p.one_signed is True or not p.before_update:
        return []
    signed = f", signed mean {p.signed:+.2g} (symmetric)" if p.signed is not None else ""
    later = f"; median {p.later_median:.3g} after" if math.isfinite(p.later_median) else ""
    sig = (f"{_step0(p)}: {V.parity_text(p.mean, p.tol)}{signed}{later}",)
    source = SEED_PIPELINERL
    if not r.fingerprint:
        return [Cause("numerics", "engine and trainer numerics differ (precision, lm_head, kernels)", sig, (),
                      "run the engine in the trainer's dtype, the lm_head in float32 at least", source,
                      hint=NO_FINGERPRINT, step=p.step)]
    trainer = S.trainer_dtype(r.params)
    base = S.bits(trainer[1]) if trainer else None
    eng, head = r.setting("engine.dtype"), r.setting("engine.lm_head_dtype")
    ref_eng = S.reference_value(r.ref_params, "engine.dtype")
    low = [b for b in (base, S.bits(ref_eng)) if b]
    floor = max(low) if low else None
    against = f" (the trainer runs {trainer[1]})" if trainer else ""
    settings = [d for d in [r.differs("engine.dtype"), r.differs("engine.lm_head_dtype")] if d]
    if floor and S.bits(eng) and S.bits(eng) < floor:
        fp32_head = bool(S.bits(head) and S.bits(head) >= 32)
        fix = ("run the engine in float32 like the trainer, or correct the remaining mismatch (truncated "
               "importance sampling)" if fp32_head else
               "run the engine in the trainer's dtype; at least load the lm_head in float32 "
               "(hf_overrides={'head_dtype': 'float32'})")
        settings = settings or [f"engine.dtype={eng}"]
        if fp32_head:
            settings.append("the lm_head already runs float32 (engine.lm_head_dtype)")
        return [Cause("engine_precision", f"engine precision: {eng} engine{against}", sig, tuple(settings), fix,
                      source, step=p.step)]
    if floor and S.bits(head) and S.bits(head) < floor:
        return [Cause("lm_head_precision", f"lm_head precision: {head} lm_head{against}", sig,
                      tuple(settings or [f"engine.lm_head_dtype={head}"]),
                      "load the lm_head in float32 (vLLM hf_overrides={'head_dtype': 'float32'})", source, step=p.step)]
    numerics = [S.vs(k, v) for k, v in r.diffs.items() if k.startswith(S.ENGINE) and any(
        w in k for w in ("attention", "kv_cache", "quantization", "eager", "compilation", "cudagraph", "batch_invariant"))]
    r.cited.update(k for k in r.diffs if any(w in k for w in ("attention", "kv_cache", "quantization")))
    return [Cause("numerics", "engine and trainer numerics differ", sig, tuple(numerics),
                  "compare kernels and batch invariance (attention backend, KV-cache dtype, quantization); the "
                  "fingerprint shows no lower dtype", source, hint="" if numerics else SAME_ENGINE, step=p.step)]


def _after_updates(r: _Run) -> list[Cause]:
    """Parity at the first step, lost from the first updates on: the engine serves stale KV or weights."""
    p = r.parity
    if p is None or not p.breaks_after_updates:
        return []
    sig = ((f"{_step0(p)}: {V.parity_text(p.mean, p.tol)}; then {p.later_median:.3g} (median) from step "
            f"{p.later_first_over} on: {p.later_over} of {p.later_steps} later steps above the tolerance"),)
    out = []
    if not r.fingerprint:
        return [Cause("stale_weights", "stale KV or weights after weight updates", sig, (),
                      "disable prefix caching or reset it on every weight push; pause generation (no async "
                      "scheduling) while weights load", f"{SEED_PIPELINERL}; {VLLM_PREFIX}", hint=NO_FINGERPRINT,
                      step=p.later_first_over or p.step)]
    if r.setting("engine.enable_prefix_caching") == "True":
        settings = [d for d in [r.differs("engine.enable_prefix_caching")] if d] or ["engine.enable_prefix_caching=True"]
        out.append(Cause("prefix_cache", "prefix caching across weight updates", sig, tuple(settings),
                         "disable prefix caching (enable_prefix_caching=False) or reset it on every weight push "
                         "(llm.reset_prefix_cache() after loading weights)", f"{SEED_PIPELINERL}; {VLLM_PREFIX}",
                         step=p.later_first_over or p.step))
    if r.setting("engine.async_scheduling") == "True":
        settings = [d for d in [r.differs("engine.async_scheduling")] if d] or ["engine.async_scheduling=True"]
        out.append(Cause("stale_weights", "stale weights: async scheduling across weight updates", sig,
                         tuple(settings), "turn async scheduling off, or pause generation while weights load and "
                         "track weight versions per token", SEED_PIPELINERL, step=p.later_first_over or p.step))
    if not out:
        out.append(Cause("stale_weights", "stale KV or weights after weight updates", sig, (),
                         "check the weight sync: every pushed tensor loaded, the cache reset, generation paused "
                         "while loading", SEED_PIPELINERL, hint="the fingerprint shows neither prefix caching "
                         "nor async scheduling", step=p.later_first_over or p.step))
    return out


def _origin(r: _Run) -> tuple[str, str]:
    """(where, text) of the first alert that says where the NaN entered (collectors/nan_origin.py), or ("", "")."""
    for e in r.alerts:
        o = e.get("origin")
        if isinstance(o, Mapping) and o.get("where"):
            return str(o["where"]), f"the alert at step {e.get('step')}: {o.get('text', o['where'])}"
    return "", ""


def _padding(r: _Run) -> list[Cause]:
    """NaN gradients from the first step with a finite (real) loss, on most steps: -inf padding in backward."""
    nf = r.nonfinite
    if nf is None or not nf.from_first_step or not nf.recurring or not nf.real_loss:
        return []
    if len(nf.loss_finite) < len(nf.steps):
        return []
    sig = [(f"non-finite gradients from step {nf.steps[0]} (the first step), {len(nf.steps)} of {nf.run_steps} "
            "steps, while the loss stays finite")]
    where, origin = _origin(r)
    if where and where != "loss_backward":  # the NaN entered elsewhere: not the padding's signature
        return []
    if origin:
        sig.append(origin)
    bxa = S.batch_x_accumulation(r.params)
    fix = ("mask padding before the divergence math: replace the -inf sentinel at padded positions (e.g. "
           "torch.where(mask, logprobs, 0)) before any exp/log, as the TRL fix does")
    if bxa is None:
        return [Cause("padding_inf", "-inf padding reaching the loss's backward", tuple(sig), (), fix, SEED_TRL,
                      hint=f"metrics only: {S.batch_unread(r.params)}", step=nf.steps[0])]
    n, text = bxa
    if n <= 1:
        return []
    return [Cause("padding_inf", "-inf padding reaching the loss's backward", tuple(sig),
                  (f"{text} = {n} samples per step: ragged lengths get padded",), fix, SEED_TRL, step=nf.steps[0])]


def _nan_filter(r: _Run) -> list[Cause]:
    """A trainer's logged loss finite (or exactly 0.0) where the gradients are NaN, or metrics that stop."""
    nf = r.nonfinite
    if nf is None or nf.real_loss:
        return []
    from rldiag.app.analysis.divergence import last_logged

    stopped = {k: s for k, s in last_logged(r.h, r.run, r.h.keys).items() if s < nf.steps[0] + 1 and s >= nf.steps[0] - 1}
    sig = []
    if nf.loss_zero:
        sig.append(f"loss logged as exactly 0.0 at step {nf.loss_zero[0]} where the gradients are non-finite")
    elif nf.loss_finite:
        sig.append(f"loss logged finite at {len(nf.loss_finite)} of {len(nf.steps)} non-finite steps (from step "
                   f"{nf.loss_finite[0]})")
    if stopped:
        sig.append("metrics stop with the first non-finite gradient: "
                   + ", ".join(f"{k} last logged at step {s}" for k, s in sorted(stopped.items())))
    if not sig:
        return []
    flag = S.find(r.params, ("logging_nan_inf_filter",))
    if flag is not None and flag[1] == "False" and not stopped:
        return []
    settings = (f"{flag[0]}={flag[1]}",) if flag else ()
    return [Cause("nan_filter", "a trainer's NaN filter hides a NaN loss", tuple(sig), settings,
                  f"the logged loss is not the real one from step {(nf.loss_zero or nf.loss_finite or nf.steps)[0]}: "
                  "set logging_nan_inf_filter=False "
                  "or log with rldiag's RldiagCallback (it records the real loss), then find where the NaN enters "
                  "(the NaN events page names the parameters)", HF_FILTER,
                  hint="" if flag else "metrics only: the run did not log logging_nan_inf_filter", step=nf.steps[0])]


def _optimizer(r: _Run) -> list[Cause]:
    """Parity holds at the first step, the departure starts after updates, and an optimizer setting differs."""
    p = r.parity
    if p is not None and (not p.holds or p.breaks_after_updates):
        return []
    opt = S.optimizer_diffs(r.diffs)
    if not opt:
        return []
    deps = departures_after_updates(r.h, r.run, r.refs)
    sig = [f"{d.key} leaves the reference seeds' range at step {d.step} ({V.range_text(d.key, d.value, d.low, d.high)}"
           ": their range widened by twice their spread or step-to-step wiggle)" for d in deps[:3]]
    sig += [t for t in r.departures if not any(t.startswith(d.key + " ") for d in deps)][:2]
    if not sig:
        return []
    lead = (f"{_step0(p)}: {V.parity_text(p.mean, p.tol)}" if p is not None
            else "engine parity not measured (no mismatch metric)")
    r.cited.update(opt)
    step = deps[0].step if deps else (first_step(r.h, r.run) or 0) + 1
    return [Cause("optimizer", "optimizer settings", (lead, *sig), tuple(S.vs(k, v) for k, v in opt.items()),
                  "go back to the reference's optimizer settings (" + ", ".join(f"{S.last(k)}={v[1]}" for k, v in
                                                                            opt.items()) + ") or retune them",
                  "GRPO/PPO practice: learning rate and clip range set the update size (TRL GRPOConfig docs)",
                  step=step)]


def _is_weights(r: _Run) -> list[Cause]:
    """An ESS drop with a rising mismatch: the importance weights degenerate (`causes_is`)."""
    return is_cause(r.h, r.run, r.refs, r.params, Cause)


RULES: tuple[Callable[[_Run], list[Cause]], ...] = (_semantics, _precision, _after_updates, _padding, _nan_filter,
                                                    _optimizer, _is_weights)


def likely_causes(histories: Histories, configs: Mapping[str, object], reference_ids: Sequence[str],
                  candidate_ids: Sequence[str], *, summaries: Sequence[object] | None = None,
                  alerts: Mapping[str, list[dict]] | None = None) -> list[RunCauses]:
    """One `RunCauses` per candidate (in order). `configs`: run id -> its params, as a mapping or an
    object with `.params` (`rldiag.app.analysis.config_diff.RunConfig`). Load SIGNATURE_KEYS into
    `histories`; missing metrics make for fewer signatures, never a false cause. `summaries`
    (`rldiag.app.analysis.divergence.summarize`) add the detector's departures as evidence; `alerts`
    (`rldiag.app.data.alerts.load_alert_events`) the NaN's positions."""
    def params(run: str) -> Mapping[str, str]:
        """The run's params as strings (MLflow's form: None -> "None"); {} where they are not a mapping."""
        c = getattr(configs.get(run) or {}, "params", configs.get(run) or {})
        return {str(k): str(v) for k, v in c.items()} if isinstance(c, Mapping) else {}

    refs = tuple(dict.fromkeys(reference_ids))
    ref_params = tuple(params(r) for r in refs)
    by_summary = {getattr(s, "run_id", None): s for s in summaries or ()}
    out = []
    for cand in candidate_ids:
        mine = params(cand)
        try:
            r = _read(histories, cand, refs, mine, ref_params, by_summary.get(cand), (alerts or {}).get(cand, ()))
        except Exception as e:  # noqa: BLE001 - one candidate's unreadable signatures never stop a report
            out.append(RunCauses(cand, (), failed=(V.check_failed("reading the metric signatures", e),)))
            continue
        causes, failed = [], []
        for rule in RULES:
            try:
                causes += rule(r)
            except Exception as e:  # noqa: BLE001 - one check's bug never hides the others or the report
                failed.append(V.check_failed(rule.__name__.strip("_").replace("_", " "), e))
        causes = with_is_evidence(sorted(causes, key=lambda c: (bool(c.hint), c.step)))  # confirmed first, earliest
        also = S.also_differs(mine, r.diffs, r.cited)
        notes = []
        if not causes:
            if not r.diffs and (mine or any(ref_params)):  # neither logged params: nothing to say, no line each
                notes.append(V.same_params_note(mine, ref_params) if mine else "it logged no params to compare")
            if r.nonfinite is not None:
                notes.append(f"non-finite gradients from step {r.nonfinite.steps[0]}: no known signature fits; "
                             "the NaN events page names the parameters")
            if r.parity is None and r.departures:
                notes.append(parity_unknown(r.h, r.run))
        out.append(RunCauses(cand, tuple(causes), also, tuple(notes), tuple(failed)))
    return out


def _read(h: Histories, cand: str, refs: tuple[str, ...], mine: Mapping[str, str],
          ref_params: tuple[Mapping[str, str], ...], summary: object, alerts: Sequence[dict]) -> _Run:
    """What the rules read about `cand`: its params' differences, parity, non-finite signature, departures."""
    diffs = S.differing(mine, ref_params) if ref_params and mine else {}  # nothing to compare: no difference
    start = first_step(h, cand)
    # each metric's lead departure (the one its headline names), worded as every product words it: alert and onset
    leads = [(d.key, dep) for d in getattr(summary, "departures", ()) if (dep := d.lead) is not None]
    departures = tuple(V.departure_sentence(key, dep) for key, dep in leads
                       if dep.kind != "nonfinite" and start is not None and dep.onset_step > start)
    return _Run(h, cand, refs, mine, ref_params, diffs, parity(h, cand, refs), nonfinite_signature(h, cand),
                departures, tuple(a for a in alerts if isinstance(a, Mapping)))

