"""Per-parameter weights cut out of a group's packed arrays, deferred to the reader.

The grouped ops produce every parameter's bytes in a few packed vectors; the caller wants one
array per parameter. Slicing them in JAX costs one XLA copy kernel per result (three per NVFP4
parameter), which dominates a step over hundreds of small parameters; ``ops.group_split`` writes every
result in one call (docs/distributed.md).
``GatheredWeights`` holds the packed vectors and cuts a parameter out only when it is read (static
slices inside the consumer's ``jit``, which XLA may fuse into the readers), so no split pass runs.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxquant.primitives import reference
from jaxquant.primitives.ops import group_split
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
        """Every weight as its own arrays, written by one ``ops.group_split`` call (or one per stage).

        Args:
          stage_of_source: as in ``ops.group_split`` (default None: one call).
          impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

        Returns:
          The list of ``NVFP4Tensor`` / ``Float8Tensor`` in the layout's order, the same bytes as
          :meth:`tensors`.
        """
        pieces = [result for per_param in self.results for result in per_param]
        arrays = group_split(self.sources, pieces, stage_of_source=stage_of_source, impl=impl)
        return [self.tensor(p, arrays[3 * p:3 * p + 3]) for p in range(len(self))]
