"""Quantize ZeRO-sharded fp32 master weights to FP8 / NVFP4 model weights (docs/numerics.md §3).

Per device, under ``shard_map`` over the data-parallel mesh axis ``axis``:

1. convert the local shard of the flat master buffer to ``compute_dtype``;
2. partial statistics of every piece the shard owns: NVFP4 tile amaxes (``ops.nvfp4_tile_amax``),
   FP8 amaxes (``ops.amax``), plus non-finite counts from the same kernel pass when asked;
3. **one** ``lax.pmax`` over ``axis`` of one packed int32 vector holding everything (fp32 amaxes are
   non-negative, so their bit patterns order as int32 do; each shard writes its non-finite counts into
   its own row of a ``[num_shards, num_params]`` block that is 0 elsewhere, so the max is the matrix);
4. scales from the reduced statistics, identical on every rank;
5. partial cast of the owned pieces into a fixed-size local byte chunk;
6. ``lax.all_gather`` of that chunk (quantized bytes only) and assembly of every weight.

Steps 2 and 5 are the grouped ops (``ops.nvfp4_group_tile_amax`` / ``nvfp4_group_cast``,
``ops.fp8_group_amax`` / ``fp8_group_cast``): one call for the whole group whose shard index is
``lax.axis_index(axis)``, a device value, so every shard runs the same program with no branch on
the shard (XLA:GPU would run a ``lax.switch`` with a device-to-host copy of the branch index) and
each shard reads only its own ``shard_size`` elements. See docs/distributed.md for the byte layout
of the gathered chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxquant import formats, ops, reference
from jaxquant.layout import FlatLayout
from jaxquant.quantize import fp8_columnwise, nvfp4_columnwise
from jaxquant.tensors import Float8Tensor, NVFP4Tensor

RECIPES = ("nvfp4", "fp8")


# ----------------------------------------------------------------------------------------------
# Non-finite report
# ----------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """NaN/±inf found in the master weights (after ``compute_dtype`` conversion).

    ``counts[r, p]``: int32 number of non-finite elements of parameter ``p`` in shard ``r``, the same
    on every rank. ``names``: the parameter names (static). Call :meth:`raise_if_nonfinite` (outside
    ``jit``; it reads the counts to the host) or test :meth:`any` inside.
    """

    counts: jax.Array
    names: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def any(self) -> jax.Array:
        return jnp.any(self.counts > 0)

    def findings(self) -> list[tuple[str, int, int]]:
        """Host side: ``[(param name, shard, count), ...]`` for every non-zero count."""
        counts = np.asarray(jax.device_get(self.counts))
        return [(self.names[p] if p < len(self.names) else f"param{p}", int(r), int(counts[r, p]))
                for r, p in zip(*np.nonzero(counts))]

    def raise_if_nonfinite(self) -> None:
        """Raise ``FloatingPointError`` naming every (parameter, shard) holding NaN/±inf."""
        found = self.findings()
        if found:
            what = "; ".join(f"{name} in shard {r}: {c} element(s)" for name, r, c in found)
            raise FloatingPointError(f"non-finite (NaN or ±inf) master weights: {what}")


# ----------------------------------------------------------------------------------------------
# Static plan (per layout)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Where each piece's quantized bytes sit in its shard's gathered chunk."""

    size: int                                # bytes per shard (the same for every shard)
    entries: tuple                           # per shard: ((piece, chunk offset, byte count), ...)


def nvfp4_chunk_plan(layout: FlatLayout) -> _Chunk:
    """NVFP4: shard ``r``'s chunk is the packed bytes ``[start//2, (end+1)//2)`` of each owned piece,
    end to end in parameter order, zero padded to the largest shard's total. A piece with an odd
    start or end shares its boundary byte with the neighbouring shard's piece; only its own nibble
    is set, and the assembly ORs the two."""
    entries, size = [], 0
    for r in range(layout.num_shards):
        row, pos = [], 0
        for pc in layout.pieces(r):
            lo, hi = formats.nvfp4_byte_range(pc.start, pc.length)
            row.append((pc, pos, hi - lo))
            pos += hi - lo
        entries.append(tuple(row))
        size = max(size, pos)
    return _Chunk(size=size, entries=tuple(entries))


