"""Pure-JAX reference of every primitive: the executable form of docs/numerics.md §1 and §2.

Each op of ``jaxquant.primitives.ops`` declares the function here of its own name as its reference
(``ops.Op.reference``), which its custom calls must match bit for bit.
No validation happens here; ``jaxquant.primitives.ops`` validates arguments before dispatching.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import formats
from jaxquant.primitives.formats import TILE

# ----------------------------------------------------------------------------------------------
# Conversions
# ----------------------------------------------------------------------------------------------


def to_fp8_saturating(v: jax.Array, dtype) -> jax.Array:
    """fp32 -> fp8, RNE, finite overflow and ±inf saturate to ±max, NaN stays NaN (docs/numerics.md §1.6)."""
    m = jnp.float32(formats.fp8_max(dtype))
    return jnp.clip(v.astype(jnp.float32), -m, m).astype(dtype)


def fp32_to_e4m3_bits(v: jax.Array) -> jax.Array:
    """fp32 -> E4M3 bit pattern (uint8), RNE, saturating to 448."""
    return jax.lax.bitcast_convert_type(to_fp8_saturating(v, jnp.float8_e4m3fn), jnp.uint8)


def e4m3_bits_to_fp32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


def fp32_to_e2m1_code(v: jax.Array) -> jax.Array:
    """fp32 -> E2M1 code (uint8 0..15), RNE on the E2M1 grid, saturating to ±6, sign kept.

    The magnitude code counts the decision boundaries at or below |v|; at a tie (docs/numerics.md §2.6) the
    even code wins, so boundaries below an even code are strict (>) and those below an odd code
    are inclusive (>=). NaN maps to code 7, as the C++ path does (NaN is outside the contract).
    """
    a = jnp.abs(v.astype(jnp.float32))
    code = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0)).astype(jnp.uint8)
    code = jnp.where(jnp.isnan(a), jnp.uint8(7), code)
    return jnp.where(jnp.signbit(v), code | jnp.uint8(8), code)


def e2m1_code_to_fp32(code: jax.Array) -> jax.Array:
    """The value of E2M1 codes (``formats.E2M1_VALUES``), built as fp32 bit patterns: exponent field e > 0 gives
    2^(e-1) * (1 + m/2), e == 0 gives m/2; no table, so that an op's reference holds no constant
    (``custom_partitioning`` refuses one)."""
    c = code.astype(jnp.uint32) & 15
    e, m = (c >> 1) & 3, c & 1
    bits = jnp.where(e > 0, ((e + 126) << 23) | (m << 22), m * jnp.uint32(0x3F000000))
    return jax.lax.bitcast_convert_type(bits | ((c & 8) << 28), jnp.float32)


def pack_codes(codes: jax.Array) -> jax.Array:
    """[..., 2n] codes -> [..., n] bytes, element 2c in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def unpack_codes(packed: jax.Array) -> jax.Array:
    lo = packed & jnp.uint8(0x0F)
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# FP8 per-tensor current scaling (docs/numerics.md §1)
# ----------------------------------------------------------------------------------------------


def amax(x: jax.Array):
    """Returns (max |x| over all elements, NaN ignored, 0 for empty input; count of NaN/±inf)."""
    if x.size == 0:
        return jnp.float32(0), jnp.int32(0)
    return jnp.max(formats.abs_ignoring_nan(x)), nonfinite_count(x)


def nonfinite_count(x: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(x.astype(jnp.float32)), dtype=jnp.int32)


def fp8_cast(x, amax_value, *, dtype, amax_epsilon=0.0, force_pow_2_scales=False, columnwise=False):
    """Returns (data, scale_inv, data_t or None)."""
    scale, scale_inv = formats.fp8_scale_from_amax(
        amax_value, formats.fp8_max(dtype), amax_epsilon, force_pow_2_scales)
    data = to_fp8_saturating(x.astype(jnp.float32) * scale, dtype)
    data_t = data.T if columnwise else None
    return data, scale_inv, data_t


# ----------------------------------------------------------------------------------------------
# NVFP4, 2D 16x16 block scaling (docs/numerics.md §2)
# ----------------------------------------------------------------------------------------------


def _scatter_shard(shard: jax.Array, rows: int, cols: int, start: int) -> jax.Array:
    """Place a flat shard at elements [start, start+len) of a zero [rows, cols] fp32 tensor."""
    flat = jnp.zeros((rows * cols,), jnp.float32)
    flat = jax.lax.dynamic_update_slice(flat, shard.astype(jnp.float32).reshape(-1), (start,))
    return flat.reshape(rows, cols)


