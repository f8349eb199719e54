"""The ``loss_fn`` contract of make_train_step (8 simulated CPU devices): auxiliary outputs (``has_aux``), a per-step
rng (one key per data-parallel rank and microbatch), non-batch inputs (``extra``) and a loss normalised by the
global weight of valid tokens (``weighted_loss``), on tests/test_train.py's MLP."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxquant as jq
from support.meshes import fsdp_mesh
from support.mlp import assert_tree_close, init_params, loss_fn, make_batch

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def run(fn, steps=1, microbatches=2, strategy="optim_grads_params", batch=None, **call):
    kw = {k: call.pop(k) for k in ("has_aux", "weighted_loss") if k in call}
    step = jq.make_train_step(fn, optax.sgd(1.0), mesh=fsdp_mesh(8), microbatches=microbatches, strategy=strategy,
                              policy=jq.MixedPrecisionPolicy(compute_weights="bf16"), **kw)
    state = step.init(init_params())
    for _ in range(steps):
        state, metrics = step(state, make_batch() if batch is None else batch, **call)
    return step.params(state), metrics


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_aux_outputs_come_back_averaged_and_change_nothing(strategy):
    def with_aux(w, b):
        return loss_fn(w, b), {"rows": jnp.float32(b["x"].shape[0]), "y_mean": jnp.mean(b["y"])}

    params, m = run(with_aux, has_aux=True, strategy=strategy)
    plain, m0 = run(loss_fn, strategy=strategy)
    assert float(m["loss"]) == float(m0["loss"])
    assert_tree_close(params, plain, 0, 0)
    assert float(m["aux"]["rows"]) == 64 / 16                       # 8 ranks x 2 microbatches of 4 rows
    np.testing.assert_allclose(float(m["aux"]["y_mean"]), float(jnp.mean(make_batch()["y"])), rtol=1e-6)


def test_rng_is_one_key_per_rank_and_microbatch():
    key = jax.random.key(7)

    def draw(w, b, rng):
        return loss_fn(w, b), jax.random.uniform(rng, ())

    _, m = run(draw, has_aux=True, rng=key)
    want = np.mean([float(jax.random.uniform(k, ())) for r in range(8)
                    for k in jax.random.split(jax.random.fold_in(key, r), 2)])
    np.testing.assert_allclose(float(m["aux"]), want, rtol=1e-6)
    _, again = run(draw, has_aux=True, rng=key)
    assert float(again["aux"]) == float(m["aux"])
    _, other = run(draw, has_aux=True, rng=jax.random.key(8))
    assert float(other["aux"]) != float(m["aux"])


def test_dropout_with_rng_trains_and_is_reproducible():
    def dropout_loss(w, b, rng):
        keep = jax.random.bernoulli(rng, 0.9, b["x"].shape)
        return loss_fn(w, {**b, "x": jnp.where(keep, b["x"] / 0.9, 0)})

    p1, m1 = run(dropout_loss, steps=2, rng=jax.random.key(0))
    p2, m2 = run(dropout_loss, steps=2, rng=jax.random.key(0))
    assert_tree_close(p1, p2, 0, 0)
    p0, _ = run(loss_fn, steps=2)
    assert not np.array_equal(np.asarray(p1["w1"]), np.asarray(p0["w1"]))


def test_extra_inputs_reach_every_rank():
    def scaled(w, b, extra):
        return extra["scale"] * loss_fn(w, b)

    params, m = run(scaled, extra={"scale": jnp.float32(2.0)})
    _, m1 = run(loss_fn)
    assert float(m["loss"]) == 2 * float(m1["loss"])
    assert not np.array_equal(np.asarray(params["w1"]), np.asarray(run(loss_fn)[0]["w1"]))


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_weighted_loss_is_normalised_by_the_global_token_count(strategy):
    """Rows masked unevenly across ranks (rank r keeps r + 1 of its 8 rows): SGD(lr=1) moves the parameters by
    minus the gradient of sum(row loss * mask) / sum(mask) over the whole batch (bf16 weights), which is not the
    mean of the ranks' means."""
    batch = make_batch()
    mask = jnp.asarray(np.concatenate([np.arange(8) <= r for r in range(8)]).astype(np.float32))
    batch = {**batch, "mask": mask}

    def row_losses(w, b):
        h = jax.nn.relu(jq.dense(b["x"], w["w1"], out_dtype=jnp.float32) + w["b1"])
        return jnp.mean((jq.dense(h, w["w2"], out_dtype=jnp.float32) - b["y"]) ** 2, axis=-1)

    def weighted(w, b):
        return jnp.sum(row_losses(w, b) * b["mask"]), jnp.sum(b["mask"])

    params, m = run(weighted, weighted_loss=True, batch=batch, strategy=strategy)
    init = init_params()

    def global_loss(ps):
        w = {"w1": ps["w1"].astype(jnp.bfloat16), "w2": ps["w2"].astype(jnp.bfloat16), "b1": ps["b1"]}
        return jnp.sum(row_losses(w, batch) * mask) / jnp.sum(mask)

    loss, g = jax.value_and_grad(global_loss)(init)
    assert float(m["weight"]) == float(jnp.sum(mask))
    np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    assert_tree_close(jax.tree.map(jnp.subtract, init, params), g, rtol=2e-2, atol=2e-3)
    mean_of_means, _ = run(lambda w, b: jnp.sum(row_losses(w, b) * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1),
                           batch=batch, strategy=strategy)
    assert float(np.max(np.abs(np.asarray(mean_of_means["w1"]) - np.asarray(params["w1"])))) > 1e-3


def test_contract_errors():
    with pytest.raises(ValueError, match=r"has_aux=True must return \(loss, aux\)"):
        run(loss_fn, has_aux=True)
    with pytest.raises(ValueError, match=r"weighted_loss=True must return \(sum of the losses, sum of their weights"):
        run(loss_fn, weighted_loss=True)
    with pytest.raises(ValueError, match=r"must return a scalar loss"):
        run(lambda w, b: jnp.zeros(2) + loss_fn(w, b))
