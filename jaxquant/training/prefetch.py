"""``scan``: ``jax.lax.scan`` over stacked layers with each layer's weights gathered one layer ahead.

An experiment, not exported: measured slower than ``jax.lax.scan`` in every recipe (docs/fsdp.md, "Prefetching
under scan by hand"); the profile since showed the scan-vs-loop gap is XLA's stacked residuals, not exposed gathers
(docs/performance.md, "Where the scan step's time goes"). Kept as that record and for links slow enough that gathers
show.

Under ``jax.lax.scan`` a layer's ``ShardedWeight`` is quantized and gathered where ``jq.dense`` reads it, inside
the loop body: the gather of layer i+1 belongs to the next iteration and cannot run under layer i's GEMMs, and
the backward's re-gather waits at the start of each reversed iteration (the loop is one sequential program per
iteration to XLA's scheduler). ``scan`` pipelines the loop by hand:

* forward: iteration i starts layer i+1's gather (quantize its rows + all-gather; only the all-gather when the
  step quantized once, ``ShardedWeight.local``) and carries the gathered bytes to iteration i+1;
* backward (a ``custom_vjp`` of the whole loop): the layers in reverse, iteration i gathering layer i-1's bytes
  while layer i's backward GEMMs run; each layer's ``dW`` is reduce-scattered inside its iteration, as before.

Each layer's residuals are those ``jax.vjp`` of the body keeps (a ``jax.checkpoint`` policy in the body applies),
minus the gathered weight: the backward gathers it again from this rank's quantized rows (FSDP2's reshard after
forward), one layer ahead. The quantization, GEMMs and reductions are those of ``jax.lax.scan`` with the same
body, so the results are the same bits.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxquant.training import fsdp


class _Plan:
    """Static description of one ``scan`` call (hashed by identity); ``residuals`` is filled when the forward
    is traced (the structure of each layer's ``jax.vjp`` closure and where its gathered weights sit in it) and
    read when the backward is traced."""

    def __init__(self, body, treedef, slots, specs, length, diff):
        self.body, self.treedef, self.slots, self.specs, self.length = body, treedef, slots, specs, length
        self.diff = diff            # per xs leaf that is not a weight: differentiated (floating) or not
        self.residuals = {}


def _index(a, i):
    return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)


def _local(plan: _Plan, shards, locals_, k: int, i):
    """Layer ``i``'s quantized rows of weight ``k``: the step's once-a-step bytes, or quantized here."""
    if locals_[k] is not None:
        return jax.tree.map(lambda a: _index(a, i), locals_[k])
    return fsdp.quantize_rows(_index(shards[k], i), plan.specs[k])


def _layer_call(plan: _Plan, c, plain_i, sinks_i, consts, gathered, shards_i):
    """The body on layer i, its weights handed over gathered (``keep_gathered``: the backward reads them)."""
    leaves, p, s = [], iter(plain_i), iter(sinks_i)
    weights = dict(zip(plan.slots, range(len(plan.slots))))
    for n in range(plan.treedef.num_leaves):
        if n in weights:
            k = weights[n]
            spec = plan.specs[k]._replace(keep_gathered=True)
            leaves.append(fsdp.ShardedWeight(shards_i[k], next(s), spec, gathered=gathered[k]))
        else:
            leaves.append(next(p))
    return plan.body(c, jax.tree_util.tree_unflatten(plan.treedef, leaves), *consts)


def _split(plan: _Plan, plain_i):
    diff = [a for a, d in zip(plain_i, plan.diff) if d]
    fixed = [a for a, d in zip(plain_i, plan.diff) if not d]
    return diff, fixed


def _merge(plan: _Plan, diff, fixed):
    d, f = iter(diff), iter(fixed)
    return [next(d) if x else next(f) for x in plan.diff]


def _run_layer(plan: _Plan, key: str, c, i, gathered, plain, sinks, shards, consts, residuals: bool):
    """((carry, y), the layer's residuals without its gathered weights, or None)."""
    plain_i = [_index(a, i) for a in plain]
    sinks_i = [_index(a, i) for a in sinks]
    shards_i = [_index(a, i) for a in shards]
    if not residuals:
        return _layer_call(plan, c, plain_i, sinks_i, consts, gathered, shards_i), None
    diff, fixed = _split(plan, plain_i)
    fn = lambda c, d, s, k: _layer_call(plan, c, _merge(plan, d, fixed), s, k, gathered, shards_i)
    out, vjp_fn = jax.vjp(fn, c, diff, sinks_i, consts)
    leaves, tree = jax.tree_util.tree_flatten(vjp_fn)
    # the gathered weights are residuals of jq.dense's backward: keep their place, not their bytes
    where = {id(a): n for n, a in enumerate(jax.tree_util.tree_leaves(gathered))}
    slots = [where.get(id(a)) for a in leaves]
    plan.residuals[key] = (tree, slots)
    return out, [a for a, n in zip(leaves, slots) if n is None]


def _pullback(plan: _Plan, key: str, kept, gathered, ct):
    tree, slots = plan.residuals[key]
    g, k = jax.tree_util.tree_leaves(gathered), iter(kept)
    vjp_fn = jax.tree_util.tree_unflatten(tree, [next(k) if n is None else g[n] for n in slots])
    return vjp_fn(ct)


def _gather_layer(plan: _Plan, shards, locals_, i):
    """(layer ``i``'s gathered operands, its quantized rows), one entry per weight."""
    local = [_local(plan, shards, locals_, k, i) for k in range(len(plan.slots))]
    return [fsdp.forward_operands(q, plan.specs[k]) for k, q in enumerate(local)], local


def _forward(plan: _Plan, init, first, plain, sinks, shards, locals_, consts, residuals: bool):
    L = plan.length
    gather_layer = lambda i: _gather_layer(plan, shards, locals_, i)
    g0, local0 = first

    def step(carry, i):
        c, g = carry
        g_next, local_next = gather_layer(i + 1)       # under this layer's GEMMs
        (c, y), kept = _run_layer(plan, "loop", c, i, g, plain, sinks, shards, consts, residuals)
        return (c, g_next), (y, kept, local_next)

    (c, g_last), (ys, kept, local_rest) = jax.lax.scan(step, (init, g0), jnp.arange(L - 1))
    (c, y_last), kept_last = _run_layer(plan, "last", c, L - 1, g_last, plain, sinks, shards, consts, residuals)
    ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys, y_last)
    if not residuals:
        return (c, ys), None
    # this rank's quantized rows of every layer, for the backward's gathers (the step's, or made here)
    local = [q if q is not None else jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), q0, rest)
             for q, q0, rest in zip(locals_, local0, local_rest)]
    return (c, ys), (kept, kept_last, local, plain, sinks, shards, consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prefetch_scan(plan, init, first, plain, sinks, shards, locals_, consts):
    return _forward(plan, init, first, plain, sinks, shards, locals_, consts, residuals=False)[0]


def _prefetch_scan_fwd(plan, init, first, plain, sinks, shards, locals_, consts):
    return _forward(plan, init, first, plain, sinks, shards, locals_, consts, residuals=True)


def _prefetch_scan_bwd(plan, res, ct):
    kept, kept_last, local, plain, sinks, shards, consts = res
    L, K = plan.length, len(plan.slots)
    gather_layer = lambda i: [fsdp.forward_operands(jax.tree.map(lambda a: _index(a, i), local[k]), plan.specs[k])
                              for k in range(K)]
    dc, dys = ct
    g_last, g_before = gather_layer(L - 1), gather_layer(L - 2)
    dc, d_plain, d_sinks, d_consts = _pullback(plan, "last", kept_last, g_last,
                                               (dc, jax.tree.map(lambda a: a[L - 1], dys)))

    def step(carry, xs):
        dc, g, d_consts = carry
        i, kept_i, dy = xs
        g_next = gather_layer(jnp.maximum(i - 1, 0))   # under this layer's backward GEMMs
        dc, dp, ds, dk = _pullback(plan, "loop", kept_i, g, (dc, dy))
        return (dc, g_next, jax.tree.map(jnp.add, d_consts, dk)), (dp, ds)

    xs = (jnp.arange(L - 1), kept, jax.tree.map(lambda a: a[: L - 1], dys))
    (dc, _, d_consts), (dp, ds) = jax.lax.scan(step, (dc, g_before, d_consts), xs, reverse=True)
    stack = lambda rest, last: jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), rest, last)
    dp, ds = stack(dp, d_plain), stack(ds, d_sinks)
    d = iter(dp)
    d_plain_all = [next(d) if x else None for x in plan.diff]
    return dc, None, d_plain_all, ds, [None] * len(shards), [None] * len(local), d_consts


