"""One quantization per activation tensor: when several ``jq.dense`` calls read the same activation with the same
recipe (q / k / v, gate / up), the lowered FP8 training step holds one activation amax pass (``jq_fp8_stats``) per
distinct activation tensor, in the forward and in a remat's re-run forward in the backward, while every GEMM's output
gradient keeps its own; the shared path trains bit for bit like GEMMs that each quantize their own copy of the
activation (FP8 and NVFP4), and the demo's flax Llama, an unchanged caller, gets the same sharing.

The counts are read from the lowered StableHLO: what the step asks for, before XLA's common-subexpression elimination
(which merged the repeated passes of the per-GEMM step when compiled for the CPU, while docs/performance.md's GPU
profile counted them repeated). A master weight's amax is a ``jq_fp8_stats`` custom call (its fp32 rows rounded to
bf16 inside the pass: ``round_bf16 = true``); an activation's or output gradient's amax is left to XLA (the pure-JAX
statistics, so that XLA fuses it into the kernel that produces the tensor: ``jaxquant/training/dense.py``,
``ACTIVATION_AMAX_IMPL``), one reduction of the whole tensor to a scalar with ``maximum``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxquant as jq
from jaxquant.primitives import _ffi
from support.meshes import fsdp_mesh

pytestmark = [
    pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (simulated) devices"),
    pytest.mark.skipif("cpu" not in _ffi.built_platforms(), reason="counts the compiled CPU extension's custom calls"),
]

D, HQ, F, LAYERS, BATCH, SEQ = 64, 32, 96, 2, 4, 16
ACTIVATIONS = 4     # per layer: the attention input (q, k, v), the attention output (o), the MLP input (gate, up),
GEMMS = 7           # the SwiGLU output (down); and seven GEMMs, each with its own output gradient


def _rms(h, scale):
    h32 = h.astype(jnp.float32)
    return (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6) * scale).astype(jnp.bfloat16)


def _block(h, p, copies):
    """A Llama-shaped block on jq.dense. ``copies``: k, v and up read an equal copy of their activation (a value of
    its own, so each of their GEMMs quantizes it again, as every GEMM did before the activation was shared)."""
    other = jnp.copy if copies else (lambda a: a)
    dense = functools.partial(jq.dense, out_dtype=jnp.float32)
    x = _rms(h, p["attn_norm"])
    q, k, v = dense(x, p["wq"]), dense(other(x), p["wk"]), dense(other(x), p["wv"])
    s = jnp.einsum("bqd,bkd->bqk", q, k) / np.float32(np.sqrt(HQ))
    s = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), s, -1e30)
    h = h + dense(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v).astype(jnp.bfloat16), p["wo"])
    x = _rms(h, p["mlp_norm"])
    gate, up = dense(x, p["wg"]), dense(other(x), p["wu"])
    return h + dense((jax.nn.silu(gate) * up).astype(jnp.bfloat16), p["wd"])


def _loss(w, batch, copies=False, remat=False):
    """The layers stacked under scan (its body lowered once: the counts below are per layer); ``remat``: the block
    re-run in the backward."""
    body = lambda h, p: (_block(h, p, copies), None)
    if remat:
        body = jax.checkpoint(body, policy=jq.remat_policy("nothing_saved"))
    h, _ = jax.lax.scan(body, batch["x"], w["blocks"])
    return jnp.mean(jnp.square(h - batch["y"]))


def _params():
    shapes = {"wq": (HQ, D), "wk": (HQ, D), "wv": (HQ, D), "wo": (D, HQ), "wg": (F, D), "wu": (F, D), "wd": (D, F)}
    layers = []
    for i in range(LAYERS):
        ks = jax.random.split(jax.random.key(i), len(shapes))
        layer = {n: jax.random.normal(k, s, jnp.float32) / np.sqrt(s[1]) for k, (n, s) in zip(ks, shapes.items())}
        layers.append(layer | {"attn_norm": jnp.ones((1, D), jnp.float32), "mlp_norm": jnp.ones((1, D), jnp.float32)})
    return {"blocks": jax.tree.map(lambda *a: jnp.stack(a), *layers)}


def _batch(seed):
    kx, ky = jax.random.split(jax.random.key(100 + seed))
    return {"x": jax.random.normal(kx, (BATCH, SEQ, D), jnp.float32),
            "y": jax.random.normal(ky, (BATCH, SEQ, D), jnp.float32)}


def _mask(p):
    return jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), p)


@functools.lru_cache(maxsize=None)
def _make_step(recipe, copies=False, remat=False):
    loss = functools.partial(_loss, copies=copies, remat=remat)
    return jq.make_train_step(loss, optax.adam(1e-2), mesh=fsdp_mesh(2), quantize_mask=_mask,
                              policy=jq.MixedPrecisionPolicy(compute_weights=recipe))


def _step(recipe, copies=False, remat=False):
    """(step, a fresh state: the step donates the one it is given), the step made once per configuration."""
    step = _make_step(recipe, copies, remat)
    return step, step.init(_params())


def amax_passes(text: str) -> dict:
    """The amax passes of a lowered module: ``weight`` (``jq_fp8_stats`` custom calls on master rows, rounded to bf16
    in the pass), ``tensor`` (an activation's or output gradient's: a reduction of every axis to a scalar with
    ``maximum``; the step has no other), ``custom`` (``jq_fp8_stats`` calls on anything else: none expected)."""
    out = {"weight": 0, "tensor": 0, "custom": 0}
    for line in text.splitlines():
        hit = re.search(r"custom_call @jq_fp8_stats\(.*round_bf16 = (true|false)", line)
        if hit:
            out["weight" if hit[1] == "true" else "custom"] += 1
        hit = re.search(r"stablehlo\.reduce\(.*applies stablehlo\.maximum across dimensions = \[([0-9, ]*)\] : "
                        r"\(tensor<([0-9x]*)x\w+>", line)
        if hit and len(hit[1].split(",")) == len(hit[2].split("x")):
            out["tensor"] += 1
    return out


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan-remat"])
def test_one_amax_pass_per_activation_tensor(remat):
    """Per layer: one activation pass per distinct activation (4, not 7) and one per GEMM's output gradient (7); with
    full remat the backward's re-run of the block adds 4 more (not 7). The same model with k, v and up reading
    copies counts 7 (and 7 more with remat) again."""
    reruns = 2 if remat else 1      # the forward, and the backward's re-run of it
    step, state = _step("fp8", remat=remat)
    got = amax_passes(step.lower(state, _batch(0)).as_text())
    # no weight amax pass in the layers: the casts read the amaxes the previous step computed (TrainState.weight_amax)
    assert got == {"weight": 0, "tensor": ACTIVATIONS * reruns + GEMMS, "custom": 0}, got
    step, state = _step("fp8", copies=True, remat=remat)
    got = amax_passes(step.lower(state, _batch(0)).as_text())
    assert got["tensor"] == GEMMS * reruns + GEMMS, got


def test_dense_on_arrays_quantizes_a_shared_activation_once():
    """jq.dense with array weights and recipe="fp8" (quantized on the fly), under jax.grad: q, k, v read x, one
    activation pass in the forward; dx is the sum of the three GEMMs' dx, as with a copy of x for each."""
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (32, D), jnp.bfloat16)
    ws = [jax.random.normal(k, (HQ, D), jnp.float32) for k in ks[1:]]

    def loss(x, ws, copies):   # each copy made right before its GEMM: x's gradient sums the dx in the same order
        ys = [jq.dense(jnp.copy(x) if copies and i else x, w, recipe="fp8", out_dtype=jnp.float32)
              for i, w in enumerate(ws)]
        return sum(jnp.sum(y * y) for y in ys)

    grads = {}
    for copies in (False, True):
        fn = jax.jit(jax.grad(functools.partial(loss, copies=copies), argnums=(0, 1)))
        got = amax_passes(fn.lower(x, ws).as_text())
        # the activation (one, or one per copy), and each GEMM's output gradient (the weights are arrays, quantized
        # on the fly: each its own amax pass)
        assert got == {"weight": 3, "tensor": (3 if copies else 1) + 3, "custom": 0}, got
        grads[copies] = jax.tree.map(np.asarray, fn(x, ws))
    jax.tree.map(np.testing.assert_array_equal, grads[False], grads[True])


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
@pytest.mark.fast_cases("fp8")
def test_shared_activation_trains_bit_for_bit_like_per_gemm_quantization(recipe):
    """Two Adam steps of the 2-layer scan: the same losses and parameters, bitwise, whether q / k / v and gate / up
    share one quantized activation or each quantize a copy (the bytes are the same; x's gradient is the same sum of
    the GEMMs' dx, in the same order)."""
    out = {}
    for copies in (False, True):
        step, state = _step(recipe, copies=copies)
        losses = []
        for i in range(2):
            state, m = step(state, _batch(i))
            losses.append(np.asarray(m["loss"]))
        out[copies] = losses, jax.tree.map(np.asarray, step.params(state))
    np.testing.assert_array_equal(out[False][0], out[True][0])
    jax.tree.map(np.testing.assert_array_equal, out[False][1], out[True][1])
    assert out[False][0][1] < out[False][0][0]


