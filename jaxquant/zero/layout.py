"""ZeRO-style flat layout of a parameter group (docs/numerics.md §3).

A :class:`FlatLayout` lays the row-major elements of an ordered list of parameters end to end in
one flat buffer (parameter ``p`` starts at element ``param_offsets[p]``, optionally after alignment
padding) and cuts the buffer into ``num_shards`` equal contiguous shards: shard ``r`` owns flat
elements ``[r * shard_size, (r + 1) * shard_size)``.

Everything here is static Python ints: a layout is hashable and can be closed over or passed as a
static argument to ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _as_int(name: str, v, *, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: must be an int, got {type(v).__name__} {v!r}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {v}")
    return v


def _as_shape(name: str, s) -> tuple[int, ...]:
    if isinstance(s, (int, np.integer)):
        s = (s,)
    try:
        dims = tuple(s)
    except TypeError:
        raise TypeError(f"{name}: must be a tuple of ints, got {s!r}") from None
    return tuple(_as_int(f"{name}[{i}]", d) for i, d in enumerate(dims))


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` that shard ``shard`` owns.

    ``start``/``length``: the element range ``[start, start + length)`` of the flattened parameter;
    ``local_offset``: where that range begins inside the shard (``0 <= local_offset < shard_size``).
    """

    shard: int
    param: int
    start: int
    length: int
    local_offset: int

    @property
    def end(self) -> int:
        return self.start + self.length


TP_SPLITS = {"col": 0, "row": 1}   # a TP split's public name -> the dimension of ``[out, in]`` it cuts


def _tp_dims(tp_dims):
    """``tp_dims`` with the names "col"/"row" replaced by their dimensions 0/1 (other entries as given)."""
    if tp_dims is None or isinstance(tp_dims, (str, bytes)) or not hasattr(tp_dims, "__iter__"):
        return tp_dims
    return [TP_SPLITS.get(d, d) if isinstance(d, str) else d for d in tp_dims]


