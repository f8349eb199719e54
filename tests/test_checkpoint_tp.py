"""DCP checkpoints of the FSDP x TP layout (docs/numerics.md §4, docs/checkpoint.md "FSDP x TP").

fp32 master weights and TP-sharded quantized weights (components sharded over ``tp`` along their TP dim,
replicated over ``fsdp``) from a JAX (fsdp, tp) mesh <-> PyTorch FSDP2 x TP (ColwiseParallel /
RowwiseParallel, then fully_shard) on 4 gloo processes, and JAX -> DCP -> JAX across (fsdp, tp) meshes.
"""

import dataclasses
import functools
import importlib.util
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402
from support.meshes import fsdp_tp_mesh  # noqa: E402

common.setup_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxquant  # noqa: E402
import jaxquant.primitives.ops  # noqa: E402
import jaxquant.zero.distributed  # noqa: E402
from jaxquant import checkpoint as ck  # noqa: E402
from jaxquant.checkpoint.metadata import read_metadata  # noqa: E402
from jaxquant.checkpoint.tree import components  # noqa: E402

# fp32 master weights [out, in]: column-parallel, row-parallel, replicated over TP (FSDP only)
MASTER_SPECS = {"col": P(("tp", "fsdp"), None), "row": P("fsdp", "tp"), "rep": P("fsdp", None)}
# the weight's TP dim -> the torch style that shards a 2-D tensor over tp along that dim
TP_DIM_STYLE = {0: "col", 1: "row"}


def _x(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _component_tp_dim(attr, value, tp_dim):
    """The dim of a quantized component that TP splits: data/scale_inv like the weight, data_t/scale_inv_t
    the transposed dim; scalars (FP8 scale_inv, amax) are replicated (None)."""
    if np.ndim(value) < 2:
        return None
    return tp_dim if attr in ("data", "scale_inv") else 1 - tp_dim


def _tp_spec(dim):
    return P() if dim is None else (P("tp", None) if dim == 0 else P(None, "tp"))


def tp_shard_quantized(q, mesh, tp_dim, put=jax.device_put):
    """``q`` laid out as quantize_master_weights(..., tp_axis="tp") returns it: each component sharded over
    tp along its TP dim and replicated over fsdp. ``put(value, sharding)`` places one component."""
    return dataclasses.replace(q, **{attr: put(v, NamedSharding(mesh, _tp_spec(_component_tp_dim(attr, v, tp_dim))))
                                     for attr, _, v in components(q)})


@pytest.fixture(scope="module")
def quant():
    """{name: (whole-tensor quantized, TP dim)}; the TP splits (tp <= 2) are aligned to the NVFP4 scale
    layout (local rows a multiple of 128 for dim 0, local cols a multiple of 64 for dim 1)."""
    opts = dict(columnwise=True)
    return {"nv_col": (jaxquant.quantize_nvfp4(jnp.asarray(_x((256, 32), 10)), **opts), 0),
            "nv_row": (jaxquant.quantize_nvfp4(jnp.asarray(_x((32, 128), 11)), **opts), 1),
            "f8_col": (jaxquant.quantize_fp8(jnp.asarray(_x((16, 32), 12)), **opts), 0),
            "f8_row": (jaxquant.quantize_fp8(jnp.asarray(_x((16, 32), 13)), **opts), 1)}


# name -> (fp32 master, torch style). "k_*" are JAX kernels [in, out], stored as torch's [out, in] (TRANSPOSE).
MASTERS = {"w_col": (_x((16, 8), 0), "col"), "w_row": (_x((8, 16), 1), "row"), "w_rep": (_x((8, 8), 2), "rep"),
           "k_col": (_x((8, 16), 3), "col"), "k_row": (_x((16, 8), 4), "row")}
TRANSPOSE = "layers.k_*.weight"


def _master_spec(name, style):
    spec = MASTER_SPECS[style]
    return P(*reversed(spec)) if name.startswith("k_") else spec


def _torch_full(name, a):
    return np.ascontiguousarray(a.T) if name.startswith("k_") else a


def _as_target(a, sharding):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def jax_tree(mesh, quant, put=jax.device_put):
    """The JAX state on ``mesh``: {"layers": {name: {"weight": ...}}}; ``put=_as_target`` gives the
    load_dcp target of the same layout."""
    layers = {n: {"weight": put(a, NamedSharding(mesh, _master_spec(n, s)))} for n, (a, s) in MASTERS.items()}
    for n, (q, d) in quant.items():
        layers[n] = {"weight": tp_shard_quantized(q, mesh, d, put)}
    return {"layers": layers}


def torch_tensors(quant):
    """[(DCP key, full numpy array, torch style)] of every tensor in :func:`jax_tree`."""
    out = [(f"layers.{n}.weight", _torch_full(n, a), s) for n, (a, s) in MASTERS.items()]
    for n, (q, d) in quant.items():
        for attr, suffix, v in components(q):
            dim = _component_tp_dim(attr, v, d)
            out.append((f"layers.{n}.weight{suffix}", np.asarray(v), "plain" if dim is None else TP_DIM_STYLE[dim]))
    return out


def _assert_same_layout_and_bytes(got, want_sharding, full, what):
    assert got.sharding == want_sharding, (what, got.sharding, want_sharding)
    assert common.same_bytes(np.asarray(got), full), what
    for shard in got.addressable_shards:  # each device holds exactly its block
        assert common.same_bytes(np.asarray(shard.data), full[shard.index]), (what, shard.index)


# JAXQUANT_REQUIRE_TORCH=1 (CI): a missing torch fails these tests instead of skipping them
torch_required = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None and os.environ.get("JAXQUANT_REQUIRE_TORCH") != "1",
    reason="the FSDP2 x TP gloo processes " + common.TORCH_SKIP_REASON)


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory, quant):
    """The two torch tests' FSDP2 x TP jobs in one start of the 4 gloo ranks (starting torch in 4 processes is most
    of a job's time): loading the JAX (fsdp=2, tp=2) save (its step 5), and torch's own save (step 17). A call runs
    them once, after a test's rerun_if_few_devices; returns (the JAX mesh, its tree, the JAX checkpoint, the load's
    per-rank results, torch's checkpoint)."""
    @functools.cache
    def run():
        work = tmp_path_factory.mktemp("fsdp2-tp")
        mesh = common.mesh22()
        tree = jax_tree(mesh, quant)
        tree["step"] = np.array(5, np.int64)
        ck.save_dcp(str(work / "ck"), tree, transpose=TRANSPOSE)
        tensors = torch_tensors(quant)
        loaded, _ = common.torch_jobs([
            dict(mode="load", ckpt=work / "ck", tensors=tensors, step=5, workdir=str(work / "load"), key=str),
            dict(mode="save", ckpt=work / "torch_ck", tensors=tensors, step=17, workdir=str(work / "save"), key=str)],
            timeout=180)
        return mesh, tree, work / "ck", loaded, work / "torch_ck"
    return run


