"""The static parameter table of a ZeRO group, shared by the grouped ops of every backend.

One int64 row per parameter; the fields and their order are defined once, in
``csrc/jaxquant/group_table.h`` (``JQ_GROUP_TABLE_FIELDS``). ``GROUP_TABLE_FIELDS`` below must list
the same names in the same order: ``tests/test_group_ops.py`` checks it against the compiled
module's ``group_table_fields()``. Code reads a column by name (``FIELD["rows"]`` or
``GroupRow.rows``), never by number.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import formats
from jaxquant.primitives.formats import TILE, check_nvfp4_shape

GROUP_TABLE_FIELDS = ("offset", "numel", "rows", "cols", "tile_base", "byte_base", "scale_base",
                      "scale_t_base", "block_base")
FIELD = {name: i for i, name in enumerate(GROUP_TABLE_FIELDS)}
GroupRow = collections.namedtuple("GroupRow", GROUP_TABLE_FIELDS)

TRANSPOSE_BLOCK = 64  # the grouped transposes work on 64 x 64-element blocks


@dataclasses.dataclass(frozen=True)
class GroupSizes:
    """Lengths of the group's packed vectors."""

    num_tiles: int        # NVFP4 16x16 tiles
    data_bytes: int       # NVFP4 packed bytes (sum of numel / 2)
    scale_bytes: int      # padded rowwise scales, all parameters
    scale_t_bytes: int    # padded columnwise scales, all parameters
    num_blocks: int       # 64x64 blocks of the grouped transposes


