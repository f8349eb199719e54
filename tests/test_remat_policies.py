"""``jq.remat_policy``: the named ``jax.checkpoint`` policies for a block of ``jq.dense`` layers keep what they
name and nothing else (``nothing_saved``: only the block's inputs; ``gemm_outputs``: every layer's output;
``quantized_activations``: the activations the layers keep for their backward, FP8 bytes and scale for an FP8
layer), on arrays and on the training step's sharded weights; and a remat'ed scanned step trains bit for bit
like the step without remat."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals

import jaxquant as jq
from support.meshes import fsdp_mesh
from support.transformer import MASK, block, head, init_params, loss_scan, make_batch

B, D, F = 32, 64, 128


def _block(x, w1, w2, recipe):
    u = jax.nn.gelu(jq.dense(x, w1, recipe=recipe))
    return jq.dense(u, w2, recipe=recipe, out_dtype=jnp.float32)


def _saved(policy, recipe, capsys):
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (B, D))
    w1, w2 = jax.random.normal(ks[1], (F, D)), jax.random.normal(ks[2], (D, F))
    f = jax.checkpoint(lambda x, w1, w2: jnp.sum(_block(x, w1, w2, recipe) ** 2), policy=jq.remat_policy(policy))
    capsys.readouterr()
    print_saved_residuals(f, x, w1, w2)
    return [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4", "bf16"])
def test_each_policy_keeps_what_it_names(recipe, capsys):
    assert _saved("nothing_saved", recipe, capsys) == []
    outputs = _saved("gemm_outputs", recipe, capsys)
    assert outputs and all("named 'jaxquant_gemm_output'" in s for s in outputs), outputs
    assert any(f"[{B},{F}]" in s for s in outputs), outputs      # the first layer's output (the gelu's input)
    acts = _saved("quantized_activations", recipe, capsys)
    assert acts and all("named 'jaxquant_quantized_activation'" in s for s in acts), acts
    # FP8's weight-gradient GEMM reads the transposed E4M3 bytes [in, B] (TN); NVFP4 GEMMs the bf16 activation;
    # "bf16" (no quantization) the activation in the fp32 weight's dtype
    want = {"fp8": "f8_e4m3fn", "nvfp4": "bf16", "bf16": "f32"}[recipe]
    for width in (D, F):
        shape = f"[{width},{B}]" if recipe == "fp8" else f"[{B},{width}]"
        assert any(s.startswith(want + shape) for s in acts), acts


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match=r"name: must be one of \('nothing_saved', 'gemm_outputs'"):
        jq.remat_policy("everything")


def _remat_scan(w, batch, policy):
    h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)

    body = jax.checkpoint(lambda h, layer: (block(h, layer), None), policy=jq.remat_policy(policy))
    h, _ = jax.lax.scan(body, h, w["blocks"])
    return head(h, w, batch)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("policy", ["nothing_saved", "gemm_outputs", "quantized_activations"])
@pytest.mark.fast_cases("gemm_outputs", "nothing_saved")  # nothing_saved: the 13B benchmark's policy
def test_remat_scan_step_equals_the_plain_scan_step(policy):
    """On the sharded weights of make_train_step (FP8, 8 devices): the same losses and parameters, bitwise, and
    the backward's re-run forward gathers no weight a second time (its gather and the backward's are one)."""
    mesh = fsdp_mesh()
    out = {}
    for name, loss in (("plain", loss_scan), (policy, functools.partial(_remat_scan, policy=policy))):
        step = jq.make_train_step(loss, optax.adam(1e-3), mesh=mesh, quantize_mask=MASK,
                                  policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))
        state = step.init(init_params())
        gathers = len(re.findall(r"all-gather(?:-start)?\(", step.lower(state, make_batch()).compile().as_text()))
        losses = []
        for i in range(2):
            state, m = step(state, make_batch(i))
            losses.append(np.asarray(m["loss"]))
        out[name] = (losses, jax.tree.map(np.asarray, step.params(state)), gathers)
    np.testing.assert_array_equal(out["plain"][0], out[policy][0])
    for a, b in zip(jax.tree.leaves(out["plain"][1]), jax.tree.leaves(out[policy][1])):
        np.testing.assert_array_equal(a, b)
    assert out[policy][2] == out["plain"][2], (out[policy][2], out["plain"][2])
