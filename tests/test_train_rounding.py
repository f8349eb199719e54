"""make_train_step keeps the bf16 rounding of gradients on every backend and at every rank count: one
data-parallel rank, so no collective, and XLA:GPU's excess precision (on by default) would drop a
plain fp32 -> bf16 -> fp32 cast (formats.to_compute_dtype). Runs on the CPU in CI and on one GPU in
scripts/gpu_suite.sh."""

import jax.numpy as jnp
import optax

import jaxquant as jq
from support.meshes import fsdp_mesh
from support.mlp import BATCH, D_HID, assert_tree_close, init_params, loss_fn, make_batch


def test_finite_gradient_overflowing_in_bf16_comm_dtype_is_reported():
    """One rank (no reduction, the leaves are checked directly): a finite fp32 gradient of 3.4e38 is
    inf once cast to grad_comm_dtype=bf16, which is what the optimizer would read: reported, skipped.
    On a GPU this fails if the step casts with a plain ``astype`` (XLA's excess precision drops it)."""
    def big(w, b):
        return loss_fn(w, b) + jnp.sum(w["b1"] * b["p"])

    step = jq.make_train_step(big, optax.sgd(1e-2), mesh=fsdp_mesh(1), report_nan=True,
                              policy=jq.MixedPrecisionPolicy(compute_weights="bf16", grad_comm_dtype=jnp.bfloat16))
    clean = {**make_batch(), "p": jnp.zeros((BATCH, D_HID), jnp.float32)}
    state, metrics = step(step.init(init_params()), clean)
    jq.raise_if_nonfinite(metrics)
    before = step.params(state)
    state, metrics = step(state, {**clean, "p": clean["p"].at[5, 3].set(3.4e38)})
    assert {k: bool(v) for k, v in metrics["nonfinite"].items()} == {"b1": True, "w1": False, "w2": False}
    assert bool(metrics["update_skipped"])
    assert_tree_close(step.params(state), before, rtol=0, atol=0)
