"""Sharding and batching rules for jaxquant's ops (docs/sharding.md).

An FFI custom call has no sharding rule of its own: under ``jax.jit`` on a sharded input XLA
would all-gather the input and replicate the result. ``@sharded(rule)`` on an op function wraps
it in (objects built once per op and static configuration, then reused)

* ``jax.experimental.custom_partitioning`` with a Shardy rule derived from ``rule``: each device
  runs the op on its local block, results with a ``reduce`` entry are max/sum all-reduced over
  exactly the mesh axes that shard the op's first operand, other results come out sharded like
  that operand (dimensions mapped through ``rule``);
* ``jax.custom_batching.custom_vmap``: ``rule.fold`` maps a batched call onto one unbatched call
  where the op allows it; otherwise the batch runs sequentially (``lax.map``).

Array specs (one string per operand/result, dimensions separated by spaces) name each dimension
by the frame dimension it follows: ``m`` / ``k`` (the op's logical [M, K]), ``k/2`` (a divisor),
``m^128`` (padded to a multiple, as the NVFP4 scale layouts), ``k/16^4``; ``""`` is a scalar,
``1`` a dimension that is never split, ``-`` "every dimension never split" (any rank), ``*`` "one
frame dimension per dimension of the first operand" (any rank; letters ``a``, ``b``, ...).

Where every mesh axis is manual (inside ``shard_map``, and inside the partitioned body itself) and
on one device custom_partitioning inlines the op, so the ops keep working there unchanged (a
``shard_map`` over some of the axes is tested with the other axes replicating the operands).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

_TERM = re.compile(r"^(?P<name>[a-z]|1)(?:/(?P<div>\d+))?(?:\^(?P<pad>\d+))?$")


@dataclasses.dataclass(frozen=True)
class Term:
    """One array dimension: frame dimension ``name`` divided by ``div``, padded to a multiple of ``pad``."""

    name: str  # a frame letter, or "1" for a dimension that is never split
    div: int = 1
    pad: int = 1


def parse_spec(spec: str, first_ndim: int = 0, own_ndim: int = 0) -> tuple[Term, ...]:
    """``"m/16^4 k"`` -> Terms; ``"*"`` / ``"-"`` expand to ``first_ndim`` / ``own_ndim`` dimensions."""
    if spec == "*":
        return tuple(Term(chr(ord("a") + i)) for i in range(first_ndim))
    if spec == "-":
        return (Term("1"),) * own_ndim
    terms = []
    for word in spec.split():
        hit = _TERM.match(word)
        if hit is None:
            raise ValueError(f"spec: cannot parse dimension {word!r} of {spec!r}")
        terms.append(Term(hit["name"], int(hit["div"] or 1), int(hit["pad"] or 1)))
    return tuple(terms)


@dataclasses.dataclass(frozen=True)
class Rule:
    """How an op partitions and batches; see the module docstring for the spec strings.

    operands / results: one spec per positional array argument / per entry of the returned tuple
    (a single spec when the op returns one array; entries the call returns as None are skipped).
    results may also be a callable of the call's keyword arguments returning them.
    reduce: result index -> "max" | "sum", all-reduced over the axes that shard operand 0.
    tile: every local block of a frame dimension must be a multiple of this (the scale grid).
    frame_kwargs: keyword arguments that hold frame sizes (e.g. rows -> "m"); the local call gets
    the local sizes.
    applies: predicate on (arrays, kwargs); where False the op runs as is (no rule).
    fold: (op, axis_size, in_batched, arrays, kwargs) -> batched outputs, or None to run the batch
    sequentially.
    """

    name: str
    operands: tuple[str, ...]
    results: object
    reduce: dict = dataclasses.field(default_factory=dict)
    tile: int = 1
    frame_kwargs: dict = dataclasses.field(default_factory=dict)
    applies: Optional[Callable] = None
    fold: Optional[Callable] = None


def sharded(rule: Rule):
    """Decorator: ``fn(*arrays, **static_kwargs)`` gets ``rule``'s sharding and batching rules.

    Called on concrete arrays (outside any trace) the op runs jitted, with its keyword arguments
    static: the rules are per-trace objects, which op-by-op execution would rebuild on every call.
    """

    def decorate(fn):
        static = tuple(name for name, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY)

        @functools.wraps(fn)
        def op(*arrays, **kwargs):
            if not all(_is_array(a) for a in arrays) or (
                    rule.applies is not None and not rule.applies(arrays, kwargs)):
                return fn(*arrays, **kwargs)
            if not any(isinstance(a, jax.core.Tracer) for a in arrays):
                if any(jax.dtypes.canonicalize_dtype(a.dtype) != a.dtype for a in arrays):
                    return fn(*arrays, **kwargs)  # jit would convert it (float64 -> float32) before the checks
                return jitted(*arrays, **kwargs)
            explicit = _explicit_sharding(arrays[0])
            if explicit is None:
                return _call(fn, op, rule, arrays, kwargs)
            # Explicit mesh axes type every value by its sharding; the op runs on Auto axes and its
            # results get the shardings the rule gives them (errors for a bad sharding at trace time).
            shardings = _result_shardings(fn, rule, arrays, kwargs, explicit)
            return jax.sharding.auto_axes(lambda *a: _call(fn, op, rule, a, kwargs),
                                          out_sharding=shardings)(*arrays)

        jitted = jax.jit(op, static_argnames=static)
        op.rule = rule
        op.unpartitioned = fn
        return op

    return decorate


def _is_array(a) -> bool:
    """An array operand: a pytree leaf with a shape and dtype (not, e.g., a quantized tensor, which has
    the logical tensor's shape and dtype; the op's own checks reject it)."""
    return hasattr(a, "shape") and hasattr(a, "dtype") and jax.tree_util.treedef_is_leaf(jax.tree.structure(a))


# ----------------------------------------------------------------------------------------------
# Specs of one call
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The terms of every operand and (non-None) result of one call, with the frame sizes."""

    operands: tuple[tuple[Term, ...], ...]
    results: tuple[tuple[Term, ...], ...]
    result_slots: tuple[int, ...]      # index in the returned tuple of each non-None result
    arity: int                         # length of the returned tuple
    frame: dict                        # frame letter -> global size
    single: bool                       # the op returns one array, not a tuple


