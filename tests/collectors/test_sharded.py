"""Sharded gradients on two real gloo processes (CPU): FSDP2 (`fully_shard`, DTensor gradient shards) and
FSDP1 (`FullyShardedDataParallel`, `use_orig_params` True and False). `Monitor` finds the shards without
being told, takes the global pre-clip norm over all of them with the one SUM all-reduce it already makes,
names a NaN parameter by its FQN on every rank, and under `skip` every rank skips, so the sharded model
stays what a plain replica trained on the finite steps only would be (clipped there by `max_norm` with that
global norm, as `clip_grad_norm_` clips the replica's full gradients)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from mlflow import MlflowClient

from tests.helpers.gloo_job import SHARD_KINDS, assert_nan_run_logged
from tests.helpers.net import free_port

STEPS = 5
BACKWARD_NAN = 1  # rank 1's backward gives 1.bias a NaN gradient; FSDP's reduce-scatter carries it on
SHARD_NAN = 3  # after backward, a NaN written into rank 1's own shard of one parameter: only rank 1 sees it
NAN_STEPS = (BACKWARD_NAN, SHARD_NAN)
# The parameter whose rank-1 shard gets the NaN at SHARD_NAN, and what to write into: rank 1's shard of
# `0.weight` under FSDP2 (rows 3-4 of 5); under FSDP1 one unit per Linear, and rank 1 holds elements 6..11 of
# unit `1`'s 12 (1.weight: 10, 1.bias: 2), so local element 0 of its FlatParameter is 1.weight's 7th.
SHARD_NAN_PARAM = {"fsdp2": "0.weight", "fsdp1-orig": "1.weight", "fsdp1-flat": "1.weight"}
SHARD_NAN_TARGET = {"fsdp2": "0.weight", "fsdp1-orig": "1.weight", "fsdp1-flat": "1._flat_param"}


def _worker(rank: int, world: int, port: int, uri: str, out_dir: str, kind: str) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from rldiag.collectors import Monitor
    from tests.helpers.gloo_job import full_params, nan_bias_hook, shard_model, teardown

    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # same initial weights on both ranks
    plain = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    ref = copy.deepcopy(plain)  # a plain replica: trained on the finite steps only
    nan_now = [False]
    plain[1].register_forward_hook(nan_bias_hook(lambda: nan_now[0]))
    model = shard_model(plain, kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    params = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}

    def x(r: int, step: int) -> torch.Tensor:
        return torch.ones(2, 3) * (r + 1) * (1 + 0.25 * step)

    def local(g):
        return g.to_local() if hasattr(g, "to_local") else g

    results = []
    with Monitor("sharded", run_name=kind, tracking_uri=uri, policy="skip",
                 spill_dir=os.path.join(out_dir, f"spill{rank}")) as mon:
        for step in range(STEPS):
            nan_now[0] = rank == 1 and step == BACKWARD_NAN
            loss = model(x(rank, step)).pow(2).mean()
            loss.backward()
            if rank == 1 and step == SHARD_NAN:
                with torch.no_grad():
                    local(params[SHARD_NAN_TARGET[kind]].grad).view(-1)[0] = float("nan")
            # FSDP averages the ranks' gradients: the replica's gradient of the mean of both ranks' losses
            sum(ref(x(r, step)).pow(2).mean() for r in range(world)).div(world).backward()
            expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
            dtensor_total = None
            if kind == "fsdp2":  # torch's own total over the DTensor gradients (a collective: every rank)
                dtensor_total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor().item()
                full = [p.grad.full_tensor() for p in model.parameters()]
                assert math.isnan(dtensor_total) or abs(torch.nn.utils.get_total_norm(full).item() - dtensor_total) < 1e-6
            # clipped to half the norm by rldiag on the shards, as torch clips the replica's full gradients
            go = mon.step(step, model, loss=loss, max_norm=0.5 * expected)
            report = mon.last_report
            zeroed = all(p.grad is None or int(torch.count_nonzero(local(p.grad).nan_to_num(1.0))) == 0
                         for p in model.parameters())
            results.append({"step": step, "go": go, "finite": report.finite, "names": report.nonfinite_params,
                            "norm": report.norm, "expected": expected, "dtensor_total": dtensor_total,
                            "zeroed": zeroed})
            if go:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5 * expected)
                opt.step()
                ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        run_id = mon.run_id
    state = full_params(model, kind)
    ref_state = {n: p.detach().tolist() for n, p in ref.named_parameters()}
    dtensors = _replicated_and_partial_dtensors(rank, world) if kind == "fsdp2" else None
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"results": results, "run_id": run_id, "state": state, "ref_state": ref_state, "dtensors": dtensors}))
    teardown()


def _replicated_and_partial_dtensors(rank: int, world: int) -> dict:
    """What `collect_grads` reads from DTensor gradients that FSDP2 alone does not make: a Replicate one
    (every rank holds all of it: its square counts once over the ranks) and a Partial one (unreduced:
    reduced first)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from rldiag.collectors.gradcheck import collect_grads

    mesh = init_device_mesh("cpu", (world,))
    rep = torch.nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Replicate()]))
    rep.grad = DTensor.from_local(torch.tensor([3.0, 4.0]), mesh, [Replicate()])
    part = torch.nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Replicate()]))
    part.grad = DTensor.from_local(torch.full((2,), float(rank + 1)), mesh, [Partial()])
    entries = collect_grads([("rep", rep), ("part", part)])
    return {e.name: {"local": e.local.tolist(), "sharded": e.sharded, "replicas": e.replicas} for e in entries}


