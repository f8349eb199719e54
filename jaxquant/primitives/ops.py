"""Low-level quantization primitives: validated, jit-able, dispatched to a custom call or the reference.

Every op takes ``impl``:
  "reference"    the pure-JAX reference (``jaxquant.primitives.reference``),
  "custom_call"  the XLA FFI custom call (error if the extension is not built),
  "auto"         the custom call on each platform it is built for, the reference elsewhere; on the CPU the
                 reference also for the ops whose reference is faster there (``_ffi.CPU_AUTO_REFERENCE``).

Arguments are checked at trace time; errors name the argument and the rule (docs/numerics.md §5).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import _ffi, formats, reference
from jaxquant.zero import group_table as gtable
from jaxquant.primitives.formats import check_nvfp4_shape  # re-exported: ops.check_nvfp4_shape
from jaxquant.zero.group_table import GROUP_TABLE_FIELDS  # noqa: F401  (re-exported)
from jaxquant.primitives.partitioning import Rule, sharded
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor
from jaxquant.primitives.formats import TILE

IMPLS = ("auto", "reference", "custom_call")
INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# ----------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl: must be one of {IMPLS}, got {impl!r}")


def _not_quantized(name: str, x) -> None:
    """TypeError for a quantized tensor, which has an array's ``shape`` and ``dtype`` (the logical
    tensor's) but is not one."""
    if isinstance(x, (Float8Tensor, NVFP4Tensor)):
        raise TypeError(f"{name}: must be an array, got {type(x).__name__}, a quantized tensor "
                        f"(dequantize() it first)")


def _not_an_array(name: str, x) -> None:
    _not_quantized(name, x)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name}: must be an array, got {type(x).__name__}")


def _check_input(name: str, x, *, rank: int | None = None) -> None:
    _not_an_array(name, x)
    if jnp.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(f"{name}: dtype must be float32 or bfloat16, got {x.dtype}")
    if rank is not None and x.ndim != rank:
        raise ValueError(f"{name}: must have rank {rank}, got shape {tuple(x.shape)}")


def _check_array(name: str, x, dtype, shape) -> None:
    _not_an_array(name, x)
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{name}: dtype must be {jnp.dtype(dtype)}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: shape must be {tuple(shape)}, got {tuple(x.shape)}")


def _check_amax(amax):
    if not hasattr(amax, "dtype") or jnp.dtype(amax.dtype) != jnp.float32 or amax.size != 1:
        raise TypeError(f"amax: must be a float32 scalar or [1] array, got "
                        f"{getattr(amax, 'dtype', type(amax).__name__)} {getattr(amax, 'shape', '')}")


def _check_fp8_cast_args(x, amax_value, dtype, amax_epsilon, columnwise):
    """Checks shared by the FP8 casts; returns the fp8 dtype."""
    _check_amax(amax_value)
    formats.fp8_max(dtype)  # validates dtype
    if columnwise and x.ndim != 2:
        raise ValueError(f"x: columnwise=True needs a rank-2 tensor, got shape {tuple(x.shape)}")
    if not np.isfinite(np.float32(amax_epsilon)) or amax_epsilon < 0:
        raise ValueError(f"amax_epsilon: must be finite in float32 and >= 0, got {amax_epsilon}")
    return jnp.dtype(dtype)


def _check_range(start: int, length: int, rows: int, cols: int) -> None:
    if not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"start: must be a non-negative int, got {start!r}")
    if start + length > rows * cols:
        raise ValueError(
            f"start: shard elements [{start}, {start + length}) lie outside the "
            f"{rows}x{cols} tensor ({rows * cols} elements)"
        )


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


def _dispatch(impl: str, custom: Callable, ref: Callable, *args, target: str | None = None):
    """Run ``custom`` or ``ref`` on ``args`` according to ``impl`` (see module docstring). ``target``: the FFI
    target ``custom`` calls, for ``impl="auto"``'s per-op choice on the CPU (``_ffi.auto_platforms``)."""
    _check_impl(impl)
    if impl == "reference":
        return ref(*args)
    if impl == "custom_call":
        _ffi.require()
        return custom(*args)
    branches = {p: custom for p in _ffi.auto_platforms(target)}
    if not branches:
        return ref(*args)
    return jax.lax.platform_dependent(*args, default=ref, **branches)


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


@sharded(Rule("amax", ("*",), results=lambda return_nonfinite=False, **_: ("", "") if return_nonfinite else "",
               reduce={0: "max", 1: "sum"}))
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
    _check_impl(impl)
    _check_input("x", x)
    if x.size == 0:
        result = (jnp.float32(0), jnp.int32(0))
    else:
        outs = [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)]
        custom = lambda v: tuple(_ffi.call("jq_amax", outs, v))
        result = _dispatch(impl, custom, reference.amax, x)
    return result if return_nonfinite else result[0]


