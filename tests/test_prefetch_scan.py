"""``jaxquant.training.prefetch.scan`` (an experiment, not exported: docs/fsdp.md): the stacked layers under a scan
that gathers each layer's weights one layer ahead (forward and backward). On 8 simulated CPU devices: the step equals
``jax.lax.scan``'s bit for bit (bf16, FP8, NVFP4; with and without ``quantize_once``, remat and microbatches; a value
the body closes over gets its gradient), the lowered program gathers one layer per loop iteration whatever the depth,
and the gathered weights are not kept per layer for the backward (temporary memory grows with depth as
``jax.lax.scan``'s does)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from jaxquant.training.prefetch import scan as prefetch_scan
from test_layerwise import MASK, _block, _head, init_params, make_batch

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def _loss(w, batch, scan, remat=False, closure=False):
    h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
    # closure: the body reads a parameter that is not part of the stack (its gradient sums over the layers)
    shared = w["embed"][0].astype(jnp.float32) if closure else 0.0
    body = lambda h, layer: (_block(h + shared, layer), jnp.mean(h))
    h, means = scan(jax.checkpoint(body) if remat else body, h, w["blocks"])
    return _head(h, w, batch) + 1e-3 * jnp.sum(means)


def _train(loss, cw, layers=None, steps=2, **kw):
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    step = jq.make_train_step(loss, optax.adam(1e-3), mesh=mesh, quantize_mask=MASK,
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw), **kw)
    state, losses = step.init(init_params()), []
    for i in range(steps):
        state, m = step(state, make_batch(i))
        losses.append(np.asarray(m["loss"]))
    return jax.tree.map(np.asarray, step.params(state)), losses


@pytest.mark.parametrize("cw,once,remat,microbatches,closure", [
    ("fp8", False, False, 1, False), ("bf16", False, False, 1, True), ("nvfp4", True, False, 2, True),
    ("fp8", True, True, 2, False)], ids=lambda v: str(v))
@pytest.mark.fast_cases("fp8-False-False-1-False", "nvfp4-True-False-2-True")
def test_step_equals_lax_scan_bitwise(cw, once, remat, microbatches, closure):
    kw = dict(quantize_once=once, microbatches=microbatches)
    got = _train(functools.partial(_loss, scan=prefetch_scan, remat=remat, closure=closure), cw, **kw)
    want = _train(functools.partial(_loss, scan=jax.lax.scan, remat=remat, closure=closure), cw, **kw)
    np.testing.assert_array_equal(got[1], want[1])
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got[0])[0], jax.tree.leaves(want[0])):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _stacked(layers):
    p = init_params()
    return {**p, "blocks": jax.tree.map(lambda a: jnp.concatenate([a] * (layers // a.shape[0] + 1))[:layers],
                                        p["blocks"])}


def _compiled(scan, layers, cw="fp8"):
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    step = jq.make_train_step(functools.partial(_loss, scan=scan), optax.sgd(0.1), mesh=mesh, quantize_mask=MASK,
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw))
    lowered = step.lower(step.init(_stacked(layers)), make_batch())
    return lowered.as_text(), lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("cw", ["fp8"])
def test_one_layer_gathered_per_iteration_and_not_kept(cw):
    """The count of all-gathers in the program does not depend on the depth (each loop iteration gathers one layer;
    the stack is never gathered), and the temporary memory grows per layer no faster than under jax.lax.scan: the
    gathered weights are no per-layer residuals."""
    (text3, temp3), (text9, temp9) = (_compiled(prefetch_scan, n, cw) for n in (3, 9))
    gathers = lambda text: len(re.findall(r"all_gather", text))
    assert gathers(text3) == gathers(text9) > 0
    for shape in re.findall(r'"stablehlo\.all_gather"\([^)]*\) <\{.*?\}> : \(tensor<([^>]*)>\)', text9):
        assert not shape.startswith("9x"), shape          # one layer's rows, not the stack's
    (_, base3), (_, base9) = (_compiled(jax.lax.scan, n, cw) for n in (3, 9))
    growth, base_growth = (temp9 - temp3) / 6, (base9 - base3) / 6
    layer_gathered = 2 * 256 * 128      # the two weights of a layer, one byte an element (FP8; NVFP4 half)
    assert growth <= base_growth + layer_gathered / 4, (growth, base_growth)


def test_falls_back_to_lax_scan_where_nothing_is_gathered_per_use():
    """reshard_after_forward=False (the gathered weights kept for the backward) and the once-a-step strategies
    are scanned by jax.lax.scan itself: the same results."""
    for kw in (dict(reshard_after_forward=False), dict(strategy="optim_grads")):
        got = _train(functools.partial(_loss, scan=prefetch_scan), "fp8", steps=1, **kw)
        want = _train(functools.partial(_loss, scan=jax.lax.scan), "fp8", steps=1, **kw)
        for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
            np.testing.assert_array_equal(a, b)


def test_bad_arguments_name_the_rule():
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))

    def int_carry(w, batch):
        h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
        body = lambda c, layer: ((_block(c[0], layer), c[1] + 1), None)
        (h, _), _ = prefetch_scan(body, (h, jnp.int32(0)), w["blocks"])
        return _head(h, w, batch)

    step = jq.make_train_step(int_carry, optax.sgd(0.1), mesh=mesh, quantize_mask=MASK)
    with pytest.raises(TypeError, match=r"init\[1\]: prefetch.scan.s carry must be floating"):
        step(step.init(init_params()), make_batch())

    def bad_length(w, batch):
        h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
        return _head(prefetch_scan(lambda c, layer: (_block(c, layer), None), h, w["blocks"], length=5)[0], w, batch)

    step = jq.make_train_step(bad_length, optax.sgd(0.1), mesh=mesh, quantize_mask=MASK)
    with pytest.raises(ValueError, match="length: 5 does not match the layer axis of xs"):
        step(step.init(init_params()), make_batch())
