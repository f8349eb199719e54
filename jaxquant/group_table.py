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

import numpy as np

from jaxquant import formats
from jaxquant.formats import TILE

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
    from jaxquant.ops import check_nvfp4_shape   # the shared shape rule and its message

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