_prefetch_scan.defvjp(_prefetch_scan_fwd, _prefetch_scan_bwd)


def scan(f: Callable, init: Any, xs: Any, length=None):
    """``jax.lax.scan(f, init, xs)`` over a stack of layers, each layer's ``ShardedWeight`` gathered one layer ahead.

    Args:
      f: the layer, ``f(carry, layer) -> (carry, y)`` as for ``jax.lax.scan``; ``layer`` is one slice of ``xs``
        (its ``ShardedWeight`` leaves one layer's, read with ``jq.dense`` or ``.gather()``). It may be wrapped in
        ``jax.checkpoint`` (e.g. with a ``jq.remat_policy``).
      init: the initial carry (floating arrays).
      xs: the stacked layers: a pytree whose ``ShardedWeight`` leaves are stacks ``[L, ...]`` (from
        ``make_train_step``'s default, layer-wise strategy) and whose other leaves have the same leading ``L``.
      length: optional; must equal ``L`` when given.

    Returns:
      ``(carry, ys)`` as ``jax.lax.scan`` returns them (``ys`` floating arrays, or None), with the same values.

    Weights the step gathers once (``optim`` / ``optim_grads`` / ``no_shard``) or keeps gathered for the backward
    (``reshard_after_forward=False``), and stacks of fewer than 2 layers, are scanned by ``jax.lax.scan`` itself.
    """
    is_weight = lambda n: isinstance(n, fsdp.ShardedWeight)
    leaves, treedef = jax.tree_util.tree_flatten(xs, is_leaf=is_weight)
    slots = [n for n, a in enumerate(leaves) if is_weight(a)]
    weights = [leaves[n] for n in slots]
    lengths = {int(jnp.shape(a.shard if is_weight(a) else a)[0]) for a in leaves if jnp.ndim(
        a.shard if is_weight(a) else a) > 0}
    if len(lengths) > 1:
        raise ValueError(f"xs: every leaf must have the same leading (layer) axis, got lengths {sorted(lengths)}")
    L = lengths.pop() if lengths else length
    if length is not None and L != length:
        raise ValueError(f"length: {length} does not match the layer axis of xs ({L})")
    plain_pipeline = (not weights or L is None or L < 2 or
                      any(not w.spec.per_use or w.spec.keep_gathered or w.gathered is not None for w in weights))
    if plain_pipeline:
        return jax.lax.scan(f, init, xs, length=length)
    for w in weights:
        if w.shard.ndim != 3:
            raise ValueError(f"xs: a ShardedWeight of shape {w.shape} is not a stack of [out, in] layers")
    for path, a in jax.tree_util.tree_leaves_with_path(init):
        if not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
            raise TypeError(f"init{jax.tree_util.keystr(path)}: prefetch.scan's carry must be floating arrays, got "
                            f"{jnp.result_type(a)}")
    plain = [a for n, a in enumerate(leaves) if n not in slots]
    diff = tuple(bool(jnp.issubdtype(jnp.result_type(a), jnp.inexact)) for a in plain)
    shards, locals_ = [w.shard for w in weights], [w.local for w in weights]
    plan = _Plan(None, treedef, tuple(slots), tuple(w.spec for w in weights), L, diff)
    first = _gather_layer(plan, shards, locals_, 0)        # layer 0's gather, before the loop
    # the first layer as the body sees it (weights gathered), to hoist what ``f`` closes over into arguments
    example = list(leaves)
    for n, a in enumerate(leaves):
        example[n] = a[0] if n not in slots else None
    for k, (n, w) in enumerate(zip(slots, weights)):
        example[n] = fsdp.ShardedWeight(w.shard[0], w.grad[0], w.spec._replace(keep_gathered=True),
                                        gathered=first[0][k])
    plan.body, consts = jax.closure_convert(f, init, jax.tree_util.tree_unflatten(treedef, example))
    carry, ys = _prefetch_scan(plan, init, first, plain, [w.grad for w in weights], shards, locals_, list(consts))
    return carry, ys
