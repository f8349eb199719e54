"""Per-parameter arrays cut out of a group's packed arrays: in one custom call, or deferred.

The grouped ops produce every parameter's bytes in a few packed vectors; the caller wants one
array per parameter. Slicing them in JAX costs one XLA copy kernel per result (three per NVFP4
parameter), which dominates a step over hundreds of small parameters; ``split`` writes every
result in one call (on GPU one launch per 1,000 copy segments, docs/distributed.md).
``GatheredWeights`` holds the packed vectors and cuts a parameter out only when it is read (static
slices inside the consumer's ``jit``, which XLA may fuse into the readers), so no split pass runs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import _ffi, ops, reference
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatheredWeights:
    """A group's quantized weights as the all-gather left them: the gathered buffers plus the packed
    scales and amaxes, with the per-parameter split deferred to the reader.

    ``quantize_master_weights(..., split=False)`` returns it. ``weights[i]`` (or ``.tensors()``) cuts
    parameter ``i``'s ``NVFP4Tensor`` / ``Float8Tensor`` out with static slices, bit-identical to the
    split result. Read inside the ``jit`` that consumes the weights, the slices are ordinary XLA ops
    that XLA may fuse into their readers, instead of one split custom call over every weight's bytes
    before anything runs: the same footing as a plain bf16 gather whose caller slices its weights out
    of the gathered buffer. Read outside ``jit``, each access copies. ``len(weights)`` is the number of
    parameters; ``weights[i]`` raises ``IndexError`` outside ``[-len, len)``.

    Attributes:
      sources: the arrays the weights are cut from.
      data_t, scale_inv_t: per-parameter columnwise arrays (already one per weight), or None (default).
      recipe: "nvfp4" (default) or "fp8" (static).
      results: per parameter, the ``(shape, segments)`` of its data, scale_inv and amax, as ``split``
        takes them (static).
      shapes: each weight's logical shape (static).
    """

    sources: tuple
    data_t: tuple | None = None
    scale_inv_t: tuple | None = None
    recipe: str = dataclasses.field(default="nvfp4", metadata=dict(static=True))
    results: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    shapes: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, p: int):
        if not -len(self) <= p < len(self):
            raise IndexError(f"p: parameter {p} of a group of {len(self)}")
        p %= len(self)
        return self.tensor(p, reference.group_split(self.sources, self.results[p]))   # static slices

    def tensors(self) -> list:
        """Every weight cut out with static slices.

        Returns:
          The list of ``NVFP4Tensor`` / ``Float8Tensor`` in the layout's order (what ``split=True``
          returns).
        """
        return [self[p] for p in range(len(self))]

    def tensor(self, p: int, arrays):
        """Weight ``p`` from its three cut arrays.

        Args:
          p: the parameter index.
          arrays: its ``(data, scale_inv, amax)``.

        Returns:
          The ``NVFP4Tensor`` / ``Float8Tensor``, with its columnwise arrays where the group has them.
        """
        data, scale_inv, amax = arrays
        data_t = None if self.data_t is None else self.data_t[p]
        if self.recipe == "nvfp4":
            return NVFP4Tensor(data=data, scale_inv=scale_inv, amax=amax, data_t=data_t,
                               scale_inv_t=None if self.scale_inv_t is None else self.scale_inv_t[p],
                               shape=tuple(self.shapes[p]))
        return Float8Tensor(data=data, scale_inv=scale_inv, amax=amax, data_t=data_t)

    def materialize(self, *, stage_of_source=None, impl: str = "auto") -> list:
        """Every weight as its own arrays, written by one :func:`split` call (or one per stage).

        Args:
          stage_of_source: as in :func:`split` (default None: one call).
          impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

        Returns:
          The list of ``NVFP4Tensor`` / ``Float8Tensor`` in the layout's order, the same bytes as
          :meth:`tensors`.
        """
        pieces = [result for per_param in self.results for result in per_param]
        arrays = split(self.sources, pieces, stage_of_source=stage_of_source, impl=impl)
        return [self.tensor(p, arrays[3 * p:3 * p + 3]) for p in range(len(self))]


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
