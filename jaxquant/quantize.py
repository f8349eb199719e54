"""Single-tensor quantization: the public entry points built from ``jaxquant.ops``."""

from __future__ import annotations

import jax.numpy as jnp

from jaxquant import ops
from jaxquant.tensors import Float8Tensor, NVFP4Tensor


def quantize_fp8(x, *, dtype=jnp.float8_e4m3fn, columnwise: bool = False, amax_epsilon: float = 0.0,
                 force_pow_2_scales: bool = False, compute_dtype=jnp.bfloat16, impl: str = "auto") -> Float8Tensor:
    """FP8 per-tensor current scaling of ``x`` (docs/numerics.md §1).

    ``compute_dtype`` (default bfloat16, as TransformerEngine converts the master weight to the
    model's compute dtype first) casts ``x`` with RNE before quantizing; None quantizes ``x`` as is.
    """
    ops._check_input("x", x)
    if x.ndim != 2:
        raise ValueError(f"x: must have rank 2, got shape {tuple(x.shape)}")
    amax, _ = ops.fp8_stats(x, compute_dtype=compute_dtype, impl=impl)
    data, scale_inv, data_t = ops.fp8_quantize(
        x, amax, dtype=dtype, compute_dtype=compute_dtype, amax_epsilon=amax_epsilon,
        force_pow_2_scales=force_pow_2_scales, columnwise=columnwise, impl=impl)
    return Float8Tensor(data=data, scale_inv=scale_inv, amax=amax, data_t=data_t)


def quantize_nvfp4(x, *, columnwise: bool = False, compute_dtype=jnp.bfloat16, impl: str = "auto") -> NVFP4Tensor:
    """NVFP4 with 2D 16x16 block scaling of a [M, K] tensor (docs/numerics.md §2).

    ``compute_dtype`` as in ``quantize_fp8`` (default bfloat16; None quantizes ``x`` as is).
    """
    ops._check_input("x", x)
    if x.ndim != 2:
        raise ValueError(f"x: must have rank 2, got shape {tuple(x.shape)}")
    rows, cols = (int(d) for d in x.shape)
    tile_amax, amax, _ = ops.nvfp4_stats(x, compute_dtype=compute_dtype, impl=impl)
    data, scale_inv, data_t, scale_inv_t = ops.nvfp4_quantize(
        x, tile_amax, amax, compute_dtype=compute_dtype, columnwise=columnwise, impl=impl)
    return NVFP4Tensor(data=data, scale_inv=scale_inv, amax=amax, data_t=data_t,
                       scale_inv_t=scale_inv_t, shape=(rows, cols))


def nvfp4_columnwise(t: NVFP4Tensor, *, impl: str = "auto") -> NVFP4Tensor:
    """Return ``t`` with its columnwise data and scales built from the rowwise ones."""
    rows, cols = t.shape
    return NVFP4Tensor(data=t.data, scale_inv=t.scale_inv, amax=t.amax,
                       data_t=ops.nvfp4_transpose(t.data, impl=impl),
                       scale_inv_t=ops.nvfp4_scale_transpose(t.scale_inv, rows=rows, cols=cols, impl=impl),
                       shape=t.shape)


def fp8_columnwise(t: Float8Tensor) -> Float8Tensor:
    """Return ``t`` with ``data_t`` (the byte transpose of ``data``)."""
    if t.data.ndim != 2:
        raise ValueError(f"t.data: columnwise data needs rank 2, got shape {tuple(t.data.shape)}")
    return Float8Tensor(data=t.data, scale_inv=t.scale_inv, amax=t.amax, data_t=t.data.T)
