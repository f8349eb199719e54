"""The single-tensor ops: FP8 casts, the NVFP4 stages, the two passes each quantizer runs, and the GEMMs on cuBLASLt
(CUDA only: the FP8 GEMM, and the scaled bf16 GEMM NVFP4 runs on Hopper).

Each op is declared once (``declare.Op``: its targets, reference, sharding and batching rule, CPU ``auto``
choice) right above the function that validates its arguments and builds its custom call. Arguments are checked at
trace time; errors name the argument and the rule (docs/numerics.md §5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import _ffi, formats, reference
from jaxquant.primitives.formats import TILE, check_nvfp4_shape
from jaxquant.primitives.ops.checks import (check_amax, check_array, check_fp8_cast_args, check_impl,
                                            check_input, check_range, not_quantized, rounds_to_bf16)
from jaxquant.primitives.ops.declare import Op, Target
from jaxquant.primitives.partitioning import Rule


def _scalar(x) -> jax.Array:
    return jnp.reshape(jnp.asarray(x, jnp.float32), ())


# ----------------------------------------------------------------------------------------------
# Batching folds (jaxquant.primitives.partitioning): a batch as one unbatched call where the op allows it
# ----------------------------------------------------------------------------------------------


def _batch_all(n, tree):
    """Broadcast results that do not depend on the batch (e.g. a shared scale_inv) to it."""
    return jax.tree.map(lambda v: jnp.broadcast_to(v, (n,) + v.shape), tree)


def _fold_elementwise(op, n, batched, xs, kwargs):
    """fp8_cast / fp8_quantize: one shared amax and no transpose -> the cast is elementwise."""
    x, amax_value = xs
    if batched[1] or kwargs.get("columnwise") or x.ndim < 2:
        return None
    data, scale_inv, _ = op(x.reshape(-1, x.shape[-1]), amax_value, **kwargs)  # rows of all items
    return data.reshape(x.shape), _batch_all(n, scale_inv), None


def _nonfinite_per_item(x, compute_dtype):
    """int32 [B]: NaN/±inf elements of each batch item after compute_dtype rounding (one extra pass,
    only in a folded batch, where the kernel's one count covers the whole batch)."""
    v = x if compute_dtype is None else formats.to_compute_dtype(x, compute_dtype)
    return jnp.sum(~jnp.isfinite(v), axis=tuple(range(1, v.ndim)), dtype=jnp.int32)


def _fold_tile_amax(op, n, batched, xs, kwargs):
    """nvfp4_tile_amax of whole [B, M, K] tensors: tiles are row-separable, B folds into M."""
    (x,) = xs
    rows = kwargs["rows"]
    out = op(x.reshape(n * rows, -1), **dict(kwargs, rows=n * rows))
    tiles = (out[0] if kwargs.get("return_nonfinite") else out).reshape(n, rows // TILE, -1)
    return (tiles, _nonfinite_per_item(x, None)) if kwargs.get("return_nonfinite") else tiles


def _fold_nvfp4_stats(op, n, batched, xs, kwargs):
    (x,) = xs
    tiles, _, _ = op(x.reshape(n * x.shape[1], x.shape[2]), **kwargs)
    tiles = tiles.reshape(n, x.shape[1] // TILE, -1)
    amax_per_item = jnp.max(tiles.reshape(n, -1), axis=1).reshape(n, 1)
    return tiles, amax_per_item, _nonfinite_per_item(x, kwargs.get("compute_dtype", jnp.bfloat16))


def _fold_nvfp4_quantize(op, n, batched, xs, kwargs):
    """One shared amax, no columnwise copy and M % 128 == 0 (each item's scale rows unpadded)."""
    x, tiles, amax_value = xs
    rows, cols = x.shape[1], x.shape[2]
    if batched[2] or not batched[0] or not batched[1] or kwargs.get("columnwise") or rows % 128:
        return None
    data, scale_inv, _, _ = op(x.reshape(n * rows, cols), tiles.reshape(n * rows // TILE, -1), amax_value,
                               **kwargs)
    return data.reshape(n, rows, -1), scale_inv.reshape(n, rows, -1), None, None


# Sharding rules (jaxquant.primitives.partitioning; docs/sharding.md). Spec letters: m, k = the op's [M, K]
# (a..: each dimension of an any-rank input); /d divides, ^p pads to a multiple of p; "" scalar.
_NVFP4_TILES = "m/16 k/16"
_NVFP4_DATA = ("m k/2", "m^128 k/16^4", "k m/2", "k^128 m/16^4")  # data, scale_inv, data_t, scale_inv_t
_FP8_OUT = ("*", "", "b a")  # data, scale_inv, data_t (rank 2)


def _whole_tensor(arrays, kwargs) -> bool:
    """nvfp4_tile_amax of a whole 2-D tensor (not a flat range of one) is row/column-separable."""
    x = arrays[0]
    return x.shape == (kwargs.get("rows"), kwargs.get("cols")) and kwargs.get("start", 0) == 0


# ----------------------------------------------------------------------------------------------
# FP8 (docs/numerics.md §1)
# ----------------------------------------------------------------------------------------------


AMAX = Op("amax", (Target("jq_amax"),), reference.amax, rule=Rule(
    "amax", ("*",), results=lambda return_nonfinite=False, **_: ("", "") if return_nonfinite else "",
    reduce={0: "max", 1: "sum"}))


@AMAX.define
def amax(x, *, return_nonfinite: bool = False, impl: str = "auto"):
    """max |x| over every element (NaN ignored, 0 when empty or all NaN).

    Args:
      x: float32 or bfloat16 array of any shape.
      return_nonfinite: also return the count of NaN/±inf elements, found in the same pass over memory
        (default False).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      The fp32 scalar amax; with ``return_nonfinite`` ``(amax, count)``, ``count`` an int32 scalar.

    Raises:
      TypeError: ``x`` is not a float32/bfloat16 array.
    """
    check_impl(impl)
    check_input("x", x)
    if x.size == 0:
        result = (jnp.float32(0), jnp.int32(0))
    else:
        outs = [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)]
        custom = lambda v: tuple(AMAX.call("jq_amax", outs, v))
        result = AMAX.dispatch(impl, custom, reference.amax, x)
    return result if return_nonfinite else result[0]


FP8_CAST = Op("fp8_cast", (Target("jq_fp8_cast", cpu_auto="reference"), Target("jq_fp8_cast_t", cpu_auto="reference")),
              reference.fp8_cast, rule=Rule("fp8_cast", ("*", "-"), _FP8_OUT, fold=_fold_elementwise))


@FP8_CAST.define
def fp8_cast(x, amax_value, *, dtype=jnp.float8_e4m3fn, amax_epsilon: float = 0.0,
             force_pow_2_scales: bool = False, columnwise: bool = False, impl: str = "auto"):
    """Scale from ``amax_value`` and cast ``x`` to fp8 (docs/numerics.md §1), no compute-dtype rounding.

    Args:
      x: float32 or bfloat16 array of any shape (a flat master-weight shard included); rank 2 with
        ``columnwise``.
      amax_value: the (global) amax, a float32 scalar or ``[1]`` array.
      dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
      amax_epsilon: lower bound on the amax used for the scale (default 0.0).
      force_pow_2_scales: round the scale down to a power of 2 (default False).
      columnwise: also return ``data_t``, the byte transpose of ``data`` (default False).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``(data, scale_inv, data_t or None)``: fp8 data of ``x``'s shape, the fp32 scalar ``scale_inv``,
      and fp8 ``[K, M]`` with ``columnwise``.

    Raises:
      TypeError: a bad ``x``, ``amax_value`` or ``dtype``.
      ValueError: ``columnwise`` with ``x`` not rank 2, or a negative / non-finite ``amax_epsilon``.
    """
    check_input("x", x)
    dtype = check_fp8_cast_args(x, amax_value, dtype, amax_epsilon, columnwise)
    kw = dict(amax_epsilon=float(amax_epsilon), force_pow_2_scales=bool(force_pow_2_scales))

    def custom(v, a):
        outs = [jax.ShapeDtypeStruct(v.shape, dtype), jax.ShapeDtypeStruct((), jnp.float32)]
        if columnwise:
            outs.append(jax.ShapeDtypeStruct(v.shape[::-1], dtype))
        res = FP8_CAST.call("jq_fp8_cast_t" if columnwise else "jq_fp8_cast", outs, v, a,
                        amax_epsilon=np.float32(kw["amax_epsilon"]),
                        force_pow_2_scales=kw["force_pow_2_scales"])
        return res[0], res[1], (res[2] if columnwise else None)

    def ref(v, a):
        return reference.fp8_cast(v, a, dtype=dtype, columnwise=columnwise, **kw)

    return FP8_CAST.dispatch(impl, custom, ref, x, _scalar(amax_value),
                             target="jq_fp8_cast_t" if columnwise else "jq_fp8_cast")


# ----------------------------------------------------------------------------------------------
# NVFP4 2D (docs/numerics.md §2)
# ----------------------------------------------------------------------------------------------


NVFP4_TILE_AMAX = Op("nvfp4_tile_amax", (Target("jq_nvfp4_tile_amax", cpu_auto="reference"),),
                     reference.nvfp4_tile_amax, rule=Rule(
    "nvfp4_tile_amax", ("m k",), tile=TILE, frame_kwargs={"rows": "m", "cols": "k"},
    results=lambda return_nonfinite=False, **_: (_NVFP4_TILES, "") if return_nonfinite else _NVFP4_TILES,
    reduce={1: "sum"}, applies=_whole_tensor, fold=_fold_tile_amax))


@NVFP4_TILE_AMAX.define
def nvfp4_tile_amax(shard, *, rows: int, cols: int, start: int = 0, return_nonfinite: bool = False,
                    impl: str = "auto"):
    """Tile amaxes of the 16x16 tiles that flat elements ``[start, start + shard.size)`` touch.

    Tiles the shard does not touch give 0, so a max over shards gives the whole tensor's tile amax.
    Sharded under jit: a whole [rows, cols] tensor (``start=0``) is tiled per block, no collectives
    (the count is sum-reduced); a flat range has no rule and is replicated (docs/sharding.md).

    Args:
      shard: float32 or bfloat16, a flat (or any-shape, read flat) range of the row-major
        ``[rows, cols]`` tensor.
      rows, cols: the whole tensor's shape, both positive multiples of 16.
      start: the flat element where ``shard`` begins (default 0).
      return_nonfinite: also return the count of NaN/±inf elements of the shard, found in the same
        pass over memory (default False).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      fp32 ``[rows/16, cols/16]``; with ``return_nonfinite`` ``(tile_amax, count)``, ``count`` an int32
      scalar.

    Raises:
      TypeError: ``shard`` is not a float32/bfloat16 array.
      ValueError: a shape that is not a multiple of 16, or a range outside the tensor.
    """
    check_impl(impl)
    check_nvfp4_shape(rows, cols)
    check_input("shard", shard)
    check_range(start, int(shard.size), rows, cols)
    out = jax.ShapeDtypeStruct((rows // TILE, cols // TILE), jnp.float32)
    if shard.size == 0:
        result = (jnp.zeros(out.shape, out.dtype), jnp.int32(0))
    else:
        flat = jnp.reshape(shard, (-1,))
        count = jax.ShapeDtypeStruct((), jnp.int32)
        custom = lambda v: tuple(NVFP4_TILE_AMAX.call("jq_nvfp4_tile_amax", [out, count], v, rows=np.int64(rows),
                                                      cols=np.int64(cols), start=np.int64(start)))
        ref = lambda v: reference.nvfp4_tile_amax(v, rows=rows, cols=cols, start=start)
        result = NVFP4_TILE_AMAX.dispatch(impl, custom, ref, flat)
    return result if return_nonfinite else result[0]


NVFP4_SCALE = Op("nvfp4_scale", (Target("jq_nvfp4_scale", cpu_auto="reference"),), reference.nvfp4_scale,
                 rule=Rule("nvfp4_scale", (_NVFP4_TILES, "-"), _NVFP4_DATA[1], tile=TILE,
                           frame_kwargs={"rows": "m", "cols": "k"}))


@NVFP4_SCALE.define
def nvfp4_scale(tile_amax, amax_value, *, rows: int, cols: int, impl: str = "auto") -> jax.Array:
    """The NVFP4 tile scales from the tile amaxes and the global amax (docs/numerics.md §2).

    Args:
      tile_amax: fp32 ``[rows/16, cols/16]`` (``nvfp4_tile_amax``, reduced over the shards).
      amax_value: the global amax, a float32 scalar or ``[1]`` array.
      rows, cols: the tensor's shape, both positive multiples of 16.
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      The padded E4M3 ``scale_inv``, uint8 ``[ru(rows,128), ru(cols/16,4)]`` (``ru``: rounded up to a
      multiple).

    Raises:
      TypeError, ValueError: an operand of the wrong dtype or shape.
    """
    check_nvfp4_shape(rows, cols)
    check_array("tile_amax", tile_amax, jnp.float32, (rows // TILE, cols // TILE))
    check_amax(amax_value)
    out = jax.ShapeDtypeStruct(formats.nvfp4_scale_shape(rows, cols), jnp.uint8)
    custom = lambda t, a: NVFP4_SCALE.call("jq_nvfp4_scale", [out], t, a)[0]
    ref = lambda t, a: reference.nvfp4_scale(t, a, rows=rows, cols=cols)
    return NVFP4_SCALE.dispatch(impl, custom, ref, tile_amax, _scalar(amax_value))


NVFP4_CAST_PARTIAL = Op("nvfp4_cast_partial", (Target("jq_nvfp4_cast_partial", cpu_auto="reference"),),
                        reference.nvfp4_cast_partial)


@NVFP4_CAST_PARTIAL.define
def nvfp4_cast_partial(shard, data_bytes, scale_inv, amax_value, *, rows: int, cols: int,
                       start: int = 0, impl: str = "auto") -> jax.Array:
    """Quantize flat elements ``[start, start + len)`` into their bytes of the packed ``[rows, cols/2]`` data.

    No sharding rule: a flat element range is not a block of a sharded 2-D array, so under jit the
    partitioner replicates the operands (all-gathers a sharded ``shard``). Call it per shard inside
    ``shard_map`` instead (docs/sharding.md).

    Args:
      shard: float32 or bfloat16, a flat (or any-shape, read flat) range of the row-major ``[rows, cols]``
        tensor, ``len = shard.size`` elements.
      data_bytes: uint8, the existing byte range ``[start//2, (start+len+1)//2)`` of the packed data.
      scale_inv: uint8 ``[ru(rows,128), ru(cols/16,4)]``, the tensor's scales (``nvfp4_scale``).
      amax_value: the global amax, a float32 scalar or ``[1]`` array.
      rows, cols: the whole tensor's shape, both positive multiples of 16.
      start: the flat element where ``shard`` begins (default 0).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``data_bytes`` with only the shard's nibbles replaced (the neighbour's nibble of a shared boundary
      byte is kept). Under jit the result aliases ``data_bytes``; donate it to update in place.

    Raises:
      TypeError, ValueError: an operand of the wrong dtype or shape, or a range outside the tensor.
    """
    check_impl(impl)
    check_nvfp4_shape(rows, cols)
    check_input("shard", shard)
    length = int(shard.size)
    check_range(start, length, rows, cols)
    lo, hi = formats.nvfp4_byte_range(start, length)
    check_array("data_bytes", data_bytes, jnp.uint8, (hi - lo,))
    check_array("scale_inv", scale_inv, jnp.uint8, formats.nvfp4_scale_shape(rows, cols))
    check_amax(amax_value)
    if hi == lo:
        return data_bytes
    flat = jnp.reshape(shard, (-1,))
    out = jax.ShapeDtypeStruct((hi - lo,), jnp.uint8)

    def custom(v, b, s, a):
        return NVFP4_CAST_PARTIAL.call("jq_nvfp4_cast_partial", [out], v, b, s, a, input_output_aliases={1: 0},
                                       rows=np.int64(rows), cols=np.int64(cols), start=np.int64(start))[0]

    def ref(v, b, s, a):
        return reference.nvfp4_cast_partial(v, b, s, a, rows=rows, cols=cols, start=start)

    return NVFP4_CAST_PARTIAL.dispatch(impl, custom, ref, flat, data_bytes, scale_inv, _scalar(amax_value))


NVFP4_TRANSPOSE = Op("nvfp4_transpose", (Target("jq_nvfp4_transpose", cpu_auto="reference"),),
                     reference.nvfp4_transpose,
                     rule=Rule("nvfp4_transpose", (_NVFP4_DATA[0],), _NVFP4_DATA[2], tile=TILE))


@NVFP4_TRANSPOSE.define
def nvfp4_transpose(data, *, impl: str = "auto") -> jax.Array:
    """The packed transpose of NVFP4 data (the columnwise copy's ``data_t``).

    Args:
      data: uint8 ``[M, K/2]``, two E2M1 codes a byte; M and K positive multiples of 16.
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      uint8 ``[K, M/2]``.

    Raises:
      TypeError: ``data`` is not a rank-2 uint8 array.
      ValueError: M or K not a positive multiple of 16.
    """
    not_quantized("data", data)
    if not hasattr(data, "dtype") or jnp.dtype(data.dtype) != jnp.uint8 or data.ndim != 2:
        raise TypeError(f"data: must be a rank-2 uint8 array, got "
                        f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}")
    rows, cols = int(data.shape[0]), int(data.shape[1]) * 2
    check_nvfp4_shape(rows, cols, name="data")
    out = jax.ShapeDtypeStruct((cols, rows // 2), jnp.uint8)
    custom = lambda d: NVFP4_TRANSPOSE.call("jq_nvfp4_transpose", [out], d)[0]
    return NVFP4_TRANSPOSE.dispatch(impl, custom, reference.nvfp4_transpose, data)


NVFP4_SCALE_TRANSPOSE = Op("nvfp4_scale_transpose", (Target("jq_nvfp4_scale_transpose", cpu_auto="reference"),),
                           reference.nvfp4_scale_transpose, rule=Rule(
    "nvfp4_scale_transpose", (_NVFP4_DATA[1],), _NVFP4_DATA[3], tile=TILE, frame_kwargs={"rows": "m", "cols": "k"}))


@NVFP4_SCALE_TRANSPOSE.define
def nvfp4_scale_transpose(scale_inv, *, rows: int, cols: int, impl: str = "auto") -> jax.Array:
    """The columnwise copy's scales (``scale_inv_t``) from the rowwise ones.

    Args:
      scale_inv: uint8 ``[ru(rows,128), ru(cols/16,4)]``.
      rows, cols: the tensor's shape M, K, both positive multiples of 16.
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      uint8 ``[ru(cols,128), ru(rows/16,4)]``.

    Raises:
      TypeError, ValueError: ``scale_inv`` of the wrong dtype or shape, or a bad shape.
    """
    check_nvfp4_shape(rows, cols)
    check_array("scale_inv", scale_inv, jnp.uint8, formats.nvfp4_scale_shape(rows, cols))
    out = jax.ShapeDtypeStruct(formats.nvfp4_scale_shape(cols, rows), jnp.uint8)
    custom = lambda s: NVFP4_SCALE_TRANSPOSE.call("jq_nvfp4_scale_transpose", [out], s, rows=np.int64(rows),
                                                  cols=np.int64(cols))[0]
    ref = lambda s: reference.nvfp4_scale_transpose(s, rows=rows, cols=cols)
    return NVFP4_SCALE_TRANSPOSE.dispatch(impl, custom, ref, scale_inv)


# ----------------------------------------------------------------------------------------------
# Single-tensor stages: statistics pass, then cast pass (what quantize_fp8 / quantize_nvfp4 run)
# ----------------------------------------------------------------------------------------------
#
# A quantizer is two passes over x: ``*_stats`` (one read: amax / tile amaxes and the non-finite
# count) and ``*_quantize`` (one read: every output, scales derived inside from the statistics).
# Sharded callers run both on the local block and max-reduce the amax in between.
# ``compute_dtype`` rounding (docs/numerics.md §2, "Compute dtype") happens inside each pass.


def _nvfp4_rows_cols(x) -> tuple[int, int]:
    if x.ndim != 2:
        raise ValueError(f"x: must have rank 2, got shape {tuple(x.shape)}")
    rows, cols = (int(d) for d in x.shape)
    check_nvfp4_shape(rows, cols, name="x")
    return rows, cols


FP8_STATS = Op("fp8_stats", (Target("jq_fp8_stats"),), reference.fp8_stats,
               rule=Rule("fp8_stats", ("*",), ("", ""), reduce={0: "max", 1: "sum"}))


@FP8_STATS.define
def fp8_stats(x, *, compute_dtype=jnp.bfloat16, impl: str = "auto"):
    """The FP8 statistics pass: amax and non-finite count of ``x`` after ``compute_dtype`` rounding.

    One read of ``x`` (custom call ``jq_fp8_stats``; the rounding is fused in).

    Args:
      x: float32 or bfloat16 array of any shape.
      compute_dtype: values are rounded to it first (default bfloat16; None: as is).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``(amax, count)``: fp32 scalar, int32 scalar (NaN/±inf elements).

    Raises:
      TypeError: a bad ``x`` or ``compute_dtype``.
    """
    check_impl(impl)
    check_input("x", x)
    round_bf16 = rounds_to_bf16(x, compute_dtype)
    if x.size == 0:
        return jnp.float32(0), jnp.int32(0)
    outs = [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)]
    custom = lambda v: tuple(FP8_STATS.call("jq_fp8_stats", outs, v, round_bf16=round_bf16))
    ref = lambda v: reference.fp8_stats(v, compute_dtype=compute_dtype)
    return FP8_STATS.dispatch(impl, custom, ref, x)


FP8_QUANTIZE = Op("fp8_quantize", (Target("jq_fp8_quantize", cpu_auto="reference"),
                                   Target("jq_fp8_quantize_t", cpu_auto="reference")),
                  reference.fp8_quantize, rule=Rule("fp8_quantize", ("*", "-"), _FP8_OUT, fold=_fold_elementwise))


@FP8_QUANTIZE.define
def fp8_quantize(x, amax_value, *, dtype=jnp.float8_e4m3fn, compute_dtype=jnp.bfloat16,
                 amax_epsilon: float = 0.0, force_pow_2_scales: bool = False, columnwise: bool = False,
                 impl: str = "auto"):
    """The FP8 cast pass: ``x`` (after ``compute_dtype`` rounding) quantized for the given (global) amax.

    docs/numerics.md §1.2-§1.7. One read of ``x``; with ``columnwise`` the same pass writes ``data_t``.

    Args:
      x: float32 or bfloat16 array of any shape; rank 2 with ``columnwise``.
      amax_value: the (global) amax, a float32 scalar or ``[1]`` array (``fp8_stats``, max-reduced).
      dtype, amax_epsilon, force_pow_2_scales, columnwise: as in :func:`fp8_cast`.
      compute_dtype: values are rounded to it first (default bfloat16; None: as is).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``(data, scale_inv, data_t or None)`` as :func:`fp8_cast`.

    Raises:
      TypeError, ValueError: as :func:`fp8_cast`, or a bad ``compute_dtype``.
    """
    check_impl(impl)
    check_input("x", x)
    round_bf16 = rounds_to_bf16(x, compute_dtype)
    dtype = check_fp8_cast_args(x, amax_value, dtype, amax_epsilon, columnwise)

    def custom(v, a):
        outs = [jax.ShapeDtypeStruct(v.shape, dtype), jax.ShapeDtypeStruct((), jnp.float32)]
        if columnwise:
            outs.append(jax.ShapeDtypeStruct(v.shape[::-1], dtype))
        return tuple(FP8_QUANTIZE.call("jq_fp8_quantize_t" if columnwise else "jq_fp8_quantize", outs, v, a,
                                       amax_epsilon=np.float32(amax_epsilon),
                                       force_pow_2_scales=bool(force_pow_2_scales), round_bf16=round_bf16))

    def ref(v, a):
        return reference.fp8_quantize(v, a, dtype=dtype, compute_dtype=compute_dtype, columnwise=columnwise,
                                      amax_epsilon=float(amax_epsilon), force_pow_2_scales=bool(force_pow_2_scales))

    res = FP8_QUANTIZE.dispatch(impl, custom, ref, x, _scalar(amax_value),
                                target="jq_fp8_quantize_t" if columnwise else "jq_fp8_quantize")
    return res[0], res[1], (res[2] if columnwise else None)


NVFP4_STATS = Op("nvfp4_stats", (Target("jq_nvfp4_stats"),), reference.nvfp4_stats, rule=Rule(
    "nvfp4_stats", ("m k",), (_NVFP4_TILES, "1", ""), reduce={1: "max", 2: "sum"}, tile=TILE, fold=_fold_nvfp4_stats))


@NVFP4_STATS.define
def nvfp4_stats(x, *, compute_dtype=jnp.bfloat16, impl: str = "auto"):
    """The NVFP4 statistics pass of a ``[M, K]`` ``x`` after ``compute_dtype`` rounding.

    One read of ``x`` (custom call ``jq_nvfp4_stats``).

    Args:
      x: float32 or bfloat16 ``[M, K]``, M and K positive multiples of 16.
      compute_dtype: values are rounded to it first (default bfloat16; None: as is).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``(tile_amax, amax, count)``: fp32 ``[M/16, K/16]``, fp32 ``[1]``, int32 scalar (NaN/±inf elements).

    Raises:
      TypeError: a bad ``x`` or ``compute_dtype``.
      ValueError: ``x`` not rank 2, or a shape that is not a multiple of 16.
    """
    check_impl(impl)
    check_input("x", x)
    round_bf16 = rounds_to_bf16(x, compute_dtype)
    rows, cols = _nvfp4_rows_cols(x)
    outs = [jax.ShapeDtypeStruct((rows // TILE, cols // TILE), jnp.float32),
            jax.ShapeDtypeStruct((1,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)]

    custom = lambda v: tuple(NVFP4_STATS.call("jq_nvfp4_stats", outs, v, round_bf16=round_bf16))
    ref = lambda v: reference.nvfp4_stats(v, compute_dtype=compute_dtype)
    return NVFP4_STATS.dispatch(impl, custom, ref, x)


NVFP4_QUANTIZE = Op("nvfp4_quantize", (Target("jq_nvfp4_quantize", cpu_auto="reference"),
                                       Target("jq_nvfp4_quantize_t")),   # the columnwise kernel is faster on the CPU
                    reference.nvfp4_quantize, rule=Rule("nvfp4_quantize", ("m k", _NVFP4_TILES, "-"), _NVFP4_DATA,
                                                        tile=TILE, fold=_fold_nvfp4_quantize))


@NVFP4_QUANTIZE.define
def nvfp4_quantize(x, tile_amax, amax_value, *, compute_dtype=jnp.bfloat16, columnwise: bool = False,
                   impl: str = "auto"):
    """The NVFP4 cast pass of a ``[M, K]`` ``x`` (after ``compute_dtype`` rounding): docs/numerics.md §2.2-§2.7.

    One read of ``x`` (custom call ``jq_nvfp4_quantize[_t]``): tile scales are derived inside, and with
    ``columnwise`` the same pass writes ``data_t`` and ``scale_inv_t``.

    Args:
      x: float32 or bfloat16 ``[M, K]``, M and K positive multiples of 16.
      tile_amax: fp32 ``[M/16, K/16]`` (``nvfp4_stats``).
      amax_value: the (global) amax, a float32 scalar or ``[1]`` array.
      compute_dtype: values are rounded to it first (default bfloat16; None: as is).
      columnwise: also write the columnwise copy (default False).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``(data, scale_inv, data_t or None, scale_inv_t or None)``: uint8 ``[M, K/2]``, uint8
      ``[ru(M,128), ru(K/16,4)]``, and with ``columnwise`` uint8 ``[K, M/2]`` and ``[ru(K,128), ru(M/16,4)]``.

    Raises:
      TypeError, ValueError: an operand of the wrong dtype or shape, or a bad ``compute_dtype``.
    """
    check_impl(impl)
    check_input("x", x)
    round_bf16 = rounds_to_bf16(x, compute_dtype)
    rows, cols = _nvfp4_rows_cols(x)
    check_array("tile_amax", tile_amax, jnp.float32, (rows // TILE, cols // TILE))
    check_amax(amax_value)
    outs = [jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint8),
            jax.ShapeDtypeStruct(formats.nvfp4_scale_shape(rows, cols), jnp.uint8)]
    if columnwise:
        outs += [jax.ShapeDtypeStruct((cols, rows // 2), jnp.uint8),
                 jax.ShapeDtypeStruct(formats.nvfp4_scale_shape(cols, rows), jnp.uint8)]

    def custom(v, t, a):
        return tuple(NVFP4_QUANTIZE.call("jq_nvfp4_quantize_t" if columnwise else "jq_nvfp4_quantize", outs, v, t,
                                         a.reshape(1), round_bf16=round_bf16))

    def ref(v, t, a):
        return reference.nvfp4_quantize(v, t, a, compute_dtype=compute_dtype, columnwise=columnwise)

    res = NVFP4_QUANTIZE.dispatch(impl, custom, ref, x, tile_amax, _scalar(amax_value),
                                  target="jq_nvfp4_quantize_t" if columnwise else "jq_nvfp4_quantize")
    return (res[0], res[1]) + ((res[2], res[3]) if columnwise else (None, None))


def _fold_nvfp4_bf16_operand(op, n, batched, xs, kwargs):
    """A batch of [B, M, K] with one shared amax: tiles are row-separable (M % 16 == 0), B folds into M."""
    x, amax_value = xs
    if batched[1] or not batched[0]:
        return None
    return op(x.reshape(n * x.shape[1], x.shape[2]), amax_value, **kwargs).reshape(x.shape)


# Sharded under jit: each block computes its own tile amaxes (blocks of whole 16x16 tiles); the amax is the whole
# tensor's, given.
NVFP4_BF16_OPERAND = Op("nvfp4_bf16_operand", (Target("jq_nvfp4_bf16_operand"),), reference.nvfp4_bf16_operand,
                        rule=Rule("nvfp4_bf16_operand", ("m k", "-"), "m k", tile=TILE,
                                  fold=_fold_nvfp4_bf16_operand))


@NVFP4_BF16_OPERAND.define
def nvfp4_bf16_operand(x, amax_value, *, compute_dtype=jnp.bfloat16, impl: str = "auto") -> jax.Array:
    """The bf16 GEMM operand of ``x``'s NVFP4 quantization, from ``x`` in one pass: ``value(q) * s8`` per element,
    the bytes of ``gemm.nvfp4_operand`` of :func:`nvfp4_quantize`'s output with ``x``'s own tile amaxes
    (:func:`nvfp4_stats`) and the given global amax, without the packed bytes or the scales in between.

    One read of ``x`` and one bf16 write (custom call ``jq_nvfp4_bf16_operand``): each 16x16 tile's amax is taken in
    the pass; the whole tensor's amax is an input (no statistics pass). The global decode factor of
    docs/numerics.md §2.8 is left out: the GEMM that reads the operand applies it to its fp32 result.

    Args:
      x: float32 or bfloat16 ``[M, K]``, M and K positive multiples of 16.
      amax_value: the whole tensor's amax after ``compute_dtype`` rounding, a float32 scalar or ``[1]`` array.
      compute_dtype: values are rounded to it first (default bfloat16; None: as is).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      bfloat16 ``[M, K]``.

    Raises:
      TypeError, ValueError: an operand of the wrong dtype or shape, or a bad ``compute_dtype``.
    """
    check_impl(impl)
    check_input("x", x)
    round_bf16 = rounds_to_bf16(x, compute_dtype)
    _nvfp4_rows_cols(x)
    check_amax(amax_value)
    out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    custom = lambda v, a: NVFP4_BF16_OPERAND.call("jq_nvfp4_bf16_operand", [out], v, a.reshape(1),
                                                  round_bf16=round_bf16)[0]
    ref = lambda v, a: reference.nvfp4_bf16_operand(v, a, compute_dtype=compute_dtype)
    return NVFP4_BF16_OPERAND.dispatch(impl, custom, ref, x, _scalar(amax_value))


# ----------------------------------------------------------------------------------------------
# The GEMMs on cuBLASLt (jaxquant.primitives.gemm.scaled_gemm; csrc/cuda_gemm.cu)
# ----------------------------------------------------------------------------------------------

FP8_GEMM_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# The GEMMs' time estimates for XLA's scheduler (_ffi.LATENCY_HINTS), FLOPs a nanosecond: what jaxquant's FP8 and bf16
# GEMMs ran at in the 4-layer step on H200s (docs/performance.md, "Current figures: 2 × H200, 2026-11-29": ~1,440
# and ~730 TFLOP/s). Estimates for the schedule, not this device's rates.
FP8_GEMM_FLOPS_PER_NS = 1.4e6
BF16_GEMM_FLOPS_PER_NS = 7.0e5
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
CUBLASLT_WORKSPACE_BYTES = 32 << 20   # csrc/jaxquant/ffi_checks.h kCublasLtWorkspaceBytes: cuBLASLt's workspace

# Sharded under jit: each device multiplies its rows of ``a`` by the whole of ``b`` (K is never split: a split K
# would need a sum of partial products in fp32 before the factors and the rounding); no fold under vmap (a batch
# folded into M could change cuBLASLt's algorithm, so the batch runs item by item).
FP8_GEMM = Op("fp8_gemm", (Target("jq_fp8_gemm", platforms=("cuda",), optional=True),),
              reference.fp8_gemm, rule=Rule("fp8_gemm", ("m 1", "1 1", "", ""), "m 1"))


def fp8_gemm_supported(a_shape, b_shape, a_dtype, b_dtype) -> bool:
    """Whether cuBLASLt's FP8 GEMM takes ``a [M, K]`` x ``b [N, K]`` (csrc/jaxquant/ffi_checks.h
    ``check_fp8_gemm``): float8 operands, not both E5M2, M > 0, N and K positive multiples of 16."""
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != b_shape[1]:
        return False
    dtypes = (jnp.dtype(a_dtype), jnp.dtype(b_dtype))
    if not all(d in FP8_DTYPES for d in dtypes) or dtypes == (jnp.dtype(jnp.float8_e5m2),) * 2:
        return False
    m, n, k = a_shape[0], b_shape[0], a_shape[1]
    return m > 0 and n > 0 and k > 0 and n % 16 == 0 and k % 16 == 0


def gemm_ns(a, b, out, flops_per_ns: float) -> int:
    """A GEMM's time estimate for XLA's scheduler: ``a [M, K]`` (this device's rows) times ``b`` into ``out [M, N]``
    at ``flops_per_ns``, or the time to read and write its operands (``_ffi.memory_bound_ns``) if longer."""
    flops = 2 * out.shape[0] * out.shape[1] * a.shape[1]
    return max(int(flops / flops_per_ns), _ffi.memory_bound_ns(a, b, out))


@FP8_GEMM.define
def fp8_gemm(a, b, a_scale, b_scale, *, out_dtype=jnp.bfloat16, fast_accum: bool = True,
             factor_product: bool = False, impl: str = "auto"):
    """``a [M, K]`` x ``b [N, K]`` accumulated in fp32 times ``a_scale * b_scale``, in ``out_dtype``
    (``reference.fp8_gemm``), on CUDA one cuBLASLt FP8 GEMM that rounds the scaled product once, to ``out_dtype``.

    Args:
      a, b: float8_e4m3fn or float8_e5m2 ``[M, K]`` and ``[N, K]``, not both E5M2; N and K multiples of 16.
      a_scale, b_scale: the operands' fp32 dequantization factors (``scale_inv``), scalars or ``[1]``.
      out_dtype: bfloat16 (default) or float32.
      fast_accum: cuBLASLt's FP8 fast accumulation (default True: XLA's own FP8 GEMM turns it on for float8
        operands at the default precision with no dot algorithm set, as ``lax.dot_general`` leaves it, so both give
        the same bytes; tests/test_fp8_gemm_gpu.py checks it).
      factor_product: give cuBLASLt the product ``a_scale * b_scale`` (computed on the device) as its alpha instead
        of the two factors as its A / B scales (default False).
      impl: "auto" (default: the custom call on CUDA where the extension has it, the reference elsewhere),
        "custom_call" or "reference".

    Raises:
      TypeError, ValueError: operands of other dtypes or shapes (those cuBLASLt does not take).
      ExtensionError: ``impl="custom_call"`` where no extension has the GEMM.
    """
    check_impl(impl)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in FP8_GEMM_OUT_DTYPES:
        raise TypeError(f"out_dtype: must be bfloat16 or float32, got {out_dtype}")
    for name, v in (("a", a), ("b", b)):
        if not hasattr(v, "dtype") or jnp.dtype(v.dtype) not in FP8_DTYPES or v.ndim != 2:
            raise TypeError(f"{name}: must be a rank-2 float8_e4m3fn or float8_e5m2 array, got "
                            f"{getattr(v, 'dtype', type(v).__name__)} {tuple(getattr(v, 'shape', ()))}")
    if not fp8_gemm_supported(a.shape, b.shape, a.dtype, b.dtype):
        raise ValueError(f"a, b: cuBLASLt's FP8 GEMM takes a [M, K] x b [N, K] with N and K positive multiples of 16, "
                         f"not both float8_e5m2; got {a.dtype} {tuple(a.shape)} x {b.dtype} {tuple(b.shape)}")
    for name, v in (("a_scale", a_scale), ("b_scale", b_scale)):
        if not hasattr(v, "dtype") or jnp.dtype(v.dtype) != jnp.float32 or v.size != 1:
            raise TypeError(f"{name}: must be a float32 scalar or [1] array, got "
                            f"{getattr(v, 'dtype', type(v).__name__)} {getattr(v, 'shape', '')}")
    outs = [jax.ShapeDtypeStruct((a.shape[0], b.shape[0]), out_dtype),
            jax.ShapeDtypeStruct((CUBLASLT_WORKSPACE_BYTES,), jnp.uint8)]

    def custom(x, y, sx, sy):
        return FP8_GEMM.call("jq_fp8_gemm", outs, x, y, sx, sy, fast_accum=bool(fast_accum),
                             factor_product=bool(factor_product),
                             cost_ns=gemm_ns(x, y, outs[0], FP8_GEMM_FLOPS_PER_NS))[0]

    def ref(x, y, sx, sy):
        return reference.fp8_gemm(x, y, sx, sy, out_dtype=out_dtype)

    return FP8_GEMM.dispatch(impl, custom, ref, a, b, _scalar(a_scale), _scalar(b_scale))


# The scaled bf16 GEMM. Sharded and batched as the FP8 GEMM: each device multiplies its rows of ``a`` by the whole of
# ``b`` (K never split), and a batch runs item by item.
BF16_GEMM_LAYOUTS = ("nk", "kn")
BF16_GEMM = Op("bf16_gemm", (Target("jq_bf16_gemm", platforms=("cuda",), optional=True),),
               reference.bf16_gemm, rule=Rule("bf16_gemm", ("m 1", "1 1", ""), "m 1"))


def bf16_gemm_supported(a_shape, b_shape, a_dtype, b_dtype, b_layout: str = "nk") -> bool:
    """Whether ``bf16_gemm`` takes ``a [M, K]`` x ``b`` (``[N, K]`` for ``b_layout`` "nk", ``[K, N]`` for "kn";
    csrc/jaxquant/ffi_checks.h ``check_bf16_gemm``): bf16 operands, M > 0, N and K positive multiples of 16."""
    if b_layout not in BF16_GEMM_LAYOUTS or len(a_shape) != 2 or len(b_shape) != 2:
        return False
    if jnp.dtype(a_dtype) != jnp.dtype(jnp.bfloat16) or jnp.dtype(b_dtype) != jnp.dtype(jnp.bfloat16):
        return False
    n, kb = (b_shape[0], b_shape[1]) if b_layout == "nk" else (b_shape[1], b_shape[0])
    m, k = a_shape
    return kb == k and m > 0 and n > 0 and k > 0 and n % 16 == 0 and k % 16 == 0


@BF16_GEMM.define
def bf16_gemm(a, b, factor, *, b_layout: str = "nk", impl: str = "auto"):
    """``a [M, K]`` x ``b`` of bf16 operands accumulated in fp32 times ``factor``, rounded once to bf16
    (``reference.bf16_gemm``); on CUDA one cuBLASLt GEMM with ``factor`` as its alpha, read on the device, that writes
    bf16 (the NVFP4 GEMMs on Hopper: docs/numerics.md §2.8).

    Args:
      a: bfloat16 ``[M, K]``.
      b: bfloat16 ``[N, K]`` (``b_layout="nk"``, the TN product) or ``[K, N]`` (``"kn"``, NN); N and K multiples of 16.
      factor: the fp32 factor of the product (an NVFP4 operand's global decode factor), a scalar or ``[1]``.
      b_layout: "nk" (default) or "kn".
      impl: "auto" (default: the custom call on CUDA where the extension has it, the reference elsewhere),
        "custom_call" or "reference".

    Raises:
      TypeError, ValueError: arguments of other dtypes or shapes, a ``b_layout`` other than "nk" / "kn".
      ExtensionError: ``impl="custom_call"`` where no extension has the GEMM.
    """
    check_impl(impl)
    if b_layout not in BF16_GEMM_LAYOUTS:
        raise ValueError(f"b_layout: must be one of {BF16_GEMM_LAYOUTS}, got {b_layout!r}")
    for name, v in (("a", a), ("b", b)):
        if not hasattr(v, "dtype") or jnp.dtype(v.dtype) != jnp.dtype(jnp.bfloat16) or v.ndim != 2:
            raise TypeError(f"{name}: must be a rank-2 bfloat16 array, got "
                            f"{getattr(v, 'dtype', type(v).__name__)} {tuple(getattr(v, 'shape', ()))}")
    if not bf16_gemm_supported(a.shape, b.shape, a.dtype, b.dtype, b_layout):
        want = "b [N, K]" if b_layout == "nk" else "b [K, N]"
        raise ValueError(f"a, b: bf16_gemm takes a [M, K] x {want} with N and K positive multiples of 16; got "
                         f"{tuple(a.shape)} x {tuple(b.shape)} (b_layout={b_layout!r})")
    if not hasattr(factor, "dtype") or jnp.dtype(factor.dtype) != jnp.float32 or factor.size != 1:
        raise TypeError(f"factor: must be a float32 scalar or [1] array, got "
                        f"{getattr(factor, 'dtype', type(factor).__name__)} {getattr(factor, 'shape', '')}")
    n = b.shape[0] if b_layout == "nk" else b.shape[1]
    outs = [jax.ShapeDtypeStruct((a.shape[0], n), jnp.bfloat16),
            jax.ShapeDtypeStruct((CUBLASLT_WORKSPACE_BYTES,), jnp.uint8)]

    def custom(x, y, f):
        return BF16_GEMM.call("jq_bf16_gemm", outs, x, y, f, b_kn=b_layout == "kn",
                              cost_ns=gemm_ns(x, y, outs[0], BF16_GEMM_FLOPS_PER_NS))[0]

    def ref(x, y, f):
        return reference.bf16_gemm(x, y, f, b_layout=b_layout)

    return BF16_GEMM.dispatch(impl, custom, ref, a, b, _scalar(factor))
