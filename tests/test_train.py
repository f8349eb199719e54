"""make_train_step on 8 simulated CPU devices: microbatches, full-batch-mean gradient, gradient dtypes in
the lowered module, NVFP4 vs on-the-fly parity over 50 steps, NaN reporting, donation, bad input.

The strategy x compute-weights equivalence matrix is in tests/test_train_strategies.py; the model and the
single-device reference both use are tests/support/mlp.py's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from support.hlo import collective_types
from support.meshes import fsdp_mesh
from support.mlp import (BATCH, D_HID, D_IN, D_OUT, assert_tree_close, init_params, loss_fn, make_batch, run_step)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cw", ["bf16", "nvfp4"])
@pytest.mark.slow
def test_microbatches_4_equals_1(cw):
    """Same batch, 4 microbatches vs 1: the loss is equal up to fp32 summation order and the update up
    to the bf16 rounding of each microbatch's weight gradient (2^-7 of the largest update); the weight quantization
    does not depend on the batch split. (FP8 activations are scaled per microbatch, so fp8 differs by
    more: its microbatches are covered against the reference in test_train_strategies.py.)"""
    params, batch = init_params(), make_batch()
    kw = dict(steps=1, optimizer=optax.sgd(1.0), policy=jq.MixedPrecisionPolicy(compute_weights=cw),
              strategy="optim_grads_params")
    p1, l1, *_ = run_step(params, batch, microbatches=1, **kw)
    p4, l4, *_ = run_step(params, batch, microbatches=4, **kw)
    np.testing.assert_allclose(l4, l1, rtol=1e-6)
    d1, d4 = (jax.tree.map(jnp.subtract, params, p) for p in (p1, p4))
    for name in d1:   # microbatch gradients are larger than their mean: bound by the largest update
        np.testing.assert_allclose(d4[name], d1[name], rtol=0, atol=2 ** -7 * float(jnp.max(jnp.abs(d1[name]))),
                                   err_msg=name)
    assert float(jnp.max(jnp.abs(d1["w1"]))) > 1e-2


@pytest.mark.parametrize("num_shards", [1, 8])
@pytest.mark.slow
def test_update_is_full_batch_mean_gradient(num_shards):
    """SGD(lr=1) with 4 microbatches: params move by exactly minus the full-batch-mean gradient
    (not g + sum(g), not a sum over microbatches), also with a data-parallel group of size 1."""
    params, batch = init_params(), make_batch()
    policy = jq.MixedPrecisionPolicy(compute_weights="bf16", main_params_dtype=jnp.float32)
    p, *_ = run_step(params, batch, steps=1, optimizer=optax.sgd(1.0), policy=policy, microbatches=4,
                     strategy="optim_grads", mesh=fsdp_mesh(num_shards))

    def full_loss(ps):   # the full-batch mean loss with the same bf16 weights
        return loss_fn({"w1": ps["w1"].astype(jnp.bfloat16), "w2": ps["w2"].astype(jnp.bfloat16),
                        "b1": ps["b1"]}, batch)

    g = jax.grad(full_loss)(params)
    moved = jax.tree.map(lambda a, b: a - b, params, p)
    # bf16 rounding of each microbatch's weight gradient: far below the 25% a g + sum(g) bug would add
    assert_tree_close(moved, g, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("comm", [None, jnp.bfloat16])
@pytest.mark.slow
def test_grad_comm_dtype_in_lowered_module_optim(comm):
    """optim (ZeRO-1): each leaf's gradient is all-reduced whole, in grad_comm_dtype, and nothing is
    reduce-scattered; it reaches the optimizer in fp32. (That the sum over ranks comes once, after the
    microbatches, is what tests/test_train_microbatches.py's bitwise equality with the reference shows.)"""
    policy = jq.MixedPrecisionPolicy(compute_weights="nvfp4", grad_comm_dtype=comm)
    step = jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=fsdp_mesh(8), policy=policy, strategy="optim",
                              microbatches=2)
    text = step.lower(step.init(init_params()), make_batch()).as_text()
    t = "bf16" if comm is not None else "f32"
    reduced = collective_types(text, "all_reduce")
    for shape in (f"{D_HID}x{D_IN}", f"{D_OUT}x{D_HID}", f"{D_HID}"):     # w1, w2, b1: every row
        assert (f"tensor<{shape}x{t}>", f"tensor<{shape}x{t}>") in reduced, reduced
    assert collective_types(text, "reduce_scatter") == []
    if comm is not None:   # accumulated in fp32, sent in bf16, back to fp32 for the optimizer
        assert re.search(rf"stablehlo\.convert %\S+ : \(tensor<{D_HID}x{D_IN}xf32>\) -> tensor<{D_HID}x{D_IN}xbf16>",
                         text)
        assert re.search(rf"stablehlo\.convert %\S+ : \(tensor<{D_HID}x{D_IN}xbf16>\) -> tensor<{D_HID}x{D_IN}xf32>",
                         text)


