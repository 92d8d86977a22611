"""DeepSpeed ZeRO 1, 2 and 3 on two real gloo processes (CPU: DeepSpeed's CPU accelerator). ZeRO keeps the
gradients out of `.grad`; `Monitor.step`, called between `engine.backward(loss)` and `engine.step()`, reads
each rank's partition from the engine's buffers, takes the global pre-clip norm over them (DeepSpeed's own
`get_global_grad_norm()` on finite steps), names a NaN parameter by its name on every rank, and under
`skip` every rank skips (rldiag zeroes the partitions, the loop leaves out `engine.step()`), so the model
stays what a plain replica trained on the finite steps only would be. ZeRO-Offload included: there `skip`
must also reset DeepSpeed's count of backwards, else the step after a skip adds a stale gradient (stage 2)
or keeps the NaN (stage 3). DeepSpeed's fp16 cannot run on a CPU ("Type fp16 is not supported on your
device"): that case is tests/gpu/deepspeed_zero.py's, for a GPU."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.helpers.gloo_job import assert_nan_run_logged, teardown
from tests.helpers.net import free_port

STEPS = 5
BACKWARD_NAN = 1  # rank 1's backward gives 1.bias a NaN gradient; DeepSpeed's reduce carries it on
PARTITION_NAN = 3  # after backward, a NaN written into rank 1's own partition of 1.weight: only rank 1 sees it
NAN_STEPS = (BACKWARD_NAN, PARTITION_NAN)
CASES = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16"), (2, "fp32-offload"), (3, "fp32-offload")]


def _worker(rank: int, world: int, port: int, uri: str, out_dir: str, stage: int, dtype: str) -> None:
    import copy

    import deepspeed
    import torch
    from torch import nn

    from rldiag.collectors import Monitor
    from rldiag.collectors.compat.deepspeed import zero_local_grad
    from tests.helpers.gloo_job import nan_bias_hook

    os.environ.update({"MLFLOW_DISABLE_TELEMETRY": "true", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)  # same initial weights on both ranks
    plain = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    ref = copy.deepcopy(plain)  # a plain float32 replica: trained on the finite steps only
    nan_now = [False]
    plain[1].register_forward_hook(nan_bias_hook(lambda: nan_now[0]))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 1.0}  # DeepSpeed clips (its default, spelled out): the replica is clipped alike
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype.endswith("offload"):  # ZeRO-Offload: the optimizer and its gradient partitions in CPU memory
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False  # the client's SGD (the replica's), not DeepSpeedCPUAdam
    engine, _, _, _ = deepspeed.initialize(model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
                                           config=config)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    low = next(engine.module.parameters()).dtype

    def x(r: int, step: int) -> torch.Tensor:
        return torch.ones(2, 3) * (r + 1) * (1 + 0.25 * step)

    warned = _capture_warnings()
    results = []
    with Monitor("deepspeed", run_name=f"zero{stage}-{dtype}", tracking_uri=uri, policy="skip",
                 spill_dir=os.path.join(out_dir, f"spill{rank}")) as mon:
        for step in range(STEPS):
            nan_now[0] = rank == 1 and step == BACKWARD_NAN
            loss = engine(x(rank, step).to(low)).float().pow(2).mean()
            engine.backward(loss)
            if rank == 1 and step == PARTITION_NAN:
                with torch.no_grad():
                    zero_local_grad(dict(engine.module.named_parameters())["1.weight"])[0] = float("nan")
            # DeepSpeed averages the ranks' gradients: the replica's gradient of the mean of both ranks' losses
            sum(ref(x(r, step)).pow(2).mean() for r in range(world)).div(world).backward()
            expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
            go = mon.step(step, engine, loss=loss)
            report = mon.last_report
            pieces = [zero_local_grad(p) for p in engine.module.parameters()]
            zeroed = all(int(torch.count_nonzero(g.float().nan_to_num(1.0))) == 0 for g in pieces if g is not None)
            ds_norm = None
            if go:
                engine.step()  # DeepSpeed's own norm of this step's gradients, read after its step
                ds_norm = float(engine.get_global_grad_norm())
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                ref_opt.step()
            ref_opt.zero_grad()
            results.append({"step": step, "go": go, "found": report.found, "finite": report.finite,
                            "names": report.nonfinite_params, "norm": report.norm, "expected": expected,
                            "ds_norm": ds_norm, "zeroed": zeroed, "pieces": sum(g is not None for g in pieces)})
        run_id = mon.run_id
    partial = _partial_read(engine, x(rank, STEPS).to(low), warned)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # the full weights (ZeRO 3)
        state = {n: p.detach().float().tolist() for n, p in engine.module.named_parameters()}
    ref_state = {n: p.detach().tolist() for n, p in ref.named_parameters()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"results": results, "run_id": run_id, "state": state, "ref_state": ref_state, "partial": partial}))
    teardown()


def _capture_warnings() -> list[str]:
    import logging

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    logging.getLogger("rldiag").addHandler(Keep(logging.WARNING))
    return got


def _partial_read(engine, x, warned: list[str]) -> dict:
    """One more backward, then DeepSpeed made to refuse one parameter this rank holds a piece of (as
    `get_lp_grad_fragment` refuses outside its window): the check reads the others and says which went
    unchecked, once; the normal steps before warned of no partial read."""
    from rldiag.collectors.compat.deepspeed import owns_zero_grad
    from rldiag.collectors.gradcheck import collect_grads

    before = list(warned)
    engine.backward(engine(x).float().pow(2).mean())
    named = dict(engine.module.named_parameters())
    victim = next(n for n, p in named.items() if owns_zero_grad(p))
    p = named[victim]
    z3 = getattr(p, "_z3_optimizer", None)
    if z3 is not None:  # ZeRO 3: the optimizer's partition lookup fails for this one parameter
        real = z3._get_fp32_grad_state_partition

        def refuse(param, release_swap_buffers=False):
            if param is p:
                raise KeyError(param.ds_id)
            return real(param=param, release_swap_buffers=release_swap_buffers)

        z3._get_fp32_grad_state_partition = refuse
    else:  # ZeRO 1-2: this parameter's fragment mapping refuses
        def refuse(*_a, **_k):
            raise ValueError("lp_grad_fragment is only available immediately after backward")

        p._hp_mapping.get_lp_grad_fragment = refuse
    read = [e.name for e in collect_grads(engine.module)]
    collect_grads(engine.module)  # the same gap again: no second warning
    engine.zero_grad()
    return {"victim": victim, "read": read, "before": before, "after": warned[len(before):]}


def _close(a, b, tol: float) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    return abs(a - b) <= tol * (1 + abs(b))


@pytest.mark.timeout(600)  # two gloo ranks building DeepSpeed ops: past 300 s on 2 shared cores
@pytest.mark.parametrize(("stage", "dtype"), CASES, ids=[f"zero{s}-{d}" for s, d in CASES])
def test_nan_in_a_zero_partition_every_rank_agrees_and_skips(stage, dtype, tmp_path, sqlite_uri):
    mp.start_processes(_worker, args=(2, free_port(), sqlite_uri, str(tmp_path), stage, dtype), nprocs=2,
                       join=True, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # bf16 weights, inputs and gradients part from the float32 replica by a few per cent over the steps;
    # DeepSpeed's own norm is of the same bf16 gradients rldiag reads
    tol, norm_tol = (1e-5, 1e-5) if dtype.startswith("fp32") else (2e-2, 5e-2)
    for r in ranks:
        res = r["results"]
        # ZeRO's gradients were found (each rank holds a partition: never the "no gradient" unknown)
        assert all(x["found"] for x in res) and all(x["pieces"] > 0 for x in res)
        # every rank agrees: non-finite and skipped at both NaN steps only, its partitions zeroed there
        assert [x["go"] for x in res] == [s not in NAN_STEPS for s in range(STEPS)]
        assert [x["finite"] for x in res] == [s not in NAN_STEPS for s in range(STEPS)]
        assert all(x["zeroed"] for x in res if x["step"] in NAN_STEPS)
        # named by the model's own parameter names, once, whichever ranks' partitions hold the NaN
        assert res[BACKWARD_NAN]["names"] == ["1.bias"]
        assert res[PARTITION_NAN]["names"] == ["1.weight"]
        for x in res:  # the global pre-clip norm over every rank's partition: the replica's, and DeepSpeed's
            if x["finite"]:
                assert x["norm"] == pytest.approx(x["expected"], rel=norm_tol)
                assert x["norm"] == pytest.approx(x["ds_norm"], rel=1e-5)
            else:
                assert math.isnan(x["norm"])
        # both skips on both ranks: the model is the plain replica trained on the finite steps
        assert set(r["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
        for name, value in r["state"].items():
            assert _close(value, r["ref_state"][name], tol), name
    assert ranks[0]["state"] == ranks[1]["state"]
    assert ranks[1]["run_id"] is None  # rank 0 logs
    for r in ranks:  # a parameter DeepSpeed gave no gradient for is named as unchecked, never silently left out
        part = r["partial"]
        assert not [w for w in part["before"] if "gave no gradient" in w]
        assert part["read"] and part["victim"] not in part["read"]
        assert len(part["after"]) == 1 and "gave no gradient for 1 of the" in part["after"][0]
        assert part["victim"] in part["after"][0]

    # rank 0's run: the NaN steps flagged, no step unknown, DeepSpeed's norms, both alerts
    assert_nan_run_logged(sqlite_uri, ranks[0]["run_id"], steps=STEPS, nan_steps=NAN_STEPS,
                          norms={x["step"]: x["ds_norm"] for x in ranks[0]["results"] if x["finite"]},
                          last_param="1.weight")


def test_a_model_without_deepspeed_parameters_reads_as_before():
    """`zero_local_grad` reads nothing from a plain parameter (no ZeRO attributes): such a model's check
    is the plain one, and a parameter without a gradient is still left out (unknown, never finite)."""
    import torch

    from rldiag.collectors.compat.deepspeed import is_zero_param, zero_local_grad
    from rldiag.collectors.gradcheck import collect_grads

    lin = torch.nn.Linear(2, 2)
    assert zero_local_grad(lin.weight) is None and not is_zero_param(lin.weight)
    assert collect_grads(lin) == []
    lin(torch.ones(1, 2)).sum().backward()
    assert [(e.name, e.sharded) for e in collect_grads(lin)] == [("weight", False), ("bias", False)]


def test_fp16_zero_parameters_passed_without_the_engine_are_warned_of(sqlite_uri, tmp_path, caplog):
    """DeepSpeed's fp16 cannot run on a CPU: a FAKE fp16 ZeRO parameter (a `_hp_mapping` attribute, as ZeRO 1-2
    sets one) stands in for `engine.module`. Its loss scale cannot be read without the engine, so Monitor.step
    says to pass the engine, once."""
    import deepspeed  # noqa: F401 - loaded, as in a DeepSpeed run
    import torch

    from rldiag.collectors import Monitor

    class FakeMapping:  # what ZeRO 1-2 hangs on a parameter; this one has no gradient fragment to give
        def get_lp_grad_fragment(self, index):
            raise ValueError("lp_grad_fragment is only available immediately after backward")

    model = torch.nn.Linear(2, 2).half()
    for p in model.parameters():
        p._hp_mapping, p._index_in_param_group = FakeMapping(), 0
    with Monitor("deepspeed", run_name="fp16-module", tracking_uri=sqlite_uri, spill_dir=str(tmp_path)) as mon:
        with caplog.at_level("WARNING", logger="rldiag"):
            mon.step(0, model)
            mon.step(1, model)
    said = [r.getMessage() for r in caplog.records if "not the DeepSpeedEngine" in r.getMessage()]
    assert len(said) == 1 and "Pass the engine" in said[0]


def _accumulation_worker(rank: int, world: int, port: int, uri: str, out_dir: str, stage: int,
                         policy: str = "warn") -> None:
    import deepspeed
    import torch
    from torch import nn

    from rldiag.collectors import Monitor

    os.environ.update({"MLFLOW_DISABLE_TELEMETRY": "true", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=config)
    rows = []
    warned = _capture_warnings()
    with Monitor("deepspeed", run_name=f"zero{stage}-accumulation", tracking_uri=uri, policy=policy,
                 spill_dir=os.path.join(out_dir, f"spill{rank}")) as mon:
        for step in range(3):
            for micro in range(2):
                loss = engine(torch.ones(2, 3) * (rank + 1) * (1 + 0.25 * step + 0.1 * micro)).pow(2).mean()
                engine.backward(loss)
                boundary = engine.is_gradient_accumulation_boundary()
                if boundary:  # once per optimizer step, over both micro-batches' gradients
                    mon.step(step, engine, loss=loss)
                engine.step()  # every micro-batch: DeepSpeed steps at the boundary
                if boundary:
                    r = mon.last_report
                    rows.append({"found": r.found, "finite": r.finite, "norm": r.norm,
                                 "ds_norm": float(engine.get_global_grad_norm())})
    Path(out_dir, f"acc{rank}.json").write_text(json.dumps({"rows": rows, "warned": warned}))
    teardown()


@pytest.mark.timeout(600)  # two gloo ranks building DeepSpeed ops: past 300 s on 2 shared cores
@pytest.mark.parametrize(("stage", "policy"), [(2, "warn"), (3, "warn"), (2, "skip")])
def test_under_gradient_accumulation_the_boundary_norm_is_deepspeeds(stage, policy, tmp_path, sqlite_uri):
    """Two micro-batches per step: at the accumulation boundary the partitions hold both micro-batches'
    gradients, and rldiag's norm of them is the one DeepSpeed clips by. `skip` is not supported there (leaving
    out engine.step() at the boundary shifts DeepSpeed's micro-batch count): rank 0 says so at the first step,
    once, before any NaN; with `warn` nothing is said."""
    mp.start_processes(_accumulation_worker, args=(2, free_port(), sqlite_uri, str(tmp_path), stage, policy),
                       nprocs=2, join=True, start_method="spawn")
    for r in (0, 1):
        got = json.loads((tmp_path / f"acc{r}.json").read_text())
        said = [w for w in got["warned"] if "under DeepSpeed gradient accumulation" in w]
        assert len(said) == (1 if policy == "skip" and r == 0 else 0), got["warned"]
        rows = got["rows"]
        assert len(rows) == 3
        for x in rows:
            assert x["found"] and x["finite"]
            assert x["norm"] == pytest.approx(x["ds_norm"], rel=1e-5)
