"""examples/train_loop.py runs and its loss decreases, with a once-a-step strategy and with layer-wise FSDP."""

import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train_loop  # noqa: E402



@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.parametrize("recipe,shards,strategy", [("nvfp4", 4, "optim"), ("fp8", 3, "optim_grads_params")])
@pytest.mark.slow
def test_train_loop(recipe, shards, strategy):
    """The loop learns; that the weights a step trains with are the single-tensor quantization of the masters is
    tests/test_train_modes.py::test_once_a_step_gather_is_each_layers_quantization (and the 8-vs-1-device tests
    of tests/test_layerwise.py for the per-use gather)."""
    losses, step, state = train_loop.train(steps=12, num_shards=shards, recipe=recipe, strategy=strategy,
                                           verbose=False)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    assert int(state.step) == 12