def _tile_max(x: jax.Array) -> jax.Array:
    rows, cols = x.shape
    return x.reshape(rows // TILE, TILE, cols // TILE, TILE).max(axis=(1, 3))


def nvfp4_tile_amax(shard: jax.Array, *, rows: int, cols: int, start: int):
    """(per-tile amax [rows/16, cols/16] of the tiles a flat shard touches, other tiles 0;
    count of NaN/±inf elements in the shard)."""
    if shard.size == 0:
        return jnp.zeros((rows // TILE, cols // TILE), jnp.float32), jnp.int32(0)
    tiles = _tile_max(formats.abs_ignoring_nan(_scatter_shard(shard, rows, cols, start)))
    return tiles, nonfinite_count(shard)


def nvfp4_scale(tile_amax: jax.Array, amax_value: jax.Array, *, rows: int, cols: int) -> jax.Array:
    """Global amax + tile amaxes -> padded E4M3 scale_inv [ru(rows,128), ru(cols/16,4)], uint8."""
    s_enc = formats.nvfp4_global_encode_scale(jnp.reshape(amax_value, ()))
    s8 = fp32_to_e4m3_bits(formats.nvfp4_tile_scale(tile_amax, s_enc))
    per_row = jnp.repeat(s8, TILE, axis=0)
    pr, pc = formats.nvfp4_scale_shape(rows, cols)
    return jnp.pad(per_row, ((0, pr - rows), (0, pc - cols // TILE)))


def tile_encode(scale_inv: jax.Array, amax_value: jax.Array, rows: int, cols: int) -> jax.Array:
    """Per-tile encode multiplier [rows/16, cols/16] from the stored scales (docs/numerics.md §2.5)."""
    s_dec = formats.nvfp4_global_decode_scale(jnp.reshape(amax_value, ()))
    s8 = e4m3_bits_to_fp32(scale_inv[0:rows:TILE, : cols // TILE])
    # Materialize the per-tile values: without the barrier XLA fuses them into the per-element
    # consumer and redoes the integer division (formats.div_rn) for every element.
    return jax.lax.optimization_barrier(formats.nvfp4_tile_encode(s8, s_dec))


def nvfp4_codes(x: jax.Array, scale_inv: jax.Array, amax_value: jax.Array) -> jax.Array:
    """E2M1 codes [rows, cols] of a whole tensor given its scales."""
    rows, cols = x.shape
    enc = tile_encode(scale_inv, amax_value, rows, cols)[:, None, :, None]
    scaled = x.astype(jnp.float32).reshape(rows // TILE, TILE, cols // TILE, TILE) * enc
    return fp32_to_e2m1_code(scaled).reshape(rows, cols)


def nvfp4_cast_partial(shard, data_bytes, scale_inv, amax_value, *, rows: int, cols: int, start: int):
    """Return ``data_bytes`` (the shard's byte range of the packed data) with the shard's nibbles set.

    ``data_bytes`` covers bytes [start//2, (start+len+1)//2); nibbles of elements outside
    [start, start+len) are kept as they are.
    """
    length = int(shard.size)
    lo, hi = formats.nvfp4_byte_range(start, length)
    if hi == lo:
        return data_bytes
    codes = nvfp4_codes(_scatter_shard(shard, rows, cols, start), scale_inv, amax_value).reshape(-1)
    idx = jnp.arange(2 * lo, 2 * hi)
    owned = (idx >= start) & (idx < start + length)
    old = unpack_codes(data_bytes)
    new = jnp.where(owned, codes[2 * lo: 2 * hi], old)
    return pack_codes(new)


def nvfp4_transpose(data: jax.Array) -> jax.Array:
    """Packed [M, K/2] -> packed [K, M/2]: element (k, m) of the result is element (m, k)."""
    return pack_codes(unpack_codes(data).T)


def nvfp4_scale_transpose(scale_inv: jax.Array, *, rows: int, cols: int) -> jax.Array:
    """scale_inv [ru(M,128), ru(K/16,4)] -> scale_inv_t [ru(K,128), ru(M/16,4)]."""
    s8 = scale_inv[0:rows:TILE, : cols // TILE]
    per_row = jnp.repeat(s8.T, TILE, axis=0)
    pr, pc = formats.nvfp4_scale_shape(cols, rows)
    return jnp.pad(per_row, ((0, pr - cols), (0, pc - rows // TILE)))


def nvfp4_blockwise(data, scale_inv, shape) -> jax.Array:
    """fp32 ``value(q) * float(s8)`` of every element (docs/numerics.md §2.8 without the global factor): a 2-bit by
    4-bit significand product, exact in fp32 and in bf16."""
    rows, cols = shape
    values = e2m1_code_to_fp32(unpack_codes(data))
    s8 = e4m3_bits_to_fp32(scale_inv[0:rows:TILE, : cols // TILE])
    return values * jnp.repeat(jnp.repeat(s8, TILE, 0), TILE, 1)


def nvfp4_dequantize(data, scale_inv, amax_value, shape) -> jax.Array:
    global_dec = jnp.reshape(amax_value, ()).astype(jnp.float32) * (np.float32(1) / formats.NVFP4_GLOBAL_RANGE)
    return nvfp4_blockwise(data, scale_inv, shape) * global_dec


# ----------------------------------------------------------------------------------------------
# The GEMMs on cuBLASLt (jaxquant.primitives.gemm.scaled_gemm: float8 operands; bf16 operands with a factor)
# ----------------------------------------------------------------------------------------------


def fp8_gemm(a, b, a_scale, b_scale, *, out_dtype):
    """``a [M, K]`` x ``b [N, K]`` (both contracted on their minor axis) accumulated in fp32, times the operands'
    dequantization factors ``a_scale * b_scale`` (fp32 scalars), rounded once to ``out_dtype`` (RNE; a bf16 rounding
    that XLA keeps: ``formats.to_compute_dtype``)."""
    acc = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return round_result(acc * (jnp.reshape(a_scale, ()) * jnp.reshape(b_scale, ())), out_dtype)


def bf16_dot_f32(a, b, dims):
    """``dot_general(a, b, dims)`` of bf16 operands accumulated in fp32. XLA's CPU runtime refuses some bf16 x bf16 ->
    f32 dots ("Unsupported element type for DotThunk"); there the same GEMM runs on fp32 copies, which is exact (a
    bf16 product is exact in fp32, the sum is fp32 either way)."""
    up = lambda: jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                                     preferred_element_type=jnp.float32)
    as_is = lambda: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    return jax.lax.platform_dependent(cpu=up, default=as_is)


def bf16_gemm(a, b, factor, *, b_layout):
    """``a [M, K]`` x ``b`` (``b_layout`` "nk": ``[N, K]``, contracted on its minor axis; "kn": ``[K, N]``, on its
    major axis) of bf16 operands accumulated in fp32, times the fp32 scalar ``factor``, rounded once to bf16 (RNE):
    an NVFP4 GEMM on Hopper, whose operand is the exact bf16 blockwise value and ``factor`` the global decode factor
    that multiplies the fp32 result (docs/numerics.md §2.8)."""
    dims = (((1,), (1 if b_layout == "nk" else 0,)), ((), ()))
    return round_result(bf16_dot_f32(a, b, dims) * jnp.reshape(factor, ()), jnp.bfloat16)


def round_result(acc, out_dtype):
    """The fp32 ``acc`` in ``out_dtype``; to bf16 with ``formats.to_compute_dtype``, whose rounding XLA never drops
    (a plain convert followed by one back to fp32 may be simplified away on the GPU)."""
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype == jnp.dtype(jnp.bfloat16) and acc.dtype == jnp.dtype(jnp.float32):
        return formats.to_compute_dtype(acc, out_dtype)
    return acc.astype(out_dtype)


# ----------------------------------------------------------------------------------------------
# The quantizers' two passes (statistics, then cast), composed from the functions above
# ----------------------------------------------------------------------------------------------


def _rounded(x, compute_dtype):
    return x if compute_dtype is None else formats.to_compute_dtype(x, compute_dtype)


def fp8_stats(x, *, compute_dtype):
    """(amax, non-finite count) of ``x`` after ``compute_dtype`` rounding (None: as is)."""
    return amax(_rounded(x, compute_dtype))


def fp8_quantize(x, amax_value, *, dtype, compute_dtype, amax_epsilon=0.0, force_pow_2_scales=False,
                 columnwise=False):
    """``fp8_cast`` of ``x`` after ``compute_dtype`` rounding: (data, scale_inv) or, with ``columnwise``,
    (data, scale_inv, data_t)."""
    res = fp8_cast(_rounded(x, compute_dtype), amax_value, dtype=dtype, columnwise=columnwise,
                   amax_epsilon=amax_epsilon, force_pow_2_scales=force_pow_2_scales)
    return tuple(res[:3] if columnwise else res[:2])


def nvfp4_stats(x, *, compute_dtype):
    """(tile_amax [M/16, K/16], amax [1], non-finite count) of a [M, K] ``x`` after ``compute_dtype`` rounding."""
    rows, cols = x.shape
    tiles, count = nvfp4_tile_amax(_rounded(x, compute_dtype).reshape(-1), rows=rows, cols=cols, start=0)
    return tiles, jnp.max(tiles).reshape(1), count


def nvfp4_quantize(x, tile_amax, amax_value, *, compute_dtype, columnwise: bool):
    """NVFP4 of a [M, K] ``x`` after ``compute_dtype`` rounding, scales from its tile amaxes and global amax:
    (data, scale_inv) or, with ``columnwise``, (data, scale_inv, data_t, scale_inv_t)."""
    rows, cols = x.shape
    scale_inv = nvfp4_scale(tile_amax, amax_value, rows=rows, cols=cols)
    data = pack_codes(nvfp4_codes(_rounded(x, compute_dtype), scale_inv, amax_value))
    if not columnwise:
        return data, scale_inv
    return data, scale_inv, nvfp4_transpose(data), nvfp4_scale_transpose(scale_inv, rows=rows, cols=cols)


def nvfp4_bf16_operand(x, amax_value, *, compute_dtype):
    """The bf16 GEMM operand of a [M, K] ``x`` quantized to NVFP4 with the whole tensor's ``amax_value`` (its tile
    amaxes its own): ``value(q) * s8`` of :func:`nvfp4_quantize`'s bytes (:func:`nvfp4_blockwise`, exact in bf16), the
    global decode factor left to the GEMM (§2.8). ``nvfp4_stats`` + ``nvfp4_quantize`` + the decode, composed."""
    tiles, _, _ = nvfp4_stats(x, compute_dtype=compute_dtype)
    data, scale_inv = nvfp4_quantize(x, tiles, amax_value, compute_dtype=compute_dtype, columnwise=False)
    return nvfp4_blockwise(data, scale_inv, x.shape).astype(jnp.bfloat16)


# ----------------------------------------------------------------------------------------------
# Grouped primitives over one shard of a ZeRO flat buffer (docs/numerics.md §3)
# ----------------------------------------------------------------------------------------------
#
# ``table`` is the parameter table of ``jaxquant.primitives.ops.table`` as ``GroupRow`` tuples (fields by
# name). Shard r owns flat elements [r * n, (r + 1) * n) of the group buffer, with r =
# ``shard_index`` (a traced int32 scalar). These references place the shard into a zero buffer of
# the whole group: parameters' elements that other shards own are 0 there and are masked out
# where that matters. They loop over parameters in Python (the custom calls do not).


def _place_shard(shard, shard_index, num_shards: int):
    n = shard.size
    full = jnp.zeros((num_shards * n,), jnp.float32)
    return jax.lax.dynamic_update_slice(full, shard.astype(jnp.float32), (shard_index * n,))


def _owned_mask(shard_index, n: int, offset: int, numel: int):
    g = jnp.arange(offset, offset + numel)
    return (g >= shard_index * n) & (g < (shard_index + 1) * n)


def nvfp4_group_tile_amax(shard, shard_index, *, table, num_shards: int):
    """(tile amax of every parameter's tiles, packed [T]; amax [P]; non-finite counts [P])."""
    full = _place_shard(shard, shard_index, num_shards)
    tiles, amaxes, counts = [], [], []
    for row in table:
        w = full[row.offset:row.offset + row.numel]
        absw = formats.abs_ignoring_nan(w)
        tiles.append(_tile_max(absw.reshape(row.rows, row.cols)).reshape(-1))
        amaxes.append(jnp.max(absw))
        counts.append(nonfinite_count(w))
    if not table:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)
    return jnp.concatenate(tiles), jnp.stack(amaxes), jnp.stack(counts)


def _tiles_of(tiles, row):
    t = (row.rows // TILE) * (row.cols // TILE)
    return tiles[row.tile_base:row.tile_base + t].reshape(row.rows // TILE, row.cols // TILE)


def nvfp4_group_scale(tiles, amax, *, table):
    """(packed padded scale_inv of every parameter, uint8; encode multiplier of every tile [T])."""
    scales, encs = [], []
    for p, row in enumerate(table):
        s = nvfp4_scale(_tiles_of(tiles, row), amax[p], rows=row.rows, cols=row.cols)
        scales.append(s.reshape(-1))
        encs.append(tile_encode(s, amax[p], row.rows, row.cols).reshape(-1))
    if not table:
        return jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.float32)
    return jnp.concatenate(scales), jnp.concatenate(encs)


def nvfp4_group_columnwise(data, scale_inv, *, table):
    """(packed data_t of every parameter [sum numel/2]; packed padded scale_inv_t of every parameter)."""
    datas, scales = [], []
    for row in table:
        d = data[row.byte_base:row.byte_base + row.numel // 2].reshape(row.rows, row.cols // 2)
        datas.append(nvfp4_transpose(d).reshape(-1))
        pr, pc = formats.nvfp4_scale_shape(row.rows, row.cols)
        s = scale_inv[row.scale_base:row.scale_base + pr * pc].reshape(pr, pc)
        scales.append(nvfp4_scale_transpose(s, rows=row.rows, cols=row.cols).reshape(-1))
    if not table:
        return jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.uint8)
    return jnp.concatenate(datas), jnp.concatenate(scales)


def fp8_group_transpose(data, *, table):
    """uint8 [N]: parameter p's [cols, rows] byte transpose at its offset, 0 elsewhere."""
    out = jnp.zeros_like(data)
    for row in table:
        if row.numel:
            t = data[row.offset:row.offset + row.numel].reshape(row.rows, row.cols).T.reshape(-1)
            out = jax.lax.dynamic_update_slice(out, t, (row.offset,))
    return out


def nvfp4_group_cast(shard, shard_index, enc, *, table, num_shards: int, chunk_lo, chunk_size: int):
    """This shard's chunk of the group's packed bytes: param-byte positions
    [chunk_lo[r], chunk_lo[r] + chunk_size), nibbles of elements the shard does not own are 0."""
    n = shard.size
    full = _place_shard(shard, shard_index, num_shards)
    parts = []
    for row in table:
        rows, cols = row.rows, row.cols
        e = _tiles_of(enc, row).reshape(rows // TILE, 1, cols // TILE, 1)
        scaled = full[row.offset:row.offset + row.numel].reshape(rows // TILE, TILE, cols // TILE, TILE) * e
        codes = fp32_to_e2m1_code(scaled).reshape(-1)
        codes = jnp.where(_owned_mask(shard_index, n, row.offset, row.numel), codes, jnp.uint8(0))
        parts.append(pack_codes(codes))
    packed = jnp.concatenate(parts + [jnp.zeros((chunk_size,), jnp.uint8)])
    lo = jnp.asarray(chunk_lo, jnp.int32)[shard_index]
    return jax.lax.dynamic_slice(packed, (lo,), (chunk_size,))


def fp8_group_amax(shard, shard_index, *, table, num_shards: int):
    """(amax of every parameter over the shard's elements [P]; non-finite counts [P])."""
    full = _place_shard(shard, shard_index, num_shards)
    amaxes, counts = [], []
    for row in table:
        w = full[row.offset:row.offset + row.numel]
        amaxes.append(jnp.max(formats.abs_ignoring_nan(w)) if row.numel else jnp.float32(0))
        counts.append(nonfinite_count(w))
    return jnp.stack(amaxes), jnp.stack(counts)


def fp8_group_cast(shard, shard_index, scale, *, table, num_shards: int, dtype):
    """fp8 bytes of the shard's elements, each scaled by its parameter's scale; padding is 0."""
    n = shard.size
    full = _place_shard(shard, shard_index, num_shards)
    out = jnp.zeros((num_shards * n,), dtype)
    for p, row in enumerate(table):
        if row.numel:
            q = to_fp8_saturating(full[row.offset:row.offset + row.numel] * scale[p], dtype)
            out = jax.lax.dynamic_update_slice(out, q, (row.offset,))
    return jax.lax.dynamic_slice(out, (shard_index * n,), (n,))


def group_split(sources, pieces):
    """Reference of ``ops.group_split``: ``pieces`` as (shape, ((source, first, count), ...))."""
    flats = [s.reshape(-1) for s in sources]
    out = []
    for shape, segments in pieces:
        parts = [flats[src][first:first + count] for src, first, count in segments]
        out.append((parts[0] if len(parts) == 1 else jnp.concatenate(parts)).reshape(shape))
    return tuple(out)