def gathered_bytes(layout: FlatLayout, recipe: str = "nvfp4") -> int:
    """Bytes the all-gather of :func:`quantize_master_weights` delivers to each rank.

    NVFP4: ``num_shards * chunk`` where ``chunk`` is the largest per-shard sum of owned piece byte
    counts; equals ``sum(numel) / 2`` exactly when every shard boundary inside a parameter falls on
    an even element and the shards own equally many bytes, and exceeds it by at most
    ``num_shards * (pieces per shard + 1) / 2`` bytes plus the imbalance otherwise.
    FP8: ``total_size`` (the flat buffer, alignment padding included, one byte an element).
    """
    if recipe == "nvfp4":
        return layout.num_shards * nvfp4_chunk_plan(layout).size
    if recipe == "fp8":
        return layout.total_size
    raise ValueError(f"recipe: must be one of {RECIPES}, got {recipe!r}")


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
    if recipe not in RECIPES:
        raise ValueError(f"recipe: must be one of {RECIPES}, got {recipe!r}")
    if compute_dtype is not None and jnp.dtype(compute_dtype) not in ops.INPUT_DTYPES:
        raise TypeError(f"compute_dtype: must be None, float32 or bfloat16, got {compute_dtype}")
    for p, shape in enumerate(layout.shapes):
        where = f"layout.shapes[{p}] ({layout.names[p]})"
        if recipe == "nvfp4":
            if len(shape) != 2:
                raise ValueError(f"{where}: NVFP4 weights must have rank 2, got shape {shape}")
            ops.check_nvfp4_shape(shape[0], shape[1], name=where)
        elif columnwise and len(shape) != 2:
            raise ValueError(f"{where}: columnwise=True needs rank-2 weights, got shape {shape}")


def _check_flat(name, x, length, what):
    """``x`` is a float32/bfloat16 array of shape (length,); ``what`` says where length comes from."""
    ops._check_input(name, x)
    if tuple(x.shape) != (length,):
        raise ValueError(f"{name}: shape must be ({length},) ({what}), got {tuple(x.shape)}")


def _axis_size(axis) -> int:
    try:
        return int(jax.lax.axis_size(axis))
    except NameError as e:
        raise ValueError(f"axis: {axis!r} is not a mesh axis bound here (call this inside "
                         f"shard_map over a mesh with that axis): {e}") from None


# ----------------------------------------------------------------------------------------------
# Per-device form
# ----------------------------------------------------------------------------------------------


def quantize_master_weights_local(shard, layout: FlatLayout, *, axis: str = "fsdp", recipe: str = "nvfp4",
                                  compute_dtype=jnp.bfloat16, columnwise: bool = False,
                                  manual_post_all_gather_processing: bool = True, check_finite: bool = False,
                                  fp8_dtype=jnp.float8_e4m3fn, amax_epsilon: float = 0.0,
                                  force_pow_2_scales: bool = False, impl: str = "auto"):
    """The per-device body of :func:`quantize_master_weights`, for use inside your own ``shard_map``.

    ``shard``: this device's ``[layout.shard_size]`` slice of the flat master buffer (shard index =
    ``lax.axis_index(axis)``). Returns the gathered weights (identical, i.e. invariant, on every rank of
    ``axis``), and with ``check_finite`` also a :class:`NonFiniteReport`.
    Collectives over ``axis``: one ``pmax`` (int32, all statistics of the group) and one
    ``all_gather`` (uint8, quantized bytes only).
    """
    _check_options(layout, recipe, compute_dtype, columnwise)
    _check_flat("shard", shard, layout.shard_size, "layout.shard_size")
    ops._check_impl(impl)
    size = _axis_size(axis)
    if size != layout.num_shards:
        raise ValueError(f"layout: has {layout.num_shards} shards but mesh axis {axis!r} has {size} devices")
    x = shard if compute_dtype is None else formats.to_compute_dtype(shard, compute_dtype)
    if layout.num_params == 0:
        weights = []
    elif recipe == "nvfp4":
        weights, counts = _nvfp4_local(x, layout, axis, check_finite, impl)
    else:
        weights, counts = _fp8_local(x, layout, axis, check_finite, jnp.dtype(fp8_dtype),
                                     float(amax_epsilon), bool(force_pow_2_scales), impl)
    if columnwise and not manual_post_all_gather_processing:
        weights = post_all_gather_processing(weights, impl=impl)
    if not check_finite:
        return weights
    if layout.num_params == 0:
        counts = jnp.zeros((layout.num_shards, 0), jnp.int32)
    return weights, NonFiniteReport(counts=counts, names=layout.names)


