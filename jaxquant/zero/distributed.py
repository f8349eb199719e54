"""Quantize ZeRO-sharded fp32 master weights to FP8 / NVFP4 model weights (docs/numerics.md §3).

Per device, under ``shard_map`` over the data-parallel mesh axis ``axis`` (and, for FSDP x TP
layouts, the tensor-parallel axis ``tp_axis``):

1. (``compute_dtype`` rounding happens inside the grouped ops of steps 2 and 5, as they read the
   shard: no separate conversion pass);
2. partial statistics of every parameter over the shard, one grouped op for the group
   (``ops.nvfp4_group_tile_amax``: tile amaxes and amaxes; ``ops.fp8_group_amax``), non-finite
   counts from the same pass;
3. **one** ``lax.pmax`` of one packed int32 vector (fp32 statistics are non-negative, so their bit
   patterns order as int32 do), over ``axis`` and ``tp_axis`` together: the amaxes are max-reduced
   over the whole weight; TP-local tile amaxes travel in a ``[tp_size, T]`` block in which each TP
   rank fills its own row, non-finite counts in a ``[tp_size, num_shards, P]`` block likewise.
   NVFP4 on a 1-D mesh: that pmax carries the amaxes and only the tiles cut by a shard boundary
   (``cut_tiles``), which is all the cast needs; every tile amax (for the output scales) goes in a
   second pmax that need not finish before the cast;
4. scales of every parameter from the reduced statistics in one grouped op (``ops.nvfp4_group_scale``;
   FP8: vectorized jnp), identical on every rank of ``axis``;
5. cast of the shard into a fixed-size byte chunk (``ops.nvfp4_group_cast`` / ``ops.fp8_group_cast``);
6. ``lax.all_gather`` over ``axis`` only of that chunk (quantized bytes only); the chunks are laid out
   so that their concatenation is every parameter's bytes in order (NVFP4: one OR per odd shard
   boundary); one ``group_split`` call writes every per-parameter output from them (with
   ``split=False`` none: a ``GatheredWeights`` holds them, each weight cut out where it is read);
7. with ``columnwise`` (and ``manual_post_all_gather_processing=False``), one grouped transpose for
   the group (``ops.nvfp4_group_columnwise`` / ``ops.fp8_group_transpose``) that reads the gathered
   pieces in place (``ops.GatheredSpace``) and writes each parameter's own columnwise arrays.

The number of custom calls (and of XLA kernels) does not depend on the number of parameters. The shard index is
``lax.axis_index(axis)``, a device value: every shard runs the same program with no branch on the
shard. See docs/distributed.md for the byte layout of the gathered chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxquant.primitives import formats, ops

from jaxquant.zero import group_split
from jaxquant.primitives.ops import table as gtable
from jaxquant.zero.layout import FlatLayout
from jaxquant.primitives.quantize import fp8_columnwise, nvfp4_columnwise
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor



# ----------------------------------------------------------------------------------------------
# Non-finite report
# ----------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """NaN/±inf found in the master weights (after ``compute_dtype`` conversion), a pytree.

    Returned by :func:`quantize_master_weights` (and the ``_local`` form) with ``check_finite=True``.
    Call :meth:`raise_if_nonfinite` or ``jq.raise_if_nonfinite(report)`` (the same; outside ``jit``: it
    reads the counts to the host) or test :meth:`any` inside.

    Attributes:
      counts: int32 ``[num_shards, num_params]``: ``counts[r, p]`` is the number of non-finite elements
        of parameter ``p`` in shard ``r``, the same on every rank; ``[tp_size, num_shards, num_params]``
        (``counts[j, r, p]``, ``j`` the TP rank) for an FSDP x TP layout.
      names: the parameter names (static), as the layout's ``names``.
    """

    counts: jax.Array
    names: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def any(self) -> jax.Array:
        """True (a bool scalar array, usable inside ``jit``) where any count is non-zero."""
        return jnp.any(self.counts > 0)

    def findings(self) -> list[tuple]:
        """The non-zero counts, read to the host (outside ``jit``).

        Returns:
          One tuple per non-zero count: ``(param name, shard, count)``, or ``(param name, tp rank, shard,
          count)`` for an FSDP x TP layout; empty when every weight is finite.
        """
        counts = np.asarray(jax.device_get(self.counts))
        out = []
        for idx in zip(*np.nonzero(counts)):
            p = idx[-1]
            name = self.names[p] if p < len(self.names) else f"param{p}"
            out.append((name, *(int(i) for i in idx[:-1]), int(counts[idx])))
        return out

    def raise_if_nonfinite(self) -> None:
        """Raise if any master weight held NaN/±inf (outside ``jit``: reads the counts to the host).

        Raises:
          FloatingPointError: naming every (parameter, [TP rank,] shard) holding NaN/±inf, and its count.
        """
        found = self.findings()
        if found:
            what = "; ".join(f"{f[0]} in tp rank {f[1]}, shard {f[2]}: {f[3]} element(s)" if len(f) == 4
                             else f"{f[0]} in shard {f[1]}: {f[2]} element(s)" for f in found)
            raise FloatingPointError(f"non-finite (NaN or ±inf) master weights: {what}")


# ----------------------------------------------------------------------------------------------
# Static plan (per layout)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NVFP4Chunks:
    """Where each shard's NVFP4 bytes sit: the group's param-byte space (every parameter's packed
    bytes end to end, parameter p from ``byte_base``) cut at the shards' element boundaries.

    Shard ``r`` owns param-byte-space elements ``[a_r, a_{r+1})`` (alignment padding is not in that
    space), so its chunk is bytes ``[lo[r], lo[r] + size)`` with ``lo[r] = a_r // 2``, nibbles it does
    not own 0. The first ``length[r] = a_{r+1}//2 - a_r//2`` bytes of the chunks, concatenated, are
    the whole space, except that a byte split by an odd boundary ``a_{r+1}`` also needs the low
    nibble that shard ``r`` holds at chunk position ``length[r]``: ``fix_pos`` (byte in the space)
    and ``fix_src`` (position in the gathered buffer) list those, one per odd boundary.
    """

    size: int
    lo: tuple
    length: tuple
    fix_pos: tuple
    fix_src: tuple


@functools.lru_cache(maxsize=128)
def nvfp4_chunks(layout: FlatLayout) -> NVFP4Chunks:
    table = layout_group_table(layout, True)
    rows = gtable.rows_of(table)
    end = 2 * gtable.sizes(table).data_bytes
    starts = []
    for r in range(layout.num_shards):
        pcs = layout.pieces(r)
        starts.append(2 * rows[pcs[0].param].byte_base + pcs[0].start if pcs else None)
    a = [0] * (layout.num_shards + 1)
    a[-1] = end
    for r in reversed(range(layout.num_shards)):     # a shard owning nothing starts where the next does
        a[r] = a[r + 1] if starts[r] is None else starts[r]
    S = layout.num_shards
    lo = tuple(a[r] // 2 for r in range(S))
    length = tuple(a[r + 1] // 2 - a[r] // 2 for r in range(S))
    size = max((-(-a[r + 1] // 2) - a[r] // 2 for r in range(S)), default=0)
    fix_pos, fix_src = [], []
    for r in range(S):
        if a[r + 1] % 2 and a[r + 1] < end and a[r + 1] > a[r]:
            fix_pos.append(a[r + 1] // 2)
            fix_src.append(r * size + length[r])
    return NVFP4Chunks(size=size, lo=lo, length=length, fix_pos=tuple(fix_pos), fix_src=tuple(fix_src))


def gathered_bytes(layout: FlatLayout, recipe: str = "nvfp4") -> int:
    """Bytes the all-gather of :func:`quantize_master_weights` delivers to each rank (per TP rank).

    Args:
      layout: the group's :class:`FlatLayout`.
      recipe: "nvfp4" (default) or "fp8".

    Returns:
      NVFP4: ``num_shards * chunk`` where ``chunk`` is the largest shard's byte span; equals
      ``sum(numel) / 2`` exactly when every shard boundary inside a parameter falls on an even element
      and the shards own equally many bytes, and exceeds it by at most one byte a shard plus the
      imbalance otherwise. FP8: ``total_size`` (the flat buffer, alignment padding included).

    Raises:
      ValueError: an unknown ``recipe``.
    """
    if recipe == "nvfp4":
        return layout.num_shards * nvfp4_chunks(layout).size
    if recipe == "fp8":
        return layout.total_size
    raise ValueError(f"recipe: must be one of {formats.QUANTIZED_RECIPES}, got {recipe!r}")


@functools.lru_cache(maxsize=128)
def layout_group_table(layout: FlatLayout, nvfp4: bool) -> np.ndarray:
    """The grouped ops' parameter table of ``layout`` (TP-local shapes), built once per layout."""
    return ops.group_table(layout.param_offsets, layout.local_shapes, num_shards=layout.num_shards,
                           shard_size=layout.shard_size, nvfp4=nvfp4)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _f32_bits(x):
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def _bits_f32(x):
    return jax.lax.bitcast_convert_type(x, jnp.float32)


