"""What the layer-wise FP8 step does differently where a weight is one shard (one GPU, or a weight not split over
ranks), and that it changes no byte:

* the forward's weight cast also writes the columnwise bytes, which the backward keeps instead of the rowwise ones
  (``fsdp.keeps_columnwise``): the dgrad's operand needs no transpose in the backward;
* a weight gradient that ``fsdp.reduce_grad``'s roundings and scaling leave as it is (scale 1, already in the comm
  dtype) goes on unconverted: no bf16 -> fp32 -> reduce_precision -> bf16 round trip in the program.

Under ``scan`` on an H200 the first removes a transpose of the whole stacked residual and a strided copy of each
layer's slice, the second lets XLA's dynamic-slice fusion write each weight gradient straight into the stacked
gradient (tests/test_layerwise_gpu.py checks that compiled form; docs/performance.md has the times).
"""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.training import fsdp
from support.bitwise import bits
from support.sharding import one_shard_spec
from support.transformer import (assert_same_training, loss_loop, loss_scan, two_steps_bf16_wire)

F32, BF16 = np.dtype(np.float32), jnp.dtype(jnp.bfloat16)


_spec = functools.partial(one_shard_spec, recipe="fp8")   # a field given to _spec replaces it


def _assert_same(a, b):
    """The same bits, but for NaN's payload (NaN where the other is NaN)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = np.isnan(np.asarray(a, np.float32))
    np.testing.assert_array_equal(nan, np.isnan(np.asarray(b, np.float32)))
    np.testing.assert_array_equal(bits(a)[~nan], bits(b)[~nan])


def _gradient(dtype, seed=0):
    """A weight gradient with the values a rounding could touch: ±0, ±inf, NaN, the largest finite value and the
    subnormals of ``dtype`` beside random ones."""
    x = jax.random.normal(jax.random.key(seed), (32, 48), jnp.float32) * 1e-3
    info = jnp.finfo(dtype)
    special = jnp.array([0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan, float(info.max), -float(info.max),
                         float(info.smallest_subnormal), -float(info.smallest_subnormal), float(info.tiny)])
    return x.at[0, : special.size].set(special).astype(dtype)


def test_reduce_grad_leaves_an_exact_gradient_unconverted(monkeypatch):
    spec = _spec()
    dw = _gradient(BF16)
    fn = jax.jit(lambda d: fsdp.reduce_grad(d, spec))
    text = fn.lower(dw).as_text()
    assert "reduce_precision" not in text and "convert" not in text, text
    out = fn(dw)
    monkeypatch.setattr(fsdp, "rounds_to_itself", lambda dw, spec: False)   # the whole rounding chain
    chain = jax.jit(lambda d: fsdp.reduce_grad(d, spec))
    assert "reduce_precision" in chain.lower(dw).as_text()
    _assert_same(out, chain(dw))


@pytest.mark.parametrize("dtype,grad,sharded", [
    (BF16, fsdp.GradReduce(0.5, F32, BF16), True),       # a scale
    (F32, fsdp.GradReduce(1.0, BF16, F32), True),        # a bf16 main dtype rounds an fp32 gradient
    (F32, fsdp.GradReduce(1.0, F32, BF16), True),        # the comm dtype rounds it
    (BF16, fsdp.GradReduce(1.0, F32, BF16), False),      # unsharded: the result is the fp32 main dtype
])
def test_reduce_grad_converts_where_that_changes_the_gradient(dtype, grad, sharded):
    """Elsewhere the chain stays, and its result is not the gradient as it came (another dtype or other values)."""
    spec = _spec(grad=grad, grad_sharded=sharded)
    dw = _gradient(dtype)
    assert not fsdp.rounds_to_itself(dw, spec)
    out = jax.jit(lambda d: fsdp.reduce_grad(d, spec))(dw)
    assert out.dtype == (grad.comm_dtype if sharded else grad.main_dtype)
    finite = np.isfinite(np.asarray(dw, np.float32))
    assert out.dtype != dw.dtype or np.any(np.asarray(out)[finite] != np.asarray(dw)[finite])


def test_only_an_unsplit_fp8_weight_keeps_its_columnwise_bytes():
    assert fsdp.keeps_columnwise(_spec())
    assert fsdp.keeps_columnwise(_spec(gather_axis="fsdp"))            # one rank on the FSDP axis
    assert fsdp.keeps_columnwise(_spec(transposed=True))               # [in, out]: the forward reads them
    for kw in ({"gather_axis": "fsdp", "num_shards": 2}, {"keep_gathered": True},
               {"per_use": False}, {"recipe": "nvfp4"}, {"recipe": "bf16"}):
        assert not fsdp.keeps_columnwise(_spec(**kw)), kw


def test_an_in_out_weight_reads_the_columnwise_bytes_its_cast_wrote(monkeypatch):
    """An ``[in, out]`` weight (flax's kernels): the forward GEMM reads the columnwise bytes the cast wrote (no
    transpose of its result after the cast), the backward keeps the rowwise ones its dgrad reads; the bytes of the
    rowwise-only way, which transposes the cast's result in the forward."""
    spec = _spec(transposed=True)
    shard = jax.random.normal(jax.random.key(3), (64, 48), jnp.float32)
    fwd, kept = fsdp.forward_weight(shard, None, None, spec)
    assert "data" not in fwd and set(kept) == {"data", "scale_inv", "amax"}
    monkeypatch.setattr(fsdp, "keeps_columnwise", lambda spec: False)
    fwd0, kept0 = fsdp.forward_weight(shard, None, None, spec)
    assert "data" in fwd0   # the rowwise bytes, transposed after the cast for the forward
    for k in ("data_t", "scale_inv", "amax"):
        np.testing.assert_array_equal(bits(fwd[k]), bits(fwd0[k]), err_msg=k)
    for k in kept:
        np.testing.assert_array_equal(bits(kept[k]), bits(kept0[k]), err_msg=k)


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_dense_on_one_shard_gives_the_rowwise_ways_bytes(monkeypatch, transposed):
    """``jq.dense`` on a one-shard FP8 ``ShardedWeight``, both layouts: y, dx and the weight gradient have the bytes
    of the rowwise-only way."""
    spec = _spec(transposed=transposed)
    w = jax.random.normal(jax.random.key(3), (64, 48), jnp.float32)
    x = jax.random.normal(jax.random.key(4), (32, w.shape[0] if transposed else w.shape[1]), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(5), (32, w.shape[1] if transposed else w.shape[0]), jnp.bfloat16)

    def fwd_bwd():   # a new function each time: jit's cache would otherwise reuse the first trace
        def fn(x, sink):
            y, vjp = jax.vjp(lambda x, s: jq.dense(x, fsdp.ShardedWeight(w, s, spec)), x, sink)
            return (y,) + vjp(g.astype(y.dtype))
        return jax.jit(fn)

    sink = jnp.zeros(w.shape, BF16)
    got = fwd_bwd()(x, sink)
    monkeypatch.setattr(fsdp, "keeps_columnwise", lambda spec: False)
    for name, a, b in zip(("y", "dx", "dW"), got, fwd_bwd()(x, sink)):
        assert a.dtype == b.dtype, name
        _assert_same(np.asarray(a), np.asarray(b))


