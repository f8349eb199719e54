"""examples/train_loop.py runs: the loss decreases, and the weights the step trains with are exactly the
single-tensor quantization of the master weights."""

import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train_loop  # noqa: E402

from jaxquant.quantize import quantize_fp8, quantize_nvfp4  # noqa: E402


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.parametrize("recipe,shards", [("nvfp4", 4), ("fp8", 3)])
@pytest.mark.slow
def test_train_loop(recipe, shards):
    # "optim" keeps the gathered weights of the last update in the state: compare them to the masters
    losses, step, state = train_loop.train(steps=12, num_shards=shards, recipe=recipe, strategy="optim",
                                           verbose=False)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    masters = jax.tree.leaves(step.params(state))
    fn = quantize_nvfp4 if recipe == "nvfp4" else quantize_fp8
    for i, q in zip(state.plan.matrix_leaves, state.weights):
        name = state.plan.names[i]
        ref = fn(masters[i], columnwise=True, compute_dtype=jnp.bfloat16, impl="reference")
        for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(ref)):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype.itemsize == 1:
                a, b = a.view(np.uint8), b.view(np.uint8)
            np.testing.assert_array_equal(a, b, err_msg=name)
