"""What the layer-wise NVFP4 step does differently where a weight is one shard (one GPU, or a weight not split over
ranks: ``fsdp.dequantizes_once``), and that it changes no byte: the forward makes the bf16 GEMM operand
``value(q) * s8`` straight from the master rows in one pass (``ops.nvfp4_bf16_operand``) with the whole weight's amax
precomputed by the update that wrote the master (``TrainState.weight_amax``), and keeps it for the dgrad, instead of
a statistics pass, the cast to packed bytes and a decode before each of the two GEMMs.
"""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from codegen import XLA_DEFAULT_CODEGEN
from jaxquant.primitives import gemm
from jaxquant.training import fsdp
from support.bitwise import bits
from support.hlo import max_reductions
from support.sharding import one_shard_spec
from support.transformer import LR, MASK, init_params, loss_loop, loss_scan, make_batch

F32, BF16 = np.dtype(np.float32), jnp.dtype(jnp.bfloat16)


_spec = functools.partial(one_shard_spec, recipe="nvfp4")   # a field given to _spec replaces it


def _same(a, b, what=""):
    assert np.asarray(a).dtype == np.asarray(b).dtype, what
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)


def test_only_an_unsplit_nvfp4_weight_dequantizes_once():
    assert fsdp.dequantizes_once(_spec())
    assert fsdp.dequantizes_once(_spec(gather_axis="fsdp"))            # one rank on the FSDP axis
    assert fsdp.dequantizes_once(_spec(transposed=True))               # [in, out]: the same operand, read NN / TN
    for kw in ({"gather_axis": "fsdp", "num_shards": 2}, {"pad_rows": 16}, {"keep_gathered": True},
               {"per_use": False}, {"recipe": "fp8"}, {"recipe": "bf16"}):
        assert not fsdp.dequantizes_once(_spec(**kw)), kw


def _master(seed=3, shape=(64, 48)):
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    # values that round up in bf16 to a new amax, an inf-free huge tile, zeros
    return w.at[0, 0].set(np.float32(np.nextafter(np.float32(7.96875), np.float32(9)))).at[16:32, 16:32].set(0.0)


def test_weight_amax_is_the_statistics_amax():
    """``fsdp.weight_amax`` (what the update computes) is NVFP4's statistics amax of the bf16-rounded values
    (docs/numerics.md §2.1, "Compute dtype"), also for NaN and inf elements."""
    for w in (_master(), _master().at[5, 7].set(jnp.nan), _master().at[40, 3].set(-jnp.inf)):
        _same(jnp.reshape(fsdp.weight_amax(w), (1,)), fsdp.statistics(w, _spec())[0])
    stacked = jnp.stack([_master(1), _master(2) * 3])
    _same(fsdp.weight_amax(stacked), jnp.stack([fsdp.statistics(w, _spec())[0][0] for w in stacked]))


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_dense_forward_and_backward_read_the_operand_made_once(monkeypatch, transposed):
    """``jq.dense`` on a one-shard NVFP4 ``ShardedWeight``: the forward runs one ``nvfp4_bf16_operand`` and no
    statistics pass (the amax is given), the backward no decode of its own; y, dx and the weight gradient have the
    bytes of the packed bytes' way (both layouts: an ``[in, out]`` weight reads the same operand contracted on its
    other axis)."""
    spec = _spec(transposed=transposed)
    w = _master()
    n_in = w.shape[0] if transposed else w.shape[1]
    x = jax.random.normal(jax.random.key(4), (32, n_in), jnp.float32)
    g = jax.random.normal(jax.random.key(5), (32, w.shape[1] if transposed else w.shape[0]), jnp.float32)
    amax = fsdp.weight_amax(w)

    def fwd_bwd():   # a new function each time: jit's cache would otherwise reuse the first trace
        def fn(x, sink):
            y, vjp = jax.vjp(lambda x, s: jq.dense(x, fsdp.ShardedWeight(w, s, spec, amax=amax)), x, sink)
            return (y,) + vjp(g.astype(y.dtype))
        return jax.jit(fn)

    sink = jnp.zeros(w.shape, BF16)
    text = fwd_bwd().lower(x, sink).as_text()
    assert text.count("@jq_nvfp4_bf16_operand(") == 1 and "jq_nvfp4_stats" not in text and "ui8" not in text
    got = fwd_bwd()(x, sink)
    monkeypatch.setattr(fsdp, "dequantizes_once", lambda spec: False)
    text0 = fwd_bwd().lower(x, sink).as_text()
    assert "jq_nvfp4_bf16_operand" not in text0 and "ui8" in text0
    want = fwd_bwd()(x, sink)
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        _same(a, b, name)