def _blocks(rows: int, cols: int) -> int:
    return -(-rows // TRANSPOSE_BLOCK) * -(-cols // TRANSPOSE_BLOCK)


def build(offsets, shapes, *, num_shards: int, shard_size: int, nvfp4: bool) -> np.ndarray:
    """The int64 [P, len(GROUP_TABLE_FIELDS)] table of parameters at ``offsets`` with ``shapes`` in a
    flat buffer of ``num_shards * shard_size`` elements (rank-1 / scalar parameters: rows = numel,
    cols = 1). Raises ValueError naming the parameter when they overlap, leave the buffer or (NVFP4)
    break the 16x16 grid."""
    if len(offsets) != len(shapes):
        raise ValueError(f"offsets: {len(offsets)} offsets for {len(shapes)} shapes")
    if not isinstance(num_shards, (int, np.integer)) or num_shards <= 0:
        raise ValueError(f"num_shards: must be a positive int, got {num_shards!r}")
    total = num_shards * shard_size
    out, end = [], 0
    tile = byte = scale = scale_t = block = 0
    for p, (off, shape) in enumerate(zip(offsets, shapes)):
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        if nvfp4:
            if len(shape) != 2:
                raise ValueError(f"shapes[{p}]: NVFP4 weights must have rank 2, got {shape}")
            check_nvfp4_shape(*shape, name=f"shapes[{p}]")
        rows, cols = shape if len(shape) == 2 else (numel, 1)
        if off < end:
            raise ValueError(f"offsets[{p}]: parameters must not overlap and must be in order "
                             f"(offset {off} < end of the previous parameter {end})")
        if off + numel > total:
            raise ValueError(f"offsets[{p}]: parameter [{off}, {off + numel}) lies outside the flat buffer "
                             f"of {num_shards} x {shard_size} elements")
        out.append(GroupRow(offset=off, numel=numel, rows=rows, cols=cols, tile_base=tile, byte_base=byte,
                            scale_base=scale, scale_t_base=scale_t, block_base=block))
        end = off + numel
        block += _blocks(rows, cols) if numel else 0
        if nvfp4:
            tile += numel // (TILE * TILE)
            byte += numel // 2
            scale += math.prod(formats.nvfp4_scale_shape(rows, cols))
            scale_t += math.prod(formats.nvfp4_scale_shape(cols, rows))
    return np.asarray(out, np.int64).reshape(-1, len(GROUP_TABLE_FIELDS))


def rows_of(table: np.ndarray) -> tuple:
    """The table as a tuple of ``GroupRow`` of Python ints (static, for the references)."""
    return tuple(GroupRow(*(int(c) for c in row)) for row in np.asarray(table))


def sizes(table: np.ndarray) -> GroupSizes:
    rows = rows_of(table)
    if not rows:
        return GroupSizes(0, 0, 0, 0, 0)
    last = rows[-1]
    nvfp4 = last.rows % TILE == 0 and last.cols % TILE == 0
    scale = math.prod(formats.nvfp4_scale_shape(last.rows, last.cols)) if nvfp4 else 0
    scale_t = math.prod(formats.nvfp4_scale_shape(last.cols, last.rows)) if nvfp4 else 0
    return GroupSizes(num_tiles=last.tile_base + (last.numel // (TILE * TILE) if nvfp4 else 0),
                      data_bytes=last.byte_base + (last.numel // 2 if nvfp4 else 0),
                      scale_bytes=last.scale_base + scale, scale_t_bytes=last.scale_t_base + scale_t,
                      num_blocks=last.block_base + (_blocks(last.rows, last.cols) if last.numel else 0))


# ----------------------------------------------------------------------------------------------
# A space held by gather pieces (csrc/jaxquant/gathered_space.h; the limits are its constants,
# which tests check against the compiled module's gathered_space_limits())
# ----------------------------------------------------------------------------------------------

MAX_GATHER_PIECES = 16
MAX_GATHER_SHARDS = 128


def chunk_segments(r: int, first: int, count: int, bounds, src0: int = 0) -> list:
    """Segments ``(source, offset, count)`` of chunk offsets ``[first, first + count)`` of shard ``r``:
    source ``src0 + j`` is gather piece j (``[S * length_j]``, shard r's part at ``r * length_j``)."""
    segs = []
    for j, (start, length) in enumerate(bounds):
        a, b = max(first, start), min(first + count, start + length)
        if a < b:
            segs.append((src0 + j, r * length + a - start, b - a))
    return segs


@dataclasses.dataclass(frozen=True)
class GatheredSpace:
    """A byte space (the NVFP4 param-byte space, the FP8 flat buffer) that arrives as all-gather
    pieces instead of one buffer, so that the grouped transposes read it where it lies.

    Shard ``r`` holds bytes ``[lo[r], lo[r + 1])`` of the space (the last shard's part ends at
    ``size``) from offset 0 of its ``chunk``-byte chunk; gather piece j holds chunk offsets
    ``bounds[j] = (start, length)`` of every shard, shard r's at ``r * length``. The pieces are equal
    steps of the chunk (``distributed.gather_piece_bounds``); :meth:`whole` is one plain buffer.
    """

    size: int
    chunk: int
    lo: tuple
    bounds: tuple

    @classmethod
    def whole(cls, size: int) -> "GatheredSpace":
        return cls(size=int(size), chunk=int(size), lo=(0,), bounds=((0, int(size)),))

    def __post_init__(self):
        step = self.step
        want = tuple((s, min(step, self.chunk - s)) for s in range(0, self.chunk, step)) or ((0, 0),)
        if tuple(map(tuple, self.bounds)) != want:
            raise ValueError(f"space: bounds must be the chunk of {self.chunk} bytes in equal steps, got {self.bounds}")
        if not self.lo:
            raise ValueError("space: needs at least one shard")
        if self.lo[0] != 0 or any(not 0 <= e - a <= self.chunk for a, e in self.parts()):
            raise ValueError(f"space: shard r's part [lo[r], lo[r+1]) must follow the previous one from 0 and fit "
                             f"the chunk of {self.chunk} bytes, got lo={self.lo}, size {self.size}")

    @property
    def step(self) -> int:
        return max(int(self.bounds[0][1]), 1)

    @property
    def readable_in_place(self) -> bool:
        """Whether the custom calls can read it as pieces (at most MAX_GATHER_SHARDS shards and
        MAX_GATHER_PIECES pieces); callers assemble it (:meth:`assemble`) otherwise."""
        return len(self.lo) <= MAX_GATHER_SHARDS and len(self.bounds) <= MAX_GATHER_PIECES

    @property
    def num_shards(self) -> int:
        return len(self.lo)

    def piece_shapes(self) -> list:
        return [(self.num_shards * length,) for _, length in self.bounds]

    def attr(self) -> np.ndarray:
        """The custom calls' ``space`` attribute: {size, chunk, step, lo[0], ..., lo[S-1]}."""
        return np.asarray([self.size, self.chunk, self.step, *self.lo], np.int64)

    def parts(self) -> list:
        """Each shard's part ``(start, end)`` of the space."""
        return list(zip(self.lo, list(self.lo[1:]) + [self.size]))

    def segments(self) -> list:
        """``(piece, offset, count)`` of the whole space in order."""
        return [seg for r, (a, e) in enumerate(self.parts()) for seg in chunk_segments(r, 0, e - a, self.bounds)]

    def assemble(self, pieces):
        """The space as one array (the reference path; the custom calls read the pieces in place)."""
        parts = [pieces[j][at:at + n] for j, at, n in self.segments()]
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), pieces[0].dtype)
