"""``scan_layers`` (``jaxquant/training/prefetch.py``, not exported): each iteration quantizes and gathers the next
layer's weights, in the forward and in the backward, while the layer it runs reads operands gathered the iteration
before. It trains to the bits of ``jax.lax.scan(jax.checkpoint(body), ...)``, and its loops are shaped so: every
gather of a loop body is at the body's top level and feeds only the carry, and no layer gathers inside itself."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from jaxquant.training.prefetch import scan_layers
from support.transformer import (LR, MASK, assert_same_params, assert_same_training, block, head, init_params,
                                 loss_scan, make_batch, two_steps_bf16_wire)


def loss_prefetch(w, batch):
    h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
    h = scan_layers(lambda h, layer: (block(h, layer), None), h, w["blocks"])
    return head(h, w, batch)


def loss_checkpointed(w, batch):
    return loss_scan(w, batch, remat=True)


def checkpointed_scan(body, carry, layers):
    """What ``scan_layers`` equals: ``jax.lax.scan`` of the checkpointed body (saving nothing)."""
    return jax.lax.scan(jax.checkpoint(body), carry, layers)[0]


@pytest.mark.parametrize("recipe", ["fp8", "bf16", "nvfp4"])
@pytest.mark.fast_cases("fp8")
def test_scan_layers_trains_to_the_bits_of_a_checkpointed_scan(recipe):
    assert_same_training(two_steps_bf16_wire(loss_prefetch, recipe, 8),
                         two_steps_bf16_wire(loss_checkpointed, recipe, 8))


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def _scan_bodies(jaxpr) -> list:
    """(reverse, body) of every scan in ``jaxpr``, nested ones included."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            out.append((e.params["reverse"], e.params["jaxpr"].jaxpr))
        for sub in _sub_jaxprs(e):
            out.extend(_scan_bodies(sub))
    return out


def _gathers_inside(eqn) -> int:
    return sum((e.primitive.name == "all_gather") + _gathers_inside(e) for sub in _sub_jaxprs(eqn) for e in sub.eqns)


LAYER_WORK = ("dot_general", "custom_vjp_call", "custom_vmap_call")   # GEMMs; jq.dense and jaxquant's ops


def _layer_work(eqn) -> bool:
    return eqn.primitive.name in LAYER_WORK or any(_layer_work(e) for sub in _sub_jaxprs(eqn) for e in sub.eqns)


def _loop_shape(body):
    """(the body's top-level all-gathers, whether any of their values reach a layer's work (a GEMM, ``jq.dense``, a
    jaxquant op, or a call holding one) in the same iteration, the all-gathers inside other eqns)."""
    tainted, read_by_a_call, top = set(), False, 0
    for e in body.eqns:
        if e.primitive.name == "all_gather":
            top += 1
            tainted.update(map(id, e.outvars))
            continue
        hit = any(id(v) in tainted for v in e.invars if not isinstance(v, jax.extend.core.Literal))
        if hit:
            tainted.update(map(id, e.outvars))
            read_by_a_call |= _layer_work(e)
    inside = sum(_gathers_inside(e) for e in body.eqns)
    return top, read_by_a_call, inside


def _bodies(loss, recipe="fp8"):
    step = jq.make_train_step(loss, optax.sgd(LR), mesh=Mesh(np.array(jax.devices()[:8]), ("fsdp",)),
                              quantize_mask=MASK, policy=jq.MixedPrecisionPolicy(compute_weights=recipe))
    state = step.init(init_params())
    return {reverse: body for reverse, body in _scan_bodies(jax.make_jaxpr(step)(state, make_batch()).jaxpr)}


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
@pytest.mark.fast_cases("fp8")
def test_each_iteration_gathers_the_next_layer_and_no_layer_gathers_itself(recipe):
    """Forward and backward loop alike: one all-gather of each prefetched weight (w1, w2; NVFP4: bytes and scales)
    at the body's top level, whose values reach no layer computation in the same iteration; none inside the layer.
    The checkpointed scan's forward loop reads each gather in the iteration that makes it, and its backward loop
    gathers inside the layer's recomputation and backward."""
    per_weight = 2 if recipe == "nvfp4" else 1
    for reverse, body in _bodies(loss_prefetch, recipe).items():
        assert _loop_shape(body) == (2 * per_weight, False, 0), (reverse, _loop_shape(body))
    shapes = {reverse: _loop_shape(body) for reverse, body in _bodies(loss_checkpointed, recipe).items()}
    assert shapes[False][0] == 2 * per_weight and shapes[False][1], shapes
    assert shapes[True][2] >= 2 * per_weight, shapes


