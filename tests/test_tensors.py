"""Float8Tensor / NVFP4Tensor describe the logical tensor like an array: ``shape``, ``ndim``,
``size`` of the dequantized tensor, ``dtype`` = the dtype ``dequantize()`` returns by default
(float32); the stored bytes keep their own shapes and dtypes (``data.shape``, ``data.dtype``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.primitives import ops, tensors

ROWS, COLS = 48, 64


def _x():
    return jnp.asarray(np.random.default_rng(0).standard_normal((ROWS, COLS)), jnp.float32)


def _quantized():
    x = _x()
    return [("fp8_e4m3", jq.quantize_fp8(x, columnwise=True, impl="reference")),
            ("fp8_e5m2", jq.quantize_fp8(x, dtype=jnp.float8_e5m2, impl="reference")),
            ("nvfp4", jq.quantize_nvfp4(x, columnwise=True, impl="reference"))]


@pytest.mark.parametrize("i", range(3), ids=["fp8_e4m3", "fp8_e5m2", "nvfp4"])
def test_logical_shape_ndim_size_dtype(i):
    _, q = _quantized()[i]
    assert q.shape == (ROWS, COLS) and isinstance(q.shape, tuple)
    assert q.ndim == 2 and q.size == ROWS * COLS
    assert q.dtype == jnp.dtype(jnp.float32) == tensors.DEQUANTIZED_DTYPE
    x = q.dequantize()
    assert (x.shape, x.dtype, x.ndim, x.size) == (q.shape, q.dtype, q.ndim, q.size)
    assert q.dequantize(jnp.bfloat16).dtype == jnp.bfloat16


def test_storage_fields_keep_their_shapes_and_dtypes():
    (_, e4m3), (_, e5m2), (_, nv) = _quantized()
    assert e4m3.data.dtype == jnp.float8_e4m3fn and e4m3.data.shape == (ROWS, COLS)
    assert e4m3.data_t.shape == (COLS, ROWS)
    assert e5m2.data.dtype == jnp.float8_e5m2
    assert nv.data.dtype == jnp.uint8 and nv.data.shape == (ROWS, COLS // 2)   # two E2M1 codes a byte
    assert nv.data_t.shape == (COLS, ROWS // 2)
    assert nv.scale_inv.dtype == jnp.uint8 and nv.scale_inv.shape == (128, 4)
    assert nv.dequantize_t().shape == (COLS, ROWS)


def test_nvfp4_shape_from_data_when_not_given():
    nv = jq.quantize_nvfp4(_x(), impl="reference")
    bare = jq.NVFP4Tensor(data=nv.data, scale_inv=nv.scale_inv, amax=nv.amax)
    assert bare.shape == (ROWS, COLS) and bare.ndim == 2 and bare.size == ROWS * COLS


def test_properties_under_jit_and_a_1d_fp8_shard():
    def f(x):
        q8, q4 = jq.quantize_fp8(x, impl="reference"), jq.quantize_nvfp4(x, impl="reference")
        for q in (q8, q4):
            assert (q.shape, q.ndim, q.size, q.dtype) == ((ROWS, COLS), 2, ROWS * COLS, jnp.float32)
        return q8.dequantize(), q4.dequantize()

    a, b = jax.jit(f)(_x())
    assert a.dtype == b.dtype == jnp.float32
    shard = tensors.Float8Tensor(data=jnp.zeros((100,), jnp.float8_e4m3fn), scale_inv=jnp.float32(1),
                                 amax=jnp.float32(0))
    assert (shard.shape, shard.ndim, shard.size, shard.dtype) == ((100,), 1, 100, jnp.float32)


def test_dtype_is_not_pytree_metadata():
    """The treedef is the layout's alone: leaves (the stored arrays) and NVFP4's static shape."""
    for _, q in _quantized():
        leaves, treedef = jax.tree.flatten(q)
        assert all(isinstance(v, jax.Array) for v in leaves)
        rebuilt = jax.tree.unflatten(treedef, leaves)
        assert type(rebuilt) is type(q) and (rebuilt.shape, rebuilt.dtype) == (q.shape, q.dtype)
        zeros = jax.tree.map(jnp.zeros_like, q)   # another tensor of the same layout: the same treedef
        assert jax.tree.structure(zeros) == treedef


def test_straight_through_checks_the_logical_shape():
    for _, q in _quantized():
        held = jq.straight_through(q, jnp.zeros(q.shape, jnp.float32))
        assert (held.shape, held.dtype) == (q.shape, q.dtype)
        with pytest.raises(ValueError, match="master: must have the weight's shape"):
            jq.straight_through(q, jnp.zeros((ROWS, COLS // 2), jnp.float32))


@pytest.mark.parametrize("i", range(3), ids=["fp8_e4m3", "fp8_e5m2", "nvfp4"])
def test_a_quantized_tensor_is_not_an_array_operand(i):
    """It has an array's shape and a float dtype, but the ops reject it (no op runs on a pytree)."""
    _, q = _quantized()[i]
    for call in (lambda: ops.amax(q), lambda: ops.fp8_stats(q), lambda: jq.quantize_fp8(q),
                 lambda: jax.jit(lambda v: ops.nvfp4_stats(v))(q), lambda: ops.nvfp4_transpose(q)):
        with pytest.raises(TypeError, match=rf": must be an array, got {type(q).__name__}, a quantized tensor"):
            call()
