"""Precomputed weight scales (``TrainState.weight_amax``): the step that writes a master weight also computes each
layer's amax of it, and the next step's casts read that amax instead of running a scalar all-reduce per layer (FP8:
and an amax pass; NVFP4 still runs its statistics pass for the tile amaxes). The amaxes equal each layer's
statistics; training from them is bit for bit training without them (the casts computing their own), in the layer-
wise strategy, under ZeRO 0-2 (weights gathered once a step) and with ``quantize_once`` (which keeps its own packed
reduction); a master replaced by hand is refreshed with ``refresh_amax``."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxquant as jq
from jaxquant.primitives import ops
from support.meshes import fsdp_mesh
from support.transformer import MASK, init_params, loss_loop, loss_scan, make_batch

# 4 ranks on the 8 simulated CPU devices; on a GPU machine, as many GPUs as it has up to 4 (2 x H200: the CUDA casts)
RANKS = min(4, len(jax.devices()))
pytestmark = pytest.mark.skipif(RANKS < 2, reason="needs 2 devices or more")


@functools.lru_cache(maxsize=None)
def _make_step(loss, strategy="optim_grads_params", quantize_once=False, recipe="fp8"):
    return jq.make_train_step(loss, optax.adam(1e-2), mesh=fsdp_mesh(RANKS), quantize_mask=MASK, strategy=strategy,
                              quantize_once=quantize_once, policy=jq.MixedPrecisionPolicy(compute_weights=recipe))


def _layer_amaxes(master):
    """Each layer's amax of a (global) master leaf, by the statistics op the casts use (bf16 rounding)."""
    a = np.asarray(master)
    layers = a.reshape(-1, *a.shape[-2:])
    return np.array([np.asarray(ops.fp8_stats(jnp.asarray(x), compute_dtype=jnp.bfloat16)[0]) for x in layers]
                    ).reshape(a.shape[:-2])


def _check_amaxes(step, state):
    leaves = jax.tree_util.tree_leaves(state.master)
    assert len(state.weight_amax) == len(leaves)
    quantized = 0
    for m, a, r in zip(leaves, state.weight_amax, state.plan.rules):
        if r.quantized and r.recipe in ("fp8", "nvfp4"):
            quantized += 1
            np.testing.assert_array_equal(np.asarray(a), _layer_amaxes(m), err_msg=r.name)
        else:
            assert a is None, r.name
    assert quantized >= 3      # w1, w2 (stacked or per layer) and the head


@pytest.mark.parametrize("loss", [loss_scan, loss_loop], ids=["scan", "loop"])
@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
@pytest.mark.fast_cases("fp8-scan", "fp8-loop", "nvfp4-scan")
def test_the_steps_keep_each_layers_amax(loss, recipe):
    """After init and after each step, ``weight_amax`` holds each FP8 / NVFP4 leaf's per-layer amax of its master
    (stacked leaves: one per layer), None for every other leaf."""
    step = _make_step(loss, recipe=recipe)
    state = step.init(init_params(stacked=loss is loss_scan))
    _check_amaxes(step, state)
    for i in range(2):
        state, _ = step(state, make_batch(i))
        _check_amaxes(step, state)


@pytest.mark.parametrize("strategy,quantize_once,recipe", [
    ("optim_grads_params", False, "fp8"), ("optim_grads", False, "fp8"), ("optim_grads_params", True, "fp8"),
    ("optim_grads_params", False, "nvfp4"), ("optim_grads", False, "nvfp4")],
    ids=["per-use", "zero2-gathered-once", "quantize-once", "per-use-nvfp4", "zero2-gathered-once-nvfp4"])
@pytest.mark.fast_cases("per-use", "per-use-nvfp4")
def test_training_from_precomputed_amaxes_is_bitwise_training_without(strategy, quantize_once, recipe):
    """Three Adam steps on one batch from the same state: with the precomputed amaxes, and with ``weight_amax``
    dropped before each step (the casts then compute their own amax and max-reduce it): the same losses and masters,
    bit for bit. With the amaxes the step has fewer all-reduces (none a layer's amax)."""
    step = _make_step(loss_scan, strategy, quantize_once, recipe)
    state0 = step.init(init_params())
    if not quantize_once:
        reductions = lambda st: step.lower(st, make_batch(0)).as_text().count("all_reduce")
        assert reductions(state0) < reductions(dataclasses.replace(state0, weight_amax=None))
    runs = {}
    for precomputed in (True, False):
        state = step.init(init_params())
        losses = []
        for i in range(3):
            if not precomputed:
                state = dataclasses.replace(state, weight_amax=None)
            state, m = step(state, make_batch(0))   # one batch: the loss falls
            losses.append(np.asarray(m["loss"]))
        runs[precomputed] = losses, jax.tree.map(np.asarray, state.master)
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    jax.tree.map(np.testing.assert_array_equal, runs[True][1], runs[False][1])
    assert runs[True][0][-1] < runs[True][0][0]
    if quantize_once:   # quantize_once's leaves keep their own packed reduction: no precomputed amax
        assert all(a is None for a in step.init(init_params()).weight_amax)


def test_refresh_amax_after_replacing_the_master():
    """A master replaced by hand (here: scaled by 3) gets its amaxes from ``refresh_amax``; the stale state's amaxes
    are those of the old master."""
    step = _make_step(loss_scan)
    state = step.init(init_params())
    old = [None if a is None else np.asarray(a) for a in state.weight_amax]
    scaled = dataclasses.replace(state, master=jax.tree.map(lambda m: m * 3, state.master))
    fresh = step.refresh_amax(scaled)
    _check_amaxes(step, fresh)
    for a, b in zip(old, fresh.weight_amax):
        if a is not None:
            assert np.all(np.asarray(b) > a)


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
@pytest.mark.fast_cases("fp8")
def test_separate_stacked_amax_trains_to_the_same_bits(monkeypatch, recipe):
    """``fsdp.SEPARATE_STACKED_AMAX``: a stacked master's amaxes reduced behind an optimization barrier (a pass of their
    own, not inside the update's fusion): two steps give the same losses and masters, bit for bit; one barrier per
    stacked FP8 / NVFP4 leaf (w1, w2) in the lowered step, none for a per-layer leaf (the loop). Quantized where read
    (``quantize_once=False``): NVFP4 weights quantized once a step, their default, take no precomputed amax."""
    from support.transformer import LR, assert_same_training, switched_runs, two_steps_bf16_wire

    barriers = lambda run: run[2].count("optimization_barrier")
    runs = switched_runs(monkeypatch, "SEPARATE_STACKED_AMAX",
                         lambda: (two_steps_bf16_wire(loss_scan, recipe, RANKS, optax.adam(LR), quantize_once=False),
                                  two_steps_bf16_wire(loss_loop, recipe, RANKS, optax.adam(LR), stacked=False,
                                                      quantize_once=False)))
    assert barriers(runs[True][0]) - barriers(runs[False][0]) == 2
    assert barriers(runs[True][1]) == barriers(runs[False][1])
    for form in (0, 1):
        assert_same_training(runs[True][form], runs[False][form])
