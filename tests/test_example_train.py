"""examples/train_loop.py runs: loss decreases, and the model weights are exactly the quantized masters."""

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

from jaxquant.distributed import quantize_master_weights  # noqa: E402
from jaxquant.quantize import quantize_fp8, quantize_nvfp4  # noqa: E402

IMPL = os.environ.get("JAXQUANT_TEST_IMPL", "auto")


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.parametrize("recipe,shards", [("nvfp4", 4), ("fp8", 3)])
def test_train_loop(recipe, shards):
    losses, master, layout, mesh, _ = train_loop.train(steps=12, num_shards=shards, recipe=recipe,
                                                       impl=IMPL, verbose=False)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    # the weights quantized from the updated master shards == single-tensor quantization of each master
    weights = quantize_master_weights(master, layout, mesh=mesh, recipe=recipe, impl=IMPL)
    fn = quantize_nvfp4 if recipe == "nvfp4" else quantize_fp8
    ref = jax.jit(lambda ms: [fn(m, compute_dtype=jnp.bfloat16, impl="reference") for m in ms])(
        layout.unflatten(jax.device_get(master)))
    for q, r in zip(weights, ref):
        for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(r)):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype.itemsize == 1:
                a, b = a.view(np.uint8), b.view(np.uint8)
            np.testing.assert_array_equal(a, b)