def _check_options(layout, recipe, compute_dtype, columnwise):
    if not isinstance(layout, FlatLayout):
        raise TypeError(f"layout: must be a jaxquant.FlatLayout, got {type(layout).__name__}")
    if recipe not in formats.QUANTIZED_RECIPES:
        raise ValueError(f"recipe: must be one of {formats.QUANTIZED_RECIPES}, got {recipe!r}")
    if compute_dtype is not None and jnp.dtype(compute_dtype) not in ops.INPUT_DTYPES:
        raise TypeError(f"compute_dtype: must be None, float32 or bfloat16, got {compute_dtype}")
    for p, (shape, local) in enumerate(zip(layout.shapes, layout.local_shapes)):
        where = f"layout.shapes[{p}] ({layout.names[p]})"
        if local != shape:
            where += f", TP-local shape {local} (tp_dims[{p}]={layout.tp_dims[p]}, tp_size={layout.tp_size})"
        if recipe == "nvfp4":
            if len(shape) != 2:
                raise ValueError(f"{where}: NVFP4 weights must have rank 2, got shape {shape}")
            ops.check_nvfp4_shape(local[0], local[1], name=where)
        elif columnwise and len(shape) != 2:
            raise ValueError(f"{where}: columnwise=True needs rank-2 weights, got shape {shape}")


