"""The grouped ops: every parameter of a ZeRO group in one call, over one shard of its flat buffer
(docs/numerics.md §3), and the split of a group's packed arrays into per-parameter arrays.

One call covers every parameter of a group, and the shard index is a traced value (e.g.
``lax.axis_index``), so the same program runs on every shard with no branch on the shard: no
conditional (which XLA:GPU executes with a device-to-host copy of the branch index) and one
kernel launch per step instead of one per (shard, parameter) piece. The ops take the group's static
parameter table (:func:`group_table`, laid out by ``jaxquant.primitives.ops.table``).

None of them has a sharding rule (``declare.Op.rule``): a group buffer's shard is not a block of a sharded
array; callers run them per shard inside ``shard_map``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import formats, reference
from jaxquant.primitives.formats import TILE
from jaxquant.primitives.ops import table as gtable
from jaxquant.primitives.ops.checks import check_array, check_impl, check_input, not_quantized, rounds_to_bf16
from jaxquant.primitives.ops.declare import Op, Target


def group_table(offsets, shapes, *, num_shards: int, shard_size: int, nvfp4: bool) -> np.ndarray:
    """The static parameter table the grouped ops take.

    Args:
      offsets: the first flat element of each of the P parameters in the group buffer.
      shapes: each parameter's shape (rank 2 for NVFP4).
      num_shards: the number of ZeRO shards of the buffer.
      shard_size: elements per shard.
      nvfp4: lay out the NVFP4 tiles, bytes and scales (True) or FP8 only (False).

    Returns:
      A numpy int64 ``[P, F]`` table (``jaxquant.primitives.ops.table``: the fields, by name, are
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
    check_impl(impl)
    check_input("shard", shard)
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
    round_bf16 = rounds_to_bf16(shard, compute_dtype)
    convert = (lambda v: v) if compute_dtype is None else (lambda v: formats.to_compute_dtype(v, compute_dtype))
    return round_bf16, convert


def int64_words(a: np.ndarray) -> jax.Array:
    """A static int64 array as a device operand without x64: its little-endian uint32 words."""
    return jnp.asarray(np.ascontiguousarray(a, np.int64).reshape(-1).view(np.uint32))


NVFP4_GROUP_TILE_AMAX = Op("nvfp4_group_tile_amax", (Target("jq_nvfp4_group_tile_amax"),),
                           reference.nvfp4_group_tile_amax)


@NVFP4_GROUP_TILE_AMAX.define
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
        return tuple(NVFP4_GROUP_TILE_AMAX.call("jq_nvfp4_group_tile_amax", outs, v, r, int64_words(table),
                                                round_bf16=round_bf16))

    def ref(v, r):
        return reference.nvfp4_group_tile_amax(convert(v), r, table=rows, num_shards=num_shards)

    result = NVFP4_GROUP_TILE_AMAX.dispatch(impl, custom, ref, shard, index)
    return result if return_nonfinite else result[:2]


NVFP4_GROUP_SCALE = Op("nvfp4_group_scale", (Target("jq_nvfp4_group_scale"),), reference.nvfp4_group_scale)


@NVFP4_GROUP_SCALE.define
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
    check_impl(impl)
    table, rows = _check_table(table)
    sz = gtable.sizes(table)
    check_array("tile_amax", tile_amax, jnp.float32, (sz.num_tiles,))
    check_array("amax", amax, jnp.float32, (table.shape[0],))
    outs = [jax.ShapeDtypeStruct((sz.scale_bytes,), jnp.uint8), jax.ShapeDtypeStruct((sz.num_tiles,), jnp.float32)]

    def custom(t, a):
        return tuple(NVFP4_GROUP_SCALE.call("jq_nvfp4_group_scale", outs, t, a, int64_words(table)))

    def ref(t, a):
        return reference.nvfp4_group_scale(t, a, table=rows)

    return NVFP4_GROUP_SCALE.dispatch(impl, custom, ref, tile_amax, amax)


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
        check_array(f"data[{j}]", piece, jnp.uint8, shape)
    return pieces, space


def _transpose_ranges(rows, sizes, nvfp4: bool) -> np.ndarray:
    """The transposes' ``ranges`` attribute: each parameter's first 64x64 block and (NVFP4) first
    columnwise scale strip (16 bytes), then the ends (the launches batch parameters and need them on
    the host)."""
    starts = [(row.block_base, row.scale_t_base // TILE if nvfp4 else 0) for row in rows]
    end = (sizes.num_blocks, sizes.scale_t_bytes // TILE if nvfp4 else 0)
    return np.asarray(starts + [end], np.int64).reshape(-1)


NVFP4_GROUP_COLUMNWISE = Op("nvfp4_group_columnwise", (Target("jq_nvfp4_group_columnwise"),),
                            reference.nvfp4_group_columnwise)


@NVFP4_GROUP_COLUMNWISE.define
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
    check_impl(impl)
    table, rows = _check_table(table)
    sz = gtable.sizes(table)
    if space is None:
        check_array("data", data, jnp.uint8, (sz.data_bytes,))
    pieces, space = _gathered_pieces(data, space, sz.data_bytes)
    check_array("scale_inv", scale_inv, jnp.uint8, (sz.scale_bytes,))
    data_shapes = [(row.cols, row.rows // 2) for row in rows]
    scale_shapes = [formats.nvfp4_scale_shape(row.cols, row.rows) for row in rows]
    outs = [jax.ShapeDtypeStruct(shape, jnp.uint8) for shape in data_shapes + scale_shapes]
    if not rows:
        return [], []

    def custom(s, *ps):
        return tuple(NVFP4_GROUP_COLUMNWISE.call("jq_nvfp4_group_columnwise", outs, s, int64_words(table), *ps,
                               ranges=_transpose_ranges(rows, sz, True), space=space.attr()))

    def ref(s, *ps):
        data_t, scale_inv_t = reference.nvfp4_group_columnwise(space.assemble(ps), s, table=rows)
        return tuple([data_t[row.byte_base:row.byte_base + row.numel // 2].reshape(shape)
                      for row, shape in zip(rows, data_shapes)] +
                     [scale_inv_t[row.scale_t_base:row.scale_t_base + int(np.prod(shape))].reshape(shape)
                      for row, shape in zip(rows, scale_shapes)])

    result = NVFP4_GROUP_COLUMNWISE.dispatch(impl, custom, ref, scale_inv, *pieces)
    return list(result[:len(rows)]), list(result[len(rows):])


FP8_GROUP_TRANSPOSE = Op("fp8_group_transpose", (Target("jq_fp8_group_transpose"),), reference.fp8_group_transpose)


@FP8_GROUP_TRANSPOSE.define
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
    check_impl(impl)
    table, rows = _check_table(table)
    _check_space(space)
    if space is None:
        not_quantized("data", data)
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
        return tuple(FP8_GROUP_TRANSPOSE.call("jq_fp8_group_transpose", outs, int64_words(table), *ps,
                               ranges=_transpose_ranges(rows, gtable.sizes(table), False), space=space.attr()))

    def ref(*ps):
        flat = reference.fp8_group_transpose(space.assemble(ps), table=rows)
        flat = jax.lax.bitcast_convert_type(flat, dtype) if dtype != jnp.uint8 else flat
        return tuple(flat[row.offset:row.offset + row.numel].reshape(o.shape) for row, o in zip(rows, outs))

    return list(FP8_GROUP_TRANSPOSE.dispatch(impl, custom, ref, *pieces))


NVFP4_GROUP_CAST = Op("nvfp4_group_cast", (Target("jq_nvfp4_group_cast"),), reference.nvfp4_group_cast)


@NVFP4_GROUP_CAST.define
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
    check_array("enc", enc, jnp.float32, (num_tiles,))
    chunk_lo = np.asarray(chunk_lo, np.int64)
    if chunk_lo.shape != (num_shards,):
        raise ValueError(f"chunk_lo: must have one entry per shard ({num_shards}), got shape {chunk_lo.shape}")
    out = jax.ShapeDtypeStruct((chunk_size,), jnp.uint8)

    def custom(v, r, e):
        return NVFP4_GROUP_CAST.call("jq_nvfp4_group_cast", [out], v, r, int64_words(table), int64_words(chunk_lo), e,
                         round_bf16=round_bf16)[0]

    def ref(v, r, e):
        return reference.nvfp4_group_cast(convert(v), r, e, table=rows,
                                          num_shards=num_shards, chunk_lo=chunk_lo, chunk_size=chunk_size)

    return NVFP4_GROUP_CAST.dispatch(impl, custom, ref, shard, index, enc)


FP8_GROUP_AMAX = Op("fp8_group_amax", (Target("jq_fp8_group_amax"),), reference.fp8_group_amax)


@FP8_GROUP_AMAX.define
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
        return tuple(FP8_GROUP_AMAX.call("jq_fp8_group_amax", outs, v, r, int64_words(table), round_bf16=round_bf16))

    def ref(v, r):
        return reference.fp8_group_amax(convert(v), r, table=rows,
                                        num_shards=num_shards)

    result = FP8_GROUP_AMAX.dispatch(impl, custom, ref, shard, index)
    return result if return_nonfinite else result[0]


FP8_GROUP_CAST = Op("fp8_group_cast", (Target("jq_fp8_group_cast"),), reference.fp8_group_cast)


@FP8_GROUP_CAST.define
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
    check_array("scale", scale, jnp.float32, (table.shape[0],))
    n = shard.shape[0]
    count = n - first if count is None else count
    for name, v in (("first", first), ("count", count)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}: must be an int >= 0, got {v!r}")
    if first + count > n:
        raise ValueError(f"first, count: elements [{first}, {first + count}) leave the shard of {n}")
    out = jax.ShapeDtypeStruct((int(count),), dtype)

    def custom(v, r, s):
        return FP8_GROUP_CAST.call("jq_fp8_group_cast", [out], v, r, int64_words(table), s, round_bf16=round_bf16,
                         first=np.int64(first))[0]

    def ref(v, r, s):
        whole = reference.fp8_group_cast(convert(v), r, s, table=rows, num_shards=num_shards, dtype=dtype)
        return whole[first:first + count]

    return FP8_GROUP_CAST.dispatch(impl, custom, ref, shard, index, scale)


GROUP_SPLIT = Op("group_split", (Target("jq_group_split"),), reference.group_split)


@GROUP_SPLIT.define
def group_split(sources, pieces, *, stage_of_source=None, impl: str = "auto") -> list:
    """Per-parameter arrays cut from a group's packed arrays, all in one call (one launch on GPU
    instead of one XLA copy per result, whatever the number of parameters).

    ``sources``: a list of arrays; ``pieces``: one entry per result, ``(shape, segments)`` with
    ``segments`` a tuple of ``(source index, first element, element count)`` laid end to end in the
    result (one segment for a contiguous piece, several when it is spread over a gathered buffer).
    A result has its sources' dtype; all segments of one result come from sources of one dtype.

    ``stage_of_source`` (one int per source): copy in one call per stage instead, in stage order,
    each call taking only its stage's sources and writing into the previous call's results in place
    (aliased). A stage's copies then wait only for its own sources: the segments of gather piece j
    can be copied while piece j + 1 is still being gathered (docs/distributed.md). The bytes are
    the same; with the reference implementation it is one computation either way.
    """
    check_impl(impl)
    sources = list(sources)
    if stage_of_source is not None and len(stage_of_source) != len(sources):
        raise ValueError(f"stage_of_source: one stage per source ({len(sources)}), got {len(stage_of_source)}")
    flats = [s.reshape(-1) for s in sources]
    outs, plan = [], []
    for i, (shape, segments) in enumerate(pieces):
        shape = tuple(int(d) for d in shape)
        dtypes = {jnp.dtype(flats[src].dtype) for src, _, _ in segments}
        if len(dtypes) != 1:
            raise ValueError(f"pieces[{i}]: its segments must come from sources of one dtype, "
                             f"got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        if sum(int(n) for _, _, n in segments) != math.prod(shape):
            raise ValueError(f"pieces[{i}]: segments hold {sum(int(n) for _, _, n in segments)} elements, "
                             f"shape {shape} needs {math.prod(shape)}")
        pos = 0
        for src, first, count in segments:
            if not 0 <= src < len(flats) or first < 0 or first + count > flats[src].shape[0]:
                raise ValueError(f"pieces[{i}]: segment ({src}, {first}, {count}) lies outside the sources")
            size = dtype.itemsize
            plan.append((i, pos * size, src, int(first) * size, int(count) * size))
            pos += int(count)
        outs.append(jax.ShapeDtypeStruct(shape, dtype))
    if not outs:
        return []

    stages = sorted({stage_of_source[src] for _, _, src, _, _ in plan}) if stage_of_source is not None else []

    def call(srcs, rows, results, partial):
        used = sorted({src for _, _, src, _, _ in rows})   # only the stage's sources are its operands
        at = {src: i for i, src in enumerate(used)}
        words = np.asarray([(i, d, at[src], f, n) for i, d, src, f, n in rows], np.int64).reshape(-1)
        aliases = {len(used) + i: i for i in range(len(results))} or None
        return GROUP_SPLIT.call("jq_group_split", outs, *[srcs[j] for j in used], *results, plan=words, partial=partial,
                         input_output_aliases=aliases)

    def custom(*srcs):
        if len(stages) <= 1:
            return tuple(call(srcs, plan, [], False))
        results = []
        for stage in stages:
            results = call(srcs, [row for row in plan if stage_of_source[row[2]] == stage], results, True)
        return tuple(results)

    def ref(*srcs):
        return reference.group_split(srcs, [(o.shape, segments) for o, (_, segments) in zip(outs, pieces)])

    return list(GROUP_SPLIT.dispatch(impl, custom, ref, *flats))
