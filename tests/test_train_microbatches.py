"""Every strategy x compute_weights with 4 microbatches on 8 simulated devices equals the single-device
computation of the same math after 3 SGD steps, bitwise, or within fp32 reordering for the layer-wise step (see
tests/test_train_strategies.py)."""

import jax
import pytest

from support.mlp import COMPUTE_WEIGHTS, STRATEGIES, check_strategy_equals_single_device

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


# Every strategy with each quantized recipe (ZeRO 0-2 hold one gathered quantized weight across the microbatches,
# ZeRO 3 quantizes per use); bf16, with no quantized weight to hold, on ZeRO 3 only (the microbatch loop and each
# strategy's gradient reduction do not depend on the recipe; bf16 on every strategy: test_train_strategies.py)
CASES = [(s, cw) for s in STRATEGIES for cw in COMPUTE_WEIGHTS if cw != "bf16" or s == "optim_grads_params"]


@pytest.mark.parametrize("strategy,cw", CASES, ids=[f"{s}-{cw}" for s, cw in CASES])
@pytest.mark.fast_cases("optim_grads_params-nvfp4")  # the other cases: slow
def test_strategy_equals_single_device_4_microbatches(strategy, cw):
    check_strategy_equals_single_device(strategy, cw, microbatches=4)
