"""Layer-wise FSDP (make_train_step's default strategy) on 8 simulated CPU devices: stacked leaves under
``jax.lax.scan`` (with and without remat) equal per-layer leaves in a Python loop, 8 devices equal 1, HSDP on
(replicate, fsdp, tp) equals one device, ``quantize_mask`` leaves arrive as arrays and train, and the HLO
gathers quantized bytes and reduce-scatters per layer inside the loop.
"""

import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from codegen import XLA_DEFAULT_CODEGEN

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

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


def _block(h, layer, tp_axis=None):
    x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6) * layer["norm"]
    if tp_axis is not None:   # column-parallel w1 (Megatron's "f": its transpose sums dx over tp); x stays
        x = jax.lax.pcast(x, tp_axis, to="varying")   # fp32 so that dx's TP partial sums are not rounded to bf16
    amax = () if tp_axis is None else (tp_axis,)
    u = jax.nn.gelu(jq.dense(x, layer["w1"], amax_axes=amax))
    y = jq.dense(u, layer["w2"], out_dtype=jnp.float32, amax_axes=amax)
    return h + (y if tp_axis is None else jax.lax.psum(y, tp_axis))


def _head(h, w, batch):
    logits = jq.dense(h.astype(jnp.bfloat16), w["head"], out_dtype=jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][:, None], axis=-1))


def loss_scan(w, batch, remat=False, tp_axis=None):
    h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
    body = lambda h, layer: (_block(h, layer, tp_axis), None)
    h, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, h, w["blocks"])
    return _head(h, w, batch)


def loss_loop(w, batch):
    h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)
    for layer in w["blocks"]:
        h = _block(h, layer)
    return _head(h, w, batch)


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


@pytest.mark.parametrize("cw", ["bf16", "fp8", "nvfp4"])
@pytest.mark.slow
def test_scan_over_stacked_equals_loop_over_layers(cw):
    """Bitwise: each layer is quantized with its own scales and its gradient reduce-scattered on its own,
    whether the layers are a stack under scan or separate leaves."""
    stacked, losses_s, _, _ = trained_scan(cw)       # init_params() is stacked
    looped, losses_l, _, _ = train(loss_loop, init_params(stacked=False), cw=cw, compiler_options=XLA_DEFAULT_CODEGEN)
    np.testing.assert_array_equal(losses_s, losses_l)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(stacked)[0], jax.tree.leaves(stack_params(looped))):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    assert losses_s[-1] < losses_s[0]


@pytest.mark.slow
def test_remat_inside_scan_equals_no_remat():
    plain, lp, _, _ = trained_scan("fp8")
    remat, lr_, _, _ = train(functools.partial(loss_scan, remat=True), init_params(), cw="fp8",
                             compiler_options=XLA_DEFAULT_CODEGEN)
    np.testing.assert_array_equal(lp, lr_)
    jax.tree.map(np.testing.assert_array_equal, plain, remat)


@pytest.mark.parametrize("cw", ["bf16", "nvfp4"])
@pytest.mark.slow
def test_eight_devices_equal_one(cw):
    """One step of the same model on 8 FSDP ranks and on 1: the same loss (fp32 sum order) and updates
    within the bf16 rounding of each rank's weight gradient (8 ranks round 8 partial gradients, one rank the
    whole). FP8 is left out: its activations are scaled per rank (make_train_step's amax scope)."""
    p8, l8 = scan_after_one_step(cw)                   # train(loss_scan, init_params(), cw=cw, steps=1)
    p1, l1, _, _ = train(loss_scan, init_params(), devices=1, cw=cw, steps=1)
    np.testing.assert_allclose(l8, l1, rtol=1e-6)
    assert_close_to(p8, p1, init_params(), 2 ** -6)


