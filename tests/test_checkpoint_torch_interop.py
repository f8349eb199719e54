"""jaxquant <-> torch.distributed.checkpoint, in one process and in 4 gloo processes (FSDP2 x TP)."""

import functools
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402

common.setup_devices()
torch = common.require_torch()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxquant  # noqa: E402
from jaxquant import checkpoint as ck  # noqa: E402

COL, ROW = P(("tp", "fsdp"), None), P("fsdp", "tp")


def _rand(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.uint8:
        return rng.integers(0, 256, shape).astype(np.uint8)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


# (name, full array, torch TP style); the last two have uneven FSDP shards in torch (10 -> 5 -> 3/2, 5 -> 3/2)
TENSORS = [("col_bf16", _rand((16, 8), ml_dtypes.bfloat16, 0), "col"),
           ("row_f32", _rand((8, 16), np.float32, 1), "row"),
           ("col_f8", _rand((16, 8), ml_dtypes.float8_e4m3fn, 2), "col"),
           ("row_u8", _rand((8, 16), np.uint8, 3), "row"),
           ("col_uneven_f32", _rand((10, 8), np.float32, 4), "col"),
           ("row_uneven_u8", _rand((5, 8), np.uint8, 5), "row")]


def _jax_spec(arr, style):
    if arr.shape[0] % 4:
        return P(None, "tp")  # JAX needs even shards: uneven rows stay whole, columns split
    return COL if style == "col" else ROW


def test_jax_save_loads_in_torch_single_process_bit_identical(tmp_path, request):
    if common.rerun_if_few_devices(request):
        return
    import torch.distributed.checkpoint as dcp

    mesh = common.mesh22()
    tree = {"layers": {n: {"weight": jax.device_put(a, NamedSharding(mesh, _jax_spec(a, s)))} for n, a, s in TENSORS}}
    tree["step"] = jnp.array(7, jnp.int32)  # 0-d counter (a DCP tensor)
    tree["host_step"], tree["lr"] = 9, 0.125  # Python scalars (DCP byte entries)
    tree["a.b"] = jnp.arange(4, dtype=jnp.float32)  # flat dotted key
    q = jaxquant.quantize_fp8(jnp.asarray(_rand((16, 32), np.float32, 9)), columnwise=True, impl="reference")
    tree["q"] = q
    ck.save_dcp(str(tmp_path / "ck"), tree)

    sd = {f"layers.{n}.weight": torch.zeros(a.shape, dtype=getattr(torch, np.dtype(a.dtype).name))
          for n, a, _ in TENSORS}
    sd.update({"step": torch.tensor(0, dtype=torch.int32), "host_step": 0, "lr": 0.0,
               "a.b": torch.zeros(4), "q": torch.zeros(16, 32, dtype=torch.float8_e4m3fn),
               "q.scale_inv": torch.zeros(()), "q.amax": torch.zeros(()),
               "q.data_t": torch.zeros(32, 16, dtype=torch.float8_e4m3fn)})
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    for n, a, _ in TENSORS:
        assert common.same_bytes(sd[f"layers.{n}.weight"].view(torch.uint8).numpy(), a.view(np.uint8)), n
    assert sd["step"].dim() == 0 and int(sd["step"]) == 7
    assert sd["host_step"] == 9 and sd["lr"] == 0.125
    assert common.same_bytes(sd["a.b"].numpy(), np.arange(4, dtype=np.float32))
    for key, comp in (("q", q.data), ("q.data_t", q.data_t)):
        assert common.same_bytes(sd[key].view(torch.uint8).numpy(), np.asarray(comp).view(np.uint8)), key
    assert common.same_bytes(sd["q.scale_inv"].numpy(), np.asarray(q.scale_inv))
    assert common.same_bytes(sd["q.amax"].numpy(), np.asarray(q.amax))


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """The two 4-process tests' FSDP2 x TP jobs in one start of the 4 gloo ranks (starting torch in 4 processes is
    most of a job's time): loading the JAX (fsdp=2, tp=2) save of TENSORS (its step 11), and torch's own save of
    TENSORS (step 23). A call runs them once, after a test's rerun_if_few_devices; returns (the load's per-rank
    results, torch's checkpoint)."""
    @functools.cache
    def run():
        work = tmp_path_factory.mktemp("fsdp2-tp")
        mesh = common.mesh22()
        tree = {"layers": {n: {"weight": jax.device_put(a, NamedSharding(mesh, _jax_spec(a, s)))}
                           for n, a, s in TENSORS}, "step": np.array(11, np.int64)}
        ck.save_dcp(str(work / "ck"), tree)
        loaded, _ = common.torch_jobs([
            dict(mode="load", ckpt=work / "ck", tensors=TENSORS, step=11, workdir=str(work / "load")),
            dict(mode="save", ckpt=work / "torch_ck", tensors=TENSORS, step=23, workdir=str(work / "save"))])
        return loaded, work / "torch_ck"
    return run


@pytest.mark.slow
def test_jax_save_loads_into_fsdp2_tp_dtensors_in_4_processes(request, torch_runs):
    if common.rerun_if_few_devices(request):
        return
    results, _ = torch_runs()
    # the worker asserted every rank's local shard bytes; check the layouts are the FSDP2 x TP ones
    for r in results:
        assert set(r["checked"]) == {n for n, _, _ in TENSORS}
        assert "_StridedShard" in r["checked"]["col_bf16"]["placements"][0]
        assert r["checked"]["row_f32"]["placements"] == ["Shard(dim=0)", "Shard(dim=1)"]
    # docs/numerics.md §4: rank (fsdp=i, tp=j) of a column-parallel [N, K] weight holds rows from j*N/tp + i*N/(tp*fsdp)
    for rank, r in enumerate(results):
        i, j = divmod(rank, 2)
        assert r["checked"]["col_bf16"]["offset"] == [j * 16 // 2 + i * 16 // 4, 0]
    assert any(r["checked"]["col_uneven_f32"]["shape"][0] == 2 for r in results)  # uneven 3/2 row split


@pytest.mark.slow
def test_torch_fsdp2_tp_save_loads_into_jax_layouts_bit_identical(request, torch_runs):
    if common.rerun_if_few_devices(request):
        return
    torch_ck = torch_runs()[1]      # torch saved TENSORS (step 23)
    md = ck.inspect_dcp(str(torch_ck), verify=True)
    assert md["ok"] and {k["key"]: k["chunks"] for k in md["keys"]}["layers.col_uneven_f32.weight"] == 4
    mesh = common.mesh22()
    for spec in (COL, ROW, P()):
        target = {"layers": {}, "step": int}
        for n, a, _ in TENSORS:
            s = spec if a.shape[0] % 4 == 0 else (P() if spec == P() else P(None, "tp"))
            target["layers"][n] = {"weight": jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))}
        out = ck.load_dcp(str(torch_ck), target)
        assert out["step"] == 23
        for n, a, _ in TENSORS:
            got = out["layers"][n]["weight"]
            assert got.sharding == target["layers"][n]["weight"].sharding
            assert common.same_bytes(np.asarray(got), a), (spec, n)
            for shard in got.addressable_shards:  # each device holds exactly its block
                assert common.same_bytes(np.asarray(shard.data), a[shard.index]), (spec, n)