def test_demo_llama_through_the_flax_adapter_shares_too():
    """The demo's NNX Llama (separate nnx.Linear q / k / v and gate / up, nothing of jaxquant in it) under
    make_train_step, FP8, its layers under nnx.scan (the body lowered once): the lowered step's activation and
    gradient amax passes are the 4 activations and 7 output gradients of the block plus the head's activation and
    gradient (before: the 7 GEMMs' activations and 7 gradients, plus the head's two)."""
    from jaxquant.cli import llama

    cfg = llama.LlamaConfig(vocab=64, dim=64, heads=2, ffn=128, layers=1, seq=16)
    loss_fn = jq.flax_loss(llama.llama(cfg), llama.lm_loss)
    step = jq.make_train_step(loss_fn, optax.sgd(1e-3), mesh=fsdp_mesh(2), rules=llama.rules(),
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))
    state = step.init(jq.flax_params(loss_fn))
    got = amax_passes(step.lower(state, {"tokens": jnp.zeros((4, cfg.seq + 1), jnp.int32)}).as_text())
    # + 1: the head's weight, a whole 2-D leaf, whose next amax the update computes (the stacked layers' per-layer
    # amaxes reduce over two of three axes: not counted)
    assert got == {"weight": 0, "tensor": ACTIVATIONS + GEMMS + 2 + 1, "custom": 0}, got