class FlatLayout:
    """Parameters laid end to end in one flat buffer, cut into ``num_shards`` equal shards.

    ``FlatLayout(shapes, num_shards, align=1)`` puts parameter ``p`` at the first multiple of
    ``align`` at or after the end of parameter ``p - 1`` and pads the total to a multiple of
    ``num_shards``. :meth:`from_param_offsets` takes explicit offsets, :meth:`from_start_offsets`
    TransformerEngine-style per-rank start offsets. A layout is static and hashable.

    **Tensor parallelism** (docs/distributed.md, "FSDP x TP"): with ``tp_dims`` every TP rank's flat
    buffer holds its TP-local slices, laid out and ZeRO-cut as above; all TP ranks share one layout of
    the local shapes. :meth:`flatten` then returns the global master ``[tp_size, total_size]`` (even with
    ``tp_size=1``) and :meth:`unflatten` inverts it.

    Args:
      shapes: one shape (a tuple of ints, or an int) per parameter, in buffer order.
      num_shards: the number of equal shards (the FSDP / ZeRO axis size), >= 1.
      align: each parameter starts at a multiple of this many elements (default 1: no padding between
        parameters).
      names: one name per parameter, used in error messages and reports (default ``param0``, ``param1``...).
      tp_size: the tensor-parallel size (default 1).
      tp_dims: one entry per parameter, the names of ``make_train_step``'s ``param_specs``: ``"col"``
        = TP splits rows, i.e. ``out`` of a column-parallel ``[out, in]`` weight; ``"row"`` = TP splits
        columns, row-parallel; None = replicated over TP; 0 and 1 are accepted for "col" and "row".
        Default None: no TP (then ``tp_size`` must be 1).

    Raises:
      TypeError: a shape, count or size that is not an int.
      ValueError: a negative size, a ``tp_dims`` of the wrong length or value, a TP-split parameter that
        is not rank 2 or whose split dimension does not divide by ``tp_size``, or ``names`` of the wrong
        length.

    Attributes:
      shapes: the global shapes; ``local_shapes``: the TP-local ones (= ``shapes`` without TP).
      numels: elements of each parameter (TP-local).
      names, num_params, num_shards, shard_size: as named; ``total_size`` = ``num_shards * shard_size``.
      param_offsets: the first flat element of each parameter.
      align: as given (None for layouts built from explicit offsets).
      tp_size, tp_dims: as given (``tp_dims`` None without TP; stored as dimensions, 0 for "col", 1 for
        "row").
    """

    def __init__(self, shapes: Sequence[Sequence[int]], num_shards: int, align: int = 1, *,
                 names: Optional[Sequence[str]] = None, tp_size: int = 1, tp_dims: Optional[Sequence] = None):
        shapes = self._check_shapes(shapes)
        num_shards = _as_int("num_shards", num_shards, minimum=1)
        align = _as_int("align", align, minimum=1)
        tp_size = _as_int("tp_size", tp_size, minimum=1)
        tp_dims = _tp_dims(tp_dims)
        local = self._tp_local_shapes(shapes, tp_size, tp_dims)
        offsets, pos = [], 0
        for s in local:
            pos = -(-pos // align) * align
            offsets.append(pos)
            pos += math.prod(s)
        shard_size = -(-pos // num_shards)
        self._init(local, tuple(offsets), num_shards, shard_size, names)
        self.align = align
        self.shapes = shapes
        self.tp_size = tp_size
        self.tp_dims = None if tp_dims is None else tuple(None if d is None else int(d) for d in tp_dims)

    @staticmethod
    def _tp_local_shapes(shapes, tp_size, tp_dims):
        if tp_dims is None:
            if tp_size != 1:
                raise ValueError(f"tp_dims: needed when tp_size > 1 (got tp_size={tp_size}); one entry per "
                                 f"parameter: 'col' (rows split), 'row' (columns split) or None (replicated)")
            return shapes
        tp_dims = list(tp_dims)
        if len(tp_dims) != len(shapes):
            raise ValueError(f"tp_dims: expected {len(shapes)} entries (one per parameter), got {len(tp_dims)}")
        local = []
        for p, (s, d) in enumerate(zip(shapes, tp_dims)):
            if d is None:
                local.append(s)
                continue
            if isinstance(d, bool) or d not in (0, 1):
                raise ValueError(f"tp_dims[{p}]: must be 'col', 'row', None, 0 or 1, got {d!r}")
            if len(s) != 2:
                raise ValueError(f"tp_dims[{p}]: a TP-split parameter must have rank 2, got shape {s}")
            if s[d] % tp_size:
                raise ValueError(f"tp_dims[{p}]: dimension {d} of shape {s} is not divisible by tp_size={tp_size}")
            local.append(tuple(n // tp_size if i == d else n for i, n in enumerate(s)))
        return tuple(local)

    # -- construction ------------------------------------------------------------------------

    @staticmethod
    def _check_shapes(shapes) -> tuple[tuple[int, ...], ...]:
        if isinstance(shapes, (str, bytes)) or not hasattr(shapes, "__iter__"):
            raise TypeError(f"shapes: must be a sequence of shapes, got {type(shapes).__name__}")
        return tuple(_as_shape(f"shapes[{i}]", s) for i, s in enumerate(shapes))

    def _init(self, shapes, offsets, num_shards, shard_size, names):
        self.shapes = self.local_shapes = shapes
        self.tp_size, self.tp_dims = 1, None
        self.numels = tuple(math.prod(s) for s in shapes)
        self.num_params = len(shapes)
        self.num_shards = num_shards
        self.shard_size = shard_size
        self.total_size = num_shards * shard_size
        self.param_offsets = offsets
        self.align = None
        if names is None:
            names = tuple(f"param{p}" for p in range(self.num_params))
        else:
            names = tuple(str(n) for n in names)
            if len(names) != self.num_params:
                raise ValueError(f"names: expected {self.num_params} names, got {len(names)}")
        self.names = names
        end = 0
        for p, (o, m) in enumerate(zip(offsets, self.numels)):
            if o < end:
                raise ValueError(
                    f"param_offsets: parameter {p} ({names[p]}) starts at element {o}, inside the "
                    f"previous parameter, which ends at {end}; parameters must be in order and not overlap")
            end = o + m
        if end > self.total_size:
            raise ValueError(
                f"shard_size: {num_shards} shards of {shard_size} elements ({self.total_size}) do not "
                f"cover the parameters, which end at element {end}")
        self._pieces = tuple(tuple(self._compute_pieces(r)) for r in range(num_shards))

    @classmethod
    def from_param_offsets(cls, shapes: Sequence[Sequence[int]], param_offsets: Sequence[int],
                           num_shards: int, shard_size: Optional[int] = None, *,
                           names: Optional[Sequence[str]] = None) -> "FlatLayout":
        """A layout with explicit parameter offsets (any gaps, odd offsets included).

        Args:
          shapes: one shape per parameter.
          param_offsets: the first flat element of each parameter, in order, not overlapping.
          num_shards: the number of equal shards, >= 1.
          shard_size: elements per shard (default: the smallest that covers the last parameter).
          names: one name per parameter (default ``param0``, ``param1``...).

        Returns:
          The :class:`FlatLayout` (no TP; ``align`` None).

        Raises:
          ValueError: a wrong number of offsets, overlapping parameters, or shards that do not cover them.
        """
        shapes = cls._check_shapes(shapes)
        num_shards = _as_int("num_shards", num_shards, minimum=1)
        offsets = tuple(_as_int(f"param_offsets[{i}]", o) for i, o in enumerate(param_offsets))
        if len(offsets) != len(shapes):
            raise ValueError(f"param_offsets: expected {len(shapes)} offsets (one per shape), got {len(offsets)}")
        end = max((o + math.prod(s) for o, s in zip(offsets, shapes)), default=0)
        if shard_size is None:
            shard_size = -(-end // num_shards)
        shard_size = _as_int("shard_size", shard_size)
        self = cls.__new__(cls)
        self._init(shapes, offsets, num_shards, shard_size, names)
        return self

    @classmethod
    def from_start_offsets(cls, shapes: Sequence[Sequence[int]], start_offsets: Sequence[Sequence],
                           lengths: Sequence[Sequence[int]], *, shard_size: Optional[int] = None,
                           names: Optional[Sequence[str]] = None) -> "FlatLayout":
        """A layout from the per-rank arguments TransformerEngine's ``quantize_master_weights`` takes.

        The per-rank arguments do not say where padding sits inside a shard, so this convention is
        used: each rank's pieces lie end to end from the start of its shard in parameter order, except
        that a last piece continued on the next rank ends the shard (padding goes just before it, or
        at the end of the shard). Which rank owns which elements, all quantization depends on, is
        exactly as given.

        Args:
          shapes: one shape per parameter.
          start_offsets: ``start_offsets[r][p]``, the element of flattened parameter ``p`` where rank
            ``r``'s master piece begins (TE's ``start_offsets`` on rank ``r``; ``None`` where rank ``r``
            holds nothing of ``p``). The number of ranks is ``len(start_offsets)``.
          lengths: ``lengths[r][p]``, that piece's element count (``master_weights[p].numel()`` on rank
            ``r``, 0 where it is ``None``).
          shard_size: elements per shard (default: the largest rank total).
          names: one name per parameter (default ``param0``, ``param1``...).

        Returns:
          The :class:`FlatLayout`; :meth:`te_start_offsets` gives the arguments back.

        Raises:
          ValueError: the pieces do not tile every parameter in rank order (naming the rank and the
            parameter), or the rows have the wrong length.
        """
        shapes = cls._check_shapes(shapes)
        num_params = len(shapes)
        numels = [math.prod(s) for s in shapes]
        if len(start_offsets) != len(lengths):
            raise ValueError(f"lengths: expected one row per rank ({len(start_offsets)}), got {len(lengths)}")
        num_shards = len(start_offsets)
        if num_shards < 1:
            raise ValueError("start_offsets: needs at least one rank")
        rows = []
        for r in range(num_shards):
            so, ln = list(start_offsets[r]), list(lengths[r])
            if len(so) != num_params or len(ln) != num_params:
                raise ValueError(f"start_offsets[{r}] / lengths[{r}]: expected {num_params} entries "
                                 f"(one per parameter), got {len(so)} / {len(ln)}")
            row = []
            for p in range(num_params):
                length = _as_int(f"lengths[{r}][{p}]", 0 if ln[p] is None else ln[p])
                if length == 0:
                    row.append(None)
                    continue
                if so[p] is None:
                    raise ValueError(f"start_offsets[{r}][{p}]: is None but lengths[{r}][{p}] = {length}")
                start = _as_int(f"start_offsets[{r}][{p}]", so[p])
                if start + length > numels[p]:
                    raise ValueError(
                        f"start_offsets[{r}][{p}]: elements [{start}, {start + length}) lie outside "
                        f"parameter {p} of shape {shapes[p]} ({numels[p]} elements)")
                row.append((start, length))
            rows.append(row)
        totals = [sum(x[1] for x in row if x is not None) for row in rows]
        if shard_size is None:
            shard_size = max(totals)
        shard_size = _as_int("shard_size", shard_size)
        for r, t in enumerate(totals):
            if t > shard_size:
                raise ValueError(f"lengths[{r}]: rank {r} holds {t} elements, more than shard_size={shard_size}")
        # Local position of each piece: end to end from the start of the shard.
        offsets: list[Optional[int]] = [None] * num_params
        for r, row in enumerate(rows):
            pos = 0
            owned = [p for p, x in enumerate(row) if x is not None]
            for p in owned:
                start, length = row[p]
                if p == owned[-1] and start + length < numels[p]:
                    pos = shard_size - length      # continued on the next rank: ends the shard
                if offsets[p] is None:
                    offsets[p] = r * shard_size + pos - start
                pos += length
        prev_end = 0
        for p in range(num_params):
            if offsets[p] is None:
                if numels[p]:
                    raise ValueError(f"start_offsets: no rank holds any element of parameter {p} "
                                     f"(shape {shapes[p]})")
                offsets[p] = prev_end
            if offsets[p] < 0:
                raise ValueError(f"start_offsets: parameter {p}'s first piece does not start at element 0")
            prev_end = offsets[p] + numels[p]
        try:
            layout = cls.from_param_offsets(shapes, offsets, num_shards, shard_size, names=names)
        except ValueError as e:
            raise ValueError(f"start_offsets: the pieces do not form a flat layout ({e})") from None
        for r, row in enumerate(rows):
            for p, x in enumerate(row):
                got = layout.owned_range(r, p)
                want = (0, 0) if x is None else (x[0], x[0] + x[1])
                if got[1] - got[0] != want[1] - want[0] or (x is not None and got[0] != want[0]):
                    raise ValueError(
                        f"start_offsets[{r}][{p}]: rank {r} holds elements [{want[0]}, {want[1]}) of "
                        f"parameter {p}, but pieces laid end to end in shards of {shard_size} elements "
                        f"put [{got[0]}, {got[1]}) there; the pieces must tile each parameter in rank order")
        return layout

    # -- queries -----------------------------------------------------------------------------

    def _compute_pieces(self, r: int):
        lo, hi = r * self.shard_size, (r + 1) * self.shard_size
        for p, (o, m) in enumerate(zip(self.param_offsets, self.numels)):
            a, b = max(lo, o), min(hi, o + m)
            if a < b:
                yield Piece(shard=r, param=p, start=a - o, length=b - a, local_offset=a - lo)

    def _check_shard(self, shard: int) -> int:
        shard = _as_int("shard", shard)
        if shard >= self.num_shards:
            raise ValueError(f"shard: must be < num_shards={self.num_shards}, got {shard}")
        return shard

    def _check_param(self, param: int) -> int:
        param = _as_int("param", param)
        if param >= self.num_params:
            raise ValueError(f"param: must be < num_params={self.num_params}, got {param}")
        return param

    def pieces(self, shard: int) -> tuple[Piece, ...]:
        """The non-empty pieces shard ``shard`` owns, in parameter (= local) order."""
        return self._pieces[self._check_shard(shard)]

    def piece(self, shard: int, param: int) -> Optional[Piece]:
        param = self._check_param(param)
        for pc in self.pieces(shard):
            if pc.param == param:
                return pc
        return None

    def owned_range(self, shard: int, param: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of flattened parameter ``param`` that shard ``shard`` owns.

        Empty (``start == end``) when it owns none; ``start`` is then clamped into ``[0, numel]``.
        """
        shard, param = self._check_shard(shard), self._check_param(param)
        pc = self.piece(shard, param)
        if pc is not None:
            return pc.start, pc.end
        s = min(max(shard * self.shard_size - self.param_offsets[param], 0), self.numels[param])
        return s, s

    def local_range(self, shard: int, param: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of shard ``shard``'s local buffer that hold parameter ``param``."""
        pc = self.piece(shard, param)
        if pc is None:
            return 0, 0
        return pc.local_offset, pc.local_offset + pc.length

    def owners(self, param: int) -> tuple[int, ...]:
        """The shards owning part of ``param``, in order."""
        param = self._check_param(param)
        return tuple(r for r in range(self.num_shards) if self.piece(r, param) is not None)

    def te_start_offsets(self, shard: int) -> tuple[list[Optional[int]], list[int]]:
        """(start_offsets, lengths) of rank ``shard`` as TransformerEngine takes them (see
        :meth:`from_start_offsets`)."""
        starts, lengths = [], []
        for p in range(self.num_params):
            pc = self.piece(shard, p)
            starts.append(None if pc is None else pc.start)
            lengths.append(0 if pc is None else pc.length)
        return starts, lengths

    # -- data movement -----------------------------------------------------------------------

    def tp_slice(self, array, param: int, tp_rank: int):
        """TP rank ``tp_rank``'s slice of the whole parameter ``array`` (the whole of it when the
        parameter is replicated over TP)."""
        d = None if self.tp_dims is None else self.tp_dims[param]
        if d is None:
            return array
        n = self.local_shapes[param][d]
        return jax.lax.slice_in_dim(jnp.asarray(array), tp_rank * n, (tp_rank + 1) * n, axis=d)

    def flatten(self, arrays: Sequence, dtype=None):
        """Lay whole parameters into the flat master buffer.

        Args:
          arrays: one whole parameter each, in order, shapes as ``shapes``.
          dtype: the buffer's dtype (default: the arrays' result type; float32 for an empty layout).

        Returns:
          ``[total_size]``, or ``[tp_size, total_size]`` (row ``j``: TP rank ``j``'s slices) for a layout
          built with ``tp_dims``; padding is 0.

        Raises:
          ValueError: the wrong number of arrays or a wrong shape.
        """
        arrays = list(arrays)
        if len(arrays) != self.num_params:
            raise ValueError(f"arrays: expected {self.num_params} arrays (one per parameter), got {len(arrays)}")
        for p, (a, s) in enumerate(zip(arrays, self.shapes)):
            if tuple(np.shape(a)) != s:
                raise ValueError(f"arrays[{p}]: shape must be {s} ({self.names[p]}), got {tuple(np.shape(a))}")
        if dtype is None:
            dtype = jnp.result_type(*arrays) if arrays else jnp.float32
        if self.tp_dims is None:
            return self._flatten_local(arrays, dtype)
        return jnp.stack([self._flatten_local([self.tp_slice(a, p, j) for p, a in enumerate(arrays)], dtype)
                          for j in range(self.tp_size)])

    def _flatten_local(self, arrays, dtype):
        parts, pos = [], 0
        for a, o, m in zip(arrays, self.param_offsets, self.numels):
            if o > pos:
                parts.append(jnp.zeros((o - pos,), dtype))
            parts.append(jnp.reshape(jnp.asarray(a, dtype), (-1,)))
            pos = o + m
        if self.total_size > pos:
            parts.append(jnp.zeros((self.total_size - pos,), dtype))
        if not parts:
            return jnp.zeros((0,), dtype)
        return jnp.concatenate(parts)

    def unflatten(self, flat) -> list:
        """The inverse of :meth:`flatten`.

        Args:
          flat: a buffer as :meth:`flatten` returns it.

        Returns:
          The list of whole parameters, in their (global) shapes.

        Raises:
          ValueError: ``flat`` has the wrong shape.
        """
        want = (self.total_size,) if self.tp_dims is None else (self.tp_size, self.total_size)
        if tuple(np.shape(flat)) != want:
            raise ValueError(f"flat: shape must be {want}, got {tuple(np.shape(flat))}")
        if self.tp_dims is None:
            return self._unflatten_local(flat)
        ranks = [self._unflatten_local(flat[j]) for j in range(self.tp_size)]
        return [ranks[0][p] if d is None else jnp.concatenate([r[p] for r in ranks], axis=d)
                for p, d in enumerate(self.tp_dims)]

    def _unflatten_local(self, flat) -> list:
        return [jnp.reshape(flat[o:o + m], s)
                for o, m, s in zip(self.param_offsets, self.numels, self.local_shapes)]

    def shard_of(self, flat, shard: int):
        """Shard ``shard``'s local range of a flat buffer."""
        shard = self._check_shard(shard)
        return flat[shard * self.shard_size:(shard + 1) * self.shard_size]

    # -- identity ----------------------------------------------------------------------------

    def _key(self):
        return (self.shapes, self.param_offsets, self.num_shards, self.shard_size, self.names, self.tp_size,
                self.tp_dims)

    def __eq__(self, other):
        return isinstance(other, FlatLayout) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (f"FlatLayout(num_params={self.num_params}, num_shards={self.num_shards}, "
                f"shard_size={self.shard_size}, param_offsets={self.param_offsets}, shapes={self.shapes}"
                + (f", tp_size={self.tp_size}, tp_dims={self.tp_dims})" if self.tp_dims is not None else ")"))