@pytest.mark.slow
def test_hsdp_with_tp_equals_fsdp():
    """(replicate 2, fsdp 2, tp 2) against 4 FSDP ranks (the same 4 batch shards, so the same FP8 activation
    scales): params and optimizer state replicated over "dp", sharded over "fsdp", w1 column- and w2
    row-parallel over "tp"; equal within fp32 reordering of the gradient sums (which may flip the bf16
    rounding of a weight-gradient element)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("dp", "fsdp", "tp"))
    specs = {"embed": None, "head": None, "blocks": {"w1": "col", "w2": "row", "norm": None}}
    p, l, step, state = train(functools.partial(loss_scan, tp_axis="tp"), init_params(), mesh=mesh, cw="fp8",
                              tp_axis="tp", param_specs=specs, replicate_axis="dp")
    assert tuple(state.master["blocks"]["w1"].sharding.spec)[:2] == (None, ("tp", "fsdp"))
    assert tuple(state.master["blocks"]["w2"].sharding.spec) == (None, "fsdp", "tp")
    shard = state.master["blocks"]["w1"].addressable_shards[0].data
    assert shard.shape == (L, F // 4, D)                # 1/(tp x fsdp) of the rows, whole over dp
    p4, l4, _, _ = train(loss_scan, init_params(), devices=4, cw="fp8")
    np.testing.assert_allclose(l, l4, rtol=1e-5)
    assert_close_to(p, p4, init_params(), 1e-3)   # a reordered fp32 sum can flip a bf16 rounding of dW


@pytest.mark.slow
def test_quantize_mask_leaves_arrive_as_arrays():
    seen = {}

    def loss(w, batch):
        seen.update(embed=w["embed"], norm=w["blocks"]["norm"], w1=w["blocks"]["w1"])
        return loss_scan(w, batch)

    p, losses, _, _ = train(loss, init_params(), cw="nvfp4")
    assert isinstance(seen["embed"], jax.Array) and seen["embed"].dtype == jnp.bfloat16      # masked matrix
    assert seen["embed"].shape == (VOCAB, D)                                                  # gathered whole
    assert isinstance(seen["norm"], jax.Array) and seen["norm"].dtype == jnp.bfloat16
    assert isinstance(seen["w1"], jq.ShardedWeight) and seen["w1"].shape == (L, F, D)
    assert losses[-1] < losses[0]
    assert float(jnp.max(jnp.abs(p["embed"] - init_params()["embed"]))) > 0      # the embedding trains
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    with pytest.raises(ValueError, match=r"quantize_mask\[.embed.\]: leaves must be True or False"):
        bad = {**MASK(init_params()), "embed": "no"}
        jq.make_train_step(loss_scan, optax.sgd(LR), mesh=mesh, quantize_mask=bad).init(init_params())
    with pytest.raises(ValueError, match="quantize_mask: must be a pytree like params, or a prefix of it"):
        jq.make_train_step(loss_scan, optax.sgd(LR), mesh=mesh, quantize_mask={"embed": False}).init(init_params())


def _all_gathers(text):
    """(operand type, result type) of every all-gather in a lowered module's text."""
    return re.findall(r'"stablehlo\.all_gather"\([^)]*\) <\{.*?\}> : \((tensor<[^>]*>)\) -> (tensor<[^>]*>)', text)