def _layout(rule: Rule, arrays, kwargs, out_shapes) -> _Layout:
    ndim0 = arrays[0].ndim
    operands = tuple(parse_spec(s, ndim0, a.ndim) for s, a in zip(rule.operands, arrays, strict=True))
    specs = rule.results(**kwargs) if callable(rule.results) else rule.results
    single = isinstance(specs, str)
    specs, outs = ((specs,), (out_shapes,)) if single else (specs, out_shapes)
    results, slots = [], []
    for i, (spec, out) in enumerate(zip(specs, outs, strict=True)):
        if out is not None:
            results.append(parse_spec(spec, ndim0, out.ndim))
            slots.append(i)
    frame = {letter: int(kwargs[key]) for key, letter in rule.frame_kwargs.items()}
    for terms, a in zip(operands, arrays):
        for t, size in zip(terms, a.shape):
            if t.name != "1" and t.pad == 1:
                frame.setdefault(t.name, int(size) * t.div)
    return _Layout(operands, tuple(results), tuple(slots), len(specs), frame, single)


def _aligned(t: Term, frame: dict) -> bool:
    """A padded dimension shards like its frame dimension only when the padding is empty."""
    return t.name == "1" or (frame[t.name] // t.div) % t.pad == 0


def _sdy_rule(layout: _Layout) -> SdyShardingRule:
    """Frame letter L with divisors d1 > d2 > ... is factored L0 (size F/d1), L1 (d1/d2), ...; a
    dimension F/di is the compound (L0 .. L{i-1}). Padded dimensions that are not aligned and size-1
    dimensions get factors of their own (never sharded by the rule)."""
    every = layout.operands + layout.results
    divisors = {}
    for terms in every:
        for t in terms:
            if t.name != "1" and _aligned(t, layout.frame):
                divisors.setdefault(t.name, set()).add(t.div)
    chains = {name: sorted(ds, reverse=True) for name, ds in divisors.items()}
    fresh = iter(range(1 << 30))

    def factor_size(name: str, i: int) -> int:
        chain = chains[name]
        return layout.frame[name] // chain[0] if i == 0 else chain[i - 1] // chain[i]

    def mapping(t: Term) -> list:
        """The factors of one dimension as (name, size) pairs (size None: never inferred)."""
        if t.name == "1" or not _aligned(t, layout.frame):
            return [(f"u{next(fresh)}", None)]
        n = chains[t.name].index(t.div) + 1
        # Shardy rejects size-1 factors inside a compound (e.g. L0 when M = 16 rows is one tile row).
        factors = [(f"{t.name}{i}", factor_size(t.name, i)) for i in range(n)]
        kept = [f for f in factors if f[1] > 1] if n > 1 else factors
        return kept or [(f"u{next(fresh)}", None)]

    ops = tuple(tuple(mapping(t) for t in terms) for terms in layout.operands)
    res = tuple(tuple(mapping(t) for t in terms) for terms in layout.results)
    # Shardy infers the size of a factor that is a whole dimension somewhere; the others need it.
    alone = {m[0][0] for dims in ops + res for m in dims if len(m) == 1}
    sizes = {name: size for dims in ops + res for m in dims if len(m) > 1 for name, size in m if name not in alone}
    as_dim = lambda m: m[0][0] if len(m) == 1 else CompoundFactor(*(name for name, _ in m))
    ops = tuple(tuple(as_dim(m) for m in dims) for dims in ops)
    res = tuple(tuple(as_dim(m) for m in dims) for dims in res)
    return SdyShardingRule(tuple(ArrayMapping(*m) for m in ops), tuple(ArrayMapping(*m) for m in res), **sizes)


# ----------------------------------------------------------------------------------------------
# Partitioning
# ----------------------------------------------------------------------------------------------


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _frame_axes(rule: Rule, layout: _Layout, mesh, sharding, shape) -> dict:
    """Frame letter -> mesh axes that shard it in operand 0; errors for blocks off the tile grid."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    axes = {}
    for d, (t, entry) in enumerate(zip(layout.operands[0], spec)):
        names = _axes_of(entry)
        if not names or t.name == "1" or not _aligned(t, layout.frame):
            continue  # not split, or padded so that blocks are not pieces of it: replicated
        shards = math.prod(mesh.shape[a] for a in names)
        frame = layout.frame[t.name]
        if frame % (shards * rule.tile) or (frame // t.div) % shards:
            grid = f" (the {rule.tile}x{rule.tile} scale grid)" if rule.tile > 1 else ""
            raise ValueError(
                f"{rule.name}: input sharding {P(*spec)} splits dimension {d} (size {shape[d]}) over mesh "
                f"axes {names} into {shards} blocks, which needs {frame} (the tensor's size along it) to be "
                f"a multiple of {shards} x {rule.tile}{grid}. Use a sharding whose blocks are multiples of "
                f"{rule.tile} along that dimension, or replicate it.")
        axes[t.name] = names
    return axes


def _spec_for(terms, frame_axes, frame) -> P:
    return P(*((frame_axes.get(t.name) or None) if t.name != "1" and _aligned(t, frame) else None
               for t in terms))


def _as_named(sharding, mesh, shape) -> NamedSharding:
    """The NamedSharding over ``mesh`` that places ``shape`` as ``sharding`` does.

    The partitioner hands shardings over undecoded (decoding a result split over a sub-axis of a
    mesh axis, which Shardy may choose for a block off the scale grid, fails inside JAX); operand
    shardings that matter here are plain mesh-axis splits, decoded axis by axis from the device
    placements (``_decode_split``).
    """
    if isinstance(sharding, NamedSharding):
        return sharding
    shape = tuple(shape)
    if tuple(sharding.shard_shape(shape)) == shape:
        return NamedSharding(mesh, P())
    named = _decode_split(sharding, mesh, shape)
    if named is not None:
        return named
    local = tuple(sharding.shard_shape(shape))
    raise ValueError(f"input sharding of a {shape} array into {local} blocks is not a split over "
                     f"whole axes of the mesh {dict(mesh.shape)}; jaxquant's ops need NamedSharding splits "
                     f"whose blocks are multiples of the 16x16 scale grid (NVFP4).")


def _decode_split(sharding, mesh, shape) -> Optional[NamedSharding]:
    """The split of ``shape`` over whole axes of ``mesh`` that places it as ``sharding`` does, or None.

    Linear in the number of mesh axes (plus one comparison of device placements): stepping one
    device along mesh axis ``a`` moves its block along the one dimension ``a`` splits, by the
    product of the sizes of the axes minor to ``a`` in that dimension's split. The spec returned is
    the one a search over every order of the mesh axes (lexicographic, in mesh order) and every
    assignment of axes to dimensions (dimension 0 first, "unused" last) finds first: each
    dimension's axes major to minor, the axes ordered as in the mesh where the splits leave it
    free, size-1 axes (which place nothing) on dimension 0.
    """
    want = sharding.devices_indices_map(shape)
    devices = np.asarray(mesh.devices)
    if set(want) != set(devices.flat):
        return None
    names = tuple(mesh.axis_names)
    block = tuple(sharding.shard_shape(shape))

    def blocks(device):
        return tuple(s.indices(n)[0] // b if b else 0 for s, n, b in zip(want[device], shape, block))

    origin = blocks(devices[(0,) * devices.ndim])
    unused = len(shape)
    dim_of, stride = {}, {}
    for k, name in enumerate(names):
        if devices.shape[k] == 1:
            dim_of[name] = 0  # places nothing: the search puts it on dimension 0
            continue
        step = blocks(devices[tuple(int(j == k) for j in range(devices.ndim))])
        moved = [d for d, (i, j) in enumerate(zip(origin, step)) if i != j]
        if len(moved) > 1:
            return None
        dim_of[name] = moved[0] if moved else unused
        if moved:
            stride[name] = step[moved[0]] - origin[moved[0]]
    # Each dimension's axes, major (largest stride) to minor; the smallest order of all axes (by
    # mesh position) that keeps every such chain in order.
    chains = [sorted((a for a in names if a in stride and dim_of[a] == d), key=lambda a: -stride[a])
              for d in range(len(shape))]
    chain_of = {a: c for c, chain in enumerate(chains) for a in chain}
    heads = [0] * len(chains)
    order, left = [], list(names)
    while left:
        for a in left:
            c = chain_of.get(a)
            if c is None or chains[c][heads[c]] == a:
                break
        else:  # unreachable: a chain's head is always free
            return None
        if a in chain_of:
            heads[chain_of[a]] += 1
        order.append(a)
        left.remove(a)
    spec = [tuple(a for a in order if dim_of[a] == d) for d in range(len(shape))]
    candidate = NamedSharding(mesh, P(*(e if e else None for e in spec)))
    return candidate if candidate.devices_indices_map(shape) == want else None


def _partition(fn, rule: Rule, layout: _Layout, kwargs, mesh, arg_shapes, result_shape):
    del result_shape  # the shardings of the results follow from operand 0's (returned below)
    x_sharding = _as_named(arg_shapes[0].sharding, mesh, arg_shapes[0].shape)
    frame_axes = _frame_axes(rule, layout, mesh, x_sharding, arg_shapes[0].shape)
    reduce_axes = tuple(a for names in frame_axes.values() for a in names)
    local_frame = {name: size // math.prod(mesh.shape[a] for a in frame_axes.get(name, ()))
                   for name, size in layout.frame.items()}
    local_kwargs = dict(kwargs, **{key: local_frame[letter] for key, letter in rule.frame_kwargs.items()})
    arg_shardings = tuple(NamedSharding(mesh, _spec_for(t, frame_axes, layout.frame)) for t in layout.operands)
    out_shardings = [NamedSharding(mesh, _spec_for(t, frame_axes, layout.frame)) for t in layout.results]

    def lower(*local):
        local = [_to_local_padding(a, terms, layout.frame, frame_axes) for a, terms in zip(local, layout.operands)]
        out = fn(*local, **local_kwargs)
        outs = [out] if layout.single else list(out)
        for slot, terms in zip(layout.result_slots, layout.results):
            value = outs[slot]
            how = rule.reduce.get(slot)
            if how is not None and reduce_axes:
                value = (jax.lax.pmax if how == "max" else jax.lax.psum)(value, reduce_axes)
            outs[slot] = _to_global_padding(value, terms, layout.frame, local_frame, frame_axes)
        return outs[0] if layout.single else tuple(outs)

    results = out_shardings[0] if layout.single else _with_slots(out_shardings, layout)
    return mesh, lower, results, arg_shardings


def _to_global_padding(value, terms, frame, local_frame, frame_axes):
    """A padded dimension whose padding is not empty cannot be a block of the global array: its
    local rows are gathered (they are the global rows in order) and the global padding added."""
    for d, t in enumerate(terms):
        if t.pad == 1 or _aligned(t, frame):
            continue
        names = frame_axes.get(t.name, ())
        if not names:
            continue  # not split: the local array is already the global one
        value = jax.lax.slice_in_dim(value, 0, local_frame[t.name] // t.div, axis=d)
        value = _pad_to_multiple(jax.lax.all_gather(value, names, axis=d, tiled=True), d, t.pad)
    for d, t in enumerate(terms):  # aligned padded dimensions: drop the local padding
        if t.pad != 1 and _aligned(t, frame) and frame_axes.get(t.name):
            value = jax.lax.slice_in_dim(value, 0, local_frame[t.name] // t.div, axis=d)
    return value


def _to_local_padding(value, terms, frame, frame_axes):
    """A block of an aligned padded operand is the local layout without its (zero) padding."""
    for d, t in enumerate(terms):
        if t.pad != 1 and _aligned(t, frame) and frame_axes.get(t.name):
            value = _pad_to_multiple(value, d, t.pad)
    return value


def _pad_to_multiple(value, axis: int, multiple: int):
    """Zero rows appended along ``axis`` up to a multiple of ``multiple`` (the NVFP4 scale padding)."""
    pad = [(0, 0)] * value.ndim
    pad[axis] = (0, -value.shape[axis] % multiple)
    return jnp.pad(value, pad)


def _with_slots(items, layout: _Layout):
    """Results listed per non-None output -> the op's tuple shape (None where it returns None)."""
    full = [None] * layout.arity
    for slot, item in zip(layout.result_slots, items):
        full[slot] = item
    return tuple(full)


def _explicit_sharding(x):
    """``x``'s NamedSharding when its mesh has Explicit axes (sharding in types), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    return sharding if any(t == jax.sharding.AxisType.Explicit for t in types) else None


def _unsharded_layout(fn, rule, arrays, kwargs) -> _Layout:
    bound = lambda *a: fn(*a, **kwargs)
    out_shapes = jax.eval_shape(bound, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays))
    return _layout(rule, arrays, kwargs, out_shapes)


def _result_shardings(fn, rule, arrays, kwargs, sharding):
    layout = _unsharded_layout(fn, rule, arrays, kwargs)
    frame_axes = _frame_axes(rule, layout, sharding.mesh, sharding, arrays[0].shape)
    specs = [NamedSharding(sharding.mesh, _spec_for(t, frame_axes, layout.frame)) for t in layout.results]
    return specs[0] if layout.single else _with_slots(specs, layout)


def _call(fn, op, rule: Rule, arrays, kwargs):
    """``op``'s call on ``arrays`` under its batching and partitioning rules. The custom_vmap and
    custom_partitioning objects are built once per op and static configuration (keyword arguments;
    operand shapes and dtypes for the latter) and reused, so that every trace of the same call binds
    the same rule objects."""
    del fn, rule  # op.unpartitioned and op.rule: the cache keys on op
    static = _static_key(kwargs)
    batched = _batched(op, static) if static is not None else _build_batched(op, kwargs, None)
    return batched(*arrays)


def _typed(value):
    """``value`` with the type of each of its parts: 1, 1.0 and True hash alike but are distinct
    configurations."""
    if isinstance(value, tuple):
        return (tuple, tuple(_typed(v) for v in value))
    return type(value)


def _static_key(kwargs) -> Optional[tuple]:
    """A hashable key of the keyword arguments (and their types), or None where one is unhashable."""
    items = tuple(sorted(kwargs.items()))
    key = (items, tuple(_typed(v) for _, v in items))
    try:
        hash(key)
    except TypeError:
        return None
    return key


_CACHE_SIZE = 4096  # op x static configurations x operand shapes held at once


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _batched(op, static: tuple):
    return _build_batched(op, dict(static[0]), static)


def _build_batched(op, kwargs, static: Optional[tuple]):
    rule = op.rule

    def run(*xs):
        avals = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in xs)
        cp = _partitioned(op, static, avals) if static is not None else _build_partitioned(op, kwargs, avals)
        return cp(*xs)

    batched = custom_vmap(run)

    @batched.def_vmap
    def _batch(axis_size, in_batched, *xs):
        out = rule.fold(op, axis_size, in_batched, xs, kwargs) if rule.fold is not None else None
        if out is None:
            out = _sequential(op, in_batched, xs, kwargs)
        return out, jax.tree.map(lambda _: True, out)

    return batched


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _partitioned(op, static: tuple, avals: tuple):
    return _build_partitioned(op, dict(static[0]), avals)


def _build_partitioned(op, kwargs, avals: tuple):
    fn, rule = op.unpartitioned, op.rule
    bound = lambda *a: fn(*a, **kwargs)
    layout = _unsharded_layout(fn, rule, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals], kwargs)
    cp = custom_partitioning(bound)
    cp.def_partition(
        partition=functools.partial(_partition, fn, rule, layout, kwargs),
        sharding_rule=_sdy_rule(layout), decode_shardings=False)
    return cp


def _sequential(op, in_batched, xs, kwargs):
    """The batch one element at a time (batch dimension 0, as custom_vmap hands it over)."""
    def one(batched_items):
        it = iter(batched_items)
        return op(*(next(it) if b else x for x, b in zip(xs, in_batched)), **kwargs)

    return jax.lax.map(one, [x for x, b in zip(xs, in_batched) if b])
