"""The private torch and MLflow APIs rldiag uses (`rldiag.collectors.compat`), pinned to the installed
versions: if an upgrade changes one, this file fails before the collectors misbehave."""

from __future__ import annotations

import mlflow
import torch
from torch.testing import assert_close

from rldiag.collectors.compat.mlflow import rest_host_creds, tracking_store
from rldiag.collectors.compat.torch import foreach_norm_f32, host_dtype, queue_backward_callback
from rldiag.collectors.gradcheck import check_gradients, grad_norm_stats


def test_foreach_norm_is_the_float32_norm_of_each_tensor():
    ts = [torch.randn(3, 4), torch.randn(7, dtype=torch.float64), torch.tensor([3.0, 4.0], dtype=torch.float16)]
    got = foreach_norm_f32(ts)
    assert [n.dtype for n in got] == [torch.float32] * 3
    assert_close(torch.stack(got), torch.stack([torch.linalg.vector_norm(t.float()) for t in ts]))
    assert got[2].item() == 5.0


def test_an_fp16_gradient_whose_fp16_norm_overflows_is_finite():
    # 100 elements of 10000 in fp16: every element is finite, the norm (1e5) is past fp16's 65504.
    g = torch.full((100,), 10000.0, dtype=torch.float16)
    assert torch.isinf(torch.linalg.vector_norm(g))  # what an fp16 norm would say
    stats = grad_norm_stats([g])
    assert_close(stats[1].item(), 1e5) and torch.isfinite(stats).all()
    p = torch.nn.Parameter(torch.zeros(100, dtype=torch.float16))
    p.grad = g
    report = check_gradients([p])
    assert report.finite and abs(report.norm - 1e5) < 1.0 and not report.nonfinite_params


def test_a_total_norm_past_float32_is_still_finite():
    # two float32 norms of 3e38 each: finite, but their total (4.2e38) passes float32's 3.4e38
    grads = [torch.tensor([3e38], dtype=torch.float32), torch.tensor([3e38], dtype=torch.float32)]
    total = grad_norm_stats(grads)[0].item()
    assert abs(total - 3e38 * 2 ** 0.5) / total < 1e-6


def test_queued_callback_runs_once_at_the_end_of_backward():
    calls = []
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda g: queue_backward_callback(lambda: calls.append("end")) or g)
    (x * 2).sum().backward()
    assert calls == ["end"]


def test_host_dtype():
    assert host_dtype(torch.device("cpu")) == torch.float64
    assert host_dtype(torch.device("mps")) == torch.float32


def test_tracking_store_of_a_sqlite_client_has_no_rest_credentials(tmp_path):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    assert isinstance(tracking_store(client), SqlAlchemyStore)
    assert rest_host_creds(client) is None


def test_rest_credentials_of_a_server_client_carry_its_host_and_auth(monkeypatch):
    from mlflow.store.tracking.rest_store import RestStore

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "t0ken")
    client = mlflow.MlflowClient("http://127.0.0.1:5999")  # no request is made
    assert isinstance(tracking_store(client), RestStore)
    creds = rest_host_creds(client)
    assert creds.host == "http://127.0.0.1:5999" and creds.token == "t0ken"


# --- sharded gradients: what the FSDP1 / DTensor code paths read from torch ---------------------------------


def test_fsdp1_names_and_markers_are_torchs():
    from torch.distributed.fsdp import _common_utils, _unshard_param_utils

    from rldiag.collectors.compat import torch as compat

    assert compat.FSDP_PREFIX == _common_utils.FSDP_PREFIX
    assert compat.CHECKPOINT_PREFIX == _common_utils._CHECKPOINT_PREFIX
    assert compat.FSDP_FLATTENED == _common_utils.FSDP_FLATTENED
    assert compat.FLAT_PARAM == _unshard_param_utils.FLAT_PARAM
    for name in ["_fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp._fsdp_wrapped_module.w",
                 "_fsdp_wrapped_module._flat_param", "embed.weight"]:
        assert compat.clean_fqn(name) == _common_utils.clean_tensor_name(name)
    p = torch.nn.Parameter(torch.zeros(2))
    assert not compat.fsdp1_flattened(p)
    _common_utils._set_fsdp_flattened(p)
    assert compat.fsdp1_flattened(p) and not compat.is_flat_param(p)


def test_fsdp1_flat_parameter_metadata_rldiag_reads_is_there():
    # FlatParameter's documented per-parameter metadata (names, this rank's shard) and FSDP1's unit API;
    # tests/collectors/test_sharded.py runs them for real on two gloo processes
    from torch.distributed.fsdp import FlatParameter, FullyShardedDataParallel, ShardingStrategy, _flat_param

    assert {"in_shard", "offset_in_shard", "numel_in_shard"} <= set(_flat_param._ShardParamInfo._fields)
    for attr in ("_fqns", "_shard_param_infos", "_params"):
        assert attr in (FlatParameter.__doc__ or ""), attr
    assert isinstance(FullyShardedDataParallel._flat_param, property)
    assert callable(FullyShardedDataParallel.fsdp_modules) and ShardingStrategy.NO_SHARD


def test_dtensor_class_is_the_public_one_once_loaded():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from rldiag.collectors.compat.torch import dtensor_class

    assert dtensor_class() is DTensor
    assert Replicate().is_replicate() and Shard(0).is_shard() and not Shard(0).is_partial()


def test_checking_a_plain_model_loads_no_fsdp_or_dtensor_module():
    import subprocess
    import sys

    code = ("import sys, torch\nfrom rldiag.collectors import check_gradients\n"
            "m = torch.nn.Linear(2, 2); m(torch.ones(1, 2)).sum().backward(); assert check_gradients(m).finite\n"
            "print(sorted(x for x in ('torch.distributed.tensor', 'torch.distributed.fsdp') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
