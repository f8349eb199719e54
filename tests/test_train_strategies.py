"""Every strategy x compute_weights with one microbatch (four: tests/test_train_microbatches.py) on 8 simulated
devices equals a single-device computation of the same math after 3 SGD steps (tests/support/mlp.py:
``reference_sgd``, ``check_strategy_equals_single_device``).

With fp32 gradient communication the parameters are bitwise equal (the reference adds the ranks'
contributions in rank order, as XLA:CPU's all-reduce and reduce-scatter do; strategies with sharded gradients
and several microbatches: within fp32 reordering, see check_strategy_equals_single_device); the reported loss is within
1e-6 relative (the reference averages the microbatch losses on the host in float64). bf16 gradient
communication after one step within bf16 rounding of the 8 contributions and of their sum (2^-6 of the
largest update: the reference adds in bf16 in rank order, XLA:CPU adds in fp32).
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxquant as jq
from support.mlp import (COMPUTE_WEIGHTS, LR, STRATEGIES, check_strategy_equals_single_device, init_params,
                         make_batch, reference, run_step)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

@pytest.mark.parametrize("cw", COMPUTE_WEIGHTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.fast_cases("optim_grads_params-nvfp4")  # the other cases: slow
def test_strategy_equals_single_device(strategy, cw):
    check_strategy_equals_single_device(strategy, cw, microbatches=1)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.slow
def test_bf16_grad_comm_within_bf16_rounding(strategy):
    """One step (later steps re-quantize the weights, where a rounding difference can flip an NVFP4 code)."""
    params, _, *_ = run_step(init_params(), make_batch(), steps=1, optimizer=optax.sgd(LR),
                             policy=jq.MixedPrecisionPolicy(compute_weights="nvfp4", grad_comm_dtype=jnp.bfloat16),
                             strategy=strategy, microbatches=1)
    ref_params, _ = reference("nvfp4", 1, jnp.bfloat16, steps=1)
    init = init_params()
    for name in ref_params:
        update = float(jnp.max(jnp.abs(ref_params[name] - init[name])))
        np.testing.assert_allclose(params[name], ref_params[name], rtol=0, atol=2 ** -6 * update, err_msg=name)
