"""make_train_step on an FSDP x TP mesh (8 simulated CPU devices): a tiny MLP with one column-parallel and
one row-parallel weight, meshes 4x2 and 2x4, compute weights bf16 / fp8 / nvfp4.

After 3 SGD steps the params equal a single-device computation of the same math: whole weights quantized
whole (TP-local quantization with the whole weight's amax gives the same bytes: the splits are aligned to
the 16-element tiles), each FSDP rank's rows, gradients in bf16 accumulated in fp32, scaled by 1/S and
summed in rank order. Not bitwise: on the mesh the row-parallel GEMM's contraction is split in T partial
sums added by the psum over tp, on one device it is one GEMM. Stated tolerance: 1e-5 of the parameter's
largest update (fp32 reordering of the output; measured on XLA:CPU: w1 and w2 come out bitwise equal, the
bias b2, whose gradient is the fp32 output, within 2e-7 of its update), losses within 1e-5 relative.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from support.mlp import reference_sgd

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

D_IN, D_HID, D_OUT, BATCH, STEPS, LR = 32, 64, 32, 32, 3, 0.5
SPECS = {"w1": "col", "w2": "row", "b2": None}


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (D_HID, D_IN), jnp.float32) * 0.3,
            "w2": jax.random.normal(k2, (D_OUT, D_HID), jnp.float32) * 0.3,
            "b2": jnp.linspace(-0.1, 0.1, D_OUT, dtype=jnp.float32)}


def make_batch():
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (BATCH, D_IN), jnp.float32),
            "y": jax.random.normal(ky, (BATCH, D_OUT), jnp.float32)}


def tp_varying(x, tp_axis):
    """Megatron's "f": identity forward, all-reduce over tp of the gradient (the transpose of the cast)."""
    return jax.lax.pcast(x, tp_axis, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(x, tp_axis)


def mlp_loss(w, batch, tp_axis=None):
    """Megatron MLP: the input marked TP-varying before the column-parallel w1, psum after the row-parallel w2."""
    x = batch["x"] if tp_axis is None else tp_varying(batch["x"], tp_axis)
    # FP8: activations / gradients split over tp share one amax over tp (the whole tensor's, as on one device)
    amax = () if tp_axis is None else (tp_axis,)
    h = jax.nn.relu(jq.dense(x, w["w1"], out_dtype=jnp.float32, amax_axes=amax))
    y = jq.dense(h, w["w2"], out_dtype=jnp.float32, amax_axes=amax)
    y = y if tp_axis is None else jax.lax.psum(y, tp_axis)
    return jnp.mean((y + w["b2"] - batch["y"]) ** 2)


@functools.lru_cache(maxsize=None)
def reference(cw, num_shards, microbatches=1):
    """Single-device SGD of the same math (see the module docstring)."""
    return reference_sgd(init_params(), make_batch(), cw=cw, num_shards=num_shards, microbatches=microbatches,
                         lr=LR, steps=STEPS, loss=mlp_loss, bias="b2")


def run_tp(fsdp, tp, cw, strategy="optim_grads_params", steps=STEPS, params=None, report_nan=False, microbatches=1):
    mesh = Mesh(np.array(jax.devices()[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))
    step = jq.make_train_step(functools.partial(mlp_loss, tp_axis="tp"), optax.sgd(LR), mesh=mesh,
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw), strategy=strategy,
                              tp_axis="tp", param_specs=SPECS, report_nan=report_nan,
                              microbatches=microbatches)
    state = step.init(init_params() if params is None else params)
    losses, metrics = [], None
    for _ in range(steps):
        state, metrics = step(state, make_batch())
        losses.append(float(metrics["loss"]))
    return step.params(state), losses, metrics, state


def assert_matches_reference(params, losses, cw, fsdp, microbatches=1):
    ref_params, ref_losses = reference(cw, fsdp, microbatches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    init = init_params()
    for name in ref_params:
        update = float(jnp.max(jnp.abs(ref_params[name] - init[name])))
        assert update > 1e-3, f"{name} did not train"
        np.testing.assert_allclose(params[name], ref_params[name], rtol=0, atol=1e-5 * update, err_msg=name)


@pytest.mark.parametrize("cw", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("fsdp,tp", [(4, 2), (2, 4)])
@pytest.mark.fast_cases("4-2-nvfp4")  # the other cases: slow
def test_fsdp_tp_equals_single_device(fsdp, tp, cw):
    params, losses, _, state = run_tp(fsdp, tp, cw)
    # per-leaf masters: column-parallel rows split over tp (then fsdp), row-parallel columns over tp
    assert "tp" in str(state.master["w1"].sharding.spec[0]) and state.master["w2"].sharding.spec[1] == "tp"
    assert_matches_reference(params, losses, cw, fsdp)


@pytest.mark.parametrize("strategy,microbatches", [("no_shard", 1), ("optim", 1), ("optim_grads", 1),
                                                   ("optim_grads_params", 2)])
@pytest.mark.slow
def test_fsdp_tp_other_strategies_and_microbatches(strategy, microbatches):
    params, losses, _, _ = run_tp(4, 2, "nvfp4", strategy=strategy, microbatches=microbatches)
    assert_matches_reference(params, losses, "nvfp4", 4, microbatches)


@pytest.mark.parametrize("bad", ["w2", "b2"])
@pytest.mark.slow
def test_fsdp_tp_nan_report_names_parameter(bad):
    def poisoned(w, b):   # the extra term is 0 normally, NaN in the gradient of `bad` when b["p"] is NaN
        p2 = tp_varying(b["p"][:, :w["w2"].shape[1]], "tp")
        extra = (jnp.sum(jq.dense(p2, w["w2"], out_dtype=jnp.float32)) if bad == "w2"
                 else jnp.sum(w["b2"] * b["p"][:, :D_OUT]))
        if bad == "w2":   # TP-local: summed over tp so that the loss stays the same on every TP rank
            extra = jax.lax.psum(extra, "tp")
        return mlp_loss(w, b, "tp") + 0.0 * extra

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    step = jq.make_train_step(poisoned, optax.sgd(LR), mesh=mesh, tp_axis="tp", param_specs=SPECS,
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"), report_nan=True)
    clean = {**make_batch(), "p": jnp.zeros((BATCH, D_HID), jnp.float32)}
    state, metrics = step(step.init(init_params()), clean)
    jq.raise_if_nonfinite(metrics)                    # nothing to report
    before = step.params(state)
    state, metrics = step(state, {**clean, "p": clean["p"].at[5, 3].set(jnp.nan)})
    assert {k: bool(v) for k, v in metrics["nonfinite"].items()} == {"w1": False, "w2": bad == "w2", "b2": bad == "b2"}
    with pytest.raises(FloatingPointError, match=rf"\['{bad}'\]"):
        jq.raise_if_nonfinite(metrics)
    after = step.params(state)
    for name in before:                                # the update was skipped
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_param_specs_errors():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    make = functools.partial(jq.make_train_step, functools.partial(mlp_loss, tp_axis="tp"), optax.sgd(LR),
                             mesh=mesh, tp_axis="tp")
    with pytest.raises(ValueError, match=r"param_specs\['b2'\]: only \[out, in\]"):
        make(param_specs={**SPECS, "b2": "col"}).init(init_params())
    with pytest.raises(ValueError, match=r"param_specs\['w1'\]: must be 'col', 'row' or None"):
        make(param_specs={**SPECS, "w1": "cols"}).init(init_params())
    with pytest.raises(ValueError, match="param_specs: given without tp_axis"):
        jq.make_train_step(mlp_loss, optax.sgd(LR), mesh=mesh, param_specs=SPECS)


def test_missing_tp_cast_is_explained():
    def no_cast(w, b):    # the column-parallel w1 applied to the TP-replicated batch without pcast
        h = jax.nn.relu(jq.dense(b["x"], w["w1"], out_dtype=jnp.float32))
        return jnp.mean(jax.lax.psum(jq.dense(h, w["w2"], out_dtype=jnp.float32), "tp") + w["b2"])

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    step = jq.make_train_step(no_cast, optax.sgd(LR), mesh=mesh, tp_axis="tp", param_specs=SPECS)
    with pytest.raises(ValueError, match="loss_fn: a TP-split weight met an activation"):
        step(step.init(init_params()), make_batch())
