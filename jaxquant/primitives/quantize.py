"""Single-tensor quantization: the public entry points built from ``jaxquant.primitives.ops``.

Each quantizer is a statistics stage and a quantize stage (``ops.*_stats`` / ``ops.*_quantize``).
Both carry sharding rules (docs/sharding.md): under ``jax.jit`` on a sharded input each device
quantizes its own block, with one max all-reduce of the amax in between.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxquant.primitives import ops
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor


def _check_rank2(x) -> None:
    ops.check_input("x", x)
    if x.ndim != 2:
        raise ValueError(f"x: must have rank 2, got shape {tuple(x.shape)}")


def quantize_fp8(x, *, dtype=jnp.float8_e4m3fn, columnwise: bool = False, amax_epsilon: float = 0.0,
                 force_pow_2_scales: bool = False, compute_dtype=jnp.bfloat16, check_finite: bool = False,
                 impl: str = "auto"):
    """FP8 per-tensor current scaling of ``x`` (docs/numerics.md §1).

    Non-finite input: NaN is ignored by the amax and stays NaN in ``data`` (the format's NaN with
    the input's sign, docs/decisions.md, "FP8 NaN encoding"); ±inf makes the amax inf, so the scale is 1
    (docs/numerics.md §1.3) and ±inf saturates to ±max (§1.6). Values that overflow the compute
    dtype (fp32 beyond bfloat16's range) count as ±inf.

    Args:
      x: float32 or bfloat16 array of rank 2. Under ``jax.jit`` it may be sharded: each device quantizes
        its own block, with one max all-reduce of the amax.
      dtype: the FP8 format, ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
      columnwise: also write ``data_t``, the byte transpose of ``data``, in the same pass (default False).
      amax_epsilon: lower bound on the amax used for the scale (default 0.0; docs/numerics.md §1).
      force_pow_2_scales: round the scale down to a power of 2 (default False; docs/numerics.md §1).
      compute_dtype: ``x`` is cast to it with RNE before quantizing, as TransformerEngine converts the
        master weight to the model's compute dtype first (default bfloat16); None quantizes ``x`` as is.
      check_finite: also return the count of NaN/±inf elements (default False).
      impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

    Returns:
      A :class:`Float8Tensor`; with ``check_finite=True`` ``(tensor, count)``, ``count`` the int32 number
      of NaN/±inf elements (after the compute-dtype rounding), from the same pass as the amax (summed
      over the shards of a sharded ``x``).

    Raises:
      TypeError: ``x`` is not a float32/bfloat16 array (a quantized tensor included), or a bad dtype.
      ValueError: ``x`` is not rank 2, or a bad option value.
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

    Non-finite input is outside the bit-exact contract (docs/numerics.md §2.6, docs/decisions.md,
    "NVFP4 NaN input") and is NOT reported unless asked: NaN is ignored by the amaxes and its element becomes
    a finite ±6 x tile scale (code 7 / 15, the NaN's sign; the hardware conversion on sm_100a may
    differ). ±inf makes its tile amax and the amax inf: the global scales fall back to 1 (§2 step 2),
    the element saturates to ±6 x 448, and since the stored amax is inf the whole tensor dequantizes
    to non-finite values (§2.8).

    Args:
      x: float32 or bfloat16 array ``[M, K]``, M and K multiples of 16 (``ops.check_nvfp4_shape``). Under
        ``jax.jit`` it may be sharded: each device quantizes its own block, with one max all-reduce of
        the amax.
      columnwise: also write ``data_t`` and ``scale_inv_t`` (the quantized transpose) in the same pass
        (default False).
      compute_dtype: as in :func:`quantize_fp8` (default bfloat16; None quantizes ``x`` as is).
      check_finite: also return the count of NaN/±inf elements (default False).
      impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

    Returns:
      An :class:`NVFP4Tensor`; with ``check_finite=True`` ``(tensor, count)``, ``count`` the int32 number
      of NaN/±inf elements (after the compute-dtype rounding), from the same pass as the tile amaxes
      (summed over the shards of a sharded ``x``).

    Raises:
      TypeError: ``x`` is not a float32/bfloat16 array (a quantized tensor included), or a bad
        ``compute_dtype``.
      ValueError: ``x`` is not rank 2 or its shape does not tile into 16x16 blocks.
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
    """Add the columnwise copy to an NVFP4 tensor, built from its rowwise data and scales.

    Args:
      t: an :class:`NVFP4Tensor` (its ``data_t`` / ``scale_inv_t``, if any, are replaced).
      impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

    Returns:
      ``t`` with ``data_t`` (uint8 ``[K, M/2]``) and ``scale_inv_t`` (uint8 ``[ru(K,128), ru(M/16,4)]``),
      the same bytes as ``quantize_nvfp4(..., columnwise=True)`` writes.
    """
    rows, cols = t.shape
    return NVFP4Tensor(data=t.data, scale_inv=t.scale_inv, amax=t.amax,
                       data_t=ops.nvfp4_transpose(t.data, impl=impl),
                       scale_inv_t=ops.nvfp4_scale_transpose(t.scale_inv, rows=rows, cols=cols, impl=impl),
                       shape=t.shape)


def fp8_columnwise(t: Float8Tensor) -> Float8Tensor:
    """Add the columnwise copy to an FP8 tensor: the byte transpose of its data.

    Args:
      t: a :class:`Float8Tensor` with rank-2 ``data`` (its ``data_t``, if any, is replaced).

    Returns:
      ``t`` with ``data_t = data.T`` (the scale is per tensor, so the transpose needs no new scale).

    Raises:
      ValueError: ``t.data`` is not rank 2.
    """
    if t.data.ndim != 2:
        raise ValueError(f"t.data: columnwise data needs rank 2, got shape {tuple(t.data.shape)}")
    return Float8Tensor(data=t.data, scale_inv=t.scale_inv, amax=t.amax, data_t=t.data.T)