def _check_flat(name, x, shape, what):
    """``x`` is a float32/bfloat16 array of ``shape``; ``what`` says where the shape comes from."""
    ops.check_input(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: shape must be {tuple(shape)} ({what}), got {tuple(x.shape)}")


def _axis_size(axis) -> int:
    try:
        return int(jax.lax.axis_size(axis))
    except NameError as e:
        raise ValueError(f"axis: {axis!r} is not a mesh axis bound here (call this inside "
                         f"shard_map over a mesh with that axis): {e}") from None


def _check_tp(layout, tp_axis, tp_size_of):
    """The TP axis agrees with the layout; returns the TP size (1 without TP)."""
    if tp_axis is None:
        if layout.tp_size > 1:
            raise ValueError(f"tp_axis: the layout is split over tp_size={layout.tp_size} TP ranks; pass the "
                             f"tensor-parallel mesh axis as tp_axis")
        return 1
    if layout.tp_dims is None:
        raise ValueError(f"tp_axis: {tp_axis!r} given but the layout has no tp_dims (build it with "
                         f"FlatLayout(..., tp_size=..., tp_dims=...))")
    size = tp_size_of(tp_axis)
    if size != layout.tp_size:
        raise ValueError(f"layout: has tp_size={layout.tp_size} but mesh axis {tp_axis!r} has {size} devices")
    return size


# ----------------------------------------------------------------------------------------------
# Per-device form
# ----------------------------------------------------------------------------------------------


def quantize_master_weights_local(shard, layout: FlatLayout, *, axis: str = "fsdp", tp_axis=None,
                                  recipe: str = "nvfp4", compute_dtype=jnp.bfloat16, columnwise: bool = False,
                                  manual_post_all_gather_processing: bool = True, check_finite: bool = False,
                                  fp8_dtype=jnp.float8_e4m3fn, amax_epsilon: float = 0.0,
                                  force_pow_2_scales: bool = False, gather_pieces=None, split: bool = True,
                                  impl: str = "auto"):
    """The per-device body of :func:`quantize_master_weights`, for use inside your own ``shard_map``.

    Collectives: one ``pmax`` over ``axis`` and ``tp_axis`` (int32, all statistics of the group) and
    ``all_gather`` over ``axis`` (uint8, quantized bytes only: one per gather piece).

    Args:
      shard: this device's ``[layout.shard_size]`` slice of its (TP rank's) flat float32/bfloat16 master
        buffer (shard index = ``lax.axis_index(axis)``; ``[1, shard_size]`` is accepted too).
      layout: the group's :class:`FlatLayout`; its ``num_shards`` must equal the size of ``axis``.
      axis, tp_axis, recipe, compute_dtype, columnwise, manual_post_all_gather_processing, check_finite,
      fp8_dtype, amax_epsilon, force_pow_2_scales, gather_pieces, split, impl: as in
        :func:`quantize_master_weights`, the axes named as in the enclosing ``shard_map``.

    Returns:
      This TP rank's weights (identical on every rank of ``axis``; TP-local shapes): a list of
      ``NVFP4Tensor`` / ``Float8Tensor`` in the layout's order, or a :class:`jaxquant.GatheredWeights`
      with ``split=False``; with ``check_finite=True`` ``(weights, NonFiniteReport)``.

    Raises:
      TypeError, ValueError: as :func:`quantize_master_weights`, for a bad argument or a layout that
        does not match the axes.
    """
    _check_options(layout, recipe, compute_dtype, columnwise)
    pieces = _check_gather_pieces(gather_pieces)
    if hasattr(shard, "shape") and tuple(shard.shape) == (1, layout.shard_size):
        shard = shard.reshape(-1)
    _check_flat("shard", shard, (layout.shard_size,), "layout.shard_size")
    ops.check_impl(impl)
    size = _axis_size(axis)
    if size != layout.num_shards:
        raise ValueError(f"layout: has {layout.num_shards} shards but mesh axis {axis!r} has {size} devices")
    _check_tp(layout, tp_axis, _axis_size)
    _check_split(split, tp_axis)
    cd = None if compute_dtype is None else jnp.dtype(compute_dtype)   # rounded inside the grouped ops
    build_columnwise = columnwise and not manual_post_all_gather_processing
    mesh_axes = _MeshAxes(axis, tp_axis, layout.tp_size)
    if layout.num_params == 0:
        weights = [] if split else group_split.GatheredWeights(sources=(), recipe=recipe)
        counts = jnp.zeros(_counts_shape(layout, tp_axis), jnp.int32)
    elif recipe == "nvfp4":
        weights, counts = _nvfp4_local(shard, cd, layout, mesh_axes, check_finite, build_columnwise, pieces, split,
                                        impl)
    else:
        weights, counts = _fp8_local(shard, cd, layout, mesh_axes, check_finite, build_columnwise, jnp.dtype(fp8_dtype),
                                     float(amax_epsilon), bool(force_pow_2_scales), pieces, split, impl)
    if not check_finite:
        return weights
    return weights, NonFiniteReport(counts=counts, names=layout.names)


@dataclasses.dataclass(frozen=True)
class _MeshAxes:
    axis: str
    tp_axis: object
    tp_size: int

    @property
    def reduce(self):
        """The axes of the statistics' all-reduce: the whole weight mesh."""
        return self.axis if self.tp_axis is None else (self.axis, self.tp_axis)

    def tp_index(self):
        return jnp.int32(0) if self.tp_axis is None else jax.lax.axis_index(self.tp_axis)


def _counts_shape(layout, tp_axis):
    return ((layout.num_shards, layout.num_params) if tp_axis is None
            else (layout.tp_size, layout.num_shards, layout.num_params))


def _own_row(value, rows: int, row):
    """A [rows, *value.shape] zero block with ``value`` in row ``row``: max-reduced, every row is its
    owner's value."""
    block = jnp.zeros((rows,) + value.shape, value.dtype)
    return jax.lax.dynamic_update_slice(block, value[None], (row,) + (0,) * value.ndim)


def _reduce_stats(parts_f32, counts, layout, axes: _MeshAxes, check_finite):
    """One pmax over the weight mesh of one int32 vector holding ``parts_f32`` (fp32, >= 0: their
    bits order as int32 do) and, with ``check_finite``, the counts block. Returns the reduced parts
    and counts ([S, P], or [tp, S, P] with a TP axis)."""
    vecs = [_f32_bits(v).reshape(-1) for v in parts_f32]
    if check_finite:
        block = _own_row(counts.astype(jnp.int32), layout.num_shards, jax.lax.axis_index(axes.axis))
        if axes.tp_axis is not None:
            block = _own_row(block, axes.tp_size, axes.tp_index())
        vecs.append(block.reshape(-1))
    packed = jax.lax.pmax(jnp.concatenate(vecs), axes.reduce)
    out, pos = [], 0
    for v in parts_f32:
        out.append(_bits_f32(packed[pos:pos + v.size]).reshape(v.shape))
        pos += v.size
    counts = packed[pos:].reshape(_counts_shape(layout, axes.tp_axis)) if check_finite else None
    return out, counts


def _gather(chunk, axis):
    return jax.lax.all_gather(chunk, axis, tiled=True, to="invarying")


def _nvfp4_local(x, compute_dtype, layout, axes: _MeshAxes, check_finite, build_columnwise, pieces, split, impl):
    S = layout.num_shards
    table = layout_group_table(layout, True)
    rows = gtable.rows_of(table)
    plan = nvfp4_chunks(layout)
    r = jax.lax.axis_index(axes.axis)
    tiles, amax, counts = ops.nvfp4_group_tile_amax(x, r, table=table, num_shards=S, return_nonfinite=True,
                                                    compute_dtype=compute_dtype, impl=impl)
    if axes.tp_axis is None and S > 1:
        # The cast needs only this shard's tiles, complete here except those cut by a shard boundary:
        # the all-reduce it waits for carries the amaxes and the cut tiles (small). Every tile's
        # amax (the output scales only) is reduced after, off the cast's path. docs/distributed.md, step 3.
        cut = cut_tiles(rows, layout.shard_size, S)
        (amax, cut_amax), counts = _reduce_stats([amax, tiles[cut]], counts, layout, axes, check_finite)
        _, enc = ops.nvfp4_group_scale(tiles.at[cut].set(cut_amax), amax, table=table, impl=impl)
        # after enc: XLA would otherwise combine the two all-reduces into one on the cast's path
        tiles, enc = jax.lax.optimization_barrier((tiles, enc))
        (tiles,), _ = _reduce_stats([tiles], None, layout, axes, False)
        scale_inv, _ = ops.nvfp4_group_scale(tiles, amax, table=table, impl=impl)
    else:
        if axes.tp_axis is None:
            (tiles, amax), counts = _reduce_stats([tiles, amax], counts, layout, axes, check_finite)
        else:   # TP-local tiles: each TP rank its own row; amaxes over the whole weight
            j = axes.tp_index()
            (block, amax), counts = _reduce_stats([_own_row(tiles, axes.tp_size, j), amax], counts, layout, axes,
                                                  check_finite)
            tiles = jax.lax.dynamic_index_in_dim(block, j, keepdims=False)
        scale_inv, enc = ops.nvfp4_group_scale(tiles, amax, table=table, impl=impl)
    # The chunk is cast and gathered in pieces (one by default): XLA can run each piece's all-gather
    # (its own stream) while the next piece is cast.
    bounds = gather_piece_bounds(plan.size, pieces)
    gathered = [_gather(ops.nvfp4_group_cast(x, r, enc, table=table, num_shards=S,
                                             chunk_lo=[lo + start for lo in plan.lo], chunk_size=size,
                                             compute_dtype=compute_dtype, impl=impl), axes.axis)
                for start, size in bounds]
    space = gtable.GatheredSpace(size=gtable.sizes(table).data_bytes, chunk=plan.size, lo=plan.lo, bounds=bounds)
    if plan.fix_pos or (build_columnwise and not space.readable_in_place):   # the space assembled first
        data = _assemble_nvfp4(gathered, bounds, plan)
        data_t = scale_inv_t = None
        if build_columnwise:
            data_t, scale_inv_t = ops.nvfp4_group_columnwise(data, scale_inv, table=table, impl=impl)
        return _split_nvfp4(rows, [data], scale_inv, amax, data_t, scale_inv_t, split=split, impl=impl), counts
    # Each weight's bytes (and the transpose's input) straight from the gathered pieces: no assembled
    # copy of the space, and one split call a piece, each waiting only for its own piece's gather.
    data_t = scale_inv_t = None
    if build_columnwise:
        data_t, scale_inv_t = ops.nvfp4_group_columnwise(gathered, scale_inv, table=table, space=space, impl=impl)
    return _split_nvfp4(rows, gathered, scale_inv, amax, data_t, scale_inv_t, plan=plan, bounds=bounds,
                        stages=_split_stages(len(gathered), S, 2), split=split, impl=impl), counts


def cut_tiles(rows, shard_size: int, num_shards: int) -> np.ndarray:
    """Indices into the packed tile vector (``rows``: the group table's) of the NVFP4 tiles that have
    elements on two or more shards (shard r owns flat ``[r * shard_size, (r + 1) * shard_size)``).
    Only the tile row holding a boundary ``b`` can be cut, and its tile ``(ti, tj)`` is cut exactly
    when its first element lies before ``b`` and its last at or after it."""
    out = []
    offsets = np.asarray([row.offset for row in rows], np.int64)
    for b in range(shard_size, shard_size * num_shards, shard_size):
        p = int(np.searchsorted(offsets, b, side="right")) - 1
        if p < 0 or not rows[p].offset < b < rows[p].offset + rows[p].numel:
            continue   # in a gap between parameters, or at a parameter's start
        row, tile = rows[p], gtable.TILE
        ti, tj = (b - row.offset) // row.cols // tile, np.arange(row.cols // tile, dtype=np.int64)
        first = row.offset + tile * ti * row.cols + tile * tj
        last = first + (tile - 1) * row.cols + tile - 1
        out.append(row.tile_base + ti * (row.cols // tile) + tj[(first < b) & (b <= last)])
    return np.unique(np.concatenate(out)).astype(np.int32) if out else np.zeros((0,), np.int32)


def _check_split(split, tp_axis):
    if not isinstance(split, (bool, np.bool_)):
        raise TypeError(f"split: must be a bool, got {type(split).__name__}")
    if not split and tp_axis is not None:
        raise ValueError("split: False (GatheredWeights) is for 1-D meshes; with tp_axis the weights are split "
                         "(pass split=True)")


def _check_gather_pieces(pieces) -> int:
    """``gather_pieces`` as an int; None (automatic) is one piece: beside the casts a gather slows down to
    about a cast's duration, so splitting it hides nothing and each piece adds a cast launch, a gather and
    a split call (docs/decisions.md, "One gather piece by default"; figures in docs/performance.md)."""
    if pieces is None:
        return 1
    if isinstance(pieces, bool) or not isinstance(pieces, (int, np.integer)) or pieces < 1:
        raise ValueError(f"gather_pieces: must be None (automatic) or an int >= 1, got {pieces!r}")
    return int(pieces)


def gather_piece_bounds(size: int, pieces: int = 1) -> tuple:
    """``(start, length)`` of each gather piece of a shard's ``size``-byte chunk (NVFP4 packed bytes,
    FP8 elements): ``pieces`` equal parts (starts multiples of 128, so the casts keep their vector
    stores)."""
    if size == 0:
        return ((0, 0),)
    step = max(128, -(-size // (pieces * 128)) * 128)   # ceil(size / pieces), rounded up to 128
    return tuple((start, min(step, size - start)) for start in range(0, size, step))


def _assemble_nvfp4(gathered, bounds, plan: NVFP4Chunks):
    """The group's param-byte space from the gathered pieces: shard r's first ``length[r]`` chunk bytes
    in shard order (one concatenate of static slices), one OR per odd shard boundary."""
    parts = [gathered[j][pos:pos + n] for r, length in enumerate(plan.length) if length
             for j, pos, n in gtable.chunk_segments(r, 0, length, bounds)]
    data = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)
    if plan.fix_pos:
        pos = np.asarray(plan.fix_pos)
        held = []   # the low nibble shard r holds at chunk offset length[r]
        for src in plan.fix_src:
            r, offset = divmod(src, plan.size)
            [(j, at, _)] = gtable.chunk_segments(r, offset, 1, bounds)
            held.append(gathered[j][at])
        data = data.at[pos].set(data[pos] | jnp.stack(held))
    return data


def _space_segments(src0, first, count, shards, bounds):
    """Segments (source, offset, count) of positions [first, first + count) of a gathered space: the
    space itself (source ``src0``; ``shards`` None), or spread over the gather pieces (sources
    ``src0 + j``), where ``shards`` lists each shard's ``(lo, length)`` part of the space, held from
    offset 0 of its chunk (NVFP4: the param-byte space without odd boundaries; FP8: the flat buffer)."""
    if shards is None:
        return ((src0, first, count),)
    segs = []
    for r, (lo, n) in enumerate(shards):
        a, b = max(first, lo), min(first + count, lo + n)
        if a < b:
            segs += gtable.chunk_segments(r, a - lo, b - a, bounds, src0)
    return tuple(segs)


def _split_stages(num_pieces: int, num_shards: int, num_other: int):
    """``ops.group_split``'s stage of each source: gather pieces first (piece j in stage j, with the
    other sources in stage 0), so that each piece's weights are copied out while the next pieces are
    still being gathered; None (one call) with a single piece or nothing gathered (one shard)."""
    if num_pieces == 1 or num_shards == 1:
        return None
    return list(range(num_pieces)) + [0] * num_other


def _split_nvfp4(rows, data, scale_inv, amax, data_t=None, scale_inv_t=None, *, plan=None, bounds=None,
                 stages=None, split=True, impl="auto"):
    """Per-parameter tensors from the group's packed vectors (``_per_parameter``: one ``group_split``
    call, one per gather piece with ``stages``, or a ``GatheredWeights`` without ``split``). ``data``: a list
    holding the param-byte space, or with ``plan`` the gathered pieces (``bounds``) that hold it. ``data_t`` /
    ``scale_inv_t``: the per-parameter columnwise arrays (``ops.nvfp4_group_columnwise``), or None."""
    k = len(data)
    shards = None if plan is None else tuple(zip(plan.lo, plan.length))
    results = []
    for p, row in enumerate(rows):
        m, c = row.rows, row.cols
        sr, sc = formats.nvfp4_scale_shape(m, c)
        results.append((((m, c // 2), _space_segments(0, row.byte_base, m * c // 2, shards, bounds)),
                        ((sr, sc), ((k, row.scale_base, sr * sc),)),
                        ((1,), ((k + 1, p, 1),))))
    return _per_parameter("nvfp4", list(data) + [scale_inv, amax], results, [(row.rows, row.cols) for row in rows],
                          data_t, scale_inv_t, split, stages, impl)


def _per_parameter(recipe, sources, results, shapes, data_t, scale_inv_t, split, stages, impl):
    """The weights from the group's packed vectors: a ``GatheredWeights`` (``split`` False: each weight
    cut out where it is read), or the list of weights written by ``group_split`` (one call, or one per
    gather piece with ``stages``)."""
    weights = group_split.GatheredWeights(
        sources=tuple(sources), data_t=None if data_t is None else tuple(data_t),
        scale_inv_t=None if scale_inv_t is None else tuple(scale_inv_t), recipe=recipe, results=tuple(results),
        shapes=tuple(tuple(int(d) for d in s) for s in shapes))
    return weights.materialize(stage_of_source=stages, impl=impl) if split else weights


def _fp8_local(x, compute_dtype, layout, axes: _MeshAxes, check_finite, build_columnwise, dtype, amax_epsilon,
               force_pow_2_scales, pieces, split, impl):
    S, n = layout.num_shards, layout.shard_size
    fmax = formats.fp8_max(dtype)
    table = layout_group_table(layout, False)
    r = jax.lax.axis_index(axes.axis)
    amax, counts = ops.fp8_group_amax(x, r, table=table, num_shards=S, return_nonfinite=True,
                                      compute_dtype=compute_dtype, impl=impl)
    (amax,), counts = _reduce_stats([amax], counts, layout, axes, check_finite)
    scale, scale_inv = formats.fp8_scale_from_amax(amax, fmax, amax_epsilon, force_pow_2_scales)
    # Cast and gathered in pieces (one by default; with more, each gather can overlap the next cast);
    # the columnwise transpose reads the pieces where they lie (GatheredSpace), or one assembled
    # buffer past its limits.
    bounds = gather_piece_bounds(n, pieces)
    as_u8 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
    gathered_u8 = [_gather(as_u8(ops.fp8_group_cast(x, r, scale, table=table, num_shards=S, dtype=dtype,
                                                    compute_dtype=compute_dtype, first=start, count=size, impl=impl)),
                           axes.axis)
                   for start, size in bounds]
    gathered = [jax.lax.bitcast_convert_type(g, dtype) for g in gathered_u8]
    data_t = [None] * layout.num_params
    if build_columnwise:   # each weight's transpose straight from the pieces into its own array
        space = gtable.GatheredSpace(size=S * n, chunk=n, lo=tuple(i * n for i in range(S)), bounds=bounds)
        if space.readable_in_place:
            ts = ops.fp8_group_transpose(gathered_u8, table=table, space=space, dtype=dtype, impl=impl)
        else:
            ts = ops.fp8_group_transpose(space.assemble(gathered_u8), table=table, dtype=dtype, impl=impl)
        data_t = [t.reshape(tuple(shape)[::-1]) for t, shape in zip(ts, layout.local_shapes)]
    k = len(gathered)
    shards = None if k == 1 else tuple((r * n, n) for r in range(S))   # one piece: the flat buffer itself
    results = [((shape, _space_segments(0, o, numel, shards, bounds)), ((), ((k, p, 1),)), ((), ((k + 1, p, 1),)))
               for p, (o, numel, shape) in enumerate(zip(layout.param_offsets, layout.numels, layout.local_shapes))]
    weights = _per_parameter("fp8", gathered + [scale_inv, amax], results, layout.local_shapes,
                             data_t if build_columnwise else None, None, split, _split_stages(k, S, 2), impl)
    return weights, counts


# ----------------------------------------------------------------------------------------------
# Global form
# ----------------------------------------------------------------------------------------------


def weight_partition_specs(layout, recipe, columnwise_in_step, tp_axis):
    """out_specs of each weight: sharded over ``tp_axis`` along its TP dim (the transposed dim for
    columnwise data), replicated otherwise."""
    specs = []
    for p, local in enumerate(layout.local_shapes):
        d = None if layout.tp_dims is None else layout.tp_dims[p]
        if tp_axis is None or d is None:
            row, col = P(), P()
        else:
            row = P(tp_axis, None) if d == 0 else P(None, tp_axis)
            col = P(None, tp_axis) if d == 0 else P(tp_axis, None)
        t = col if columnwise_in_step else None
        if recipe == "nvfp4":
            specs.append(NVFP4Tensor(data=row, scale_inv=row, amax=P(), data_t=t, scale_inv_t=t, shape=tuple(local)))
        else:
            specs.append(Float8Tensor(data=row, scale_inv=P(), amax=P(), data_t=t))
    return specs


@functools.lru_cache(maxsize=128)
def _build(layout, mesh, axis, tp_axis, options):
    opts = dict(options)
    body = functools.partial(quantize_master_weights_local, layout=layout, axis=axis, tp_axis=tp_axis, **opts)
    columnwise_in_step = opts["columnwise"] and not opts["manual_post_all_gather_processing"]
    # GatheredWeights (split=False): every leaf replicated
    specs = weight_partition_specs(layout, opts["recipe"], columnwise_in_step, tp_axis) if opts["split"] else P()
    out_specs = (specs, NonFiniteReport(counts=P(), names=layout.names)) if opts["check_finite"] else specs
    in_spec = P(axis) if tp_axis is None else P(tp_axis, axis)
    # 1-D: the results are replicated over ``axis`` (pmax / all_gather), which check_vma verifies.
    # FSDP x TP: weights replicated over TP (tp_dims None) are computed from TP-varying inputs that
    # hold the same values on every TP rank, which check_vma cannot know.
    smap = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_specs, check_vma=tp_axis is None)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))

    def run(master_flat):
        if explicit:   # explicit-sharding meshes do not reshard shard_map inputs implicitly
            master_flat = jax.reshard(master_flat, NamedSharding(mesh, in_spec))
        out = smap(master_flat)
        if tp_axis is None:
            return out
        weights, report = (out if opts["check_finite"] else (out, None))
        weights = [dataclasses.replace(w, shape=tuple(s)) if isinstance(w, NVFP4Tensor) else w
                   for w, s in zip(weights, layout.shapes)]
        return (weights, report) if opts["check_finite"] else weights

    return jax.jit(run)


def quantize_master_weights(master_flat, layout: FlatLayout, *, mesh, axis: str = "fsdp", tp_axis=None,
                            recipe: str = "nvfp4", compute_dtype=jnp.bfloat16, columnwise: bool = False,
                            manual_post_all_gather_processing: bool = True, check_finite: bool = False,
                            fp8_dtype=jnp.float8_e4m3fn, amax_epsilon: float = 0.0,
                            force_pow_2_scales: bool = False, gather_pieces=None, split: bool = True,
                            impl: str = "auto"):
    """Quantize a ZeRO-sharded flat fp32 master buffer into full (gathered) FP8 / NVFP4 weights.

    The weights are bit-identical to ``quantize_nvfp4`` / ``quantize_fp8`` of each whole weight after
    ``compute_dtype`` conversion. Without ``tp_axis`` they are replicated on every device. With
    ``tp_axis``, each is a global array sharded over ``tp_axis`` along its TP dim (data and scale_inv;
    columnwise data_t / scale_inv_t along the transposed dim) and replicated over ``axis``; amaxes are
    reduced over the whole weight. Bytes equal whole-tensor quantization when the TP split is aligned to
    the scale layout (docs/distributed.md, "FSDP x TP"); otherwise each TP rank's local tensor equals the
    quantization of its slice with the shared global amax. Usable eagerly or inside ``jax.jit`` (donate
    the previous step's weights to reuse their buffers).

    Args:
      master_flat: float32 (or bfloat16) global ``[layout.total_size]`` array sharded ``P(axis)`` on
        ``mesh`` (replicated over the other mesh axes), or, for an FSDP x TP layout (``tp_axis`` set),
        ``[tp_size, total_size]`` sharded ``P(tp_axis, axis)`` (:func:`master_sharding`;
        ``layout.flatten`` builds it).
      layout: the group's :class:`FlatLayout`; its ``num_shards`` must equal the size of ``axis``.
      mesh: the ``jax.sharding.Mesh``.
      axis: the mesh axis the master is sharded over (FSDP / ZeRO; default "fsdp").
      tp_axis: the tensor-parallel mesh axis, for a layout built with ``tp_dims`` (default None: no TP).
      recipe: "nvfp4" (default) or "fp8".
      compute_dtype: the master is rounded to it before quantizing (default bfloat16; None: as is).
      columnwise: also produce the columnwise data (``data_t`` and, for NVFP4, ``scale_inv_t``;
        default False).
      manual_post_all_gather_processing: with ``columnwise``, leave the columnwise data to the caller,
        who runs :func:`post_all_gather_processing` when it suits, e.g. overlapped with the next layer's
        compute (default True); False builds it in the step.
      check_finite: also return a :class:`NonFiniteReport` (default False).
      fp8_dtype, amax_epsilon, force_pow_2_scales: FP8 options, as in :func:`quantize_fp8`
        (docs/numerics.md §1).
      gather_pieces: cast and all-gather each shard's bytes in this many pieces, so that the gather of
        one can overlap the cast of the next (None, the default: 1; more pieces slow each gather and add
        launches, docs/decisions.md, "One gather piece by default"); the bytes do not depend on it.
      split: True (default) returns a list of tensors. False (1-D meshes, no ``tp_axis``) returns a
        :class:`jaxquant.GatheredWeights`: the gathered bytes, with each weight cut out where it is read
        (``weights[i]``, ``weights.tensors()``; the same bytes). Inside the ``jit`` that consumes the
        weights this skips the split pass over every weight's bytes (the slices are plain XLA ops, free
        to fuse into their readers), as a bf16 gather whose caller slices its weights out of the
        gathered buffer pays none (docs/distributed.md).
      impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

    Returns:
      The list of ``NVFP4Tensor`` / ``Float8Tensor`` in the layout's order (a ``GatheredWeights`` with
      ``split=False``); with ``check_finite=True`` ``(weights, NonFiniteReport)``.

    Raises:
      TypeError: ``layout`` is not a ``FlatLayout``, ``mesh`` not a ``Mesh``, or a bad dtype.
      ValueError: an axis not in the mesh, a layout whose shards or TP split do not match the mesh,
        a ``master_flat`` of the wrong shape, weights the recipe cannot quantize (NVFP4: rank 2,
        multiples of 16), or a bad option value.
    """
    _check_options(layout, recipe, compute_dtype, columnwise)
    ops.check_impl(impl)
    pieces = _check_gather_pieces(gather_pieces)
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh: must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for name, a in (("axis", axis), ("tp_axis", tp_axis)):
        if (a is not None or name == "axis") and (not isinstance(a, str) or a not in mesh.axis_names):
            raise ValueError(f"{name}: {a!r} is not an axis of the mesh (axes {mesh.axis_names})")
    if tp_axis == axis:
        raise ValueError(f"tp_axis: must differ from axis ({axis!r})")
    if mesh.shape[axis] != layout.num_shards:
        raise ValueError(f"layout: has {layout.num_shards} shards but mesh axis {axis!r} has "
                         f"{mesh.shape[axis]} devices")
    _check_tp(layout, tp_axis, lambda a: mesh.shape[a])
    _check_split(split, tp_axis)
    if layout.tp_dims is None:
        _check_flat("master_flat", master_flat, (layout.total_size,), "layout.total_size = num_shards * shard_size")
    else:
        if tp_axis is None:
            raise ValueError("tp_axis: the layout was built with tp_dims; pass the tensor-parallel mesh axis")
        _check_flat("master_flat", master_flat, (layout.tp_size, layout.total_size),
                    "[layout.tp_size, layout.total_size], as layout.flatten returns it")
    options = (("recipe", recipe),
               ("compute_dtype", None if compute_dtype is None else jnp.dtype(compute_dtype)),
               ("columnwise", bool(columnwise)),
               ("manual_post_all_gather_processing", bool(manual_post_all_gather_processing)),
               ("check_finite", bool(check_finite)), ("fp8_dtype", jnp.dtype(fp8_dtype)),
               ("amax_epsilon", float(amax_epsilon)), ("force_pow_2_scales", bool(force_pow_2_scales)),
               ("gather_pieces", pieces), ("split", bool(split)), ("impl", impl))
    return _build(layout, mesh, axis, tp_axis, options)(master_flat)


def master_sharding(mesh, axis: str = "fsdp", tp_axis=None) -> NamedSharding:
    """The sharding :func:`quantize_master_weights` expects for ``master_flat``.

    Args:
      mesh: the ``jax.sharding.Mesh``.
      axis: the FSDP mesh axis (default "fsdp").
      tp_axis: the tensor-parallel mesh axis of an FSDP x TP layout (default None).

    Returns:
      ``NamedSharding(mesh, P(axis))``, or ``P(tp_axis, axis)`` with ``tp_axis``.
    """
    return NamedSharding(mesh, P(axis) if tp_axis is None else P(tp_axis, axis))


# ----------------------------------------------------------------------------------------------
# Post all-gather processing
# ----------------------------------------------------------------------------------------------


def post_all_gather_processing(weights, *, impl: str = "auto"):
    """Build the columnwise data from the gathered rowwise data.

    NVFP4: ``data_t`` and ``scale_inv_t``; FP8: ``data_t``, the byte transpose. A list is processed as
    a group: one grouped transpose call for all its NVFP4 tensors (``ops.nvfp4_group_columnwise``) and
    one for all its FP8 tensors (``ops.fp8_group_transpose``), whatever their number. For FSDP x TP
    weights whose TP split is not aligned to the scale layout, run it per TP rank (inside
    ``shard_map``) or pass ``manual_post_all_gather_processing=False`` to the quantizer.

    Args:
      weights: one ``NVFP4Tensor`` / ``Float8Tensor``, or a list/tuple of them (e.g. what
        :func:`quantize_master_weights` returned).
      impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

    Returns:
      The same structure with columnwise data; tensors that already have it are returned unchanged.

    Raises:
      TypeError: ``weights`` holds something other than quantized tensors.
      ValueError: an FP8 tensor whose data is not rank 2, or an NVFP4 tensor whose scales are a TP shard
        not aligned to the scale layout.
    """
    if isinstance(weights, (list, tuple)):
        for w in weights:
            if not isinstance(w, (NVFP4Tensor, Float8Tensor)):
                raise TypeError(f"weights: must be an NVFP4Tensor, a Float8Tensor or a list of them, "
                                f"got an element of type {type(w).__name__}")
        out = list(weights)
        nv = [i for i, w in enumerate(out)
              if isinstance(w, NVFP4Tensor) and (w.data_t is None or w.scale_inv_t is None)]
        f8 = [i for i, w in enumerate(out) if isinstance(w, Float8Tensor) and w.data_t is None]
        for i, w in zip(nv, _nvfp4_group_columnwise([out[i] for i in nv], impl)):
            out[i] = w
        for i, w in zip(f8, _fp8_group_columnwise([out[i] for i in f8], impl)):
            out[i] = w
        return type(weights)(out)
    if isinstance(weights, NVFP4Tensor):
        if weights.data_t is not None and weights.scale_inv_t is not None:
            return weights
        return nvfp4_columnwise(weights, impl=impl)
    if isinstance(weights, Float8Tensor):
        if weights.data_t is not None:
            return weights
        return fp8_columnwise(weights)
    raise TypeError(f"weights: must be an NVFP4Tensor, a Float8Tensor or a list of them, "
                    f"got {type(weights).__name__}")


def _packed_table(shapes, nvfp4):
    offsets = np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in shapes])]).astype(int)
    return ops.group_table([int(o) for o in offsets[:-1]], shapes, num_shards=1, shard_size=int(offsets[-1]),
                           nvfp4=nvfp4)


