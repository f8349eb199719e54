"""Per-parameter arrays cut out of a group's packed arrays in one custom call.

The grouped ops produce every parameter's bytes in a few packed vectors; the caller wants one
array per parameter. Slicing them in JAX costs one XLA copy kernel per result (three per NVFP4
parameter), which dominates a step over hundreds of small parameters; ``split`` writes every
result in one call (on GPU one launch per 1,000 copy segments, docs/distributed.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import _ffi, ops, reference
def split(sources, pieces, *, stage_of_source=None, impl: str = "auto") -> list:
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
    ops._check_impl(impl)
    sources = list(sources)
    if stage_of_source is not None and len(stage_of_source) != len(sources):
        raise ValueError(f"stage_of_source: one stage per source ({len(sources)}), got {len(stage_of_source)}")
    flats = [s.reshape(-1) for s in sources]
    outs, plan = [], []
    for i, (shape, segments) in enumerate(pieces):
        shape = tuple(int(d) for d in shape)
        dtypes = {jnp.dtype(flats[src].dtype) for src, _, _ in segments}
        if len(dtypes) != 1:
            raise ValueError(f"pieces[{i}]: its segments must come from sources of one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        if sum(int(n) for _, _, n in segments) != math.prod(shape):
            raise ValueError(f"pieces[{i}]: segments hold {sum(int(n) for _, _, n in segments)} elements, shape {shape} "
                             f"needs {math.prod(shape)}")
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
        return _ffi.call("jq_group_split", outs, *[srcs[j] for j in used], *results, plan=words, partial=partial,
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

    return list(ops._dispatch(impl, custom, ref, *flats))
