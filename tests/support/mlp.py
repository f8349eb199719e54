"""A small MLP trained by ``make_train_step``, and the single-device reference of one step's math (rank by rank,
microbatch by microbatch, in the step's dtypes) that the strategy tests hold the sharded step to."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxquant as jq
from support.meshes import fsdp_mesh

D_IN, D_HID, D_OUT, BATCH = 16, 32, 16, 64


def init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (D_HID, D_IN), jnp.float32) * 0.3,
            "b1": jnp.linspace(-0.1, 0.1, D_HID, dtype=jnp.float32),
            "w2": jax.random.normal(k2, (D_OUT, D_HID), jnp.float32) * 0.3}


def make_batch(seed=1, n=BATCH):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (n, D_IN), jnp.float32),
            "y": jax.random.normal(ky, (n, D_OUT), jnp.float32)}


def loss_fn(w, batch):
    h = jax.nn.relu(jq.dense(batch["x"], w["w1"], out_dtype=jnp.float32) + w["b1"])
    return jnp.mean((jq.dense(h, w["w2"], out_dtype=jnp.float32) - batch["y"]) ** 2)



def compute_weight(w, cw):
    """What the step hands loss_fn for a 2-D master ``w`` under compute_weights ``cw``."""
    if cw == "bf16":
        return w.astype(jnp.bfloat16)
    fn = jq.quantize_fp8 if cw == "fp8" else jq.quantize_nvfp4
    return fn(w, columnwise=True, compute_dtype=jnp.bfloat16)


def same_math_grad(loss, cw, bias):
    """jitted (params, batch) -> (loss, grads) of the math one rank runs on one microbatch: bf16 gradients of
    the compute weights of w1 and w2 (straight-through for quantized ones), fp32 for the bias ``bias``."""

    @jax.jit
    def grad(params, mb):
        mats = {n: compute_weight(params[n], cw) for n in ("w1", "w2")}

        def f(diff):
            w = {n: (jq.straight_through(mats[n], diff[n]) if cw != "bf16" else diff[n]) for n in mats}
            return loss({**w, bias: diff[bias]}, mb)

        diff = {n: (jnp.zeros(params[n].shape, jnp.bfloat16) if cw != "bf16" else mats[n]) for n in mats}
        return jax.value_and_grad(f)({**diff, bias: params[bias]})

    return grad


def reference_sgd(params, batch, *, cw, num_shards, microbatches, lr, steps, comm_dtype=jnp.float32, loss=None,
                  bias="b1"):
    """Single-device SGD with the step's math: rank r's rows, microbatch j's rows, gradients accumulated
    in fp32 from zero, scaled by 1/(S*k), cast to the comm dtype, summed over ranks in rank order. ``loss``
    (default: this module's ``loss_fn``) and its ``bias`` leaf: see :func:`same_math_grad`."""
    grad = same_math_grad(loss or loss_fn, cw, bias)
    n = jax.tree.leaves(batch)[0].shape[0]
    rows = n // (num_shards * microbatches)
    scale = np.float32(1.0 / (num_shards * microbatches))
    losses = []
    for _ in range(steps):
        total, loss_sum = None, 0.0
        for r in range(num_shards):
            acc = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), params)
            for j in range(microbatches):
                lo = (r * microbatches + j) * rows
                loss, g = grad(params, jax.tree.map(lambda a: a[lo:lo + rows], batch))
                loss_sum += float(loss)
                acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
            part = jax.tree.map(lambda a: (a * scale).astype(comm_dtype), acc)
            total = part if total is None else jax.tree.map(jnp.add, total, part)
        g = jax.tree.map(lambda a: a.astype(jnp.float32), total)
        params = jax.tree.map(lambda p, d: p + (-lr) * d, params, g)
        losses.append(loss_sum / (num_shards * microbatches))
    return params, losses


def run_step(params, batch, *, steps, optimizer, **kw):
    mesh = kw.pop("mesh", None) or fsdp_mesh(8)
    step = jq.make_train_step(loss_fn, optimizer, mesh=mesh, **kw)
    state = step.init(params)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return step.params(state), [float(v) for v in losses], step, state


def assert_tree_close(actual, expected, rtol, atol, what=""):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        name = what + jax.tree_util.keystr(path)
        if rtol == 0 and atol == 0:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=name)


STEPS, LR = 3, 0.5


@functools.lru_cache(maxsize=None)
def reference(cw, microbatches, comm=jnp.float32, steps=STEPS):
    """reference_sgd of the default parameters and batch on 8 ranks, computed once per configuration."""
    return reference_sgd(init_params(), make_batch(), cw=cw, num_shards=8, microbatches=microbatches,
                         lr=LR, steps=steps, comm_dtype=comm)


STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
COMPUTE_WEIGHTS = ["bf16", "fp8", "nvfp4"]


def check_strategy_equals_single_device(strategy, cw, microbatches):
    """make_train_step on 8 devices equals reference_sgd after STEPS steps: bitwise, or within fp32 reordering where
    sharded gradients are reduce-scattered per microbatch; losses within 1e-6 relative."""
    params, losses, *_ = run_step(init_params(), make_batch(), steps=STEPS, optimizer=optax.sgd(LR),
                                  policy=jq.MixedPrecisionPolicy(compute_weights=cw), strategy=strategy,
                                  microbatches=microbatches)
    ref_params, ref_losses = reference(cw, microbatches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for name in ref_params:
        if strategy in ("optim_grads", "optim_grads_params") and microbatches > 1:
            # sharded gradients are reduce-scattered each microbatch (no full-size accumulator): the sum over
            # ranks comes before the sum over microbatches, an fp32 reordering of the same terms
            update = float(jnp.max(jnp.abs(ref_params[name] - init_params()[name])))
            np.testing.assert_allclose(params[name], ref_params[name], rtol=0, atol=1e-6 * update, err_msg=name)
        else:
            np.testing.assert_array_equal(params[name], ref_params[name], err_msg=name)
    moved = float(jnp.max(jnp.abs(params["w1"] - init_params()["w1"])))
    assert moved > 1e-2, "the parameters did not train"