def _close(a, b, tol: float = 1e-6) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    return abs(a - b) <= tol * (1 + abs(b))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", SHARD_KINDS)
def test_nan_in_a_shard_every_rank_agrees_and_skips(kind, tmp_path, sqlite_uri):
    mp.start_processes(_worker, args=(2, free_port(), sqlite_uri, str(tmp_path), kind), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        res = r["results"]
        # every rank agrees: non-finite and skipped at both NaN steps only, the gradients zeroed there
        assert [x["go"] for x in res] == [s not in NAN_STEPS for s in range(STEPS)]
        assert [x["finite"] for x in res] == [s not in NAN_STEPS for s in range(STEPS)]
        assert all(x["zeroed"] for x in res if x["step"] in NAN_STEPS)
        # named by FQN, once, whichever ranks' shards hold the NaN (FSDP2: both ranks' halves of 1.bias)
        assert res[BACKWARD_NAN]["names"] == ["1.bias"]
        assert res[SHARD_NAN]["names"] == [SHARD_NAN_PARAM[kind]]
        for x in res:  # the global pre-clip norm over all shards, as torch computes it on the full gradients
            if x["finite"]:
                assert x["norm"] == pytest.approx(x["expected"], rel=1e-6)
                if kind == "fsdp2":
                    assert x["norm"] == pytest.approx(x["dtensor_total"], rel=1e-6)
            else:
                assert math.isnan(x["norm"])
        # both skips on both ranks: the sharded model is the plain replica trained (and clipped: max_norm,
        # with the global norm on every rank) on the finite steps
        assert set(r["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
        for name, value in r["state"].items():
            assert _close(value, r["ref_state"][name]), name
    assert ranks[0]["state"] == ranks[1]["state"]  # the full model is the same seen from either rank
    if kind == "fsdp2":
        for r in ranks:  # Replicate: counted once over 2 ranks; Partial (1 on rank 0, 2 on rank 1): reduced to 3
            assert r["dtensors"] == {"rep": {"local": [3.0, 4.0], "sharded": True, "replicas": 2},
                                     "part": {"local": [3.0, 3.0], "sharded": True, "replicas": 2}}
    assert ranks[1]["run_id"] is None

    assert_nan_run_logged(sqlite_uri, ranks[0]["run_id"], steps=STEPS, nan_steps=NAN_STEPS,
                          norms={x["step"]: x["expected"] for x in ranks[0]["results"] if x["finite"]},
                          last_param=SHARD_NAN_PARAM[kind])


def test_shard_split_divides_replicated_shards_and_keeps_plain_tensors_apart():
    import torch

    from rldiag.collectors.gradcheck import GradEntry, shard_split

    t = torch.zeros(1)
    entries = [GradEntry("a", t, t, sharded=True), GradEntry("b", t, t, sharded=True, replicas=2),
               GradEntry("c", t, t), GradEntry("d", t, t, sharded=True)]
    per = torch.tensor([3.0, 4.0, 12.0, 1.0], dtype=torch.float64)
    shared, rest = shard_split(per, entries).tolist()
    assert shared == 9 + 16 / 2 + 1 and rest == 12.0  # a shard held by 2 ranks counts once over both
    shared, rest = shard_split(per, entries, plain_sharded=True).tolist()  # Monitor(grads_sharded=True)
    assert shared == 9 + 16 / 2 + 144 + 1 and rest == 0.0
    assert shard_split(per[:0], []).tolist() == [0.0, 0.0]


# --- the transformers callback on an FSDP2 model ----------------------------------------------------------
# accelerate turns FSDP on only for GPU distributed types (a CPU Trainer with fsdp=... trains under DDP), so a
# Trainer cannot shard on this machine: the worker calls the real callback's hooks in the order Trainer does
# (on_train_begin; per step forward, backward, clip, on_pre_optimizer_step, optimizer.step, on_optimizer_step;
# on_train_end) around a real fully_shard'ed Llama and real TrainingArguments/TrainerState.
CB_STEPS, CB_NAN = 3, 1  # at CB_NAN rank 1's backward makes layer 1's down_proj weight gradient NaN
CB_NAN_PARAM = "model.layers.1.mlp.down_proj.weight"


def _callback_worker(rank: int, world: int, port: int, uri: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), MLFLOW_DISABLE_TELEMETRY="true")
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM, TrainerControl, TrainerState

    from rldiag.collectors.integrations.transformers import RldiagCallback
    from tests.helpers.gloo_job import full_params, nan_weight_hook, teardown
    from tests.helpers.tiny_hf import V, llama_config, training_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    ref = copy.deepcopy(model)  # a plain replica, trained on the finite steps only
    nan_now = [False]
    model.model.layers[1].mlp.down_proj.register_forward_hook(nan_weight_hook(lambda: nan_now[0]))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    args = training_args(Path(out_dir) / f"rank{rank}", ddp_backend="gloo")
    state, control = TrainerState(), TrainerControl()
    state.is_world_process_zero = state.is_local_process_zero = rank == 0  # what Trainer sets
    cb = RldiagCallback(experiment="sharded-cb", run_name="fsdp2", tracking_uri=uri, policy="skip",
                        spill_dir=os.path.join(out_dir, f"spill{rank}"))

    def batch(r: int, step: int) -> torch.Tensor:
        return torch.randint(2, V, (2, 8), generator=torch.Generator().manual_seed(100 * step + r))

    cb.on_train_begin(args, state, control, model=model)
    expected = []
    for step in range(CB_STEPS):
        nan_now[0] = rank == 1 and step == CB_NAN
        ids = batch(rank, step)
        model(input_ids=ids, labels=ids).loss.backward()
        # FSDP averages the ranks' gradients: the replica's gradient of the mean of both ranks' losses
        sum(ref(input_ids=batch(r, step), labels=batch(r, step)).loss for r in range(world)).div(world).backward()
        expected.append(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # Trainer clips before the callback
        cb.on_pre_optimizer_step(args, state, control, model=model, optimizer=opt)
        opt.step()  # a no-op at the NaN step under "skip"
        cb.on_optimizer_step(args, state, control)
        if step != CB_NAN:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        state.global_step += 1
    run_id = cb.session.run_id if cb.session is not None else None
    cb.on_train_end(args, state, control)
    state_full = full_params(model, "fsdp2")
    ref_state = {n: p.detach().tolist() for n, p in ref.named_parameters()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"run_id": run_id, "expected": expected, "state": state_full, "ref_state": ref_state}))
    teardown()


@pytest.mark.timeout(240)
def test_the_transformers_callback_on_fsdp2_reports_the_global_norm_and_plain_names(tmp_path, sqlite_uri):
    pytest.importorskip("transformers")
    MlflowClient(sqlite_uri).search_experiments()  # migrate before two processes race to
    mp.start_processes(_callback_worker, args=(2, free_port(), sqlite_uri, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r1["run_id"] is None and r0["run_id"] is not None
    client = MlflowClient(sqlite_uri)
    run_id = r0["run_id"]

    def hist(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    steps = range(1, CB_STEPS + 1)  # the callback logs step global_step + 1
    assert hist("grad/finite") == {s: float(s != CB_NAN + 1) for s in steps}
    norms = hist("grad/norm")
    for step, want in enumerate(r0["expected"]):
        if step != CB_NAN:  # the global pre-clip norm over both ranks' shards, not rank 0's shard alone
            assert norms[step + 1] == pytest.approx(want, rel=1e-5)
    assert math.isnan(norms[CB_NAN + 1])
    tags = client.get_run(run_id).data.tags
    assert tags["rldiag.alert.count"] == "1" and tags["rldiag.alert.first_step"] == str(CB_NAN + 1)
    last = json.loads(tags["rldiag.alert.last"])
    # named once by its FQN, no rank prefix, though the NaN reached both ranks' shards through the reduce-scatter
    assert last["params"] == [CB_NAN_PARAM]
    assert last["origin"]["where"] == "layer" and last["origin"]["param"] == CB_NAN_PARAM
    # both ranks skipped the NaN step: the sharded model is the replica trained on the finite steps
    for r in (r0, r1):
        assert set(r["state"]) == set(r["ref_state"])
        for name, value in r["state"].items():
            assert _close(value, r["ref_state"][name], 1e-5), name