@pytest.mark.parametrize("comm", [None, jnp.bfloat16])
def test_grad_comm_dtype_in_lowered_module_layerwise(comm):
    """optim_grads_params: each weight's gradient is reduce-scattered on its own, in grad_comm_dtype, from
    the full [out, in] gradient of this rank to its rows; the optimizer reads fp32 shards."""
    policy = jq.MixedPrecisionPolicy(compute_weights="fp8", grad_comm_dtype=comm)
    step = jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=fsdp_mesh(8), policy=policy, microbatches=2)
    text = step.lower(step.init(init_params()), make_batch()).as_text()
    t = "bf16" if comm is not None else "f32"
    scattered = collective_types(text, "reduce_scatter")
    for rows, cols in ((D_HID, D_IN), (D_OUT, D_HID)):          # w1, w2: rows split over 8 ranks
        assert (f"tensor<{rows}x{cols}x{t}>", f"tensor<{rows // 8}x{cols}x{t}>") in scattered, scattered
    assert (f"tensor<{D_HID}x{t}>", f"tensor<{D_HID // 8}x{t}>") in scattered, scattered       # b1
    if comm is not None:
        assert re.search(rf"stablehlo\.convert %\S+ : \(tensor<{D_HID // 8}x{D_IN}xbf16>\) -> "
                         rf"tensor<{D_HID // 8}x{D_IN}xf32>", text)
        assert not any("f32" in a for a, _ in scattered), scattered


@pytest.mark.slow
def test_nvfp4_weights_match_bf16_weights_quantized_on_the_fly_over_50_steps():
    """TransformerEngine's parity test: NVFP4 weights cast from fp32 master shards each step vs bf16
    weights that dense quantizes with the same recipe: the loss is bitwise equal at every step."""
    params, batch = init_params(), make_batch()
    kw = dict(steps=50, optimizer=optax.adam(1e-2), strategy="optim_grads_params", microbatches=1)
    _, la, *_ = run_step(params, batch, policy=jq.MixedPrecisionPolicy(compute_weights="nvfp4"), **kw)

    def on_the_fly(w, b):
        h = jax.nn.relu(jq.dense(b["x"], w["w1"], recipe="nvfp4", out_dtype=jnp.float32) + w["b1"])
        return jnp.mean((jq.dense(h, w["w2"], recipe="nvfp4", out_dtype=jnp.float32) - b["y"]) ** 2)

    step = jq.make_train_step(on_the_fly, optax.adam(1e-2), mesh=fsdp_mesh(8),
                              policy=jq.MixedPrecisionPolicy(compute_weights="bf16"), strategy="optim_grads_params")
    state, lb = step.init(params), []
    for _ in range(50):
        state, m = step(state, batch)
        lb.append(float(m["loss"]))
    assert la[-1] < 0.8 * la[0], la
    np.testing.assert_array_equal(np.asarray(la, np.float32), np.asarray(lb, np.float32))


