"""``make_train_step(quantize_once=True)`` (NVFP4 weights' default, ``quantize_once=None``): every layer's rows are
quantized once a step, before the first microbatch, with the amaxes of every layer of every weight max-reduced in one
packed all-reduce, and the layers only gather (``ShardedWeight.local``). On 8 simulated CPU devices: the step equals the
quantize-where-used step bit for bit (bf16, FP8, NVFP4; scan and loop; 2 microbatches), the packed amaxes equal
each layer's own, and the lowered program has one packed amax reduction, no scalar one, and gathers one layer at a
time under scan (not the stack); the default quantizes NVFP4 weights so and FP8 weights where they are read."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant.training import fsdp
from support.transformer import MASK, init_params, loss_loop, loss_scan, make_batch
from support.hlo import max_reductions
from support.meshes import fsdp_mesh

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def _make(loss, cw, once, microbatches=2):
    return jq.make_train_step(loss, optax.adam(1e-3), mesh=fsdp_mesh(), quantize_mask=MASK, microbatches=microbatches,
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw), quantize_once=once)


def _train(loss, cw, once, stacked):
    step = _make(loss, cw, once)
    state = step.init(init_params(stacked=stacked))
    losses = []
    for i in range(2):
        state, m = step(state, make_batch(i))
        losses.append(np.asarray(m["loss"]))
    return jax.tree.map(np.asarray, step.params(state)), losses


@pytest.mark.parametrize("cw,form", [("fp8", "scan"), ("nvfp4", "scan"), ("bf16", "scan"), ("fp8", "loop"),
                                     ("nvfp4", "loop")])
@pytest.mark.fast_cases("fp8-scan", "nvfp4-loop")
def test_step_equals_the_quantize_where_used_step(cw, form):
    loss, stacked = (loss_scan, True) if form == "scan" else (loss_loop, False)
    (p_once, l_once), (p_use, l_use) = (_train(loss, cw, once, stacked) for once in (True, False))
    np.testing.assert_array_equal(l_once, l_use)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(p_once)[0], jax.tree.leaves(p_use)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_packed_amaxes_equal_each_layers():
    """quantize_once over an FP8 stack, an NVFP4 stack and a single FP8 matrix: each layer's amax is the max of
    |that layer| over all ranks (as statistics() gives it), and its bytes are quantize_shard's with it."""
    grad = fsdp.GradReduce(1.0, jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))
    specs = [fsdp.WeightSpec(r, "fsdp", 8, ("fsdp",), grad) for r in ("fp8", "nvfp4", "fp8")]
    ks = jax.random.split(jax.random.key(5), 3)
    scales = jnp.array([1.0, 40.0, 1e-3])[:, None, None]     # each layer its own amax
    weights = [jax.random.normal(ks[0], (3, 256, 64)) * scales, jax.random.normal(ks[1], (3, 128, 64)) * scales,
               jax.random.normal(ks[2], (128, 32)) * 7.0]
    in_specs = [P(None, "fsdp"), P(None, "fsdp"), P("fsdp")]

    def per_layer(shard, spec):
        fn = lambda s: fsdp.quantize_shard(s, spec, fsdp.statistics(s, spec))
        return jax.vmap(fn)(shard) if shard.ndim == 3 else fn(shard)

    def body(*shards):
        once = fsdp.quantize_once(list(shards), specs)
        return once, [per_layer(s, spec) for s, spec in zip(shards, specs)]

    out_specs = [{k: P(None, "fsdp") if w.ndim == 3 and k in ("data", "scales") else P("fsdp") if k in (
        "data", "scales") else P() for k in ("data", "scales", "scale_inv", "amax")} for w in weights]
    fn = jax.shard_map(body, mesh=fsdp_mesh(), in_specs=tuple(in_specs), check_vma=False,
                       out_specs=([{k: o[k] for k in d} for o, d in zip(out_specs, _keys(specs))],) * 2)
    once, want = jax.jit(fn)(*weights)
    for i, (w, a, b) in enumerate(zip(weights, once, want)):
        assert sorted(a) == sorted(b), (i, sorted(a), sorted(b))
        for k in a:
            x, y = np.asarray(a[k]), np.asarray(b[k])
            np.testing.assert_array_equal(x.view(np.uint8) if x.dtype.itemsize == 1 else x,
                                          y.view(np.uint8) if y.dtype.itemsize == 1 else y, err_msg=f"{i} {k}")
        layer_max = np.max(np.abs(np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32))), axis=(-2, -1))
        np.testing.assert_array_equal(np.asarray(a["amax"]).reshape(layer_max.shape), layer_max, err_msg=str(i))


def _keys(specs):
    return [{"data": 0, "scale_inv": 0, "amax": 0} if s.recipe == "fp8" else {"data": 0, "scales": 0, "amax": 0}
            for s in specs]


@pytest.mark.parametrize("cw", ["fp8", "nvfp4"])
def test_lowered_scan_step_reduces_amaxes_once_and_gathers_one_layer(cw):
    params = init_params()
    L, F, D = params["blocks"]["w1"].shape
    texts = {}
    for once in (True, False):
        step = _make(loss_scan, cw, once, microbatches=1)
        texts[once] = step.lower(step.init(params), make_batch()).as_text()
    # w1 and w2: L amaxes each, the head: 1 -> one packed reduction of 2L+1; none of a scalar
    assert max_reductions(texts[True]) == [f"tensor<{2 * L + 1}xf32>"], max_reductions(texts[True])
    # where used, none: the casts read the amaxes the previous step computed (TrainState.weight_amax)
    per_use = max_reductions(texts[False])
    assert per_use == [], per_use
    data = "f8E4M3FN" if cw == "fp8" else "ui8"
    width = D if cw == "fp8" else D // 2
    gathers = re.findall(r'"stablehlo\.all_gather".*: \((tensor<[^>]*>)\) -> (tensor<[^>]*>)', texts[True])
    assert (f"tensor<{F // 8}x{width}x{data}>", f"tensor<{F}x{width}x{data}>") in gathers, gathers   # one layer
    assert not any(a.startswith(f"tensor<{L}x") for a, _ in gathers), gathers                      # not the stack


@pytest.mark.parametrize("cw", ["fp8", "nvfp4"])
def test_default_quantizes_nvfp4_once_and_fp8_where_read(cw):
    """``quantize_once=None`` (the default): the lowered step is the one of ``True`` for NVFP4 weights (split over
    8 ranks) and of ``False`` for FP8 weights; on one rank NVFP4 weights make their bf16 operand where they are
    read (``fsdp.dequantizes_once``), so the default lowers as ``False`` there."""
    params = init_params()

    def lowered(once, mesh):
        step = jq.make_train_step(loss_scan, optax.adam(1e-3), mesh=mesh, quantize_mask=MASK,
                                  policy=jq.MixedPrecisionPolicy(compute_weights=cw), quantize_once=once)
        return step.lower(step.init(params), make_batch()).as_text()

    texts = {once: lowered(once, fsdp_mesh()) for once in (None, True, False)}
    assert texts[None] == texts[cw == "nvfp4"]
    assert texts[None] != texts[cw != "nvfp4"]
    if cw == "nvfp4":
        one = fsdp_mesh(1)
        assert lowered(None, one) == lowered(False, one)
