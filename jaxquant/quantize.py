"""Single-tensor quantization: the public entry points built from ``jaxquant.ops``.

Each quantizer is a statistics stage and a quantize stage (``ops.*_stats`` / ``ops.*_quantize``).
Both carry sharding rules (docs/sharding.md): under ``jax.jit`` on a sharded input each device
quantizes its own block, with one max all-reduce of the amax in between.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxquant import ops
from jaxquant.tensors import Float8Tensor, NVFP4Tensor


def _check_rank2(x) -> None:
    ops._check_input("x", x)
    if x.ndim != 2:
        raise ValueError(f"x: must have rank 2, got shape {tuple(x.shape)}")


def quantize_fp8(x, *, dtype=jnp.float8_e4m3fn, columnwise: bool = False, amax_epsilon: float = 0.0,
                 force_pow_2_scales: bool = False, compute_dtype=jnp.bfloat16, check_finite: bool = False,
                 impl: str = "auto"):
    """FP8 per-tensor current scaling of ``x`` (docs/numerics.md §1).

    ``compute_dtype`` (default bfloat16, as TransformerEngine converts the master weight to the
    model's compute dtype first) casts ``x`` with RNE before quantizing; None quantizes ``x`` as is.

    Non-finite input: NaN is ignored by the amax and stays NaN in ``data`` (the format's NaN with
    the input's sign, docs/decisions.md, "FP8 NaN encoding"); ±inf makes the amax inf, so the scale is 1
    (docs/numerics.md §1.3) and ±inf saturates to ±max (§1.6). Values that overflow the compute
    dtype (fp32 beyond bfloat16's range) count as ±inf. With ``check_finite=True`` returns
    ``(tensor, count)``: ``count`` is the int32 number of NaN/±inf elements (after the compute-dtype
    rounding), from the same pass as the amax (summed over the shards of a sharded ``x``).
    """
    _check_rank2(x)
    amax, count = ops.fp8_stats(x, compute_dtype=compute_dtype, impl=impl)
    data, scale_inv, data_t = ops.fp8_quantize(
        x, amax, dtype=dtype, compute_dtype=compute_dtype, amax_epsilon=amax_epsilon,
        force_pow_2_scales=force_pow_2_scales, columnwise=columnwise, impl=impl)
    tensor = Float8Tensor(data=data, scale_inv=scale_inv, amax=amax, data_t=data_t)
    return (tensor, count) if check_finite else tensor


def quantize_nvfp4(x, *, columnwise: bool = False, compute_dtype=jnp.bfloat16, check_finite: bool = False,
                   impl: str = "auto"):
    """NVFP4 with 2D 16x16 block scaling of a [M, K] tensor (docs/numerics.md §2).

    ``compute_dtype`` as in ``quantize_fp8`` (default bfloat16; None quantizes ``x`` as is).

    Non-finite input is outside the bit-exact contract (docs/numerics.md §2.6, docs/decisions.md,
    "NVFP4 NaN input") and is NOT reported unless asked: NaN is ignored by the amaxes and its element becomes
    a finite ±6 x tile scale (code 7 / 15, the NaN's sign; the hardware conversion on sm_100a may
    differ). ±inf makes its tile amax and the amax inf: the global scales fall back to 1 (§2 step 2),
    the element saturates to ±6 x 448, and since the stored amax is inf the whole tensor dequantizes
    to non-finite values (§2.8). With ``check_finite=True`` returns ``(tensor, count)``:
    ``count`` is the int32 number of NaN/±inf elements (after the compute-dtype rounding), from the
    same pass as the tile amaxes (summed over the shards of a sharded ``x``).
    """
    _check_rank2(x)
    rows, cols = (int(d) for d in x.shape)
    tile_amax, amax, count = ops.nvfp4_stats(x, compute_dtype=compute_dtype, impl=impl)
    data, scale_inv, data_t, scale_inv_t = ops.nvfp4_quantize(
        x, tile_amax, amax, compute_dtype=compute_dtype, columnwise=columnwise, impl=impl)
    tensor = NVFP4Tensor(data=data, scale_inv=scale_inv, amax=amax, data_t=data_t,
                         scale_inv_t=scale_inv_t, shape=(rows, cols))
    return (tensor, count) if check_finite else tensor


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
