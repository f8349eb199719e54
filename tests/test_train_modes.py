"""The four strategies are modes of one training step (jaxquant/training/train.py): on a model with stacked
``[L, out, in]`` leaves under ``jax.lax.scan`` (tests/test_layerwise.py's), on 8 simulated CPU devices, each
strategy quantizes the stacked leaves (its NVFP4 step differs from its bf16 step), all four agree after 2 steps
within bf16 rounding of dW, each round-trips its state dict (and a checkpoint of one strategy loads into
another), each shards what it says it shards, and the step compiles once."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxquant as jq
import jaxquant.training.fsdp
from support.meshes import fsdp_mesh
from support.transformer import MASK, init_params, loss_scan, make_batch

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
LR = 0.05


def make(strategy, cw, microbatches=2, opt=None):
    return jq.make_train_step(loss_scan, opt or optax.sgd(LR), mesh=fsdp_mesh(),
                              strategy=strategy, quantize_mask=MASK, microbatches=microbatches,
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw))


def trained(strategy, cw, steps=2):
    """The parameters after ``steps`` (1 or 2) steps: one 2-step run per strategy and recipe serves both."""
    return _trained(strategy, cw)[steps - 1]


@functools.lru_cache(maxsize=None)
def _trained(strategy, cw):
    step = make(strategy, cw)
    state = step.init(init_params())
    after = []
    for _ in range(2):
        state, _ = step(state, make_batch())
        after.append(jax.tree.map(np.asarray, step.params(state)))
    return after


def _leaves(tree):
    return [(jax.tree_util.keystr(p), a) for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.fast_cases("optim")
def test_each_strategy_quantizes_stacked_leaves(strategy):
    """The stacked w1 / w2 (and the head) train on NVFP4 weights: after one step they differ from the bf16 run's;
    the masked leaves (embed, norms) move the same way in both to within the forward's difference."""
    nvfp4, bf16 = trained(strategy, "nvfp4", 1), trained(strategy, "bf16", 1)
    for name in ("w1", "w2"):
        a, b = nvfp4["blocks"][name], bf16["blocks"][name]
        for layer in range(a.shape[0]):
            assert not np.array_equal(a[layer], b[layer]), f"{strategy}: blocks.{name}[{layer}] trained unquantized"
    assert not np.array_equal(nvfp4["head"], bf16["head"])


@pytest.mark.parametrize("cw", ["nvfp4", "fp8"])
@pytest.mark.fast_cases("nvfp4")
def test_strategies_agree_after_two_steps(cw):
    """2 steps, 2 microbatches: every strategy's parameters equal optim_grads_params' within bf16 rounding of dW
    (2^-8 of the largest update; the modes differ only in the order of fp32 sums over ranks and microbatches)."""
    init, ref = init_params(), trained("optim_grads_params", cw)
    for strategy in STRATEGIES[:-1]:
        for (name, a), (_, b), (_, c) in zip(_leaves(trained(strategy, cw)), _leaves(ref), _leaves(init)):
            update = float(np.max(np.abs(b - np.asarray(c))))
            assert update > 0, name
            np.testing.assert_allclose(a, b, rtol=0, atol=2 ** -8 * update, err_msg=f"{strategy} {name}")


