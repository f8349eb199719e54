"""``JAXQUANT_WGRAD_FIRST`` (``fsdp.WGRAD_FIRST``): each sharded layer's ``dx`` held behind an optimization barrier
with its ``dW``, so that the backward cannot go on to the layer below before the weight-gradient GEMM (whose
reduce-scatter then runs under that layer's backward). The barrier orders work and changes no value: two steps train
to the same bits with and without it, in the loop and under ``scan``; it appears once per sharded layer use in the
backward, and not where the gradient is not reduce-scattered (one rank)."""

import jax
import optax
import pytest

from support.transformer import (L, LR, assert_same_training, loss_loop, loss_scan, switched_runs,
                                 two_steps_bf16_wire)


def _barriers(text: str) -> int:
    return text.count("optimization_barrier")


@pytest.mark.parametrize("recipe", ["fp8", "bf16", "nvfp4"])
@pytest.mark.parametrize("loss", [loss_loop, loss_scan], ids=["loop", "scan"])
@pytest.mark.fast_cases("loop-fp8")
def test_wgrad_first_trains_to_the_same_bits(monkeypatch, loss, recipe):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    stacked = loss is loss_scan
    runs = switched_runs(monkeypatch, "WGRAD_FIRST",
                         lambda: two_steps_bf16_wire(loss, recipe, 8, optax.adam(LR), stacked=stacked))
    run0, run = runs[False], runs[True]
    # one a sharded jq.dense: w1 and w2 of each layer (of the scan body, once, under scan) and the head
    uses = (2 if stacked else 2 * L) + 1
    assert _barriers(run[2]) - _barriers(run0[2]) == uses, (_barriers(run[2]), _barriers(run0[2]), uses)
    assert_same_training(run, run0)


def test_wgrad_first_leaves_one_rank_alone(monkeypatch):
    """One rank: no reduce-scatter to bring forward, so no barrier is added."""
    runs = switched_runs(monkeypatch, "WGRAD_FIRST", lambda: two_steps_bf16_wire(loss_loop, "fp8", 1, stacked=False))
    run0, run = runs[False], runs[True]
    assert _barriers(run[2]) == _barriers(run0[2])
    assert_same_training(run, run0)
