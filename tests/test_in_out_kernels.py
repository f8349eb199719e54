"""``[in, out]`` kernels (flax's layout, ``jq.ParamRule(kernel="in_out")``) trained as they are:
tests/test_layerwise.py's model with every matrix stored transposed equals the ``[out, in]`` model (parameters
after 3 steps, transposed back, within bf16 rounding of dW: the GEMMs contract other axes, the quantized bytes are
the same), under scan, for every recipe, with a once-a-step strategy, with reshard_after_forward=False and split
over TP."""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from support.meshes import fsdp_mesh
from support.transformer import init_params, loss_scan, make_batch

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

MATRICES = ("w1", "w2")


def rules(kernel, tp=False):
    return [jq.ParamRule("embed"), jq.ParamRule(r"blocks\.norm", stacked=True),
            jq.ParamRule(r"blocks\.w1", quantize=True, stacked=True, kernel=kernel, tp="col" if tp else None),
            jq.ParamRule(r"blocks\.w2", quantize=True, stacked=True, kernel=kernel, tp="row" if tp else None),
            jq.ParamRule("head", quantize=True, kernel=kernel)]


def transposed(p):
    return {**p, "head": p["head"].T, "blocks": {**p["blocks"], **{n: p["blocks"][n].transpose(0, 2, 1)
                                                                  for n in MATRICES}}}


def train(kernel, cw, steps=3, fsdp=8, tp=1, **kw):
    mesh = Mesh(np.array(jax.devices()[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))
    loss = functools.partial(loss_scan, tp_axis="tp") if tp > 1 else loss_scan
    step = jq.make_train_step(loss, optax.sgd(0.05), mesh=mesh, rules=rules(kernel, tp > 1),
                              tp_axis="tp" if tp > 1 else None, policy=jq.MixedPrecisionPolicy(compute_weights=cw),
                              **kw)
    params = init_params() if kernel == "out_in" else transposed(init_params())
    state = step.init(params)
    for _ in range(steps):
        state, _ = step(state, make_batch())
    out = jax.tree.map(np.asarray, step.params(state))
    return out if kernel == "out_in" else transposed(out)


def assert_equal_within_bf16_of_update(a, b):
    init = init_params()
    for (path, x), y, z in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), jax.tree.leaves(init)):
        update = float(np.max(np.abs(np.asarray(y) - np.asarray(z))))
        assert update > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(x, y, rtol=0, atol=2 ** -8 * update, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("cw", ["bf16", "fp8", "nvfp4"])
@pytest.mark.fast_cases("fp8")
def test_in_out_kernels_train_like_out_in(cw):
    assert_equal_within_bf16_of_update(train("in_out", cw), train("out_in", cw))


@pytest.mark.parametrize("kw", [dict(strategy="optim", microbatches=2), dict(reshard_after_forward=False)],
                         ids=["optim", "keep-gathered"])
@pytest.mark.slow
def test_in_out_kernels_in_other_modes(kw):
    assert_equal_within_bf16_of_update(train("in_out", "nvfp4", **kw), train("out_in", "nvfp4", **kw))


@pytest.mark.parametrize("cw", ["bf16", "fp8"])
@pytest.mark.fast_cases("fp8")
def test_in_out_kernels_split_over_tp(cw):
    """(fsdp 4, tp 2): w1 column-parallel (its out = the minor axis of [in, out]) and w2 row-parallel."""
    assert_equal_within_bf16_of_update(train("in_out", cw, fsdp=4, tp=2), train("out_in", cw, fsdp=4, tp=2))


def test_in_out_kernel_errors():
    with pytest.raises(ValueError, match=r"kernel: must be one of \('out_in', 'in_out'\)"):
        jq.ParamRule("x", kernel="io")
    step = jq.make_train_step(loss_scan, optax.sgd(0.1), mesh=fsdp_mesh(),
                              rules=[jq.ParamRule(".*", kernel="in_out")])
    with pytest.raises(ValueError, match=r"blocks\.norm of shape \(3, 1, 128\): kernel='in_out' needs \[in, out\] "
                                         r"kernels \(per layer\), got \(3, 1, 128\)"):
        step.init(init_params())


def test_state_dict_holds_in_out_kernels_as_pytorch_does():
    """The state dict holds an [in, out] kernel as PyTorch's Linear does, [out, in] (stacked ones per layer): the
    transposed model's state dict equals the [out, in] model's, and each loads into the other."""
    mesh = fsdp_mesh()
    steps = {k: jq.make_train_step(loss_scan, optax.adam(1e-3), mesh=mesh, rules=rules(k),
                                   policy=jq.MixedPrecisionPolicy(compute_weights="fp8")) for k in ("in_out", "out_in")}
    states = {"in_out": steps["in_out"].init(transposed(init_params())), "out_in": steps["out_in"].init(init_params())}
    adam = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sds = {k: steps[k].state_dict(states[k], hyperparams=adam) for k in steps}
    assert sds["in_out"]["model"]["blocks.0.w1"].shape == init_params()["blocks"]["w1"].shape[1:]
    for name, a in sds["out_in"]["model"].items():
        np.testing.assert_array_equal(np.asarray(sds["in_out"]["model"][name]), np.asarray(a), err_msg=name)
    back = steps["in_out"].load_state_dict(sds["out_in"], like=states["in_out"])
    want = jax.tree.leaves(states["in_out"].master)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(back.master)[0], want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
        assert a.sharding == b.sharding