def test_forward_keeps_the_operand_the_two_passes_decode():
    """The residual is the forward's own operand, the decode of the packed bytes the old way keeps."""
    spec, w = _spec(), _master()
    fwd, kept = fsdp.forward_weight(w, None, None, spec, fsdp.weight_amax(w))
    assert set(kept) == {"operand", "dec", "amax"} and fsdp.backward_weight(kept, spec) is kept
    old = fsdp.gathered_operands(fsdp.quantize_rows(w, spec), spec, columnwise=False)
    _same(fwd["operand"], gemm.nvfp4_operand(old["data"], old["scale_inv"]), "operand")
    _same(fwd["dec"], old["dec"], "dec")
    # a ShardedWeight built by hand (no amax): one statistics pass finds it, the same bytes
    fwd0, _ = fsdp.forward_weight(w, None, None, spec)
    _same(fwd0["operand"], fwd["operand"], "operand without a precomputed amax")


def _train(loss, stacked, devices=1, steps=2):
    step = jq.make_train_step(loss, optax.sgd(LR), mesh=Mesh(np.array(jax.devices()[:devices]), ("fsdp",)),
                              quantize_mask=MASK, compiler_options=XLA_DEFAULT_CODEGEN,
                              policy=jq.MixedPrecisionPolicy(compute_weights="nvfp4", grad_comm_dtype=BF16))
    state, losses = step.init(init_params(stacked=stacked)), []
    text = step.lower(state, make_batch()).as_text()
    for i in range(steps):
        state, m = step(state, make_batch(i))
        losses.append(np.asarray(m["loss"]))
    return step.params(state), losses, text, state


# (loss, stacked, nvfp4_bf16_operand calls in the step: w1, w2 of the scan body and the head; of each layer and the
# head; remat makes the body's again in the backward)
@pytest.mark.parametrize("loss,stacked,calls", [(loss_scan, True, 3), (loss_loop, False, 7),
                                                (lambda w, b: loss_scan(w, b, remat=True), True, 5)],
                         ids=["scan", "loop", "scan-remat"])
@pytest.mark.fast_cases("scan")
def test_one_device_nvfp4_step_equals_the_packed_bytes_way(monkeypatch, loss, stacked, calls):
    """Bitwise: two NVFP4 steps on one device (losses and trained masters) as they are and with the change undone.
    The step holds one ``nvfp4_bf16_operand`` per weight use, no statistics pass and no packed bytes at all."""
    params, losses, text, state = _train(loss, stacked)
    assert text.count("@jq_nvfp4_bf16_operand(") == calls
    assert "jq_nvfp4_stats" not in text and "ui8" not in text
    amaxes = [a for a in state.weight_amax if a is not None]
    assert len(amaxes) == (3 if stacked else 7)    # head, w1, w2 (stacked) or each layer's
    monkeypatch.setattr(fsdp, "dequantizes_once", lambda spec: False)
    params0, losses0, text0, state0 = _train(loss, stacked)
    assert "jq_nvfp4_bf16_operand" not in text0 and "jq_nvfp4_stats" in text0
    assert len([a for a in state0.weight_amax if a is not None]) == len(amaxes)   # the packed way reads them too
    np.testing.assert_array_equal(losses, losses0)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params0)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_weights_split_over_ranks_keep_the_packed_bytes():
    """On 8 (simulated) devices every weight is split over FSDP: quantized where read (``quantize_once=False``; the
    default quantizes split NVFP4 weights once a step, tests/test_quantize_once.py), the step quantizes, gathers the
    packed bytes and decodes them as before; the casts read the whole weight's amax from the state
    (``TrainState.weight_amax``) and reduce none over the ranks."""
    step = jq.make_train_step(loss_scan, optax.sgd(LR), mesh=Mesh(np.array(jax.devices()[:8]), ("fsdp",)),
                              quantize_mask=MASK, policy=jq.MixedPrecisionPolicy(compute_weights="nvfp4"),
                              quantize_once=False)
    state = step.init(init_params())
    assert len([a for a in state.weight_amax if a is not None]) == 3    # head, w1, w2
    text = step.lower(state, make_batch()).as_text()
    assert "jq_nvfp4_bf16_operand" not in text and "jq_nvfp4_stats" in text and "all_gather" in text
    assert max_reductions(text) == []       # no amax reduced over the ranks