@pytest.mark.extended   # README command's time budget (docs/development.md)
def test_scan_layers_without_weights_to_prefetch_is_a_checkpointed_scan():
    """One rank: nothing is gathered, so nothing is prefetched; the same bits as the checkpointed scan."""
    assert_same_training(two_steps_bf16_wire(loss_prefetch, "fp8", 1), two_steps_bf16_wire(loss_checkpointed, "fp8", 1))


def test_scan_layers_gradient_of_a_closed_over_array():
    """A body that closes over a differentiated array (a scale shared by every layer): its gradient is the sum over
    the layers, as jax.lax.scan's."""
    def loss(scan, w, scale):
        blocks = jax.tree.map(lambda a: a.astype(jnp.float32), w)
        body = lambda h, layer: (jnp.tanh(h @ layer.T) * scale, None)
        h = jnp.ones((4, 8), jnp.float32)
        return jnp.sum(scan(body, h, blocks))

    w = jax.random.normal(jax.random.key(0), (3, 8, 8), jnp.float32) / 4
    scale = jnp.float32(1.3)
    mine = jax.grad(lambda w, s: loss(scan_layers, w, s), argnums=(0, 1))(w, scale)
    want = jax.grad(lambda w, s: loss(checkpointed_scan, w, s), argnums=(0, 1))(w, scale)
    for a, b in zip(mine, want):
        np.testing.assert_array_equal(a, b)


def test_scan_layers_errors():
    with pytest.raises(ValueError, match="layers: every leaf must be stacked along axis 0 with the same length"):
        scan_layers(lambda h, layer: (h, None), jnp.zeros(2), {"a": jnp.zeros((3, 2)), "b": jnp.zeros((4, 2))})
    with pytest.raises(ValueError, match=r"body: must return \(carry, None\)"):
        scan_layers(lambda h, layer: (h, h), jnp.zeros(2), jnp.zeros((3, 2)))


def _two_steps(loss, rules, params, recipe="fp8", tp=1):
    """Parameters after two SGD steps of ``make_train_step`` with ``rules`` on 8 ranks (``tp`` of them on "tp")."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // tp, tp), ("fsdp", "tp"))
    step = jq.make_train_step(loss, optax.sgd(LR), mesh=mesh, rules=rules, tp_axis="tp" if tp > 1 else None,
                              policy=jq.MixedPrecisionPolicy(compute_weights=recipe))
    state = step.init(params)
    for i in range(2):
        state, _ = step(state, make_batch(i))
    return jax.tree.map(np.asarray, step.params(state))


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
@pytest.mark.extended   # README command's time budget (docs/development.md)
def test_scan_layers_with_in_out_kernels(recipe):
    """``[in, out]`` kernels (flax's layout): the prefetched operands are the ones the layer's forward reads (FP8: the
    columnwise bytes); the same bits as the checkpointed scan."""
    from test_in_out_kernels import rules, transposed

    run = lambda loss: _two_steps(loss, rules("in_out"), transposed(init_params()), recipe)
    assert_same_params(run(loss_prefetch), run(loss_checkpointed))


@pytest.mark.extended   # README command's time budget (docs/development.md)
def test_scan_layers_split_over_tp():
    """FSDP 4 x TP 2 (w1 column-parallel, w2 row-parallel, amaxes reduced over tp too): the same bits as the
    checkpointed scan."""
    from test_in_out_kernels import rules

    def loss_tp(scan_fn):
        def loss(w, batch):
            h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
            h = scan_fn(lambda h, layer: (block(h, layer, tp_axis="tp"), None), h, w["blocks"])
            return head(h, w, batch)
        return loss

    run = lambda loss: _two_steps(loss, rules("out_in", tp=True), init_params(), tp=2)
    assert_same_params(run(loss_tp(scan_layers)), run(loss_tp(checkpointed_scan)))


@pytest.mark.extended   # README command's time budget (docs/development.md)
def test_scan_layers_body_closing_over_a_trained_value_in_the_step():
    """Inside the step (shard_map over 8 ranks): a body that closes over a value computed from a trained leaf (here
    the embedding's mean) sends that leaf its gradient through the loop; the same bits as the checkpointed scan."""
    def loss_with(scan_fn):
        def loss(w, batch):
            h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
            shift = jnp.mean(w["embed"].astype(jnp.float32)) * 0.01
            h = scan_fn(lambda h, layer: (block(h, layer) + shift, None), h, w["blocks"])
            return head(h, w, batch)
        return loss

    assert_same_training(two_steps_bf16_wire(loss_with(scan_layers), "fp8", 8),
                         two_steps_bf16_wire(loss_with(checkpointed_scan), "fp8", 8))