@sharded(Rule("fp8_cast", ("*", "-"), _FP8_OUT, fold=_fold_elementwise))
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
    _check_input("x", x)
    dtype = _check_fp8_cast_args(x, amax_value, dtype, amax_epsilon, columnwise)
    kw = dict(amax_epsilon=float(amax_epsilon), force_pow_2_scales=bool(force_pow_2_scales))

    def custom(v, a):
        outs = [jax.ShapeDtypeStruct(v.shape, dtype), jax.ShapeDtypeStruct((), jnp.float32)]
        if columnwise:
            outs.append(jax.ShapeDtypeStruct(v.shape[::-1], dtype))
        res = _ffi.call("jq_fp8_cast_t" if columnwise else "jq_fp8_cast", outs, v, a,
                        amax_epsilon=np.float32(kw["amax_epsilon"]),
                        force_pow_2_scales=kw["force_pow_2_scales"])
        return res[0], res[1], (res[2] if columnwise else None)

    def ref(v, a):
        return reference.fp8_cast(v, a, dtype=dtype, columnwise=columnwise, **kw)

    return _dispatch(impl, custom, ref, x, _scalar(amax_value), target="jq_fp8_cast_t" if columnwise else "jq_fp8_cast")


# ----------------------------------------------------------------------------------------------
# NVFP4 2D (docs/numerics.md §2)
# ----------------------------------------------------------------------------------------------


