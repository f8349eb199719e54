"""Sharding and batching rules of the single-tensor quantizers and the ops (docs/sharding.md).

Under plain ``jax.jit`` on a NamedSharding input: bytes equal the unsharded result, the compiled
HLO has no all-gather of the input and one max all-reduce over exactly the axes that shard it,
outputs are sharded like the input (columnwise ones transposed). Also: errors for blocks off the
16x16 grid, vmap equal to a Python loop, ops inside shard_map. 8 simulated CPU devices.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
from jaxquant.primitives import ops
from conftest import assert_bytes_equal, assert_bytes_equal_nan_aware
from support.hlo import collectives
from support.sharding import QUANTIZERS, check_quantizer_sharded, norm, tiled_input, two_axis_mesh

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices: run with "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py sets it)")


# ----------------------------------------------------------------------------------------------
# Quantizers under jit on sharded inputs
# ----------------------------------------------------------------------------------------------

CASES = [  # (mesh shape, axis names, spec); [256, 512] is aligned to every split below
    ((2, 4), ("tp", "fsdp"), P("tp", None)),
    ((4, 2), ("tp", "fsdp"), P(None, "tp")),
    ((2, 4), ("tp", "fsdp"), P(("tp", "fsdp"), None)),
    ((4, 2), ("fsdp", "tp"), P("fsdp", "tp")),
    ((8, 1), ("fsdp", "tp"), P("fsdp", "tp")),
    ((1, 8), ("rows", "cols"), P("rows", "cols")),
    ((2, 4), ("a", "b"), P("b", "a")),
]


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.parametrize("shape,names,spec", CASES, ids=[f"{s}-{sp}" for s, _, sp in CASES])
def test_quantizer_sharded_equals_unsharded(recipe, shape, names, spec):
    check_quantizer_sharded(recipe, two_axis_mesh(shape, names), spec, tiled_input(256, 512))


@pytest.mark.parametrize("impl", ["reference", "custom_call"])
@pytest.mark.fast_cases("custom_call")  # the other cases: slow
def test_options_and_impls_sharded(impl):
    """Every impl and the non-default options keep their bytes when sharded."""
    mesh = two_axis_mesh((4, 2), ("fsdp", "tp"))
    x = tiled_input(128, 64, seed=9)
    xs = jax.device_put(x, NamedSharding(mesh, P("fsdp", "tp")))
    fns = {
        "fp8": lambda v: jq.quantize_fp8(v, dtype=jnp.float8_e5m2, columnwise=True, amax_epsilon=1e-3,
                                         force_pow_2_scales=True, compute_dtype=None, impl=impl),
        "nvfp4": lambda v: jq.quantize_nvfp4(v, columnwise=True, compute_dtype=None, impl=impl),
    }
    for recipe, fn in fns.items():
        f = jax.jit(fn)
        for i, (a, b) in enumerate(zip(jax.tree.leaves(f(xs)), jax.tree.leaves(f(x)))):
            assert_bytes_equal(a, b, f"{recipe} {impl} output {i}")


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_explicit_axes_mesh(recipe):
    mesh = two_axis_mesh((4, 2), ("fsdp", "tp"), explicit=True)
    check_quantizer_sharded(recipe, mesh, P("fsdp", "tp"), tiled_input(256, 512, seed=1))


def test_nvfp4_scales_off_the_128x4_layout_are_replicated():
    """M = 192 (not a multiple of 128) and K/16 = 6 (not a multiple of 4): the global padded scale
    arrays cannot be split into the local ones, so they come out replicated, built from the local
    scale rows (uint8 all-gathers of the scales only, never of the input)."""
    mesh = two_axis_mesh((2, 4), ("tp", "fsdp"))
    x = tiled_input(192, 96, seed=2)
    xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
    compiled = QUANTIZERS["nvfp4"].lower(xs).compile()
    out, ref = compiled(xs), QUANTIZERS["nvfp4"](x)
    for name in ("data", "scale_inv", "amax", "data_t", "scale_inv_t"):
        assert_bytes_equal(getattr(out, name), getattr(ref, name), name)
    assert norm(out.data.sharding.spec, 2) == (("tp",), ())
    assert norm(out.scale_inv.sharding.spec, 2) == ((), ())
    gathers = [k for k in collectives(compiled.as_text()) if k[0] == "all-gather"]
    assert gathers and all(t.startswith("u8[") for _, t, _ in gathers), gathers


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("shape,spec", [((32, 64), P("fsdp", None)), ((64, 48), P(None, "fsdp"))])
def test_blocks_off_the_16_grid_are_an_error(explicit, shape, spec):
    mesh = two_axis_mesh((2, 4), ("tp", "fsdp"), explicit=explicit)
    xs = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, spec))
    with pytest.raises(Exception, match=r"nvfp4_stats: input sharding P\(.*'fsdp'.*\) splits dimension .* "
                                        r"16x16 scale grid"):
        jax.jit(jq.quantize_nvfp4)(xs)
    # FP8 has no grid: the same sharding works
    assert_bytes_equal(jax.jit(jq.quantize_fp8)(xs).data, jq.quantize_fp8(jnp.ones(shape, jnp.float32)).data)


# ----------------------------------------------------------------------------------------------
# check_finite: the non-finite count of a sharded input
# ----------------------------------------------------------------------------------------------


def _with_nonfinite(rows, cols):
    x = tiled_input(rows, cols, seed=3)
    x[0, 0], x[rows - 1, cols - 1], x[rows // 2, 3] = np.nan, np.inf, -np.inf
    x[5, cols // 2 + 1] = 3.4e38  # finite in fp32, +inf after rounding to bfloat16
    return x


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_check_finite_counts_and_leaves_tensor_unchanged(recipe):
    quant = jq.quantize_nvfp4 if recipe == "nvfp4" else jq.quantize_fp8
    x = _with_nonfinite(64, 64)
    t, count = quant(jnp.asarray(x), check_finite=True)
    assert int(count) == 4  # NaN, +inf, -inf, and the value that overflows bfloat16
    _, count_fp32 = quant(jnp.asarray(x), check_finite=True, compute_dtype=None)
    assert int(count_fp32) == 3
    plain = quant(jnp.asarray(x))
    compare = assert_bytes_equal if recipe == "nvfp4" else assert_bytes_equal_nan_aware
    compare(t.data, plain.data, "data")
    _, clean = quant(jnp.asarray(tiled_input(64, 64)), check_finite=True)
    assert int(clean) == 0


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_check_finite_sharded_sums_over_shards(recipe):
    quant = jq.quantize_nvfp4 if recipe == "nvfp4" else jq.quantize_fp8
    mesh = two_axis_mesh((2, 4), ("tp", "fsdp"))
    x = _with_nonfinite(128, 256)
    xs = jax.device_put(x, NamedSharding(mesh, P("tp", "fsdp")))
    compiled = jax.jit(lambda v: quant(v, check_finite=True)).lower(xs).compile()
    (t, count), (t_ref, count_ref) = compiled(xs), quant(jnp.asarray(x), check_finite=True)
    assert int(count) == int(count_ref) == 4
    compare = assert_bytes_equal if recipe == "nvfp4" else assert_bytes_equal_nan_aware
    compare(t.data, t_ref.data, "data")
    kinds = collectives(compiled.as_text())
    assert sorted(k[1][:3] for k in kinds) == ["f32", "s32"] and all(k[0] == "all-reduce" for k in kinds), kinds


# ----------------------------------------------------------------------------------------------
# Primitives of jaxquant.primitives.ops under jit on sharded inputs
# ----------------------------------------------------------------------------------------------


def _primitive_cases(x, amax1):
    rows, cols = x.shape
    tiles = ops.nvfp4_tile_amax(x, rows=rows, cols=cols)
    scale = ops.nvfp4_scale(tiles, amax1, rows=rows, cols=cols)
    data = ops.nvfp4_quantize(x, tiles, amax1)[0]
    return {  # name -> (function of the sharded operand, operand, result is sharded like the operand)
        "amax": (lambda v: ops.amax(v, return_nonfinite=True), x, False),
        "fp8_cast": (lambda v: ops.fp8_cast(v, amax1, columnwise=True), x, True),
        "nvfp4_tile_amax": (lambda v: ops.nvfp4_tile_amax(v, rows=rows, cols=cols), x, True),
        "nvfp4_scale": (lambda v: ops.nvfp4_scale(v, amax1, rows=rows, cols=cols), tiles, True),
        "nvfp4_transpose": (ops.nvfp4_transpose, data, False),
        "nvfp4_scale_transpose": (lambda v: ops.nvfp4_scale_transpose(v, rows=rows, cols=cols), scale, False),
    }


@pytest.mark.parametrize("name", ["amax", "fp8_cast", "nvfp4_tile_amax", "nvfp4_scale", "nvfp4_transpose",
                                  "nvfp4_scale_transpose"])
def test_primitives_sharded(name):
    mesh = two_axis_mesh((2, 4), ("tp", "fsdp"))
    x = jnp.asarray(tiled_input(256, 512, seed=4))
    fn, operand, same_spec = _primitive_cases(x, ops.amax(x).reshape(1))[name]
    spec = P("tp", "fsdp")
    xs = jax.device_put(operand, NamedSharding(mesh, spec))
    compiled = jax.jit(fn).lower(xs).compile()
    out, ref = compiled(xs), jax.jit(fn)(operand)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(ref))):
        assert_bytes_equal(a, b, f"{name} output {i}")
    kinds = collectives(compiled.as_text())
    assert all(k[0] == "all-reduce" for k in kinds), f"{name}: {kinds}"
    assert len(kinds) == (2 if name == "amax" else 0), f"{name}: {kinds}"
    first = jax.tree.leaves(out)[0]
    want = (((), ()) if name == "amax" else norm(spec, 2) if same_spec else (("fsdp",), ("tp",)))
    assert norm(first.sharding.spec, first.ndim) == want[:first.ndim], first.sharding


@pytest.mark.slow
def test_flat_range_primitive_is_correct_on_a_sharded_input():
    """nvfp4_cast_partial reads a flat element range: it has no sharding rule (its docstring says the
    partitioner replicates its operands) and gives the unsharded bytes."""
    mesh = two_axis_mesh((2, 4), ("tp", "fsdp"))
    x = jnp.asarray(tiled_input(64, 128, seed=5))
    amax1 = ops.amax(x).reshape(1)
    scale = ops.nvfp4_scale(ops.nvfp4_tile_amax(x, rows=64, cols=128), amax1, rows=64, cols=128)
    fn = lambda v: ops.nvfp4_cast_partial(v.reshape(-1), jnp.zeros((64 * 64,), jnp.uint8), scale, amax1,
                                          rows=64, cols=128)
    xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
    assert_bytes_equal(jax.jit(fn)(xs), fn(x), "cast_partial")


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------


def _batch():
    x = np.stack([tiled_input(128, 64, seed=s) * np.float32(s + 1) for s in range(3)])
    x[1, 3, 4] = np.nan
    x[2, 100, 7] = np.inf
    return jnp.asarray(x)


def _loops(jaxpr) -> bool:
    text = str(jaxpr)
    return "scan[" in text or "while[" in text


def _assert_batch_equals_loop(f, xb, what):
    out, one = jax.jit(jax.vmap(f))(xb), jax.jit(f)
    for i in range(xb.shape[0]):
        item = jax.tree.leaves(jax.tree.map(lambda o: o[i], out))
        for j, (a, b) in enumerate(zip(item, jax.tree.leaves(one(xb[i])))):
            assert_bytes_equal_nan_aware(a, b, f"{what} item {i} output {j}") if a.dtype != jnp.uint8 else \
                assert_bytes_equal(a, b, f"{what} item {i} output {j}")


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_vmap_quantizer_equals_loop(recipe):
    quant = jq.quantize_nvfp4 if recipe == "nvfp4" else jq.quantize_fp8
    _assert_batch_equals_loop(lambda v: quant(v, columnwise=True, check_finite=True), _batch(), recipe)


def test_vmap_folds_row_separable_ops_into_one_call():
    """NVFP4 statistics, and casts with one shared amax, fold the batch into the rows: the batched
    program is one call (no loop), per-item amax and counts still per item."""
    xb = _batch()
    shared = ops.amax(xb).reshape(1)
    folded = {
        "nvfp4_stats": lambda v: ops.nvfp4_stats(v),
        "nvfp4_tile_amax": lambda v: ops.nvfp4_tile_amax(v, rows=128, cols=64, return_nonfinite=True),
        "nvfp4_quantize_shared_amax": lambda v: ops.nvfp4_quantize(v, ops.nvfp4_stats(v)[0], shared),
        "fp8_cast_shared_amax": lambda v: ops.fp8_cast(v, shared),
    }
    for name, f in folded.items():
        _assert_batch_equals_loop(f, xb, name)
        assert not _loops(jax.make_jaxpr(jax.vmap(f))(xb)), f"{name}: batch ran as a loop"
    # per-tensor amax of each item cannot fold: a loop, still equal to the Python loop
    assert _loops(jax.make_jaxpr(jax.vmap(ops.amax))(xb))
    _assert_batch_equals_loop(lambda v: ops.amax(v, return_nonfinite=True), xb, "amax")


# ----------------------------------------------------------------------------------------------
# Inside shard_map (manual axes): the ops run on the local block as before
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("manual", [None, frozenset({"fsdp"})], ids=["all-axes", "fsdp-only"])
def test_ops_inside_shard_map(manual):
    mesh = two_axis_mesh((2, 4), ("tp", "fsdp"))
    x = tiled_input(256, 128, seed=6)

    def body(v):
        t = jq.quantize_nvfp4(v, columnwise=True)
        return t.data, t.data_t, jax.lax.pmax(ops.amax(v), "fsdp")

    kw = {} if manual is None else {"axis_names": manual}
    sm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=(P("fsdp"), P(None, "fsdp"), P()),
                               **kw))
    data, data_t, amax = sm(jax.device_put(x, NamedSharding(mesh, P("fsdp"))))
    one = jax.jit(lambda v: jq.quantize_nvfp4(v, columnwise=True))
    blocks = [one(x[64 * i:64 * (i + 1)]) for i in range(4)]
    assert_bytes_equal(data, jnp.concatenate([b.data for b in blocks]), "data")
    assert_bytes_equal(data_t, jnp.concatenate([b.data_t for b in blocks], axis=1), "data_t")
    assert_bytes_equal(amax, ops.amax(jnp.asarray(x)), "amax")


@pytest.mark.parametrize("shape", [(16, 48), (32, 16), (16, 16)])
def test_single_tile_row_or_column_under_jit(shape):
    # One tile row (or column) makes a size-1 factor, which Shardy rejects inside a compound.
    x = jax.random.normal(jax.random.key(7), shape, jnp.float32)
    got = jax.jit(lambda v: jq.quantize_nvfp4(v, columnwise=True))(x)
    want = jq.quantize_nvfp4(x, columnwise=True, impl="reference")
    for field in ("data", "scale_inv", "data_t", "scale_inv_t", "amax"):
        assert_bytes_equal(getattr(got, field), getattr(want, field))
