"""``scan_layers``: ``jax.lax.scan`` over a stack of layers, each iteration quantizing and gathering the next layer's
``ShardedWeight`` s while it runs its own layer, in the forward and in the backward.

An experiment, not exported until a two-GPU A/B at the 13B shape says it wins (docs/fsdp.md, "Prefetching under
``scan`` by hand"). An earlier hand-pipelined scan, which kept each layer's residuals, lost at 4 layers without remat,
where little of the gathers was exposed; this one is for the full-remat regime of deep stacks, where the 13B step
exposed each iteration's first gather and gathered every weight three times a step.

Under ``jax.lax.scan`` a layer's weights are gathered where its ``jq.dense`` reads them, inside the iteration, so the
first gather of every iteration has nothing of that iteration to run under; XLA's scheduler does not move work across
iterations of a while loop. Here the gathered operands of the next layer are part of the loop's carry: the gather
that iteration ``i`` issues is read by iteration ``i + 1`` (``i - 1`` in the backward), so it can run under all of
iteration ``i``'s GEMMs (PyTorch FSDP2 prefetches the next module's all-gather the same way).

The backward is written here (``jax.custom_vjp``) rather than left to JAX's autodiff of the scan: under
``jax.checkpoint`` the scan would save every iteration's carry, the prefetched operands of every layer (the whole
model's quantized weights), for the recomputation. This one saves each layer's input carry, as ``jax.checkpoint``
saving nothing does, and recomputes each layer in the backward with the operands prefetched for it, so a layer's
weights are gathered twice a step (forward and backward), not three times (forward, recomputation, backward); each
loop's last iteration gathers one layer again (a loop body is the same for every iteration: the forward's last
layer, kept for the backward's first, and the backward's layer 0, unused), 2L + 2 gathers of a layer in all.
The values are those of ``jax.lax.scan(jax.checkpoint(body), ...)`` bit for bit
(``tests/test_scan_layers.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxquant.training import fsdp


def scan_layers(body, carry, layers):
    """The final carry of ``jax.lax.scan(jax.checkpoint(body), carry, layers)``, with each layer's weights quantized
    and gathered one iteration ahead.

    Args:
      body: ``body(carry, layer) -> (carry, None)``, as ``jax.lax.scan`` takes it (no per-layer outputs). It may
        close over other arrays (the step's masks, a shared weight); their gradients are summed over the layers.
      carry: the activations entering the first layer.
      layers: a pytree whose leaves are stacked along axis 0 (one entry a layer): the step's stacked
        ``ShardedWeight`` s and any other arrays. A ``ShardedWeight`` that its layer would quantize and gather
        (ZeRO-3, split over ranks, reshard after forward) is prefetched; any other leaf is handed to ``body`` as
        ``jax.lax.scan`` would hand it.

    Returns:
      The carry after the last layer. Memory: as ``jax.checkpoint`` saving nothing, plus the gathered operands of
      two layers at a time (the one running, the one prefetched).

    Raises:
      ValueError: ``layers`` has no leaves or leaves of different lengths, or ``body`` returns per-layer outputs.
    """
    length = _length(layers)
    if not any(_prefetched(w) for w in _weights(layers)):
        return jax.lax.scan(jax.checkpoint(lambda c, layer: _no_outputs(body(c, layer))), carry, layers)[0]
    first = _gather_layer(layers, 0)
    converted, consts = jax.closure_convert(lambda c, layer, ready: body(c, _with_operands(layer, ready)), carry,
                                            _layer(layers, 0), first)
    return _scan(converted, length, carry, layers, first, tuple(consts))


def _length(layers) -> int:
    lengths = {int(jnp.shape(a)[0]) if jnp.ndim(a) else None for a in jax.tree.leaves(layers)}
    if not lengths or None in lengths or len(lengths) != 1:
        raise ValueError(f"layers: every leaf must be stacked along axis 0 with the same length, got lengths "
                         f"{sorted(str(n) for n in lengths)}")
    return lengths.pop()


def _no_outputs(out):
    c, ys = out
    if jax.tree.leaves(ys):
        raise ValueError("body: must return (carry, None); scan_layers keeps no per-layer outputs")
    return c, None


def _is_weight(x) -> bool:
    return isinstance(x, fsdp.ShardedWeight)


def _weights(tree) -> list:
    return [w for w in jax.tree.leaves(tree, is_leaf=_is_weight) if _is_weight(w)]


def _prefetched(w) -> bool:
    """Whether a stacked ``ShardedWeight`` is one its layer would quantize and gather where it reads it (ZeRO-3, more
    than one shard, gathered again in the backward): a weight of one shard gathers nothing, one kept gathered or
    gathered once a step is whole already, and an NVFP4 weight dequantized before its gather
    (``fsdp.dequantizes_once``) makes its operand its own way."""
    s = w.spec
    return (s.per_use and not s.keep_gathered and w.gathered is None and w.local is None and s.num_shards > 1
            and not fsdp.dequantizes_once(s))


def _layer(layers, i):
    """Layer ``i`` (a traced index) of every stacked leaf."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), layers)


def _gather_layer(layers, i) -> tuple:
    """The gathered operands of layer ``i`` of every prefetched weight (None for the other leaves), as the layer's
    forward GEMM reads them (``fsdp.gather_once``: this rank's rows quantized with the precomputed amax, gathered);
    the master is read through ``stop_gradient``: its gradient reaches the weight's sink in the iteration that uses
    the operands."""
    out = []
    for w in _weights(layers):
        if not _prefetched(w):
            out.append(None)
            continue
        shard = jax.lax.dynamic_index_in_dim(jax.lax.stop_gradient(w.shard), i, keepdims=False)
        amax = None if w.amax is None else jax.lax.dynamic_index_in_dim(jax.lax.stop_gradient(w.amax), i,
                                                                        keepdims=False)
        columnwise = w.spec.recipe == "fp8" and w.spec.transposed     # what fsdp.forward_operands reads
        out.append(fsdp.gather_once(shard, w.spec, columnwise=columnwise, amax=amax))
    return tuple(out)


def _with_operands(layer, operands: tuple):
    """``layer`` with each prefetched weight handed its gathered operands, kept for its backward (as
    ``reshard_after_forward=False`` keeps them: nothing is gathered inside the layer)."""
    it = iter(operands)

    def put(w):
        if not _is_weight(w):
            return w
        ops = next(it)
        if ops is None:
            return w
        return dataclasses.replace(w, gathered=ops, spec=w.spec._replace(keep_gathered=True))

    return jax.tree.map(put, layer, is_leaf=_is_weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan(body, length, carry, layers, first, consts):
    """``body(carry, layer, ready, *consts)``: the layer with ``ready``, its gathered operands; ``first``: layer 0's."""
    return _scan_fwd(body, length, carry, layers, first, consts)[0]


def _scan_fwd(body, length, carry, layers, first, consts):
    def step(state, i):
        h, ready = state
        # the last iteration gathers its own layer again: the carry out, kept for the backward's first iteration
        ahead = _gather_layer(layers, jnp.minimum(i + 1, length - 1))
        h_next = _no_outputs(body(h, _layer(layers, i), ready, *consts))[0]
        return (h_next, ahead), h

    (out, last), inputs = jax.lax.scan(step, (carry, first), jnp.arange(length))
    return out, (inputs, last, layers, consts)


def _sinks(layer):
    """The differentiable part of a layer: each ``ShardedWeight`` replaced by its gradient sink (its master's
    gradient reaches the sink; the master and its amax have none), every other leaf as it is."""
    return jax.tree.map(lambda w: w.grad if _is_weight(w) else w, layer, is_leaf=_is_weight)


def _with_sinks(layer, sinks):
    return jax.tree.map(lambda w, s: dataclasses.replace(w, grad=s) if _is_weight(w) else s, layer, sinks,
                        is_leaf=_is_weight)


def _zero(x):
    return jnp.zeros(jnp.shape(x), jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.inexact) else \
        jnp.zeros_like(x)


def _add(a, b):
    return a if a.dtype == jax.dtypes.float0 else a + b


def _scan_bwd(body, length, res, g):
    inputs, last, layers, consts = res

    def step(state, xs):
        g_h, ready, g_consts = state
        i, h = xs
        ahead = _gather_layer(layers, jnp.maximum(i - 1, 0))     # the last iteration's (layer 0 again): unused
        layer = _layer(layers, i)
        run = lambda h_, sinks, cs: _no_outputs(body(h_, _with_sinks(layer, sinks), ready, *cs))[0]
        _, vjp = jax.vjp(run, h, _sinks(layer), consts)
        g_prev, g_sinks, g_cs = vjp(g_h)
        return (g_prev, ahead, jax.tree.map(_add, g_consts, g_cs)), g_sinks

    zeros = jax.tree.map(_zero, consts)
    (g_carry, _, g_consts), g_sinks = jax.lax.scan(step, (g, last, zeros), (jnp.arange(length), inputs),
                                                   reverse=True)
    # a weight's cotangent is its sink's; its master and amax have none (None: a zero JAX need not build)
    g_layers = jax.tree.map(lambda w, s: dataclasses.replace(w, shard=None, grad=s, amax=None) if _is_weight(w) else s,
                            layers, g_sinks, is_leaf=_is_weight)
    return g_carry, g_layers, None, g_consts     # first: read through stop_gradient


_scan.defvjp(_scan_fwd, _scan_bwd)