@sharded(Rule("nvfp4_tile_amax", ("m k",), tile=TILE, frame_kwargs={"rows": "m", "cols": "k"},
               results=lambda return_nonfinite=False, **_: (_NVFP4_TILES, "") if return_nonfinite else _NVFP4_TILES,
               reduce={1: "sum"}, applies=_whole_tensor, fold=_fold_tile_amax))
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
    _check_impl(impl)
    check_nvfp4_shape(rows, cols)
    _check_input("shard", shard)
    _check_range(start, int(shard.size), rows, cols)
    out = jax.ShapeDtypeStruct((rows // TILE, cols // TILE), jnp.float32)
    if shard.size == 0:
        result = (jnp.zeros(out.shape, out.dtype), jnp.int32(0))
    else:
        flat = jnp.reshape(shard, (-1,))
        count = jax.ShapeDtypeStruct((), jnp.int32)
        custom = lambda v: tuple(_ffi.call("jq_nvfp4_tile_amax", [out, count], v, rows=np.int64(rows),
                                           cols=np.int64(cols), start=np.int64(start)))
        ref = lambda v: reference.nvfp4_tile_amax(v, rows=rows, cols=cols, start=start)
        result = _dispatch(impl, custom, ref, flat, target="jq_nvfp4_tile_amax")
    return result if return_nonfinite else result[0]


@sharded(Rule("nvfp4_scale", (_NVFP4_TILES, "-"), _NVFP4_DATA[1], tile=TILE,
               frame_kwargs={"rows": "m", "cols": "k"}))
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
    _check_array("tile_amax", tile_amax, jnp.float32, (rows // TILE, cols // TILE))
    _check_amax(amax_value)
    out = jax.ShapeDtypeStruct(formats.nvfp4_scale_shape(rows, cols), jnp.uint8)
    custom = lambda t, a: _ffi.call("jq_nvfp4_scale", [out], t, a)[0]
    ref = lambda t, a: reference.nvfp4_scale(t, a, rows=rows, cols=cols)
    return _dispatch(impl, custom, ref, tile_amax, _scalar(amax_value), target="jq_nvfp4_scale")


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
    _check_impl(impl)
    check_nvfp4_shape(rows, cols)
    _check_input("shard", shard)
    length = int(shard.size)
    _check_range(start, length, rows, cols)
    lo, hi = formats.nvfp4_byte_range(start, length)
    _check_array("data_bytes", data_bytes, jnp.uint8, (hi - lo,))
    _check_array("scale_inv", scale_inv, jnp.uint8, formats.nvfp4_scale_shape(rows, cols))
    _check_amax(amax_value)
    if hi == lo:
        return data_bytes
    flat = jnp.reshape(shard, (-1,))
    out = jax.ShapeDtypeStruct((hi - lo,), jnp.uint8)

    def custom(v, b, s, a):
        return _ffi.call("jq_nvfp4_cast_partial", [out], v, b, s, a, input_output_aliases={1: 0},
                         rows=np.int64(rows), cols=np.int64(cols), start=np.int64(start))[0]

    def ref(v, b, s, a):
        return reference.nvfp4_cast_partial(v, b, s, a, rows=rows, cols=cols, start=start)

    return _dispatch(impl, custom, ref, flat, data_bytes, scale_inv, _scalar(amax_value),
                     target="jq_nvfp4_cast_partial")


@sharded(Rule("nvfp4_transpose", (_NVFP4_DATA[0],), _NVFP4_DATA[2], tile=TILE))
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
    _not_quantized("data", data)
    if not hasattr(data, "dtype") or jnp.dtype(data.dtype) != jnp.uint8 or data.ndim != 2:
        raise TypeError(f"data: must be a rank-2 uint8 array, got "
                        f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}")
    rows, cols = int(data.shape[0]), int(data.shape[1]) * 2
    check_nvfp4_shape(rows, cols, name="data")
    out = jax.ShapeDtypeStruct((cols, rows // 2), jnp.uint8)
    custom = lambda d: _ffi.call("jq_nvfp4_transpose", [out], d)[0]
    return _dispatch(impl, custom, reference.nvfp4_transpose, data, target="jq_nvfp4_transpose")


@sharded(Rule("nvfp4_scale_transpose", (_NVFP4_DATA[1],), _NVFP4_DATA[3], tile=TILE,
               frame_kwargs={"rows": "m", "cols": "k"}))
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
    _check_array("scale_inv", scale_inv, jnp.uint8, formats.nvfp4_scale_shape(rows, cols))
    out = jax.ShapeDtypeStruct(formats.nvfp4_scale_shape(cols, rows), jnp.uint8)
    custom = lambda s: _ffi.call("jq_nvfp4_scale_transpose", [out], s, rows=np.int64(rows),
                                 cols=np.int64(cols))[0]
    ref = lambda s: reference.nvfp4_scale_transpose(s, rows=rows, cols=cols)
    return _dispatch(impl, custom, ref, scale_inv, target="jq_nvfp4_scale_transpose")


# ----------------------------------------------------------------------------------------------
# Single-tensor stages: statistics pass, then cast pass (what quantize_fp8 / quantize_nvfp4 run)
# ----------------------------------------------------------------------------------------------
#
# A quantizer is two passes over x: ``*_stats`` (one read: amax / tile amaxes and the non-finite
# count) and ``*_quantize`` (one read: every output, scales derived inside from the statistics).
# Sharded callers run both on the local block and max-reduce the amax in between.
# ``compute_dtype`` rounding (docs/numerics.md §2, "Compute dtype") happens inside each pass.


def _compute_values(x, compute_dtype):
    _check_input("x", x)
    if compute_dtype is None:
        return x
    if jnp.dtype(compute_dtype) not in INPUT_DTYPES:
        raise TypeError(f"compute_dtype: must be None, float32 or bfloat16, got {compute_dtype}")
    return formats.to_compute_dtype(x, compute_dtype)


def _round_bf16(x, compute_dtype) -> bool:
    """The fused stages' attribute: True when the compute dtype rounds x's values (fp32 -> bf16).

    Every other combination leaves the values as they are (bf16 -> fp32 is exact)."""
    _check_input("x", x)
    if compute_dtype is not None and jnp.dtype(compute_dtype) not in INPUT_DTYPES:
        raise TypeError(f"compute_dtype: must be None, float32 or bfloat16, got {compute_dtype}")
    return (compute_dtype is not None and jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16)
            and jnp.dtype(x.dtype) == jnp.dtype(jnp.float32))


def _nvfp4_rows_cols(x) -> tuple[int, int]:
    if x.ndim != 2:
        raise ValueError(f"x: must have rank 2, got shape {tuple(x.shape)}")
    rows, cols = (int(d) for d in x.shape)
    check_nvfp4_shape(rows, cols, name="x")
    return rows, cols


def _nvfp4_quantize_reference(v, tile_amax, amax_value, *, rows: int, cols: int, columnwise: bool):
    """The executable spec of ``nvfp4_quantize``: the pure-JAX primitives composed."""
    scale_inv = reference.nvfp4_scale(tile_amax, amax_value, rows=rows, cols=cols)
    data = reference.pack_codes(reference.nvfp4_codes(v, scale_inv, amax_value))
    if not columnwise:
        return data, scale_inv
    return (data, scale_inv, reference.nvfp4_transpose(data),
            reference.nvfp4_scale_transpose(scale_inv, rows=rows, cols=cols))


@sharded(Rule("fp8_stats", ("*",), ("", ""), reduce={0: "max", 1: "sum"}))
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
    _check_impl(impl)
    round_bf16 = _round_bf16(x, compute_dtype)
    if x.size == 0:
        return jnp.float32(0), jnp.int32(0)
    outs = [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)]
    custom = lambda v: tuple(_ffi.call("jq_fp8_stats", outs, v, round_bf16=round_bf16))
    ref = lambda v: reference.amax(_compute_values(v, compute_dtype))
    return _dispatch(impl, custom, ref, x)


@sharded(Rule("fp8_quantize", ("*", "-"), _FP8_OUT, fold=_fold_elementwise))
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
    _check_impl(impl)
    round_bf16 = _round_bf16(x, compute_dtype)
    dtype = _check_fp8_cast_args(x, amax_value, dtype, amax_epsilon, columnwise)

    def custom(v, a):
        outs = [jax.ShapeDtypeStruct(v.shape, dtype), jax.ShapeDtypeStruct((), jnp.float32)]
        if columnwise:
            outs.append(jax.ShapeDtypeStruct(v.shape[::-1], dtype))
        return tuple(_ffi.call("jq_fp8_quantize_t" if columnwise else "jq_fp8_quantize", outs, v, a,
                               amax_epsilon=np.float32(amax_epsilon),
                               force_pow_2_scales=bool(force_pow_2_scales), round_bf16=round_bf16))

    def ref(v, a):
        res = reference.fp8_cast(_compute_values(v, compute_dtype), a, dtype=dtype, columnwise=columnwise,
                                 amax_epsilon=float(amax_epsilon), force_pow_2_scales=bool(force_pow_2_scales))
        return tuple(res[:3] if columnwise else res[:2])

    res = _dispatch(impl, custom, ref, x, _scalar(amax_value),
                    target="jq_fp8_quantize_t" if columnwise else "jq_fp8_quantize")
    return res[0], res[1], (res[2] if columnwise else None)


@sharded(Rule("nvfp4_stats", ("m k",), (_NVFP4_TILES, "1", ""), reduce={1: "max", 2: "sum"}, tile=TILE,
               fold=_fold_nvfp4_stats))
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
    _check_impl(impl)
    round_bf16 = _round_bf16(x, compute_dtype)
    rows, cols = _nvfp4_rows_cols(x)
    outs = [jax.ShapeDtypeStruct((rows // TILE, cols // TILE), jnp.float32),
            jax.ShapeDtypeStruct((1,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)]

    def ref(v):
        tiles, count = reference.nvfp4_tile_amax(_compute_values(v, compute_dtype).reshape(-1), rows=rows,
                                                 cols=cols, start=0)
        return tiles, jnp.max(tiles).reshape(1), count

    custom = lambda v: tuple(_ffi.call("jq_nvfp4_stats", outs, v, round_bf16=round_bf16))
    return _dispatch(impl, custom, ref, x)


@sharded(Rule("nvfp4_quantize", ("m k", _NVFP4_TILES, "-"), _NVFP4_DATA, tile=TILE, fold=_fold_nvfp4_quantize))
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
    _check_impl(impl)
    round_bf16 = _round_bf16(x, compute_dtype)
    rows, cols = _nvfp4_rows_cols(x)
    _check_array("tile_amax", tile_amax, jnp.float32, (rows // TILE, cols // TILE))
    _check_amax(amax_value)
    outs = [jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint8),
            jax.ShapeDtypeStruct(formats.nvfp4_scale_shape(rows, cols), jnp.uint8)]
    if columnwise:
        outs += [jax.ShapeDtypeStruct((cols, rows // 2), jnp.uint8),
                 jax.ShapeDtypeStruct(formats.nvfp4_scale_shape(cols, rows), jnp.uint8)]

    def custom(v, t, a):
        return tuple(_ffi.call("jq_nvfp4_quantize_t" if columnwise else "jq_nvfp4_quantize", outs, v, t,
                               a.reshape(1), round_bf16=round_bf16))

    def ref(v, t, a):
        return _nvfp4_quantize_reference(_compute_values(v, compute_dtype), t, a, rows=rows, cols=cols,
                                         columnwise=columnwise)

    res = _dispatch(impl, custom, ref, x, tile_amax, _scalar(amax_value),
                    target="jq_nvfp4_quantize_t" if columnwise else "jq_nvfp4_quantize")
    return (res[0], res[1]) + ((res[2], res[3]) if columnwise else (None, None))


# ----------------------------------------------------------------------------------------------
# Grouped primitives over one shard of a ZeRO flat buffer (docs/numerics.md §3)
# ----------------------------------------------------------------------------------------------
#
# One call covers every parameter of a group, and the shard index is a traced value (e.g.
# ``lax.axis_index``), so the same program runs on every shard with no branch on the shard: no
# conditional (which XLA:GPU executes with a device-to-host copy of the branch index) and one
# kernel launch per step instead of one per (shard, parameter) piece.


def group_table(offsets, shapes, *, num_shards: int, shard_size: int, nvfp4: bool) -> np.ndarray:
    """The static parameter table the grouped ops take.

    Args:
      offsets: the first flat element of each of the P parameters in the group buffer.
      shapes: each parameter's shape (rank 2 for NVFP4).
      num_shards: the number of ZeRO shards of the buffer.
      shard_size: elements per shard.
      nvfp4: lay out the NVFP4 tiles, bytes and scales (True) or FP8 only (False).

    Returns:
      A numpy int64 ``[P, F]`` table (``jaxquant.zero.group_table``: the fields, by name, are
      ``GROUP_TABLE_FIELDS``, defined once in ``csrc/jaxquant/group_table.h``).

    Raises:
      ValueError: parameters that overlap, leave the buffer, or (NVFP4) do not tile into 16x16 blocks.
    """
    return gtable.build(offsets, shapes, num_shards=num_shards, shard_size=shard_size, nvfp4=nvfp4)


def _check_table(table):
    """Table as int64 [P, F] and as GroupRow tuples (for the references)."""
    table = np.asarray(table)
    if table.ndim != 2 or table.shape[1] != len(gtable.GROUP_TABLE_FIELDS) or table.dtype != np.int64:
        raise ValueError(f"table: must be the int64 [P, {len(gtable.GROUP_TABLE_FIELDS)}] array built by "
                         f"ops.group_table")
    return table, gtable.rows_of(table)


def _check_group_args(impl, shard, shard_index, table):
    """Validates the common arguments of the grouped ops over a shard.

    Returns (table as int64 [P, F], shard index as an int32 scalar, the table as GroupRow tuples for
    the reference, the number of tiles T of the group)."""
    _check_impl(impl)
    _check_input("shard", shard)
    if shard.ndim != 1:
        raise ValueError(f"shard: must have shape (shard_size,) (rank 1), got {tuple(shard.shape)}")
    if not hasattr(shard_index, "dtype") or not jnp.issubdtype(shard_index.dtype, jnp.integer) or shard_index.size != 1:
        raise TypeError(f"shard_index: must be an integer scalar array (e.g. lax.axis_index), got "
                        f"{getattr(shard_index, 'dtype', type(shard_index).__name__)}")
    table, rows = _check_table(table)
    num_tiles = sum(r.numel for r in rows) // (TILE * TILE)
    return table, jnp.reshape(shard_index, ()).astype(jnp.int32), rows, num_tiles


def _group_compute(shard, compute_dtype):
    """The grouped ops round to ``compute_dtype`` as they load (docs/numerics.md §2, "Compute dtype"):
    (the custom call's ``round_bf16`` attribute, the reference's input conversion)."""
    if compute_dtype is not None and jnp.dtype(compute_dtype) not in INPUT_DTYPES:
        raise TypeError(f"compute_dtype: must be None, float32 or bfloat16, got {compute_dtype}")
    round_bf16 = (compute_dtype is not None and jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16)
                  and jnp.dtype(shard.dtype) == jnp.dtype(jnp.float32))
    convert = (lambda v: v) if compute_dtype is None else (lambda v: formats.to_compute_dtype(v, compute_dtype))
    return round_bf16, convert


def _i64_operand(a: np.ndarray) -> jax.Array:
    """A static int64 array as a device operand without x64: its little-endian uint32 words."""
    return jnp.asarray(np.ascontiguousarray(a, np.int64).reshape(-1).view(np.uint32))


def nvfp4_group_tile_amax(shard, shard_index, *, table, num_shards: int, return_nonfinite: bool = False,
                          compute_dtype=None, impl: str = "auto"):
    """Tile amaxes and amaxes of every parameter of the group over this shard's elements, one pass.

    Args:
      shard: float32 or bfloat16 ``[shard_size]``, this shard of the group buffer.
      shard_index: integer scalar array, this shard's index (e.g. ``lax.axis_index``).
      table: the group's table (:func:`group_table`, ``nvfp4=True``).
      num_shards: the number of shards.
      return_nonfinite: also return the NaN/±inf counts (default False).
      compute_dtype: None (default), float32 or bfloat16: the shard's values are rounded to it as they
        are read, as ``formats.to_compute_dtype`` does.
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``(tile_amax, amax)``: fp32 ``[T]``, every parameter's tiles packed (tile ``tile_base + i * cols/16
      + j``; tiles the shard does not touch 0), and fp32 ``[P]``, the per-parameter amax over the shard;
      with ``return_nonfinite`` also the int32 ``[P]`` count of NaN/±inf elements per parameter.

    Raises:
      TypeError, ValueError: an operand of the wrong type, dtype or shape, or a table not built by
        :func:`group_table`.
    """
    table, index, rows, num_tiles = _check_group_args(impl, shard, shard_index, table)
    round_bf16, convert = _group_compute(shard, compute_dtype)
    P = table.shape[0]
    outs = [jax.ShapeDtypeStruct((num_tiles,), jnp.float32), jax.ShapeDtypeStruct((P,), jnp.float32),
            jax.ShapeDtypeStruct((P,), jnp.int32)]

    def custom(v, r):
        return tuple(_ffi.call("jq_nvfp4_group_tile_amax", outs, v, r, _i64_operand(table), round_bf16=round_bf16))

    def ref(v, r):
        return reference.nvfp4_group_tile_amax(convert(v), r, table=rows, num_shards=num_shards)

    result = _dispatch(impl, custom, ref, shard, index)
    return result if return_nonfinite else result[:2]


def nvfp4_group_scale(tile_amax, amax, *, table, impl: str = "auto"):
    """Scales of every parameter of the group, one call.

    Args:
      tile_amax: fp32 ``[T]``, every parameter's tile amaxes (reduced over the shards).
      amax: fp32 ``[P]``, every parameter's global amax.
      table: the group's table (:func:`group_table`, ``nvfp4=True``).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``(scale_inv, enc)``: uint8, every parameter's padded ``[ru(rows,128), ru(cols/16,4)]`` E4M3
      scales, row-major from ``scale_base``; fp32 ``[T]``, each tile's encode multiplier
      (docs/numerics.md §2.4, §2.5), what :func:`nvfp4_group_cast` takes.

    Raises:
      TypeError, ValueError: an operand of the wrong dtype or shape.
    """
    _check_impl(impl)
    table, rows = _check_table(table)
    sz = gtable.sizes(table)
    _check_array("tile_amax", tile_amax, jnp.float32, (sz.num_tiles,))
    _check_array("amax", amax, jnp.float32, (table.shape[0],))
    outs = [jax.ShapeDtypeStruct((sz.scale_bytes,), jnp.uint8), jax.ShapeDtypeStruct((sz.num_tiles,), jnp.float32)]

    def custom(t, a):
        return tuple(_ffi.call("jq_nvfp4_group_scale", outs, t, a, _i64_operand(table)))

    def ref(t, a):
        return reference.nvfp4_group_scale(t, a, table=rows)

    return _dispatch(impl, custom, ref, tile_amax, amax)


def _check_space(space):
    if space is not None and not isinstance(space, gtable.GatheredSpace):
        raise TypeError(f"space: must be a GatheredSpace or None, got {type(space).__name__}")


def _gathered_pieces(data, space, size: int):
    """(pieces, space) of a transpose's input: one buffer of ``size`` bytes, or with ``space`` its
    gather pieces (a list of uint8 arrays) as ``gtable.GatheredSpace`` lays them out."""
    _check_space(space)
    if space is None:
        return [data], gtable.GatheredSpace.whole(size)
    if space.size != size:
        raise ValueError(f"space: holds {space.size} bytes, the table's data needs {size}")
    if not space.readable_in_place:
        raise ValueError(f"space: at most {gtable.MAX_GATHER_SHARDS} shards and {gtable.MAX_GATHER_PIECES} gather "
                         f"pieces, got {space.num_shards} and {len(space.bounds)} (assemble it: space.assemble)")
    pieces = list(data) if isinstance(data, (list, tuple)) else [data]
    shapes = space.piece_shapes()
    if len(pieces) != len(shapes):
        raise ValueError(f"data: the space is gathered in {len(shapes)} pieces, got {len(pieces)} arrays")
    for j, (piece, shape) in enumerate(zip(pieces, shapes)):
        _check_array(f"data[{j}]", piece, jnp.uint8, shape)
    return pieces, space


def _transpose_ranges(rows, sizes, nvfp4: bool) -> np.ndarray:
    """The transposes' ``ranges`` attribute: each parameter's first 64x64 block and (NVFP4) first
    columnwise scale strip (16 bytes), then the ends (the launches batch parameters and need them on
    the host)."""
    starts = [(row.block_base, row.scale_t_base // TILE if nvfp4 else 0) for row in rows]
    end = (sizes.num_blocks, sizes.scale_t_bytes // TILE if nvfp4 else 0)
    return np.asarray(starts + [end], np.int64).reshape(-1)


def nvfp4_group_columnwise(data, scale_inv, *, table, space=None, impl: str = "auto"):
    """Columnwise data and scales of every parameter of the group, one call.

    Args:
      data: uint8 ``[sum numel/2]``, every parameter's packed rowwise data from ``byte_base``; or, with
        ``space``, the list of gather pieces that hold it, read where they lie (no assembled copy).
      scale_inv: uint8, the packed rowwise scales (:func:`nvfp4_group_scale`).
      table: the group's table (:func:`group_table`, ``nvfp4=True``).
      space: a ``group_table.GatheredSpace`` describing the gather pieces (default None: ``data`` is one
        buffer).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      ``(data_t, scale_inv_t)``: two lists with one array per parameter, written in place (no copy out
      of a packed buffer): parameter p's uint8 ``[cols, rows/2]`` and ``[ru(cols,128), ru(rows/16,4)]``.

    Raises:
      TypeError, ValueError: an operand of the wrong dtype or shape, or a ``space`` that does not match.
    """
    _check_impl(impl)
    table, rows = _check_table(table)
    sz = gtable.sizes(table)
    if space is None:
        _check_array("data", data, jnp.uint8, (sz.data_bytes,))
    pieces, space = _gathered_pieces(data, space, sz.data_bytes)
    _check_array("scale_inv", scale_inv, jnp.uint8, (sz.scale_bytes,))
    data_shapes = [(row.cols, row.rows // 2) for row in rows]
    scale_shapes = [formats.nvfp4_scale_shape(row.cols, row.rows) for row in rows]
    outs = [jax.ShapeDtypeStruct(shape, jnp.uint8) for shape in data_shapes + scale_shapes]
    if not rows:
        return [], []

    def custom(s, *ps):
        return tuple(_ffi.call("jq_nvfp4_group_columnwise", outs, s, _i64_operand(table), *ps,
                               ranges=_transpose_ranges(rows, sz, True), space=space.attr()))

    def ref(s, *ps):
        data_t, scale_inv_t = reference.nvfp4_group_columnwise(space.assemble(ps), s, table=rows)
        return tuple([data_t[row.byte_base:row.byte_base + row.numel // 2].reshape(shape)
                      for row, shape in zip(rows, data_shapes)] +
                     [scale_inv_t[row.scale_t_base:row.scale_t_base + int(np.prod(shape))].reshape(shape)
                      for row, shape in zip(rows, scale_shapes)])

    result = _dispatch(impl, custom, ref, scale_inv, *pieces)
    return list(result[:len(rows)]), list(result[len(rows):])


def fp8_group_transpose(data, *, table, space=None, dtype=None, impl: str = "auto") -> list:
    """Byte transpose of every FP8 parameter of a flat buffer, one call, written in place.

    Args:
      data: fp8 or uint8 ``[N]``, N >= the end of the last parameter; or, with ``space``, the list of
        gather pieces (uint8) that hold the flat buffer, read where they lie.
      table: the group's table (:func:`group_table`).
      space: a ``group_table.GatheredSpace`` of N bytes (default None: ``data`` is one buffer).
      dtype: the results' 1-byte dtype (default None: ``data``'s dtype, or uint8 with ``space``).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      A list with parameter p's ``[cols, rows]`` transpose (rank-1 and scalar parameters: ``[1, numel]``).

    Raises:
      TypeError: ``data`` or ``dtype`` not of 1-byte elements.
      ValueError: ``data`` shorter than the table, or a ``space`` that does not match.
    """
    _check_impl(impl)
    table, rows = _check_table(table)
    _check_space(space)
    if space is None:
        _not_quantized("data", data)
        if not hasattr(data, "dtype") or jnp.dtype(data.dtype).itemsize != 1 or data.ndim != 1:
            raise TypeError(f"data: must be a rank-1 array of 1-byte elements (fp8 or uint8), got "
                            f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}")
        dtype = jnp.dtype(dtype or data.dtype)
        data = jax.lax.bitcast_convert_type(data, jnp.uint8) if data.dtype != jnp.uint8 else data
        size = data.shape[0]
    else:
        dtype, size = jnp.dtype(dtype or jnp.uint8), space.size
    if dtype.itemsize != 1:
        raise TypeError(f"dtype: must be a 1-byte type (fp8 or uint8), got {dtype}")
    pieces, space = _gathered_pieces(data, space, size)
    if rows and rows[-1].offset + rows[-1].numel > size:
        raise ValueError(f"data: has {size} elements, the table's last parameter ends at "
                         f"{rows[-1].offset + rows[-1].numel}")
    outs = [jax.ShapeDtypeStruct((row.cols, row.rows), dtype) for row in rows]   # results typed in the call
    if not rows:
        return []

    def custom(*ps):
        return tuple(_ffi.call("jq_fp8_group_transpose", outs, _i64_operand(table), *ps,
                               ranges=_transpose_ranges(rows, gtable.sizes(table), False), space=space.attr()))

    def ref(*ps):
        flat = reference.fp8_group_transpose(space.assemble(ps), table=rows)
        flat = jax.lax.bitcast_convert_type(flat, dtype) if dtype != jnp.uint8 else flat
        return tuple(flat[row.offset:row.offset + row.numel].reshape(o.shape) for row, o in zip(rows, outs))

    return list(_dispatch(impl, custom, ref, *pieces))


def nvfp4_group_cast(shard, shard_index, enc, *, table, num_shards: int, chunk_lo, chunk_size: int,
                     compute_dtype=None, impl: str = "auto") -> jax.Array:
    """This shard's chunk of the group's packed NVFP4 bytes.

    The group's param-byte space lays every parameter's packed data end to end (parameter p at its
    ``byte_base``). Nibbles of elements the shard does not own are 0, so a byte split between two shards
    is the OR of their chunks.

    Args:
      shard, shard_index, table, num_shards, compute_dtype: as in :func:`nvfp4_group_tile_amax`.
      enc: fp32 ``[T]``, every tile's encode multiplier (:func:`nvfp4_group_scale`).
      chunk_lo: one int per shard, where shard r's chunk starts in the param-byte space.
      chunk_size: bytes per chunk.
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      uint8 ``[chunk_size]``: positions ``[chunk_lo[r], chunk_lo[r] + chunk_size)`` for shard r.

    Raises:
      TypeError, ValueError: an operand of the wrong type, dtype or shape.
    """
    table, index, rows, num_tiles = _check_group_args(impl, shard, shard_index, table)
    round_bf16, convert = _group_compute(shard, compute_dtype)
    _check_array("enc", enc, jnp.float32, (num_tiles,))
    chunk_lo = np.asarray(chunk_lo, np.int64)
    if chunk_lo.shape != (num_shards,):
        raise ValueError(f"chunk_lo: must have one entry per shard ({num_shards}), got shape {chunk_lo.shape}")
    out = jax.ShapeDtypeStruct((chunk_size,), jnp.uint8)

    def custom(v, r, e):
        return _ffi.call("jq_nvfp4_group_cast", [out], v, r, _i64_operand(table), _i64_operand(chunk_lo), e,
                         round_bf16=round_bf16)[0]

    def ref(v, r, e):
        return reference.nvfp4_group_cast(convert(v), r, e, table=rows,
                                          num_shards=num_shards, chunk_lo=chunk_lo, chunk_size=chunk_size)

    return _dispatch(impl, custom, ref, shard, index, enc)


def fp8_group_amax(shard, shard_index, *, table, num_shards: int, return_nonfinite: bool = False,
                   compute_dtype=None, impl: str = "auto"):
    """The amax of every parameter over this shard's elements, one pass.

    Args:
      shard, shard_index, table, num_shards, compute_dtype: as in :func:`nvfp4_group_tile_amax` (a table
        built with ``nvfp4=False`` or True).
      return_nonfinite: also return the NaN/±inf counts (default False).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      fp32 ``[P]`` (0 where the shard owns none of a parameter); with ``return_nonfinite``
      ``(amax, count)``, ``count`` int32 ``[P]``.

    Raises:
      TypeError, ValueError: an operand of the wrong type, dtype or shape.
    """
    table, index, rows, _ = _check_group_args(impl, shard, shard_index, table)
    round_bf16, convert = _group_compute(shard, compute_dtype)
    outs = [jax.ShapeDtypeStruct((table.shape[0],), jnp.float32), jax.ShapeDtypeStruct((table.shape[0],), jnp.int32)]

    def custom(v, r):
        return tuple(_ffi.call("jq_fp8_group_amax", outs, v, r, _i64_operand(table), round_bf16=round_bf16))

    def ref(v, r):
        return reference.fp8_group_amax(convert(v), r, table=rows,
                                        num_shards=num_shards)

    result = _dispatch(impl, custom, ref, shard, index)
    return result if return_nonfinite else result[0]


def fp8_group_cast(shard, shard_index, scale, *, table, num_shards: int, dtype=jnp.float8_e4m3fn,
                   compute_dtype=None, first: int = 0, count=None, impl: str = "auto") -> jax.Array:
    """FP8 cast of a range of this shard, each element with its parameter's scale.

    Args:
      shard, shard_index, table, num_shards, compute_dtype: as in :func:`fp8_group_amax`.
      scale: fp32 ``[P]``, each parameter's FP8 scale (docs/numerics.md §1).
      dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
      first: the first shard element to cast (default 0).
      count: how many (default None: to the end of the shard).
      impl: "auto" (default), "custom_call" or "reference" (see ``jaxquant.primitives.ops``).

    Returns:
      fp8 ``[count]``: shard elements ``[first, first + count)`` times their parameter's scale, RNE,
      saturating; elements outside every parameter (alignment padding) are 0.

    Raises:
      TypeError, ValueError: an operand of the wrong type, dtype or shape, or a range outside the shard.
    """
    table, index, rows, _ = _check_group_args(impl, shard, shard_index, table)
    round_bf16, convert = _group_compute(shard, compute_dtype)
    formats.fp8_max(dtype)
    dtype = jnp.dtype(dtype)
    _check_array("scale", scale, jnp.float32, (table.shape[0],))
    n = shard.shape[0]
    count = n - first if count is None else count
    for name, v in (("first", first), ("count", count)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}: must be an int >= 0, got {v!r}")
    if first + count > n:
        raise ValueError(f"first, count: elements [{first}, {first + count}) leave the shard of {n}")
    out = jax.ShapeDtypeStruct((int(count),), dtype)

    def custom(v, r, s):
        return _ffi.call("jq_fp8_group_cast", [out], v, r, _i64_operand(table), s, round_bf16=round_bf16,
                         first=np.int64(first))[0]

    def ref(v, r, s):
        whole = reference.fp8_group_cast(convert(v), r, s, table=rows, num_shards=num_shards, dtype=dtype)
        return whole[first:first + count]

    return _dispatch(impl, custom, ref, shard, index, scale)
