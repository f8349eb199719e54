"""ops.nonfinite_any: one flag per array (custom call == pure-JAX reference == the expected flags), the
sent-value rule (main dtype, scale, comm dtype), many arrays (the GPU batches 96 per launch), and
every error path."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant
from jaxquant import ops

IMPLS = ("reference", "custom_call")
F32, BF16 = jnp.float32, jnp.bfloat16
BF16_MAX = float(jnp.finfo(BF16).max)
_S = jax.ShapeDtypeStruct


def _arrays(rng, specs):
    """specs: (shape, dtype, {flat index: value}) -> arrays of small normal values with those set."""
    out = []
    for shape, dtype, poked in specs:
        a = rng.standard_normal(int(np.prod(shape))).astype(np.float32)
        for i, v in poked.items():
            a[i] = v
        out.append(jnp.asarray(a.reshape(shape)).astype(dtype))
    return out


def _flags(arrays, impl, **kw):
    return np.asarray(jax.jit(lambda *xs: ops.nonfinite_any(xs, impl=impl, **kw))(*arrays))


# flat positions: first, last, inside a 16-byte vector, in the scalar tail of an odd length
SPECS = [((0,), F32, {}), ((1,), BF16, {0: np.nan}), ((3, 5, 7), F32, {104: np.inf}), ((65, 63), BF16, {}),
         ((65, 63), F32, {4094: -np.inf}), ((4099,), BF16, {4098: np.nan}), ((4099,), F32, {}),
         ((33, 16), BF16, {0: -np.inf}), ((17,), F32, {9: np.nan}), ((2, 2), BF16, {3: np.inf})]


@pytest.mark.parametrize("impl", IMPLS)
def test_flags_name_the_arrays_with_nan_or_inf(rng, impl):
    arrays = _arrays(rng, SPECS)
    want = [any(not np.isfinite(v) for v in poked.values()) for _, _, poked in SPECS]
    np.testing.assert_array_equal(_flags(arrays, impl), want)


# finite values that the sent conversions turn into inf: f32 above the bf16 range overflows in a bf16
# main dtype (cast before the scale, so a scale < 1 brings nothing back) or in a bf16 comm dtype
# unless the scale brings it back into range; the bf16 maximum itself stays finite
OVERFLOW = [((8,), F32, {3: 3.4e38}), ((8,), F32, {5: BF16_MAX}), ((8,), BF16, {7: BF16_MAX}),
            ((40,), F32, {39: 3.3963e38})]


@pytest.mark.parametrize("main,comm,scale", [(F32, None, 1.0), (F32, BF16, 1.0), (BF16, None, 1.0), (F32, BF16, 0.25),
                                             (BF16, F32, 0.333984375), (F32, None, 1 / 3)])
def test_sent_rule_custom_equals_reference(rng, main, comm, scale):
    arrays = _arrays(rng, OVERFLOW + SPECS)
    ref, cus = (_flags(arrays, impl, scale=scale, main_dtype=main, comm_dtype=comm) for impl in IMPLS)
    np.testing.assert_array_equal(cus, ref)
    to_bf16 = main == BF16 or (comm == BF16 and scale == 1.0)
    assert list(ref[:4]) == [to_bf16, False, False, to_bf16]   # 3.3963e38: past the midpoint to 2^128, so bf16 inf


def test_many_arrays_in_one_call(rng):
    """More arrays than one GPU launch takes (96), of mixed sizes; every 7th poisoned."""
    specs = [((1 + 37 * k % 300,), (F32, BF16)[k % 2], {k % (1 + 37 * k % 300): np.nan} if k % 7 == 3 else {})
             for k in range(250)]
    arrays = _arrays(rng, specs)
    want = [k % 7 == 3 for k in range(250)]
    for impl in IMPLS:
        np.testing.assert_array_equal(_flags(arrays, impl), want, err_msg=impl)


def test_empty_list_and_vmap_free_shapes():
    assert ops.nonfinite_any([]).shape == (0,)
    out = ops.nonfinite_any([jnp.ones((2, 3)), jnp.full((4,), jnp.nan, BF16)], impl="custom_call")
    assert out.dtype == jnp.bool_ and list(np.asarray(out)) == [False, True]


@pytest.mark.parametrize("kwargs,match", [
    (dict(main_dtype=jnp.float16), "main_dtype: must be float32 or bfloat16"),
    (dict(comm_dtype=jnp.int32), "comm_dtype: must be float32 or bfloat16"),
    (dict(scale=0.0), "scale: must be positive"),
    (dict(scale=float("inf")), "scale: must be positive"),
    (dict(scale=0.1, main_dtype=BF16), "exact in bfloat16"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.nonfinite_any([jnp.ones(4)], **kwargs)


def test_bad_array_dtype_is_named():
    with pytest.raises(TypeError, match=r"arrays\[1\]: dtype must be float32 or bfloat16"):
        ops.nonfinite_any([jnp.ones(4), jnp.ones(4, jnp.int32)])


@pytest.mark.parametrize("results,args,attrs", [
    ([_S((3,), jnp.int32)], (jnp.ones(4), jnp.ones(2)), dict(scale=np.float32(1))),          # flag count
    ([_S((1,), jnp.int32)], (jnp.ones(4, jnp.int32),), dict(scale=np.float32(1))),           # array dtype
    ([_S((1,), jnp.int32)], (jnp.ones(4),), dict(scale=np.float32(0))),                      # scale
])
def test_ffi_handler_rejects_inconsistent_calls(results, args, attrs):
    with pytest.raises(Exception, match="jaxquant"):
        jax.block_until_ready(jaxquant._ffi.call("jq_nonfinite_any", results, *args, main_bf16=False,
                                                 comm_bf16=False, **attrs))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_large_arrays_gpu(rng):
    """Vector loop and grid stride over arrays of millions of elements; a NaN in the last vector,
    an inf in the tail, and a clean array of the same size."""
    n = (1 << 22) + 5
    specs = [((n,), BF16, {n - 6: np.nan}), ((n,), F32, {n - 1: np.inf}), ((n,), BF16, {}),
             ((2048, 4096), BF16, {2048 * 4096 // 2 + 1: -np.inf})]
    arrays = _arrays(rng, specs)
    for impl in IMPLS:
        np.testing.assert_array_equal(_flags(arrays, impl), [True, True, False, True], err_msg=impl)