def test_one_shard_keeps_the_transpose_of_the_bytes_it_multiplies(monkeypatch):
    """The forward reads the rowwise bytes, the backward the columnwise ones from the residual, with no transpose in
    the backward, and both are the bytes of the rowwise residual's way (transposed in the backward)."""
    spec = _spec()
    shard = jax.random.normal(jax.random.key(3), (64, 48), jnp.float32)
    fwd, kept = fsdp.forward_weight(shard, None, None, spec)
    assert set(kept) == {"data_t", "scale_inv", "amax"} and "data_t" not in fwd
    backward = lambda k: fsdp.backward_weight(k, spec)
    assert "transpose" not in str(jax.make_jaxpr(backward)(kept))
    bwd = backward(kept)
    np.testing.assert_array_equal(bits(bwd["data_t"]), bits(fwd["data"]).T)

    monkeypatch.setattr(fsdp, "keeps_columnwise", lambda spec: False)
    fwd0, kept0 = fsdp.forward_weight(shard, None, None, spec)
    assert set(kept0) == {"data", "scale_inv", "amax"}
    assert "transpose" in str(jax.make_jaxpr(backward)(kept0))
    bwd0 = backward(kept0)
    np.testing.assert_array_equal(bits(fwd["data"]), bits(fwd0["data"]))
    for k in ("data_t", "scale_inv", "amax"):
        np.testing.assert_array_equal(bits(bwd[k]), bits(bwd0[k]), err_msg=k)


@pytest.mark.parametrize("loss,stacked", [(loss_scan, True), (loss_loop, False)], ids=["scan", "loop"])
@pytest.mark.fast_cases("scan")
def test_one_device_fp8_step_equals_the_rowwise_residual_and_full_rounding(monkeypatch, loss, stacked):
    """Bitwise: two FP8 steps on one device with bf16 gradients on the wire (as the benchmarks send them: the
    gradient then needs no rounding), as they are and with both changes undone."""
    run = two_steps_bf16_wire(loss, "fp8", 1, stacked=stacked)
    monkeypatch.setattr(fsdp, "keeps_columnwise", lambda spec: False)
    monkeypatch.setattr(fsdp, "rounds_to_itself", lambda dw, spec: False)
    run0 = two_steps_bf16_wire(loss, "fp8", 1, stacked=stacked)
    # both changes are in the program: fewer roundings (one a weight gradient), another residual
    assert run[2].count("reduce_precision") < run0[2].count("reduce_precision")
    assert_same_training(run, run0)
