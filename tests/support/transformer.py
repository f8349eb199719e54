"""The toy transformer the layer-wise tests train: an embedding, L residual MLP blocks (RMS norm, w1, gelu, w2)
stacked for ``jax.lax.scan`` or as a list of layers, a head; its batch; the quantize mask; a trainer on a mesh of
simulated CPU devices, and a cached run of it several tests compare against."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import jaxquant as jq
from codegen import XLA_DEFAULT_CODEGEN

VOCAB, D, F, L, BATCH, STEPS, LR = 64, 128, 256, 3, 32, 3, 0.05


def init_params(stacked=True, seed=0):
    ks = jax.random.split(jax.random.key(seed), 2 * L + 2)
    w1 = [jax.random.normal(ks[2 * i], (F, D), jnp.float32) / np.sqrt(D) for i in range(L)]
    w2 = [jax.random.normal(ks[2 * i + 1], (D, F), jnp.float32) / np.sqrt(F) for i in range(L)]
    # [1, D]: a masked matrix, so it reaches the loss as bf16 both as a per-layer leaf and stacked [L, 1, D]
    norm = [jnp.linspace(0.5, 1.5, D, dtype=jnp.float32)[None] + 0.1 * i for i in range(L)]
    if stacked:
        blocks = {"w1": jnp.stack(w1), "w2": jnp.stack(w2), "norm": jnp.stack(norm)}
    else:
        blocks = [{"w1": a, "w2": b, "norm": c} for a, b, c in zip(w1, w2, norm)]
    return {"embed": jax.random.normal(ks[-2], (VOCAB, D), jnp.float32),
            "head": jax.random.normal(ks[-1], (VOCAB, D), jnp.float32) / np.sqrt(D),
            "blocks": blocks}


def stack_params(p):
    return {**p, "blocks": jax.tree.map(lambda *a: jnp.stack(a), *p["blocks"])}


def make_batch(seed=1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"tokens": jax.random.randint(k1, (BATCH,), 0, VOCAB), "targets": jax.random.randint(k2, (BATCH,), 0, VOCAB)}


def block(h, layer, tp_axis=None):
    x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6) * layer["norm"]
    if tp_axis is not None:   # column-parallel w1 (Megatron's "f": its transpose sums dx over tp); x stays
        x = jax.lax.pcast(x, tp_axis, to="varying")   # fp32 so that dx's TP partial sums are not rounded to bf16
    amax = () if tp_axis is None else (tp_axis,)
    u = jax.nn.gelu(jq.dense(x, layer["w1"], amax_axes=amax))
    y = jq.dense(u, layer["w2"], out_dtype=jnp.float32, amax_axes=amax)
    return h + (y if tp_axis is None else jax.lax.psum(y, tp_axis))


def head(h, w, batch):
    logits = jq.dense(h.astype(jnp.bfloat16), w["head"], out_dtype=jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][:, None], axis=-1))


def loss_scan(w, batch, remat=False, tp_axis=None):
    h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
    body = lambda h, layer: (block(h, layer, tp_axis), None)
    h, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, h, w["blocks"])
    return head(h, w, batch)


def loss_loop(w, batch):
    h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
    for layer in w["blocks"]:
        h = block(h, layer)
    return head(h, w, batch)


# the embedding is read with jnp.take and the norms are no weights of a GEMM: both stay (bf16) arrays
def MASK(p):
    not_norm = lambda path, _: "norm" not in jax.tree_util.keystr(path)
    return {"embed": False, "head": True, "blocks": jax.tree_util.tree_map_with_path(not_norm, p["blocks"])}


def train(loss, params, devices=8, cw="nvfp4", mesh=None, steps=STEPS, **kw):
    mesh = mesh or Mesh(np.array(jax.devices()[:devices]), ("fsdp",))
    step = jq.make_train_step(loss, optax.sgd(LR), mesh=mesh, policy=jq.MixedPrecisionPolicy(compute_weights=cw),
                              quantize_mask=MASK, **kw)
    state, losses = step.init(params), []
    for _ in range(steps):
        state, m = step(state, make_batch())
        losses.append(float(m["loss"]))
    return step.params(state), losses, step, state


def two_steps_bf16_wire(loss, cw, devices, optimizer=None, stacked=True, quantize_once=None):
    """Two steps of ``make_train_step`` over ``devices`` ranks, each on its own batch, with bf16 gradients on the
    wire (as the benchmarks send them) and XLA's default codegen: (trained params, losses, the lowered step's text)."""
    step = jq.make_train_step(loss, optimizer or optax.sgd(LR), mesh=Mesh(np.array(jax.devices()[:devices]), ("fsdp",)),
                              quantize_mask=MASK, compiler_options=XLA_DEFAULT_CODEGEN, quantize_once=quantize_once,
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw, grad_comm_dtype=jnp.bfloat16))
    state, losses = step.init(init_params(stacked=stacked)), []
    for i in range(2):
        state, m = step(state, make_batch(i))
        losses.append(np.asarray(m["loss"]))
    return step.params(state), losses, step.lower(state, make_batch()).as_text()


def switched_runs(monkeypatch, switch: str, run):
    """``{False: run(), True: run()}`` with ``jaxquant.training.fsdp``'s boolean ``switch`` off, then on (a module
    constant the step reads when it traces, e.g. ``SEPARATE_STACKED_AMAX``)."""
    from jaxquant.training import fsdp

    out = {}
    for on in (False, True):
        monkeypatch.setattr(fsdp, switch, on)
        out[on] = run()
    return out


def assert_same_params(params, params0):
    """Two parameter trees alike, bit for bit (the failing leaf's path named)."""
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params0)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def assert_same_training(run, run0):
    """Two :func:`two_steps_bf16_wire` results with the same losses and trained params, bit for bit."""
    (params, losses, _), (params0, losses0, _) = run, run0
    np.testing.assert_array_equal(losses, losses0)
    assert_same_params(params, params0)


@functools.lru_cache(maxsize=None)
def _trained_scan(cw, reshard, layers):
    """train(loss_scan, ...) on 8 devices, once per recipe, reshard_after_forward and layer count (L, the cache
    key only): several tests compare against it and only read what it returns (the step only to lower). Also
    returns the parameters after the first step (host copies: the step donates its state). Compiled at XLA's default
    level: test_scan_over_stacked_equals_loop_over_layers compares it bit for bit with another program."""
    params, losses, step, state = train(loss_scan, init_params(), cw=cw, reshard_after_forward=reshard, steps=1,
                                        compiler_options=XLA_DEFAULT_CODEGEN)
    first = jax.tree.map(np.asarray, params), list(losses)
    for _ in range(STEPS - 1):
        state, m = step(state, make_batch())
        losses.append(float(m["loss"]))
    return (step.params(state), losses, step, state), first


def trained_scan(cw, reshard=True):
    """What train(loss_scan, init_params(), cw=cw, reshard_after_forward=reshard) returns, computed once."""
    return _trained_scan(cw, reshard, L)[0]


def scan_after_one_step(cw):
    """(parameters, [loss]) of train(loss_scan, init_params(), cw=cw, steps=1): trained_scan's first step."""
    return _trained_scan(cw, True, L)[1]


def assert_close_to(params, ref, init, atol_of_update):
    for (path, a), b, c in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref),
                               jax.tree.leaves(init)):
        update = float(jnp.max(jnp.abs(b - c)))
        assert update > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, rtol=0, atol=atol_of_update * update, err_msg=jax.tree_util.keystr(path))

