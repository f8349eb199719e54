"""Layer-wise FSDP (make_train_step's default strategy) on 8 simulated CPU devices: stacked leaves under
``jax.lax.scan`` (with and without remat) equal per-layer leaves in a Python loop, 8 devices equal 1, HSDP on
(replicate, fsdp, tp) equals one device, ``quantize_mask`` leaves arrive as arrays and train, and the HLO
gathers quantized bytes and reduce-scatters per layer inside the loop.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from codegen import XLA_DEFAULT_CODEGEN
from support import transformer
from support.meshes import fsdp_mesh
from support.hlo import collective_types
from support.transformer import (D, F, LR, MASK, VOCAB, assert_close_to, init_params, loss_loop, loss_scan,
                                 make_batch, scan_after_one_step, stack_params, train, trained_scan)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

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
    assert shard.shape == (transformer.L, F // 4, D)                # 1/(tp x fsdp) of the rows, whole over dp
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
    assert isinstance(seen["w1"], jq.ShardedWeight) and seen["w1"].shape == (transformer.L, F, D)
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

    def counts(layers):
        saved, transformer.L = transformer.L, layers
        try:
            _, _, step, state = train(loss_scan, init_params(), cw=cw, steps=0)   # lowered, not run
            text = step.lower(state, make_batch()).as_text()
        finally:
            transformer.L = saved
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
        monkeypatch.setattr(transformer, "L", layers)
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
    if cw != "nvfp4":
        # NVFP4 GEMMs run on dequantized bf16 operands, which the CPU computes on fp32 copies (primitives/gemm.py):
        # there the re-gathered weights' fp32 copies, not the kept weights, decide the temporary memory
        assert t_keep > t_re, (t_keep, t_re)


def test_reshard_after_forward_is_checked():
    mesh = fsdp_mesh()
    with pytest.raises(TypeError, match="reshard_after_forward: must be a bool"):
        jq.make_train_step(loss_scan, optax.sgd(LR), mesh=mesh, reshard_after_forward="no")
    with pytest.raises(ValueError, match="reshard_after_forward: False needs strategy='optim_grads_params'"):
        jq.make_train_step(loss_scan, optax.sgd(LR), mesh=mesh, strategy="optim", reshard_after_forward=False)
