"""rldiag in a transformers `Trainer` or a TRL trainer (`GRPOTrainer`, ...): a `TrainerCallback`.

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), ...)
    RldiagCallback(experiment="grpo", run_name="v1", policy="skip").attach(trainer)
    trainer.train()

Each optimizer step (the logic lives in the core: `AccumulatedGradCheck`, `RunSession`):
- a forward hook watches the model's output logits, so an alert names the samples and token
  positions (per micro-batch) whose logits got non-finite gradients;
- per-parameter gradient norms are recorded as gradients accumulate, i.e. before `Trainer` clips
  (clipping a NaN total norm makes every gradient NaN), and judged in `on_pre_optimizer_step` with one
  host transfer: the same alert and warn/skip/raise policy as `Monitor` (one `NonFinitePolicy`,
  collectors/nonfinite.py: the run param `rldiag.nonfinite_policy`, `grad/skipped` on a non-finite step,
  `grad/found` 0 where no gradient reached `.grad`);
- `skip` zeroes the gradients and turns the coming `optimizer.step()` into a no-op for that one call
  (transformers 5.2 to 5.24 call `self.optimizer.step()` right after `on_pre_optimizer_step` and have
  no flag to skip it). The step still counts: `global_step` and the LR schedule advance;
- `grad/norm` (pre-clip), `grad/finite`, `grad/nonfinite_params` are logged every step, and once
  `attach`ed the real loss as `loss`: the sum of what `training_step` returned over the step's
  micro-batches, i.e. what `Trainer` would log with `logging_steps=1` were it not for
  `logging_nan_inf_filter`, which replaces a NaN/inf loss by the running average. The trainer's own
  logged value is kept as `trainer/loss`;
- everything the trainer logs is forwarded at `state.global_step` under its own name and also under
  the canonical key of each alias in `keys.ALIASES` (`kl`, `entropy`, `reward`, ...).
At train begin the arguments that make runs comparable become `trainer.*` params (batch size,
accumulation, learning rate, clipping, seed, TRL loss settings; a whitelist, so never tokens or paths).

Under torch.distributed (DDP, `world_size > 1`) every rank runs the check and the ranks agree on the
flag with one all-reduce per step; on a non-finite step the parameter names of every rank are gathered
(`rank<r>:name`), rank 0 alerts and writes, and every rank applies the same policy, so no rank steps
while another skips. (DDP averages gradients across ranks, so a NaN on one rank usually reaches every
rank's copy: the names then come from every rank.) Under FSDP (DTensor or flat shards) each rank measures
its shards, the same SUM all-reduce adds the ranks' squares up to the global pre-clip norm, and a sharded
parameter is named once by its FQN. DeepSpeed ZeRO keeps gradients out of `.grad`; there the check finds
nothing to read and says so once.

fp16 (accelerate's GradScaler, found on the optimizer): the recorded norms are of the scaled gradients and
are logged divided by the scale; a scaler overflow is `grad/scaler_overflow` (collectors/amp.py), not an
alert, and `skip` does nothing more: accelerate's `optimizer.step()` runs `scaler.step`, which skips the
step, and `scaler.update()`. On a non-finite step the alert says where the NaN entered
(collectors/nan_origin.py), in the order the gradients arrived.
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

from rldiag.collectors import distributed, keys
from rldiag.collectors.accumulated import AccumulatedGradCheck
from rldiag.collectors.compat import deepspeed
from rldiag.collectors.compat.torch import loss_scale_tensor
from rldiag.collectors.gradcheck import GradReport, LogitsProbe
from rldiag.collectors.import_utils import require
from rldiag.collectors.nonfinite import NonFinitePolicy, check_policy
from rldiag.collectors.session import NonFiniteGradientError, RunSession

require("transformers", "hf", purpose="rldiag's transformers/TRL callback")

from transformers import TrainerCallback

log = logging.getLogger("rldiag")

__all__ = ["LOGGED_LOSS", "RldiagCallback", "trainer_params"]

# Where a trainer log goes when the callback writes that key itself: the trainer's own (NaN-filtered,
# window-averaged) `loss` becomes `trainer/loss` once the real per-step loss owns `loss`.
TRAINER_PREFIX = "trainer/"
LOGGED_LOSS = TRAINER_PREFIX + keys.LOSS
REAL_LOSS = keys.LOSS_UNFILTERED  # the unfiltered per-step loss, in the trainer's own run (whose `loss` is filtered)
PARAM_PREFIX = "trainer"

# TrainingArguments / TRL config fields that change results; read when present. Whitelisted, so no
# token, path or hub setting can leak into the params.
COMPARED_ARGS: tuple[str, ...] = (
    # transformers
    "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "max_grad_norm", "seed",
    "data_seed", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "lr_scheduler_type",
    "warmup_steps", "max_steps", "num_train_epochs", "bf16", "fp16", "tf32", "gradient_checkpointing",
    "average_tokens_across_devices", "logging_nan_inf_filter",
    # TRL loss and sampling settings (GRPO/RLOO/DPO/distillation)
    "loss_type", "beta", "epsilon", "epsilon_high", "delta", "importance_sampling_level", "scale_rewards",
    "num_generations", "num_iterations", "steps_per_generation", "generation_batch_size",
    "max_prompt_length", "max_completion_length", "max_length", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "mask_truncated_completions", "top_entropy_quantile", "reward_weights",
    "use_vllm", "vllm_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_cap", "lmbda", "alpha", "label_smoothing", "sync_ref_model",
)

_SESSION_OPTIONS = frozenset(inspect.signature(RunSession.__init__).parameters) - {"self", "experiment"}


def trainer_params(args: Any) -> dict[str, Any]:
    """`{name: value}` of the `COMPARED_ARGS` that `args` has, plus the effective batch and versions."""
    out: dict[str, Any] = {"args_class": type(args).__name__}
    for name in COMPARED_ARGS:
        if hasattr(args, name):
            v = getattr(args, name)
            out[name] = v.value if isinstance(v, enum.Enum) else v
    world = getattr(args, "world_size", 1)
    out["world_size"] = world
    out["effective_batch_size"] = (
        getattr(args, "per_device_train_batch_size", 1) * getattr(args, "gradient_accumulation_steps", 1) * world
    )
    import transformers

    out["version.transformers"] = transformers.__version__
    if "trl" in sys.modules:  # a TRL trainer imported it; importing it here would cost seconds
        out["version.trl"] = getattr(sys.modules["trl"], "__version__", "")
    return out


class RldiagCallback(TrainerCallback):
    """Non-finite gradient alerts and policy, trainer logs under canonical keys, run params.

    Pass an open `session`, or `RunSession`'s keyword options (experiment, run_name, tags, params,
    tracking_uri, policy, ...) and the callback opens the run at train begin and ends it at train end.
    Call `attach(trainer)` (or pass it in `callbacks=[...]` and still call `attach` for the real loss).
    """

    def __init__(self, session: RunSession | None = None, *, experiment: str | None = None, **options: Any):
        unknown = set(options) - _SESSION_OPTIONS
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; RunSession takes {sorted(_SESSION_OPTIONS)}")
        if session is not None and options:
            raise TypeError(f"pass either session= or RunSession options, not both (got {sorted(options)})")
        policy = check_policy(options.get("policy", "warn"))
        self.session = session
        self._owns_session = session is None
        self._experiment = experiment
        self._options = options
        self._check: AccumulatedGradCheck | None = None
        self._loss_sum: torch.Tensor | None = None
        self._attached = False
        self._restore_step = None
        self.nonfinite = NonFinitePolicy(policy if session is None else session.policy, no_grad_hint=(
            "no gradient reached .grad before the optimizer step: DeepSpeed or FSDP keeping them elsewhere?"))
        self._distributed = False
        self._device: torch.device | None = None
        self._probe = LogitsProbe()
        self._probe_handle = None
        self._shared_run = False  # logging into transformers' MLflowCallback run (report_to="mlflow")
        self._zero = False  # DeepSpeed ZeRO through accelerate (its engine steps inside accelerator.backward)
        self._trainer_norm: Any = None  # what accelerate's clip_grad_norm_ returned this step (attach() records it)
        self._norm_from_log: int | None = None  # a step whose grad/norm is the Trainer's logged grad_norm (DDP, no attach)
        self._warned_zero_skip = False

    # ---- wiring --------------------------------------------------------------------------------
    def attach(self, trainer: Any) -> RldiagCallback:
        """Add this callback to `trainer` (once), record the real per-step loss from its
        `training_step` (the value `logging_nan_inf_filter` would hide), and end the run as FAILED
        when `train()` raises. Returns self."""
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        if not self._attached:
            step_fn = trainer.training_step

            def training_step(*args: Any, **kwargs: Any) -> torch.Tensor:
                loss = step_fn(*args, **kwargs)
                if isinstance(loss, torch.Tensor):
                    d = loss.detach()
                    self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
                return loss

            trainer.training_step = training_step
            accelerator = getattr(trainer, "accelerator", None)
            clip_fn = getattr(accelerator, "clip_grad_norm_", None)
            if clip_fn is not None:  # the Trainer's own pre-clip norm (it clips, or measures, every optimizer step)

                def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
                    norm = clip_fn(*args, **kwargs)
                    self._trainer_norm = norm
                    return norm

                accelerator.clip_grad_norm_ = clip_grad_norm_
            train_fn = trainer.train

            def train(*args: Any, **kwargs: Any) -> Any:
                try:
                    return train_fn(*args, **kwargs)
                except BaseException:  # an error or Ctrl-C mid-run: end the run as FAILED, take the hooks off
                    self._finish("FAILED")
                    raise

            trainer.train = train
            self._attached = True
        return self

    # ---- lifecycle -----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        params = trainer_params(args)
        self.nonfinite.rank = 0 if state.is_world_process_zero else max(1, getattr(args, "process_index", 1))
        if state.is_world_process_zero:
            self._open(params, args)
        self._loss_sum = None
        self._distributed = args.world_size > 1 and distributed.active()
        if not self._attached:
            log.warning("rldiag: RldiagCallback is not attached: `%s` will hold the trainer's logged loss, "
                        "which logging_nan_inf_filter cleans of NaN/inf; call .attach(trainer)", keys.LOSS)
        if self._check is not None:  # a previous train() that raised without attach()
            self._check.remove()
        if model is not None:
            self._zero = deepspeed.zero_model(model)
            self._check = AccumulatedGradCheck(model.named_parameters(), module=model)
            self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
            if self._probe_handle is not None:
                self._probe_handle.remove()
            self._probe_handle = model.register_forward_hook(self._watch_logits)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        loss, self._loss_sum = self._loss_sum, None
        if self._check is None:
            return
        extras = [loss] if loss is not None else []
        # fp16: accelerate's optimizer holds the GradScaler; the recorded norms are of the scaled gradients
        scale_t = loss_scale_tensor(getattr(optimizer, "scaler", None))
        if scale_t is not None:
            extras.append(scale_t)
        if self._distributed:  # every rank, every step: the collectives must match up
            import torch.distributed as dist

            # [ranks with a non-finite gradient, the global norm's square as shards + replicated tensors]:
            # one SUM all-reduce on the device, read with the norms in the one transfer
            summary = self._check.device_summary(self._device, dist.get_world_size())
            dist.all_reduce(summary, op=dist.ReduceOp.SUM)
            extras += list(summary)
        trainer_norm, self._trainer_norm = self._trainer_norm, None
        norm_t = trainer_norm if isinstance(trainer_norm, torch.Tensor) and trainer_norm.numel() == 1 else None
        if norm_t is not None:  # last in the one transfer
            extras.append(norm_t)
        shared = self._check.sharded_names() if self._distributed else set()  # before collect() resets
        report, extra = self._check.collect(*extras)
        if norm_t is not None:
            trainer_norm = extra.pop()
        elif not isinstance(trainer_norm, (int, float)):
            trainer_norm = None
        watched = self._probe.watched()
        if report is not None and not report.finite:  # failure path only: read the probe's flags
            report.positions, report.nonfinite_positions = self._probe.positions(), self._probe.count()
        self._probe.reset()
        step = state.global_step + 1  # the step this update becomes; on_log reports it under the same number
        if self._distributed:
            bad_ranks, shard_sq, rest_sq = extra[-3:]
            del extra[-3:]
            if report is not None:
                report.norm = math.sqrt(shard_sq + rest_sq)  # NaN when any rank's is
            report = self._agree(report, any_rank_bad=bad_ranks != 0.0, shared=shared)
            if report is not None and report.finite and not math.isfinite(report.norm):
                report.norm = math.nan  # finite gradients whose float32 squares overflowed: unknown, never inf
        scale = extra.pop() if scale_t is not None else None
        loss_value = extra[0] if extra else None
        # the norms were taken at the end of backward, before the Trainer's unscale_: still scaled
        failed = report is not None and report.finite is False and self.session is not None
        report = self.nonfinite.judge(report, scale=scale, scaled=True, loss=loss_value, how="hooks",
                                      order=self._check.order() if failed else (), watched=watched)
        unknown = self._reduced_norm(report, shared=shared, trainer_norm=trainer_norm, optimizer=optimizer)
        if unknown and (trainer_norm is None or math.isfinite(trainer_norm)):
            self._norm_from_log = step  # no norm is made up: the flag alone, and the Trainer's grad_norm
        # in the trainer's run, `loss` is MLflowCallback's (filtered) value: the real one goes beside it
        values = {(REAL_LOSS if self._shared_run else keys.LOSS): loss_value} if extra else {}
        try:
            step_anyway = self.nonfinite.settle(self.session, step, report, values, loss=loss_value,
                                                can_skip=not self._zero)
        except NonFiniteGradientError:  # the other ranks stop with rank 0
            self._finish("FAILED")
            raise
        if self._zero and self.nonfinite.policy == "skip" and report.finite is False and not report.overflow:
            # the engine stepped inside accelerator.backward, before this hook
            if not self._warned_zero_skip:
                self._warned_zero_skip = True
                log.warning("rldiag: step %d: policy 'skip' cannot skip under DeepSpeed through accelerate (the "
                            "engine has already stepped); DeepSpeed skips a non-finite step itself under fp16 and, "
                            "in ZeRO 1-2 without bf16, with gradient_clipping set", step)
            return
        if not step_anyway:  # policy "skip" (True under a scaler: its step skips it)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            self._restore_step = _skip_next_step(optimizer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._restore_step is not None:  # skip_next_step restores on its own call; be sure
            self._restore_step()
            self._restore_step = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.session is None or not logs or self._shared_run:
            return  # in the trainer's own run, MLflowCallback logs the trainer's numbers
        self.session.writer.log_metrics(self._mapped(logs, state.global_step), state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._finish("FINISHED")

    # ---- helpers -------------------------------------------------------------------------------
    def _watch_logits(self, module, inputs, output) -> None:
        """Forward hook: the probe watches each training forward's logits (which samples and tokens get
        non-finite gradients); forwards without gradients (generation, eval) are left alone."""
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.requires_grad and logits.dim() >= 2:
            self._probe.watch(logits)

    def _reduced_norm(self, report: GradReport | None, *, shared: set[str], trainer_norm: float | None,
                      optimizer: Any) -> bool:
        """Put the norm of the gradients the optimizer steps on into `report` where the hooks' own (each rank's
        gradient before its reduction) is not it; True when that norm is not known (log the flag alone).
        After `unscale_report`: both norms used here are unscaled already."""
        if report is None or not report.finite or report.overflow:
            return False
        if self._zero:
            # DeepSpeed ZeRO through accelerate: the engine has stepped already (inside accelerator.backward),
            # and the norm of the reduced gradients is DeepSpeed's own. The finite flag stands: a NaN on any
            # rank's gradient is one in the reduced gradient.
            norm = deepspeed.stepped_norm(optimizer)
        elif self._distributed and not shared:
            # DDP: each rank's norm before the average does not make the averaged gradient's; the Trainer's own
            # (accelerate's clip_grad_norm_, recorded by attach()) is of the averaged gradients.
            norm = trainer_norm if trainer_norm is not None and math.isfinite(trainer_norm) else None
        else:  # one process, or FSDP shards (their squares add up): the hooks' norm is the one
            return False
        report.norm = float(norm) if norm is not None else float("nan")
        return norm is None

    def _agree(self, report: GradReport | None, *, any_rank_bad: bool, shared: set[str]) -> GradReport | None:
        """The step as every rank sees it: on a non-finite step (on any rank), every rank's names (a
        sharded parameter's once, by its FQN; a replicated one's as `rank<r>:name`)."""
        if not any_rank_bad:
            return report
        bad = report is not None and not report.finite
        names, positions, _ = distributed.gather_failure(report.nonfinite_params if bad else [],
                                                         report.positions if bad else [], shared=shared)
        if not names:  # every rank's elements are finite: a float32 norm overflowed, not a NaN
            return report
        return GradReport(norm=report.norm if bad else float("nan"), finite=False, nonfinite_params=names,
                          positions=positions, nonfinite_positions=len(positions))

    def _open(self, params: dict[str, Any], args: Any) -> None:
        if self.session is None:
            options = dict(self._options)
            options["params"] = {**(options.get("params") or {}), PARAM_PREFIX: params}
            options["tags"] = {keys.TAG_SEED: getattr(args, "seed", ""), **(options.get("tags") or {})}
            experiment, shared = self._run_of_the_script(args, options)
            self._shared_run = shared
            self.session = RunSession(experiment, **options)
            self._owns_session = True
            self.nonfinite.record(self.session)
            return
        self.nonfinite.record(self.session)
        from mlflow.entities import Param

        from rldiag.collectors.mlflow_store import flatten_params

        items = [Param(k, v) for k, v in flatten_params({PARAM_PREFIX: params}).items()]
        try:
            self.session.client.log_batch(self.session.run_id, params=items)
        except Exception as e:  # noqa: BLE001 - a param logged earlier with another value; not worth a crash
            from rldiag.collectors.uri import redact_text

            log.warning("rldiag: could not log the trainer params on run %s (%s: %s)",
                        self.session.run_id, type(e).__name__, redact_text(str(e)))

    def _run_of_the_script(self, args: Any, options: dict[str, Any]) -> tuple[str, bool]:
        """Where a stock script's run is, as transformers' own MLflowCallback finds it. With
        `report_to="mlflow"` that callback (earlier in the list) has started its run by now: log into
        it (one run per training). Otherwise honour what MLflowCallback honours: `run_name`,
        $MLFLOW_EXPERIMENT_NAME and $MLFLOW_RUN_ID. What the user passed to RldiagCallback wins.
        Returns (experiment, whether the run is the trainer's)."""
        experiment = self._experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rldiag"
        report_to = getattr(args, "report_to", None) or []
        report_to = [report_to] if isinstance(report_to, str) else list(report_to)
        if "run_id" not in options and ("mlflow" in report_to or "all" in report_to):
            import mlflow

            active = mlflow.active_run()
            if active is not None:
                options["run_id"] = active.info.run_id
                options.setdefault("tracking_uri", mlflow.get_tracking_uri())
                options.pop("run_name", None)
                return experiment, True
        if "run_id" not in options and os.environ.get("MLFLOW_RUN_ID"):
            options["run_id"] = os.environ["MLFLOW_RUN_ID"]
        if "run_id" not in options and not options.get("run_name") and getattr(args, "run_name", None):
            options["run_name"] = args.run_name
        return experiment, False

    def _mapped(self, logs: Mapping[str, Any], step: int) -> dict[str, float]:
        """The trainer's numbers under their own names plus the canonical key of each alias, except
        where the callback writes that key itself every step (`grad/norm`, and `loss` once attached).
        A trainer key that collides with one of those moves under `trainer/`: `loss` -> `LOGGED_LOSS`.
        At a step where the callback could not know the norm (DDP without `attach`), the Trainer's own
        `grad_norm` (of the averaged gradients) is `grad/norm`."""
        owned = set()
        if self._check is not None and step != self._norm_from_log:
            owned.add(keys.GRAD_NORM)
            if self._attached:
                owned.add(keys.LOSS)
        out: dict[str, float] = {}
        for k, v in logs.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue  # TRL logs None for metrics it could not compute; strings are not metrics
            out[TRAINER_PREFIX + k if k in owned else k] = v
            canonical = keys.ALIASES.get(k)
            if canonical is not None and canonical not in owned and canonical not in logs:
                out[canonical] = v
        return out

    def _finish(self, status: str) -> None:
        if self._restore_step is not None:
            self._restore_step()
            self._restore_step = None
        if self._check is not None:
            self._check.remove()
            self._check = None
        if self._probe_handle is not None:
            self._probe_handle.remove()
            self._probe_handle = None
        self._probe.reset()
        if self.session is not None and self._owns_session:
            self.session.close(status)
            self.session = None


def _skip_next_step(optimizer: Any):
    """Make the next `optimizer.step()` a no-op, once; returns a function that undoes it.

    The replacement is an instance attribute, so whatever `step` the instance had (an accelerate or
    LR-scheduler wrapper) comes back exactly as it was.
    """
    had_own = "step" in vars(optimizer)
    own = vars(optimizer).get("step")

    def restore() -> None:
        if vars(optimizer).get("step") is not skipped:
            return
        if had_own:
            optimizer.step = own
        else:
            del optimizer.step

    def skipped(*args: Any, **kwargs: Any) -> None:
        restore()
        if getattr(own, "_wrapped_by_lr_sched", False):
            optimizer._opt_called = True  # what torch's LR-scheduler wrapper records; else it warns of a wrong order

    optimizer.step = skipped
    return restore
