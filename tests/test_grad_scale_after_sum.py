"""``fsdp.reduce_grad`` with a power-of-two scale (2, 4, 8 ... data-parallel ranks times microbatches) and a bf16
``dW`` on a bf16 wire reduce-scatters ``dW`` as the GEMM wrote it and scales this rank's reduced rows
(``fsdp.scales_after_the_sum``), where it scaled every rank's whole ``dW`` first: the same bits in bf16's normal
range, one pass over every weight gradient fewer (on two GPUs or more only, where the scale is not 1)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxquant.training import fsdp
from support.bitwise import bits
from support.sharding import one_shard_spec

F32, BF16 = np.dtype(np.float32), jnp.dtype(jnp.bfloat16)


def _spec(ranks, scale, dtype=BF16, **fields):
    grad = fsdp.GradReduce(scale=scale, main_dtype=F32, comm_dtype=dtype)
    return one_shard_spec(**({"recipe": "fp8", "gather_axis": "fsdp", "num_shards": ranks, "amax_axes": ("fsdp",),
                              "grad": grad} | fields))


def _reduced(dw, spec, ranks):
    """``reduce_grad`` under ``shard_map``: ``dw`` [ranks, rows, cols] holds each rank's gradient; returns the
    reduced rows of every rank in order, and the lowered program's text."""
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("fsdp",))
    fn = jax.jit(jax.shard_map(lambda d: fsdp.reduce_grad(d[0], spec), mesh=mesh, in_specs=P("fsdp"),
                               out_specs=P("fsdp")))
    return fn(dw), fn.lower(dw).as_text()


def _gradients(ranks, dtype=BF16, seed=0):
    """Each rank's weight gradient [ranks, 16 * ranks, 48]: random values over many binades, with ±0, ±inf and NaN
    at a few places."""
    key = jax.random.key(seed)
    x = jax.random.normal(key, (ranks, 16 * ranks, 48), jnp.float32)
    x = x * jnp.exp2(jax.random.randint(jax.random.fold_in(key, 1), x.shape, -30, 30).astype(jnp.float32))
    x = x.at[0, 0, :5].set(jnp.array([0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan]))
    return x.astype(dtype)


def _same(a, b):
    """The same bits, NaN's payload aside."""
    nan = np.isnan(np.asarray(a, np.float32))
    assert np.array_equal(nan, np.isnan(np.asarray(b, np.float32)))
    np.testing.assert_array_equal(bits(a)[~nan], bits(b)[~nan])


@pytest.mark.parametrize("ranks, microbatches", [(2, 1), (8, 1), (4, 2)])
def test_scaling_the_reduced_rows_gives_the_bits_of_scaling_first(monkeypatch, ranks, microbatches):
    if len(jax.devices()) < ranks:
        pytest.skip(f"needs {ranks} devices")
    spec = _spec(ranks, 1.0 / (ranks * microbatches))
    dw = _gradients(ranks)
    assert fsdp.scales_after_the_sum(dw[0], spec)
    out, text = _reduced(dw, spec, ranks)
    # dW reaches the reduce-scatter as the GEMM wrote it: no rounding chain in the program
    assert "reduce_precision" not in text
    monkeypatch.setattr(fsdp, "scales_after_the_sum", lambda dw, spec: False)
    first, first_text = _reduced(dw, spec, ranks)
    assert "reduce_precision" in first_text
    _same(out, first)


@pytest.mark.parametrize("why, spec, dtype", [
    ("a scale that is no power of two", functools.partial(_spec, 3, 1.0 / 3), BF16),
    ("a scale of 1: nothing to scale (fsdp.rounds_to_itself)", functools.partial(_spec, 1, 1.0), BF16),
    ("an fp32 gradient, rounded to bf16 first", functools.partial(_spec, 2, 0.5), F32),
    ("an unsharded gradient (ZeRO 0-1)", functools.partial(_spec, 2, 0.5, grad_sharded=False), BF16),
    ("no reduce-scatter", functools.partial(_spec, 2, 0.5, gather_axis=None), BF16),
])
def test_elsewhere_the_gradient_is_scaled_first(why, spec, dtype):
    assert not fsdp.scales_after_the_sum(jnp.zeros((4, 4), dtype), spec()), why


def test_the_documented_exception_a_sum_beyond_bf16s_range():
    """Two ranks' largest bf16 values: scaled first, each halves and their sum is the largest value again; summed
    first, the sum is inf before its scaling (docs/fsdp.md states it)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    spec = _spec(2, 0.5)
    top = float(jnp.finfo(BF16).max)
    dw = jnp.full((2, 32, 16), top, BF16)
    out, _ = _reduced(dw, spec, 2)
    assert np.all(np.isinf(np.asarray(out, np.float32)))


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
@pytest.mark.fast_cases("fp8")
def test_the_step_on_eight_devices_trains_to_the_same_bits(monkeypatch, recipe):
    """Two steps of the layer-wise step (scan, 8 ranks: scale 1/8, bf16 gradients on the wire), as they are and with
    every gradient scaled before its reduce-scatter: the same losses and masters, bit for bit; the program that scales
    after the sum has no rounding chain for the weight gradients."""
    import optax

    from support.transformer import LR, assert_same_training, loss_scan, two_steps_bf16_wire

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    run = two_steps_bf16_wire(loss_scan, recipe, 8, optax.adam(LR))
    monkeypatch.setattr(fsdp, "scales_after_the_sum", lambda dw, spec: False)
    run0 = two_steps_bf16_wire(loss_scan, recipe, 8, optax.adam(LR))
    assert run[2].count("reduce_precision") < run0[2].count("reduce_precision")
    assert_same_training(run, run0)