@pytest.mark.parametrize("cw,wire", [("fp8", "f8E4M3FN"), ("nvfp4", "ui8"), ("bf16", "bf16")])
@pytest.mark.slow
def test_hlo_gathers_quantized_bytes_per_layer_inside_the_loop(cw, wire):
    """The lowered step all-gathers one layer's quantized w1 / w2 (not the [L, ...] stack, not fp32) a fixed
    number of times whatever L is (forward, backward: the loop body), and reduce-scatters one layer's
    gradient [rows, in] -> [rows / 8, in] in the comm dtype (fp32)."""
    from test_train import collective_types

    def counts(layers):
        global L
        saved, L = L, layers
        try:
            _, _, step, state = train(loss_scan, init_params(), cw=cw, steps=0)   # lowered, not run
            text = step.lower(state, make_batch()).as_text()
        finally:
            L = saved
        return _all_gathers(text), collective_types(text, "reduce_scatter")

    cols = (lambda c: c // 2) if cw == "nvfp4" else (lambda c: c)
    g3, s3 = counts(3)
    g6, s6 = counts(6)
    for rows, c in ((F, D), (D, F)):
        layer = (f"tensor<{rows // 8}x{cols(c)}x{wire}>", f"tensor<{rows}x{cols(c)}x{wire}>")
        assert layer in g3, g3
        assert g3.count(layer) == g6.count(layer) <= 2, (g3.count(layer), g6.count(layer))   # not per layer unrolled
        assert (f"tensor<{rows}x{c}xf32>", f"tensor<{rows // 8}x{c}xf32>") in s3, s3
    assert not any("f32" in a and a.count("x") == 3 for a, _ in g3), g3      # no stacked fp32 weights gathered
    assert len(g3) == len(g6) and len(s3) == len(s6)


@functools.cache   # the same for every recipe
def _plain_scan_step_temp_bytes(layers):
    """Compiled temp bytes of what a JAX user writes without jaxquant: fp32 params sharded over fsdp, bf16 casts
    inside the loss, the same blocks under scan, XLA's gathers and reduce-scatters."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    params = init_params()
    spec = lambda x: P(*([None] * (x.ndim - 2)), "fsdp", None) if x.shape[-2] % 8 == 0 else P()
    params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), params)
    mm = lambda x, w: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16).T

    def loss(p, b):
        h = jnp.take(p["embed"].astype(jnp.bfloat16), b["tokens"], axis=0).astype(jnp.float32)

        def body(h, layer):
            x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6) * layer["norm"]
            return h + mm(jax.nn.gelu(mm(x, layer["w1"])), layer["w2"]).astype(jnp.float32), None

        h, _ = jax.lax.scan(body, h, p["blocks"])
        logp = jax.nn.log_softmax(mm(h, p["head"]).astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, b["targets"][:, None], axis=-1))

    step = jax.jit(lambda p, b: jax.tree.map(lambda a, d: a - LR * d, p, jax.grad(loss)(p, b)))
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("fsdp")))
    return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("cw", ["bf16", "fp8", "nvfp4"])
@pytest.mark.slow
def test_temp_memory_grows_per_layer_like_plain_fsdp(cw, monkeypatch):
    """The compiled step's temporary memory grows with the layer count about as plain JAX FSDP's does (activation
    residuals), not by a layer's gathered weights and full-size gradients (XLA:CPU's memory analysis)."""
    def temp(layers, fn):
        monkeypatch.setattr(sys.modules[__name__], "L", layers)
        return fn(layers)

    def jq_temp(layers):
        _, _, step, state = train(loss_scan, init_params(), cw=cw, steps=0)
        return step.lower(state, make_batch()).compile().memory_analysis().temp_size_in_bytes

    jq_growth = (temp(8, jq_temp) - temp(2, jq_temp)) / 6
    plain_growth = (temp(8, _plain_scan_step_temp_bytes) - temp(2, _plain_scan_step_temp_bytes)) / 6
    layer_weights_and_grads = (2 + 4) * 2 * F * D      # bf16 gathered w1 + w2 and their fp32 gradients
    assert jq_growth < 2 * plain_growth, (jq_growth, plain_growth)
    assert jq_growth < layer_weights_and_grads / 2, (jq_growth, layer_weights_and_grads)


@pytest.mark.parametrize("cw", ["bf16", "fp8", "nvfp4"])
@pytest.mark.slow
def test_reshard_after_forward_false_keeps_the_gathered_weight(cw):
    """make_train_step(reshard_after_forward=False) (PyTorch FSDP2's switch): the backward reads the weight the
    forward gathered instead of gathering it again. Same losses and parameters bitwise (the same bytes reach
    the same GEMMs); the lowered step gathers each layer's w1 / w2 once instead of twice; its compiled temporary
    memory grows by the gathered weights it keeps per layer."""
    wire = {"bf16": "bf16", "fp8": "f8E4M3FN", "nvfp4": "ui8"}[cw]
    cols = (lambda c: c // 2) if cw == "nvfp4" else (lambda c: c)
    runs = {}
    for reshard in (True, False):
        params, losses, step, state = trained_scan(cw, reshard)
        lowered = step.lower(state, make_batch())
        text = lowered.as_text()
        gathered = [result for _, result in _all_gathers(text)]
        layer_gathers = sum(gathered.count(f"tensor<{rows}x{cols(c)}x{wire}>") for rows, c in ((F, D), (D, F)))
        runs[reshard] = params, losses, layer_gathers, lowered.compile().memory_analysis().temp_size_in_bytes
    (p_re, l_re, n_re, t_re), (p_keep, l_keep, n_keep, t_keep) = runs[True], runs[False]
    np.testing.assert_array_equal(l_re, l_keep)
    jax.tree.map(np.testing.assert_array_equal, p_re, p_keep)
    assert n_keep == 2 and n_re == 4, (n_keep, n_re)     # w1 and w2: forward only / forward and backward
    assert t_keep > t_re, (t_keep, t_re)


def test_reshard_after_forward_is_checked():
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    with pytest.raises(TypeError, match="reshard_after_forward: must be a bool"):
        jq.make_train_step(loss_scan, optax.sgd(LR), mesh=mesh, reshard_after_forward="no")
    with pytest.raises(ValueError, match="reshard_after_forward: False needs strategy='optim_grads_params'"):
        jq.make_train_step(loss_scan, optax.sgd(LR), mesh=mesh, strategy="optim", reshard_after_forward=False)