@functools.lru_cache(maxsize=128)
def _group_plan(layout: FlatLayout, nvfp4: bool):
    """Static tables of the grouped ops: the parameter table and, for NVFP4, where each shard's
    chunk starts in the group's param-byte space (its first piece's first byte)."""
    table = ops.group_table(layout.param_offsets, layout.shapes, num_shards=layout.num_shards,
                            shard_size=layout.shard_size, nvfp4=nvfp4)
    if not nvfp4:
        return table, None, None
    plan = nvfp4_chunk_plan(layout)
    chunk_lo = tuple(int(table[row[0][0].param, 5]) + row[0][0].start // 2 if row else 0 for row in plan.entries)
    return table, plan, chunk_lo


def _reduce_stats(stats_f32, counts, layout, axis, check_finite):
    """ONE pmax over ``axis`` of one int32 vector: fp32 statistics (non-negative, so their bits order
    as int32 do) and, with ``check_finite``, a [S, P] block in which each shard fills its own row."""
    parts = [_f32_bits(stats_f32)]
    if check_finite:
        block = jnp.zeros((layout.num_shards, layout.num_params), jnp.int32)
        block = jax.lax.dynamic_update_slice(block, counts.astype(jnp.int32)[None], (jax.lax.axis_index(axis), 0))
        parts.append(block.reshape(-1))
    packed = jax.lax.pmax(jnp.concatenate(parts), axis)        # the one all-reduce of the group
    n = stats_f32.shape[0]
    counts = packed[n:].reshape(layout.num_shards, layout.num_params) if check_finite else None
    return _bits_f32(packed[:n]), counts


def _nvfp4_local(x, layout, axis, check_finite, impl):
    S = layout.num_shards
    dims = [tuple(s) for s in layout.shapes]
    table, plan, chunk_lo = _group_plan(layout, True)
    r = jax.lax.axis_index(axis)
    tiles, counts = ops.nvfp4_group_tile_amax(x, r, table=table, num_shards=S, return_nonfinite=True, impl=impl)
    tiles, counts = _reduce_stats(tiles, counts, layout, axis, check_finite)
    tile_amax, amax, scale_inv, enc = [], [], [], []
    for p, (m, k) in enumerate(dims):
        base, t = int(table[p, 4]), (m // formats.TILE) * (k // formats.TILE)
        tile_amax.append(tiles[base:base + t].reshape(m // formats.TILE, k // formats.TILE))
        amax.append(jnp.max(tile_amax[p]).reshape(1))          # as quantize_nvfp4
        scale_inv.append(ops.nvfp4_scale(tile_amax[p], amax[p], rows=m, cols=k, impl=impl))
        enc.append(reference.tile_encode(scale_inv[p], amax[p], m, k).reshape(-1))
    chunk = ops.nvfp4_group_cast(x, r, jnp.concatenate(enc), table=table, num_shards=S, chunk_lo=chunk_lo,
                                 chunk_size=plan.size, impl=impl)
    gathered = jax.lax.all_gather(chunk, axis, tiled=True, to="invarying")   # uint8 [S * chunk]

    # Assemble each weight from its pieces; a byte split between two shards is the OR of both.
    where = {}
    for r_, row in enumerate(plan.entries):
        for pc, off, nbytes in row:
            where[(r_, pc.param)] = (pc, r_ * plan.size + off, nbytes)
    weights = []
    for p, (m, k) in enumerate(dims):
        segs = []
        for r_ in layout.owners(p):
            pc, off, nbytes = where[(r_, p)]
            blk = gathered[off:off + nbytes]
            if segs and pc.start % 2:
                last = segs.pop()
                segs += [last[:-1], last[-1:] | blk[:1], blk[1:]]
            else:
                segs.append(blk)
        data = jnp.concatenate(segs).reshape(m, k // 2)
        weights.append(NVFP4Tensor(data=data, scale_inv=scale_inv[p], amax=amax[p], shape=(m, k)))
    return weights, counts


def _fp8_local(x, layout, axis, check_finite, dtype, amax_epsilon, force_pow_2_scales, impl):
    S = layout.num_shards
    fmax = formats.fp8_max(dtype)
    table, _, _ = _group_plan(layout, False)
    r = jax.lax.axis_index(axis)
    amax, counts = ops.fp8_group_amax(x, r, table=table, num_shards=S, return_nonfinite=True, impl=impl)
    amax, counts = _reduce_stats(amax, counts, layout, axis, check_finite)
    scale, scale_inv = formats.fp8_scale_from_amax(amax, fmax, amax_epsilon, force_pow_2_scales)
    chunk = ops.fp8_group_cast(x, r, scale, table=table, num_shards=S, dtype=dtype, impl=impl)
    chunk = jax.lax.bitcast_convert_type(chunk, jnp.uint8)
    gathered = jax.lax.all_gather(chunk, axis, tiled=True, to="invarying")   # uint8 [total_size]
    weights = []
    for p, (o, numel, shape) in enumerate(zip(layout.param_offsets, layout.numels, layout.shapes)):
        data = jax.lax.bitcast_convert_type(gathered[o:o + numel], dtype).reshape(shape)
        weights.append(Float8Tensor(data=data, scale_inv=scale_inv[p], amax=amax[p]))
    return weights, counts


# ----------------------------------------------------------------------------------------------
# Global form
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def _build(layout, mesh, axis, options):
    body = functools.partial(quantize_master_weights_local, layout=layout, axis=axis, **dict(options))
    # The results are replicated over ``axis`` (pmax / all_gather), which check_vma verifies.
    smap = jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P())
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))

    def run(master_flat):
        if explicit:   # explicit-sharding meshes do not reshard shard_map inputs implicitly
            master_flat = jax.reshard(master_flat, NamedSharding(mesh, P(axis)))
        return smap(master_flat)

    return jax.jit(run)


def quantize_master_weights(master_flat, layout: FlatLayout, *, mesh, axis: str = "fsdp",
                            recipe: str = "nvfp4", compute_dtype=jnp.bfloat16, columnwise: bool = False,
                            manual_post_all_gather_processing: bool = True, check_finite: bool = False,
                            fp8_dtype=jnp.float8_e4m3fn, amax_epsilon: float = 0.0,
                            force_pow_2_scales: bool = False, impl: str = "auto"):
    """Quantize a ZeRO-sharded flat fp32 master buffer into full (gathered) FP8 / NVFP4 weights.

    ``master_flat``: global ``[layout.total_size]`` array, sharded ``P(axis)`` on ``mesh`` (replicated
    over the other mesh axes). Returns the list of ``NVFP4Tensor`` / ``Float8Tensor`` in the layout's
    order, replicated on every device, bit-identical to ``quantize_nvfp4`` / ``quantize_fp8`` of each
    whole weight after ``compute_dtype`` conversion; with ``check_finite=True`` returns
    ``(weights, NonFiniteReport)``.

    ``columnwise``: also produce the columnwise data (``data_t`` and, for NVFP4, ``scale_inv_t``); with
    ``manual_post_all_gather_processing=True`` (default) it is left to the caller, who runs
    :func:`post_all_gather_processing` when it suits (e.g. overlapped with the next layer's compute).
    ``fp8_dtype``, ``amax_epsilon``, ``force_pow_2_scales``: FP8 options (docs/numerics.md §1).
    Usable eagerly or inside ``jax.jit`` (donate the previous step's weights to reuse their buffers).
    """
    _check_options(layout, recipe, compute_dtype, columnwise)
    ops._check_impl(impl)
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh: must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh (axes {mesh.axis_names})")
    if mesh.shape[axis] != layout.num_shards:
        raise ValueError(f"layout: has {layout.num_shards} shards but mesh axis {axis!r} has "
                         f"{mesh.shape[axis]} devices")
    _check_flat("master_flat", master_flat, layout.total_size, "layout.total_size = num_shards * shard_size")
    options = (("recipe", recipe),
               ("compute_dtype", None if compute_dtype is None else jnp.dtype(compute_dtype)),
               ("columnwise", bool(columnwise)),
               ("manual_post_all_gather_processing", bool(manual_post_all_gather_processing)),
               ("check_finite", bool(check_finite)), ("fp8_dtype", jnp.dtype(fp8_dtype)),
               ("amax_epsilon", float(amax_epsilon)), ("force_pow_2_scales", bool(force_pow_2_scales)),
               ("impl", impl))
    return _build(layout, mesh, axis, options)(master_flat)


def master_sharding(mesh, axis: str = "fsdp") -> NamedSharding:
    """The sharding ``quantize_master_weights`` expects for ``master_flat``: ``P(axis)``."""
    return NamedSharding(mesh, P(axis))


# ----------------------------------------------------------------------------------------------
# Post all-gather processing
# ----------------------------------------------------------------------------------------------


def post_all_gather_processing(weights, *, impl: str = "auto"):
    """Build the columnwise data from the gathered rowwise data.

    NVFP4: ``data_t`` (``ops.nvfp4_transpose``) and ``scale_inv_t`` (``ops.nvfp4_scale_transpose``);
    FP8: ``data_t``, the byte transpose. Takes one tensor or a list/tuple of them and returns the same
    structure; tensors that already have columnwise data are returned unchanged.
    """
    if isinstance(weights, (list, tuple)):
        return type(weights)(post_all_gather_processing(w, impl=impl) for w in weights)
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