def _nvfp4_group_columnwise(ts, impl):
    if not ts:
        return []
    for t in ts:
        if tuple(t.scale_inv.shape) != formats.nvfp4_scale_shape(*t.shape):
            raise ValueError(f"weights: an NVFP4Tensor of shape {t.shape} has scale_inv of shape "
                             f"{tuple(t.scale_inv.shape)} (a TP-sharded tensor whose split is not aligned to the "
                             f"scale layout): build its columnwise data per TP rank")
    table = _packed_table([t.shape for t in ts], True)
    data = jnp.concatenate([t.data.reshape(-1) for t in ts])
    scale_inv = jnp.concatenate([t.scale_inv.reshape(-1) for t in ts])
    data_t, scale_inv_t = ops.nvfp4_group_columnwise(data, scale_inv, table=table, impl=impl)
    return [dataclasses.replace(t, data_t=d, scale_inv_t=s) for t, d, s in zip(ts, data_t, scale_inv_t)]


def _fp8_group_columnwise(ts, impl):
    if not ts:
        return []
    for t in ts:
        if t.data.ndim != 2:
            raise ValueError(f"t.data: columnwise data needs rank 2, got shape {tuple(t.data.shape)}")
    table = _packed_table([t.data.shape for t in ts], False)
    data_t = ops.fp8_group_transpose(jnp.concatenate([t.data.reshape(-1) for t in ts]), table=table, impl=impl)
    return [dataclasses.replace(t, data_t=d) for t, d in zip(ts, data_t)]