def test_what_each_strategy_shards():
    """Master and optimizer state: replicated for no_shard, row-sharded over fsdp otherwise; the stacked w1's
    gradient travels as an all-reduce of every row (no_shard, optim) or a reduce-scatter (the others), and only
    optim_grads_params gathers inside the layer loop (the others gather every layer once, before it)."""
    from support.hlo import collective_types

    for strategy in STRATEGIES:
        step = make(strategy, "fp8", microbatches=1, opt=optax.adam(1e-3))
        state = step.init(init_params())
        w1 = state.master["blocks"]["w1"]
        mu = state.opt_state[0].mu["blocks"]["w1"]
        want = (None, None, None) if strategy == "no_shard" else (None, "fsdp", None)
        for what, a in (("master", w1), ("adam mu", mu)):
            assert tuple(a.sharding.spec) + (None,) * (3 - len(a.sharding.spec)) == want, (strategy, what)
        text = step.lower(state, make_batch()).as_text()
        L, F, D = w1.shape
        reduced, scattered = collective_types(text, "all_reduce"), collective_types(text, "reduce_scatter")
        if strategy in ("no_shard", "optim"):
            assert (f"tensor<{L}x{F}x{D}xf32>", f"tensor<{L}x{F}x{D}xf32>") in reduced, (strategy, reduced)
            assert not scattered, (strategy, scattered)
        else:
            assert (f"tensor<{F}x{D}xf32>", f"tensor<{F // 8}x{D}xf32>") in scattered, (strategy, scattered)
        gathers = re.findall(r'"stablehlo\.all_gather".*: \((tensor<[^>]*>)\) -> (tensor<[^>]*>)', text)
        fp8_w1 = f"tensor<{F // 8}x{D}xf8E4M3FN>"
        if strategy == "no_shard":
            assert not any(fp8_w1 == a for a, _ in gathers), gathers
        elif strategy == "optim_grads_params":
            assert (fp8_w1, f"tensor<{F}x{D}xf8E4M3FN>") in gathers, gathers          # one layer, in the loop
        else:
            assert (f"tensor<{L}x{F // 8}x{D}xf8E4M3FN>", f"tensor<{L}x{F}x{D}xf8E4M3FN>") in gathers, gathers


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.fast_cases("no_shard")
def test_state_dict_round_trips_and_loads_across_strategies(strategy):
    """state_dict -> load_state_dict gives back the same parameters, Adam state and step count; loaded into the
    default strategy, the next step equals this strategy's next step within bf16 rounding of dW."""
    adam = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    step = make(strategy, "fp8", opt=optax.adam(adam["lr"]))
    state = step.init(init_params())
    for _ in range(2):
        state, _ = step(state, make_batch())
    sd = step.state_dict(state, hyperparams=adam)
    like = step.init(init_params())
    back = step.load_state_dict(sd, like=like)
    assert int(back.step) == 2
    for (name, a), (_, b) in zip(_leaves((back.master, back.opt_state)), _leaves((state.master, state.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        assert a.sharding == b.sharding, name
    other = make("optim_grads_params", "fp8", opt=optax.adam(adam["lr"]))
    moved = other.load_state_dict(sd, like=other.init(init_params()))
    mine, _ = step(back, make_batch())
    theirs, _ = other(moved, make_batch())
    for (name, a), (_, b) in zip(_leaves(step.params(mine)), _leaves(other.params(theirs))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2 ** -8 * adam["lr"], err_msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.fast_cases("optim_grads_params")
def test_step_compiles_once(strategy):
    """Three steps, and a step from a loaded state dict, hit one jit cache entry (the step count comes back with
    the sharding init gave it)."""
    step = make(strategy, "nvfp4", microbatches=1)
    state = step.init(init_params())
    for _ in range(3):
        state, _ = step(state, make_batch())
    compiled = step._compiled(state.plan)
    assert compiled._cache_size() == 1
    sd = step.state_dict(state, hyperparams=dict(lr=LR, momentum=0.0, weight_decay=0.0))
    state = step.load_state_dict(sd, like=step.init(init_params()), step_count=3)
    state, _ = step(state, make_batch())
    assert compiled._cache_size() == 1


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_once_a_step_gather_is_each_layers_quantization(recipe):
    """What ZeRO 0-2 hand the layers (jaxquant.training.fsdp.gather_once over a stack, one collective for every layer)
    are, layer by layer, the bytes of quantize_fp8 / quantize_nvfp4 (columnwise=True) of that layer's whole
    weight, with its own scales; tensor_of builds the same tensor."""
    from jax.sharding import PartitionSpec as P

    from jaxquant.training import fsdp

    mesh = fsdp_mesh()
    stack = jax.random.normal(jax.random.key(3), (3, 256, 64), jnp.float32)
    stack = stack * jnp.array([1.0, 30.0, 1e-3])[:, None, None]            # each layer with its own scales
    grad = fsdp.GradReduce(1.0, jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))
    spec = fsdp.WeightSpec(recipe, "fsdp", 8, ("fsdp",), grad, per_use=False)
    # the gathered operands are the same on every rank (all-gathered; their vma type says varying)
    ops = jax.jit(jax.shard_map(lambda s: fsdp.gather_once(s, spec, columnwise=True), mesh=mesh,
                                in_specs=P(None, "fsdp"), out_specs=P(), check_vma=False))(stack)
    quantize = jq.quantize_fp8 if recipe == "fp8" else jq.quantize_nvfp4
    for layer in range(stack.shape[0]):
        want = quantize(stack[layer], columnwise=True, compute_dtype=jnp.bfloat16)
        got = fsdp.tensor_of(jax.tree.map(lambda a: a[layer], ops))
        for (name, a), (_, b) in zip(_leaves(got), _leaves(want)):
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                                          b.view(np.uint8) if b.dtype.itemsize == 1 else b, err_msg=f"{layer}{name}")
