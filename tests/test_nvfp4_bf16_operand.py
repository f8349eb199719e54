"""``ops.nvfp4_bf16_operand``: an NVFP4 weight's bf16 GEMM operand (``value(q) * s8``) from the weight in one pass,
its tile amaxes its own, the whole tensor's amax given. Custom call == reference bit for bit, and both == what the
two passes and the decode give (``ops.nvfp4_stats`` for the tiles, ``ops.nvfp4_quantize``, ``gemm.nvfp4_operand``),
on random inputs and edge cases; the errors; its batching fold and sharding rule. The file runs unchanged on a GPU
backend, where "custom_call" is the CUDA kernel (tests/test_nvfp4_bf16_operand_gpu.py adds the large shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxquant.primitives import gemm, ops
from conftest import assert_bytes_equal, nvfp4_edge_inputs, random_tiled

COMPUTE = {"none": None, "bf16": jnp.bfloat16}

operand_j = jax.jit(ops.nvfp4_bf16_operand, static_argnames=("compute_dtype", "impl"))


def _two_passes_cd(x, amax, compute_dtype):
    """The bytes the op stands for, through the ops it replaces: stats (tiles), quantize, decode (the custom calls
    where ``impl="auto"`` runs them)."""
    tiles, _, _ = ops.nvfp4_stats(x, compute_dtype=compute_dtype)
    data, scale_inv, _, _ = ops.nvfp4_quantize(x, tiles, amax, compute_dtype=compute_dtype)
    return gemm.nvfp4_operand(data, scale_inv)


_two_passes_j = jax.jit(_two_passes_cd, static_argnames=("compute_dtype",))


def _amax(x, compute_dtype):
    return ops.nvfp4_stats(x, compute_dtype=compute_dtype, impl="reference")[1]


def _check(x, compute_dtype, what, amax=None):
    amax = _amax(x, compute_dtype) if amax is None else amax
    ref = operand_j(x, amax, compute_dtype=compute_dtype, impl="reference")
    cus = operand_j(x, amax, compute_dtype=compute_dtype, impl="custom_call")
    assert ref.dtype == jnp.bfloat16 and ref.shape == x.shape
    assert_bytes_equal(cus, ref, f"{what}: custom call vs reference")
    assert_bytes_equal(ref, _two_passes_j(x, amax, compute_dtype=compute_dtype), f"{what}: vs the two passes")
    return ref


# (input dtype, compute dtype, shape): shapes on and off the kernel's 64-row block items and column spans (K = 48,
# 80, 1040: not multiples of 64; M = 16, 144: not multiples of 64 or 128)
CASES = [(jnp.float32, "bf16", (32, 48)), (jnp.float32, "none", (16, 16)), (jnp.bfloat16, "none", (144, 80)),
         (jnp.bfloat16, "bf16", (48, 1040)), (jnp.float32, "bf16", (272, 528))]


@pytest.mark.parametrize("in_dtype,compute,shape", CASES,
                         ids=[f"{jnp.dtype(d).name}-{c}-{s[0]}x{s[1]}" for d, c, s in CASES])
def test_custom_call_equals_reference_and_the_two_passes(rng, in_dtype, compute, shape):
    x = jnp.asarray(random_tiled(rng, *shape)).astype(in_dtype)
    _check(x, COMPUTE[compute], "random")


@pytest.mark.parametrize("in_dtype,compute", [(jnp.float32, "bf16"), (jnp.float32, "none"), (jnp.bfloat16, "none")])
def test_edge_cases(rng, in_dtype, compute):
    """All-zero and all -0.0 tiles (signs kept), all-equal tiles, E2M1 ties and saturation, a tile scale rounding
    to 0 next to a large tile, huge values (3e38) and ±inf (global amax inf: S_enc = 1), subnormals."""
    inputs = nvfp4_edge_inputs(rng)
    inputs["all_equal"] = np.repeat(np.repeat(rng.uniform(-9, 9, (2, 3)).astype(np.float32), 16, 0), 16, 1)
    sub = random_tiled(rng, 32, 48, -44, -38)          # fp32 subnormals and the smallest normals
    sub[0, :4] = [1.5e-45, -1.5e-45, 1e-40, -1e-40]
    inputs["subnormal"] = sub
    for name, x in inputs.items():
        out = _check(jnp.asarray(x).astype(in_dtype), COMPUTE[compute], name)
        if name == "all_neg_zero":
            assert (np.asarray(out).view(np.uint16) == 0x8000).all()
        if name == "all_equal":   # an all-equal tile's elements are its amax: code ±6 times its scale
            assert (np.asarray(out, np.float32) != 0).all()


def test_given_amax_other_than_the_tensors_own(rng):
    """The amax is an input (a whole weight's, of which ``x`` may be a block): larger, zero, inf and NaN amaxes."""
    x = jnp.asarray(random_tiled(rng, 32, 48, -3, 3))
    for amax in (1e4, 1e30, 0.0, np.inf, np.nan):
        _check(x, jnp.bfloat16, f"amax={amax}", amax=jnp.asarray([amax], jnp.float32))


@pytest.mark.parametrize("in_dtype,compute", [(jnp.float32, "bf16"), (jnp.float32, "none"), (jnp.bfloat16, "none")])
def test_nonfinite_tiles(in_dtype, compute):
    """Tiles holding NaN, ±inf or values at the bf16 overflow threshold beside finite tiles: each tile's amax
    ignores NaN (the kernel takes such tiles apart element by element). A NaN element's own code is outside the
    contract (docs/numerics.md §5): every other element has the reference's bytes, the NaN ones its magnitude."""
    x = np.random.default_rng(11).standard_normal((80, 96)).astype(np.float32)
    bits = lambda b: np.array(b, np.uint32).view(np.float32)
    x[0, 0], x[33, 50], x[34, 51] = np.nan, np.nan, -np.nan
    x[17, 35], x[79, 95] = -np.inf, np.inf
    x[50, 70], x[66, 90] = bits(0x7F7F7FFF), -bits(0x7F7F8000)   # stays finite in bf16 / rounds to -inf
    v = jnp.asarray(x).astype(in_dtype)
    cd = COMPUTE[compute]
    amax = _amax(v, cd)
    ref = np.asarray(operand_j(v, amax, compute_dtype=cd, impl="reference")).view(np.uint16)
    cus = np.asarray(operand_j(v, amax, compute_dtype=cd, impl="custom_call")).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(cus[~nan], ref[~nan])
    np.testing.assert_array_equal(cus[nan] & 0x7FFF, ref[nan] & 0x7FFF)
    two = np.asarray(_two_passes_j(v, amax, compute_dtype=cd)).view(np.uint16)
    np.testing.assert_array_equal(ref[~nan], two[~nan])


X = jnp.ones((32, 48), jnp.float32)
AMAX1 = jnp.ones((1,), jnp.float32)


@pytest.mark.parametrize("impl", ["reference", "custom_call"])
@pytest.mark.parametrize("call,exc,match", [
    (lambda i: ops.nvfp4_bf16_operand(jnp.ones((20, 16)), AMAX1, impl=i), ValueError, r"^x: .*multiple of 16"),
    (lambda i: ops.nvfp4_bf16_operand(jnp.ones((16, 24)), AMAX1, impl=i), ValueError, r"^x: .*multiple of 16"),
    (lambda i: ops.nvfp4_bf16_operand(jnp.ones((256,)), AMAX1, impl=i), ValueError, r"^x: must have rank 2"),
    (lambda i: ops.nvfp4_bf16_operand(jnp.ones((2, 16, 16)), AMAX1, impl=i), ValueError, r"^x: must have rank 2"),
    (lambda i: ops.nvfp4_bf16_operand(X.astype(jnp.float16), AMAX1, impl=i), TypeError, r"^x: dtype"),
    (lambda i: ops.nvfp4_bf16_operand(X, jnp.ones((2,)), impl=i), TypeError, r"^amax: "),
    (lambda i: ops.nvfp4_bf16_operand(X, jnp.ones((1,), jnp.bfloat16), impl=i), TypeError, r"^amax: "),
    (lambda i: ops.nvfp4_bf16_operand(X, AMAX1, compute_dtype=jnp.float16, impl=i), TypeError, r"^compute_dtype: "),
])
def test_errors(impl, call, exc, match):
    with pytest.raises(exc, match=match):
        call(impl)


def test_bad_impl():
    with pytest.raises(ValueError, match=r"^impl: must be one of"):
        ops.nvfp4_bf16_operand(X, AMAX1, impl="cuda")


def test_handler_rejects_an_inconsistent_call():
    """Called directly with a result of another shape: an error from the handler, never a write out of bounds."""
    from jaxquant.primitives import _ffi
    with pytest.raises(Exception, match="jaxquant"):
        jax.block_until_ready(_ffi.call("jq_nvfp4_bf16_operand", [jax.ShapeDtypeStruct((32, 32), jnp.bfloat16)],
                                        X, AMAX1, round_bf16=True))


def test_vmap_folds_a_shared_amax_and_maps_per_item_amaxes(rng):
    """A batch with one amax is one call over the stacked rows; per-item amaxes run item by item: both give each
    item's own bytes."""
    x = jnp.asarray(np.stack([random_tiled(rng, 32, 48) for _ in range(3)]))
    amax = jnp.max(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32)), axis=(1, 2))
    shared = jax.jit(jax.vmap(lambda v: ops.nvfp4_bf16_operand(v, amax[0])))(x)
    own = jax.jit(jax.vmap(ops.nvfp4_bf16_operand))(x, amax)
    for i in range(3):
        assert_bytes_equal(shared[i], ops.nvfp4_bf16_operand(x[i], amax[0]), f"shared amax, item {i}")
        assert_bytes_equal(own[i], ops.nvfp4_bf16_operand(x[i], amax[i]), f"own amax, item {i}")


def test_sharded_rows_and_columns_give_the_whole_tensors_bytes(rng):
    """Under jit on rows split over devices (and columns over a second axis), each device computes its blocks' tile
    amaxes: the tiles are whole in every block, so the result is the unsharded call's."""
    n = len(jax.devices())
    if n < 4:
        pytest.skip("needs 4 devices")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("r", "c"))
    x = jnp.asarray(random_tiled(rng, 64, 96))
    amax = _amax(x, jnp.bfloat16)
    whole = ops.nvfp4_bf16_operand(x, amax)
    xs = jax.device_put(x, NamedSharding(mesh, P("r", "c")))
    fn = jax.jit(ops.nvfp4_bf16_operand)
    out = fn(xs, amax)
    assert out.sharding.spec == P("r", "c")
    assert "all-gather" not in fn.lower(xs, amax).compile().as_text()
    assert_bytes_equal(out, whole, "sharded")
