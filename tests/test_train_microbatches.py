"""Every strategy x compute_weights with 4 microbatches on 8 simulated devices equals the single-device
computation of the same math after 3 SGD steps, bitwise, or within fp32 reordering for the layer-wise step (see
tests/test_train_strategies.py)."""

import jax
import pytest

from test_train_strategies import COMPUTE_WEIGHTS, STRATEGIES, check_strategy_equals_single_device

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


@pytest.mark.parametrize("cw", COMPUTE_WEIGHTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.fast_cases("optim_grads_params-nvfp4")  # the other cases: slow
def test_strategy_equals_single_device_4_microbatches(strategy, cw):
    check_strategy_equals_single_device(strategy, cw, microbatches=4)