@torch_required
@pytest.mark.slow
def test_jax_fsdp_tp_save_loads_into_torch_fsdp2_tp_dtensors(request, quant, torch_runs):
    if common.rerun_if_few_devices(request):
        return
    mesh, tree, jax_ck, results, _ = torch_runs()
    tensors = torch_tensors(quant)
    # every rank checked the bytes of every local shard (worker); here: the placements and where blocks lie
    keys = {k for k, _, _ in tensors}
    for rank, r in enumerate(results):
        assert set(r["checked"]) == keys
        i, j = divmod(rank, 2)  # torch mesh (dp, tp): rank = dp * 2 + tp
        for key, full, style in tensors:
            got = r["checked"][key]
            if style == "col":
                assert "_StridedShard(dim=0" in got["placements"][0] and got["placements"][1] == "Shard(dim=0)", got
                # docs/numerics.md §4: rank (fsdp=i, tp=j) of a column-parallel [N, K] holds rows j*N/tp + i*N/(tp*fsdp)
                n = full.shape[0]
                assert got["offset"] == [j * n // 2 + i * n // 4, 0] and got["shape"] == [n // 4, full.shape[1]], key
            elif style == "row":
                assert got["placements"] == ["Shard(dim=0)", "Shard(dim=1)"], got
                assert got["offset"] == [i * full.shape[0] // 2, j * full.shape[1] // 2], key
            elif style == "rep":
                assert got["placements"] == ["Shard(dim=0)"] and got["offset"] == [i * full.shape[0] // 2, 0], got
            else:
                assert got["placements"] == ["plain"] and got["shape"] == list(full.shape), got
    # from a mesh of torch's sizes the masters' DCP chunks are exactly torch's local shards
    md = read_metadata(str(jax_ck))
    for n in MASTERS:
        key = f"layers.{n}.weight"
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.entries[key].chunks) == \
            sorted({(tuple(r["checked"][key]["offset"]), tuple(r["checked"][key]["shape"])) for r in results}), n
    # the JAX (fsdp=i, tp=j) device of a column-parallel master (or [in, out] kernel) holds torch rank (i, j)'s rows
    for n, out_dim in (("w_col", 0), ("k_col", 1)):
        for shard in tree["layers"][n]["weight"].addressable_shards:
            i, j = (int(v[0]) for v in np.nonzero(mesh.devices == shard.device))
            assert results[i * 2 + j]["checked"][f"layers.{n}.weight"]["offset"][0] == shard.index[out_dim].start, n


@torch_required
@pytest.mark.slow
def test_torch_fsdp2_tp_save_loads_into_jax_fsdp_tp_meshes(request, quant, torch_runs):
    if common.rerun_if_few_devices(request):
        return
    tensors = torch_tensors(quant)
    torch_ck = torch_runs()[-1]      # torch saved ``tensors`` (step 17)
    report = ck.inspect_dcp(str(torch_ck), verify=True)
    assert report["ok"]
    chunks = {k["key"]: k["chunks"] for k in report["keys"]}
    assert chunks["layers.w_col.weight"] == 4 and chunks["layers.nv_col.weight.data_t"] == 4
    assert chunks["layers.w_rep.weight"] == 2 and chunks["layers.nv_col.weight.amax"] == 1
    full = {k: a for k, a, _ in tensors}
    for fsdp, tp in ((4, 2), (2, 4)):  # resharding: neither mesh is torch's (2, 2)
        mesh = fsdp_tp_mesh(fsdp, tp)
        target = jax_tree(mesh, quant, _as_target)
        target["step"] = int
        out = ck.load_dcp(str(torch_ck), target, transpose=TRANSPOSE)
        assert out["step"] == 17
        for n, (a, _) in MASTERS.items():
            _assert_same_layout_and_bytes(out["layers"][n]["weight"], target["layers"][n]["weight"].sharding, a,
                                          (fsdp, tp, n))
        for n, (q, _) in quant.items():
            got, want = out["layers"][n]["weight"], target["layers"][n]["weight"]
            assert type(got) is type(q) and got.shape == q.shape
            for (attr, suffix, v), (_, _, t) in zip(components(got), components(want)):
                _assert_same_layout_and_bytes(v, t.sharding, full[f"layers.{n}.weight{suffix}"], (fsdp, tp, n, attr))


@pytest.mark.parametrize("save_mesh,load_meshes", [((4, 2), ((2, 4), (8, 1), (1, 8))), ((2, 4), ((4, 2),))])
def test_tp_quantized_round_trip_jax_dcp_jax(tmp_path, request, quant, save_mesh, load_meshes):
    if common.rerun_if_few_devices(request):
        return
    tree = jax_tree(fsdp_tp_mesh(*save_mesh), quant)
    ck.save_dcp(str(tmp_path / "ck"), tree, transpose=TRANSPOSE)
    tp = save_mesh[1]
    # replicated over fsdp: each component is written once per TP rank, at its TP offset
    report = {k["key"]: k for k in ck.inspect_dcp(str(tmp_path / "ck"))["keys"]}
    assert report["layers.nv_col.weight"]["chunks"] == tp and report["layers.nv_col.weight.amax"]["chunks"] == 1
    assert report["layers.w_col.weight"]["chunks"] == save_mesh[0] * tp
    md = read_metadata(str(tmp_path / "ck"))
    for n, (q, d) in quant.items():
        for attr, suffix, v in components(q):
            dim = _component_tp_dim(attr, v, d)
            offsets = sorted(c.offsets for c in md.entries[f"layers.{n}.weight{suffix}"].chunks)
            if dim is None:
                assert offsets == [(0,) * np.ndim(v)]
            else:
                step = v.shape[dim] // tp
                assert offsets == sorted(tuple(j * step if ax == dim else 0 for ax in range(2)) for j in range(tp))
    for fsdp, tp_load in load_meshes:
        target = jax_tree(fsdp_tp_mesh(fsdp, tp_load), quant, _as_target)
        out = ck.load_dcp(str(tmp_path / "ck"), target, transpose=TRANSPOSE)
        for n, (q, _) in quant.items():
            got = out["layers"][n]["weight"]
            for (attr, _, v), (_, _, t), (_, _, w) in zip(components(got), components(target["layers"][n]["weight"]),
                                                          components(q)):
                _assert_same_layout_and_bytes(v, t.sharding, np.asarray(w), (fsdp, tp_load, n, attr))
        for n, (a, _) in MASTERS.items():
            _assert_same_layout_and_bytes(out["layers"][n]["weight"], target["layers"][n]["weight"].sharding, a, n)


def test_tp_quantized_dequantized_by_save_or_convert_loads_as_tp_sharded_bf16(tmp_path, request, quant):
    if common.rerun_if_few_devices(request):
        return
    mesh = fsdp_tp_mesh(4, 2)
    quant = {n: quant[n] for n in ("nv_col", "nv_row", "f8_row")}
    tree = jax_tree(mesh, quant)
    ck.save_dcp(str(tmp_path / "saved"), tree, dequantize=jnp.bfloat16, transpose=TRANSPOSE)
    # streaming conversion of the components, whose chunks are the TP ranks' row / byte-column blocks
    ck.save_dcp(str(tmp_path / "components"), tree, transpose=TRANSPOSE)
    ck.convert(str(tmp_path / "components"), str(tmp_path / "converted"), to="dcp", dequantize="bfloat16")
    target = {"layers": {n: {"weight": jax.ShapeDtypeStruct(q.shape, jnp.bfloat16, sharding=NamedSharding(
        mesh, MASTER_SPECS["col" if d == 0 else "row"]))} for n, (q, d) in quant.items()}}
    # the unsharded tensors' dequantization
    dequantized = jax.jit(lambda qs: {n: q.dequantize(jnp.bfloat16) for n, (q, _) in qs.items()})(quant)
    want = {n: np.asarray(w) for n, w in dequantized.items()}
    for path in ("saved", "converted"):
        md = read_metadata(str(tmp_path / path))
        assert "layers.nv_col.weight.scale_inv" not in md.entries and "__jaxquant__" not in md.entries
        out = ck.load_dcp(str(tmp_path / path), target)
        for n in quant:
            assert want[n].dtype == ml_dtypes.bfloat16
            _assert_same_layout_and_bytes(out["layers"][n]["weight"], target["layers"][n]["weight"].sharding, want[n],
                                          (path, n))


def per_tp_rank_nvfp4(x, mesh, tp_dim):
    """An FSDP x TP NVFP4 weight whose TP split is *not* aligned to the scale layout, as
    quantize_master_weights(..., tp_axis=) returns it: each TP rank's local tensor is the quantization of its
    slice with the whole weight's amax, and the global components concatenate the local ones along the TP dim."""
    tp = mesh.shape["tp"]
    _, amax, _ = jaxquant.primitives.ops.nvfp4_stats(x)
    locals_ = []
    for piece in jnp.split(x, tp, axis=tp_dim):
        tiles, _, _ = jaxquant.primitives.ops.nvfp4_stats(piece)
        data, scale_inv, data_t, scale_inv_t = jaxquant.ops.nvfp4_quantize(piece, tiles, amax, columnwise=True)
        locals_.append(dict(data=data, scale_inv=scale_inv, data_t=data_t, scale_inv_t=scale_inv_t))
    comps = {attr: jnp.concatenate([p[attr] for p in locals_], axis=_component_tp_dim(attr, locals_[0][attr], tp_dim))
             for attr in locals_[0]}
    return tp_shard_quantized(jaxquant.NVFP4Tensor(amax=amax, shape=tuple(x.shape), **comps), mesh, tp_dim), locals_


@pytest.mark.parametrize("tp_dim,shape", [(0, (128, 32)), (1, (16, 64))])  # local rows 64 / local cols 32
def test_tp_nvfp4_unaligned_split_round_trips_per_rank_and_refuses_dequantize(tmp_path, request, tp_dim, shape):
    if common.rerun_if_few_devices(request):
        return
    save_mesh, load_mesh = fsdp_tp_mesh(2, 2), fsdp_tp_mesh(4, 2)  # same tp (the per-rank scale blocks depend on it)
    q, locals_ = per_tp_rank_nvfp4(jnp.asarray(_x(shape, 20 + tp_dim)), save_mesh, tp_dim)
    ck.save_dcp(str(tmp_path / "ck"), {"w": q})
    target = {"w": jax.tree_util.tree_map(lambda a: _as_target(a, NamedSharding(load_mesh, a.sharding.spec)), q)}
    got = ck.load_dcp(str(tmp_path / "ck"), target)["w"]
    for (attr, _, v), (_, _, t), (_, _, w) in zip(components(got), components(target["w"]), components(q)):
        _assert_same_layout_and_bytes(v, t.sharding, np.asarray(w), attr)
        dim = _component_tp_dim(attr, v, tp_dim)
        for shard in v.addressable_shards:  # each device holds its TP rank's own local tensor
            j = int(np.nonzero(load_mesh.devices == shard.device)[1][0])
            assert common.same_bytes(np.asarray(shard.data), np.asarray(locals_[j][attr]) if dim is not None
                                     else np.asarray(w)), (attr, j)
    # the per-rank scale blocks are not the whole-tensor layout: dequantizing as a whole is refused
    with pytest.raises(ck.CheckpointError, match=r"cannot dequantize.*scale_inv is .*whole-tensor layout"):
        ck.save_dcp(str(tmp_path / "deq"), {"w": q}, dequantize=jnp.bfloat16)
    assert not os.path.exists(tmp_path / "deq")
    with pytest.raises(ck.CheckpointError, match=r"key 'w': cannot dequantize"):
        ck.convert(str(tmp_path / "ck"), str(tmp_path / "conv"), to="dcp", dequantize="bfloat16")
    assert not os.path.exists(tmp_path / "conv")


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_quantize_master_weights_tp_output_round_trips_through_dcp(tmp_path, request, recipe):
    if common.rerun_if_few_devices(request):
        return
    from jaxquant.zero.layout import FlatLayout

    mesh = fsdp_tp_mesh(2, 2)
    shapes, tp_dims = [(256, 32), (32, 128), (16, 32), (128, 32)], [0, 1, None, 0]  # the last: unaligned NVFP4
    layout = FlatLayout(shapes, 2, tp_size=2, tp_dims=tp_dims)
    master = jax.device_put(layout.flatten([jnp.asarray(_x(s, 30 + p)) for p, s in enumerate(shapes)]),
                            jaxquant.zero.distributed.master_sharding(mesh, "fsdp", "tp"))
    weights = jaxquant.zero.distributed.quantize_master_weights(master, layout, mesh=mesh, tp_axis="tp", recipe=recipe,
                                                           columnwise=True, manual_post_all_gather_processing=False)
    tree = {f"w{p}": w for p, w in enumerate(weights)}
    for w, d in zip(weights, tp_dims):  # the layout the other tests (and the torch worker) assume
        for attr, _, v in components(w):
            dim = None if d is None else _component_tp_dim(attr, v, d)
            assert v.sharding.is_equivalent_to(NamedSharding(mesh, _tp_spec(dim)), v.ndim), (attr, v.sharding)
    ck.save_dcp(str(tmp_path / "ck"), tree)
    load_mesh = fsdp_tp_mesh(4, 2)
    target = jax.tree_util.tree_map(lambda a: _as_target(a, NamedSharding(load_mesh, a.sharding.spec)), tree)
    out = ck.load_dcp(str(tmp_path / "ck"), target)
    for k in tree:
        for (attr, _, v), (_, _, t), (_, _, w) in zip(components(out[k]), components(target[k]), components(tree[k])):
            _assert_same_layout_and_bytes(v, t.sharding, np.asarray(w), (k, attr))


def test_tp_resharding_load_reads_each_chunk_once_in_file_order(tmp_path, request, quant, monkeypatch):
    if common.rerun_if_few_devices(request):
        return
    tree = jax_tree(fsdp_tp_mesh(4, 2), quant)
    ck.save_dcp(str(tmp_path / "ck"), tree, transpose=TRANSPOSE)
    reads = []
    original = ck.reader.ChunkReader.chunk

    def recording_chunk(self, e, c):
        reads.append((e.key, c.storage.relative_path, c.storage.offset))
        return original(self, e, c)

    monkeypatch.setattr(ck.reader.ChunkReader, "chunk", recording_chunk)
    # (2, 4): row-parallel blocks straddle the stored chunks and each TP component chunk feeds two blocks
    ck.load_dcp(str(tmp_path / "ck"), jax_tree(fsdp_tp_mesh(2, 4), quant, _as_target), transpose=TRANSPOSE)
    md = read_metadata(str(tmp_path / "ck"))
    assert sorted(reads) == sorted((k, c.storage.relative_path, c.storage.offset)
                                   for k, e in md.entries.items() if hasattr(e, "chunks") for c in e.chunks)
    for key in md.entries:  # each key's chunks in file order
        mine = [r[1:] for r in reads if r[0] == key]
        assert mine == sorted(mine), key