# reduce-scattered / all-reduced over 8 ranks; one rank (no reduction: the leaves are checked directly)
@pytest.mark.parametrize("strategy,ranks", [("optim_grads_params", 8), ("no_shard", 8), ("optim_grads_params", 1)])
@pytest.mark.parametrize("bad", ["b1", "w2"])
@pytest.mark.slow
def test_nan_gradient_names_parameter_and_skips_update(bad, strategy, ranks):
    """The NaN enters through one rank's batch row; each rank checks only its shard of the reduced
    gradient, so the flag comes from the rank that owns the poisoned elements."""
    def poisoned(w, b):   # the extra term is 0 normally, NaN in the gradient of `bad` when b["p"] is NaN
        extra = (jnp.sum(w["b1"] * b["p"]) if bad == "b1" else
                 jnp.sum(jq.dense(b["p"][:, :D_HID], w["w2"], out_dtype=jnp.float32)))
        return loss_fn(w, b) + 0.0 * extra

    step = jq.make_train_step(poisoned, optax.adam(1e-2), mesh=fsdp_mesh(ranks), strategy=strategy,
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"), report_nan=True)
    params = init_params()
    clean = {**make_batch(), "p": jnp.zeros((BATCH, D_HID), jnp.float32)}
    state, metrics = step(step.init(params), clean)
    jq.raise_if_nonfinite(metrics)                    # nothing to report
    before = step.params(state)
    poison = clean["p"].at[5, 3].set(jnp.nan)
    state, metrics = step(state, {**clean, "p": poison})
    flags = {k: bool(v) for k, v in metrics["nonfinite"].items()}
    assert flags == {"b1": bad == "b1", "w1": False, "w2": bad == "w2"}
    assert bool(metrics["update_skipped"])
    with pytest.raises(FloatingPointError, match=rf"\['{bad}'\]"):
        jq.raise_if_nonfinite(metrics)
    assert_tree_close(step.params(state), before, rtol=0, atol=0)
    state, metrics = step(state, clean)             # training goes on
    assert not bool(metrics["update_skipped"])


def test_state_is_donated_and_params_round_trip():
    params = init_params()
    step = jq.make_train_step(loss_fn, optax.sgd(0.0), mesh=fsdp_mesh(8),
                              policy=jq.MixedPrecisionPolicy(compute_weights="bf16"))
    state = step.init(params)
    assert_tree_close(step.params(state), params, rtol=0, atol=0)
    old = state.master["w1"]
    assert len(old.sharding.device_set) == 8 and old.addressable_shards[0].data.shape[0] == old.shape[0] // 8
    state2, _ = step(state, make_batch())
    assert old.is_deleted()
    assert_tree_close(step.params(state2), params, rtol=0, atol=0)   # lr 0
    assert isinstance(step.lower(state2, make_batch()), jax.stages.Lowered)


def test_bad_input():
    mesh = fsdp_mesh(8)
    with pytest.raises(ValueError, match="strategy"):
        jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, strategy="zero3")
    with pytest.raises(ValueError, match="compute_weights"):
        jq.MixedPrecisionPolicy(compute_weights="int8")
    with pytest.raises(ValueError, match="microbatches"):
        jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, microbatches=0)
    with pytest.raises(ValueError, match="fsdp_axis"):
        jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, fsdp_axis="dp")
    tp_mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    with pytest.raises(ValueError, match="mesh: axis 'tp' has size 2"):     # a second axis needs tp_axis=
        jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=tp_mesh)
    with pytest.raises(ValueError, match="tp_axis: must differ"):
        jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=tp_mesh, tp_axis="fsdp")
    step = jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, microbatches=4)
    state = step.init(init_params())
    with pytest.raises(ValueError, match=r"batch\['x'\].*multiple of"):
        step(state, make_batch(n=48))
    with pytest.raises(ValueError, match="metrics"):
        jq.raise_if_nonfinite({"loss": jnp.float32(1)})
    with pytest.raises(ValueError, match=r"params\['w'\].*multiples of 16"):
        jq.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh,
                           policy=jq.MixedPrecisionPolicy(compute_weights="nvfp4")).init({"w": jnp.zeros((24, 16))})
