"""Chunk geometry: boxes, intersections and the coverage rule (chunks tile the tensor exactly)."""

from __future__ import annotations

import math

import numpy as np

from jaxquant.checkpoint.metadata import TensorEntry


def index_to_box(index, shape) -> tuple[tuple, tuple]:
    """A tuple of slices (a shard's ``index``) -> (starts, stops)."""
    lo, hi = [], []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        lo.append(start)
        hi.append(max(start, stop))
    return tuple(lo), tuple(hi)


def intersect(a_lo, a_hi, b_lo, b_hi):
    """The intersection box of two boxes, or None when empty (0-d boxes always intersect)."""
    lo = tuple(max(x, y) for x, y in zip(a_lo, b_lo))
    hi = tuple(min(x, y) for x, y in zip(a_hi, b_hi))
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)


def rel_slices(lo, hi, origin) -> tuple:
    return tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, origin))


def volume(sizes) -> int:
    return math.prod(int(s) for s in sizes)


def coverage_problems(e: TensorEntry, limit: int = 5) -> list[str]:
    """Why the chunks of ``e`` do not tile its global shape exactly (empty list when they do)."""
    problems, nd = [], len(e.size)
    for c in e.chunks:
        if len(c.offsets) != nd or len(c.sizes) != nd:
            problems.append(f"chunk at offsets {c.offsets} has rank {len(c.sizes)}, tensor has rank {nd}")
        elif any(o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, e.size)):
            problems.append(f"chunk offsets {c.offsets} sizes {c.sizes} lie outside the tensor {e.size}")
    if problems:
        return problems[:limit]
    chunks = [c for c in e.chunks if volume(c.sizes) > 0]
    if chunks:
        lo = np.array([c.offsets for c in chunks], np.int64).reshape(len(chunks), nd)
        hi = lo + np.array([c.sizes for c in chunks], np.int64).reshape(len(chunks), nd)
        for i in range(len(chunks) - 1):
            hit = np.all(np.maximum(lo[i], lo[i + 1:]) < np.minimum(hi[i], hi[i + 1:]), axis=1)
            for j in np.nonzero(hit)[0][: limit - len(problems)]:
                o = chunks[i + 1 + j]
                problems.append(f"overlap: chunk at offsets {chunks[i].offsets} sizes {chunks[i].sizes} and "
                                f"chunk at offsets {o.offsets} sizes {o.sizes}")
            if len(problems) >= limit:
                return problems
    if not problems:
        covered, total = sum(volume(c.sizes) for c in chunks), volume(e.size)
        if covered != total:
            problems.append(f"gap: chunks cover {covered} of {total} elements ({total - covered} missing)")
    return problems
