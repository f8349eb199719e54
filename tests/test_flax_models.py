"""Flax models unchanged (training/flax_adapter.py): a Llama-style NNX model and linen model (tests/flax_llama.py),
layers in a Python loop and under ``nnx.scan`` / ``nn.scan``, train under ``jq.make_train_step`` on an 8-device
FSDP mesh with bf16 / FP8 / NVFP4 ``[in, out]`` kernels through the interception of jax's dot_general / einsum /
asarray (flax's promote_dtype) in a scope, and equal the same model hand-written with ``jq.dense``; 8 devices
equal 1; rng keys and counters pass through untouched; the interception leaves no trace and modifies no code;
what cannot run quantized is an error naming it."""

import functools
import importlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.training import flax_adapter as jqf  # noqa: E402
from jaxquant.training.rules import decide  # noqa: E402
from jax.numpy import einsum as _bound_einsum  # noqa: E402
import flax_llama as fl  # noqa: E402

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

STEPS, LR = 3, 0.05
STACKED = r"layers\..*"


def model_of(family, scan):
    return fl.nnx_model(scan) if family == "nnx" else fl.linen_variables(scan)


@functools.lru_cache(maxsize=None)
def init_params(family, scan):
    """The parameters every run of ``model_of(family, scan)`` starts from (its seeds are fixed), as numpy."""
    return jax.tree.map(np.asarray, jqf.flax_params(model_of(family, scan)))


MODES = {"default": {}, "optim-microbatches": dict(strategy="optim", microbatches=2),
         "keep-gathered": dict(reshard_after_forward=False)}


def make_step(model, loss_fn, cw="bf16", devices=8, rules=None, scan=False, mode="default"):
    mesh = Mesh(np.array(jax.devices()[:devices]), ("fsdp",))
    rules = jqf.flax_rules(stacked=STACKED if scan else None) if rules is None else rules
    step = jq.make_train_step(loss_fn, optax.sgd(LR), mesh=mesh, rules=rules,
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw), **MODES[mode])
    return step, step.init(jqf.flax_params(model))


def train(family, scan, cw, devices=8, steps=STEPS, reference=False, mode="default"):
    """(params after ``steps``, losses) of the flax model through ``jq.flax_loss`` or of the hand-written one."""
    params, losses = _train(family, scan, cw, devices, reference, mode)
    return params[steps - 1], losses[:steps]


@functools.lru_cache(maxsize=None)
def _train(family, scan, cw, devices, reference, mode):
    """([params after each step], losses) of ``STEPS`` steps: one run serves every ``steps`` up to ``STEPS``."""
    model = model_of(family, scan)
    loss = fl.nnx_loss if family == "nnx" else fl.linen_loss(scan)
    loss_fn = fl.ref_loss(family, scan) if reference else jqf.flax_loss(model, loss)
    step, state = make_step(model, loss_fn, cw, devices, scan=scan, mode=mode)
    params, losses = [], []
    for _ in range(STEPS):
        state, metrics = step(state, fl.make_batch())
        losses.append(float(metrics["loss"]))
        params.append(jax.tree.map(np.asarray, step.params(state)))
    return params, losses


def assert_close_to(params, ref, init, atol_of_update):
    """Every leaf within ``atol_of_update`` x its largest update (the bound style of tests/test_layerwise.py)."""
    for (path, a), b, c in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref),
                               jax.tree.leaves(init)):
        update = float(np.max(np.abs(np.asarray(b) - np.asarray(c))))
        assert update > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, rtol=0, atol=atol_of_update * update, err_msg=jax.tree_util.keystr(path))


# Every pair of family, form and recipe, not every triple: the flax side (nnx.scan / nn.scan slicing the kernel's
# leaves, the loop indexing the layers) is the same for every recipe (a ShardedWeight's leaves are; its recipe is a
# static field), and jq.dense, which the recipe changes, sees the same kernel from either family. Each family x form
# runs with a quantized recipe; the nnx-scan and linen-loop runs are test_eight_devices_equal_one's 8-device ones.
CASES = [("nnx", False, "fp8"), ("linen", True, "fp8"), ("nnx", True, "nvfp4"), ("linen", False, "nvfp4"),
         ("nnx", True, "bf16"), ("linen", False, "bf16")]
IDS = [f"{f}-{'scan' if s else 'loop'}-{c}" for f, s, c in CASES]


@pytest.mark.parametrize("family,scan,cw", CASES, ids=IDS)
@pytest.mark.fast_cases("nnx-scan-nvfp4", "linen-scan-fp8")
def test_flax_llama_trains_like_the_model_written_with_jq_dense(family, scan, cw):
    """3 steps of the unchanged flax model (loop or scan) against the same model in pure JAX + ``jq.dense`` with
    the same parameter tree: the same losses, and parameters within bf16 rounding of dW (2^-8 of the update;
    on the CPU they come out bitwise equal: the same GEMMs on the same quantized bytes)."""
    params, losses = train(family, scan, cw)
    ref, ref_losses = train(family, scan, cw, reference=True)
    assert losses[-1] < losses[0] - 0.5, losses
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_close_to(params, ref, init_params(family, scan), 2 ** -8)


@pytest.mark.parametrize("family,mode", [("nnx", "optim-microbatches"), ("linen", "keep-gathered")])
@pytest.mark.slow
def test_other_step_modes(family, mode):
    """The once-a-step gather (``strategy="optim"``, whose kernels carry ``ShardedWeight.gathered`` through the
    scan) with microbatches, and ``reshard_after_forward=False``: still the hand-written model's training."""
    params, losses = train(family, True, "fp8", mode=mode)
    ref, ref_losses = train(family, True, "fp8", reference=True, mode=mode)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_close_to(params, ref, init_params(family, True), 2 ** -8)


# nnx-scan-nvfp4 first, the case the README's command runs (tests/conftest.py): its 8-device run is
# test_flax_llama_trains_like_the_model_written_with_jq_dense[nnx-scan-nvfp4]'s (one run serves both, _train). bf16
# 8 = 1 stays in that command: through the adapter, test_flax_adapter_styles.py::test_eight_devices_equal_one
# [einsum-bf16]; stacked under scan, test_layerwise.py::test_eight_devices_equal_one[bf16].
@pytest.mark.parametrize("family,scan,cw", [("nnx", True, "nvfp4"), ("nnx", True, "bf16"),
                                            ("linen", False, "bf16"), ("linen", False, "nvfp4")],
                         ids=["nnx-scan-nvfp4", "nnx-scan-bf16", "linen-loop-bf16", "linen-loop-nvfp4"])
@pytest.mark.slow
def test_eight_devices_equal_one(family, scan, cw):
    """One step on 8 FSDP ranks and on 1: the same loss within fp32 reordering (each rank's GEMMs have 1/8 of the
    rows, the mean is a mean of per-rank means) and updates within the bf16 rounding of each rank's weight
    gradient (FP8 is left out: its activations are scaled per rank, tests/test_layerwise.py)."""
    p8, l8 = train(family, scan, cw, devices=8, steps=1)
    p1, l1 = train(family, scan, cw, devices=1, steps=1)
    np.testing.assert_allclose(l8, l1, rtol=2e-5)
    assert_close_to(p8, p1, init_params(family, scan), 2 ** -6)


def _concrete(x):
    assert not isinstance(x, jax.core.Tracer), "non-float state reached the model traced"
    return x


def _numpy(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def nnx_state(m):
    """The NNX Llama's non-float state: its dropout's rng key and count, the per-layer keys of the scanned blocks,
    the Counter."""
    return {"key": _concrete(m.dropout.rngs.key[...]), "count": _concrete(m.dropout.rngs.count[...]),
            "layer_keys": _concrete(m.layers.dropout.rngs.key[...]), "seen": _concrete(m.seen[...])}


@pytest.mark.parametrize("family", ["nnx", "linen"])
def test_non_float_state_passes_through_untouched(family):
    """Rng keys and counts (nnx.Dropout's, per layer under nnx.scan), an integer Counter (NNX) and an integer
    collection (linen) are no trained parameters; the model sees them as they are (concrete, not traced, their
    dtypes); what the model writes to them during the loss is dropped; flax_merge puts them back unchanged around
    the trained parameters and leaves the given model as it was. (A loss that draws from the rng streams is
    stepped with ``rng=``, which re-seeds them: tests/test_flax_adapter_styles.py.)"""
    model = model_of(family, True)
    params = jqf.flax_params(model)
    assert all(jnp.issubdtype(a.dtype, jnp.floating) for a in jax.tree.leaves(params))
    seen = {}
    if family == "nnx":
        original = nnx_state(model)
        assert original["layer_keys"].shape == (fl.CFG.layers,)

        def loss(m, batch):
            seen.update(nnx_state(m))
            m.seen[...] = m.seen[...] + 1    # the model writes its state: a counter
            return fl.nnx_loss(m, batch)
    else:
        original = {"seen": _concrete(model["counters"]["seen"])}

        def loss(variables, batch):
            seen.update(seen=_concrete(variables["counters"]["seen"]))
            return fl.linen_loss(True)(variables, batch)

    step, state = make_step(model, jqf.flax_loss(model, loss), "fp8", scan=True)
    names = lambda tree: {jqf.dotted_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    assert names(state.master) == names(params)
    state, metrics = step(state, fl.make_batch())
    trained = step.params(state)
    merged = jqf.flax_merge(model, trained)
    if family == "nnx":
        after_merged, after_original = nnx_state(merged), nnx_state(model)
        np.testing.assert_array_equal(model.head.kernel[...], params["head"]["kernel"])   # the given model: as it was
        np.testing.assert_array_equal(merged.head.kernel[...], trained["head"]["kernel"])
    else:
        after_merged, after_original = {"seen": merged["counters"]["seen"]}, {"seen": model["counters"]["seen"]}
        np.testing.assert_array_equal(merged["params"]["head"]["kernel"], trained["head"]["kernel"])
    for k, v in original.items():
        for what, got in (("seen in the loss", seen), ("merged", after_merged), ("given model", after_original)):
            assert got[k].dtype == v.dtype, (what, k)
            np.testing.assert_array_equal(_numpy(got[k]), _numpy(v), err_msg=f"{what}: {k}")
    assert jax.tree.structure(jqf.flax_params(merged)) == jax.tree.structure(params)


def _attrs():
    """The module attributes the interception replaces, as they are now."""
    return {name: getattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
            for name in jqf.intercepted_attributes()}


def _functions():
    """Every function the interception could have modified (jax's, flax's promote_dtype, flax's layers), by name."""
    import flax.linen.dtypes
    import flax.nnx.nn.dtypes

    fns = {name: fn for name, (fn, _) in jqf.intercepted_attributes().items()}
    fns.update({"flax.nnx.nn.dtypes.promote_dtype": flax.nnx.nn.dtypes.promote_dtype,
                "flax.linen.dtypes.promote_dtype": flax.linen.dtypes.promote_dtype,
                "jax.lax.dot": jax.lax.dot})
    for cls in (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nn.Dense, nn.DenseGeneral, nn.Einsum):
        fns[f"{cls.__module__}.{cls.__qualname__}.__call__"] = cls.__call__
    return fns


def _codes():
    return {name: fn.__code__ for name, fn in _functions().items()}


def test_the_interception_leaves_no_trace():
    """The interception replaces public module attributes only (jax.lax.dot_general, jax.numpy.einsum,
    jax.numpy.asarray, jax.lax.with_sharding_constraint) and the NNX model's own attributes holding
    ``jax.lax.dot_general`` / ``jnp.einsum`` (``nnx.Linear.dot_general``, ``nnx.Einsum.einsum_op``), for the scope:
    they are restored when the loss has run (also after an error, nested contexts and a context left in another
    thread); a plain flax forward outside gives the same numbers as before, and inside the context calls without a
    quantized kernel run as before; a thread outside the context keeps its sharding constraints."""
    attrs = jqf.intercepted_attributes()
    originals = {name: fn for name, (fn, _) in attrs.items()}
    wrappers = {name: w for name, (_, w) in attrs.items()}
    assert set(originals) == {"jax.lax.dot_general", "jax.numpy.einsum", "jax.numpy.asarray",
                              "jax.lax.with_sharding_constraint"}
    assert originals["jax.lax.dot_general"].__module__.startswith("jax")
    assert _attrs() == originals
    tokens = fl.make_batch()["tokens"]
    nnx_model, variables = fl.nnx_model(True), fl.linen_variables(False)
    linen_forward = jax.jit(fl.LinenLlama(fl.CFG).apply)
    before = (np.asarray(nnx_model(tokens)), np.asarray(linen_forward(variables, tokens)))

    for family, scan, model in (("nnx", True, nnx_model), ("linen", False, variables)):   # a traced loss: lower
        step, state = make_step(model, jqf.flax_loss(model, fl.nnx_loss if family == "nnx" else fl.linen_loss(scan)),
                                "nvfp4", scan=scan)
        assert "dot_general" in step.lower(state, fl.make_batch()).as_text()
        assert _attrs() == originals
    assert jqf._STATE["depth"] == 0
    after = (np.asarray(nnx_model(tokens)), np.asarray(jax.jit(fl.LinenLlama(fl.CFG).apply)(variables, tokens)))
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)

    plain = fl.nnx_model(False)
    linear, einsum = plain.layers[0].attn.q, plain.layers[0].mlp.down
    assert linear.dot_general is originals["jax.lax.dot_general"] and einsum.einsum_op is originals["jax.numpy.einsum"]
    with jqf.flax_intercept(plain):
        assert _attrs() == wrappers
        assert linear.dot_general is wrappers["jax.lax.dot_general"]           # captured at construction: routed
        assert einsum.einsum_op is wrappers["jax.numpy.einsum"]
        with jqf.flax_intercept():
            np.testing.assert_array_equal(nnx_model(tokens), before[0])       # no quantized kernel: as before
        assert _attrs() == wrappers and linear.dot_general is wrappers["jax.lax.dot_general"]
        np.testing.assert_array_equal(jax.jit(fl.LinenLlama(fl.CFG).apply)(variables, tokens), before[1])   # traced
    assert _attrs() == originals
    assert linear.dot_general is originals["jax.lax.dot_general"] and einsum.einsum_op is originals["jax.numpy.einsum"]
    with pytest.raises(ZeroDivisionError):
        with jqf.flax_intercept(plain):
            1 / 0
    assert _attrs() == originals and linear.dot_general is originals["jax.lax.dot_general"]
    entered, leave = threading.Event(), threading.Event()

    def other():
        with jqf.flax_intercept():
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=other)
    t.start()
    entered.wait(30)
    with jqf.flax_intercept():
        x = jnp.ones((8, 4))
        assert jax.lax.with_sharding_constraint(x, None) is x                 # inside: the constraint is dropped
    assert _attrs()["jax.lax.dot_general"] is wrappers["jax.lax.dot_general"]   # the other thread is inside
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    y = jax.jit(lambda a: jax.lax.with_sharding_constraint(a, sharding))(jnp.ones((8, 4)))   # this thread: outside
    assert y.sharding.is_equivalent_to(sharding, 2)
    leave.set()
    t.join(30)
    assert _attrs() == originals and jqf._STATE["depth"] == 0


def test_the_interception_modifies_no_code():
    """No function's code object is replaced: inside the loss, as the step traces it (NNX and linen), the module
    attributes are jaxquant's wrappers and the NNX model's layers hold them, while the code of jax's functions,
    flax's ``promote_dtype`` and flax's layers is the code they had before."""
    codes = _codes()
    attrs = jqf.intercepted_attributes()
    wrappers = {name: w for name, (_, w) in attrs.items()}
    seen = []

    def recording(loss):
        def run(model, batch, **kw):
            routed = ([model.layers[0].attn.q.dot_general, model.layers[0].mlp.down.einsum_op]
                      if isinstance(model, nnx.Module) else [])
            seen.append((_codes(), _attrs(), routed))
            return loss(model, batch, **kw)
        return run

    for family, loss in (("nnx", fl.nnx_loss), ("linen", fl.linen_loss(False))):
        model = model_of(family, False)
        step, state = make_step(model, jqf.flax_loss(model, recording(loss), batch=fl.make_batch()), "fp8")
        step.lower(state, fl.make_batch())
    assert len(seen) >= 4                                                  # the trace of flax_loss and the step's
    for inside, now, routed in seen:
        assert inside == codes
        assert now == wrappers
        assert routed in ([], [wrappers["jax.lax.dot_general"], wrappers["jax.numpy.einsum"]])
    assert sum(bool(r) for *_, r in seen) >= 2
    assert _codes() == codes


# ----------------------------------------------------------------------------------------------
# What cannot run quantized, and the rules
# ----------------------------------------------------------------------------------------------


class Tiny(nnx.Module):
    """embed -> one projection ``proj`` built by ``make`` -> head (with a bias, computing in bf16): a model for one
    layer kind."""

    def __init__(self, make, *, rngs):
        self.embed = nnx.Embed(64, 128, rngs=rngs)
        self.proj = make(rngs)
        self.head = nnx.Linear(128, 64, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, tokens):
        y = self.proj(self.embed(tokens))
        return self.head(y.reshape(*y.shape[:2], -1))


class RawMatmul(nnx.Module):
    def __init__(self, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (128, 128)) / 16)

    def __call__(self, x):
        return x @ self.kernel[...]


def tiny_loss(model, batch):
    return fl.cross_entropy(model(batch["tokens"]), batch["targets"])


def lower(model, rules, cw="bf16", loss=tiny_loss):
    step, state = make_step(model, jqf.flax_loss(model, loss), cw, rules=rules)
    return step.lower(state, fl.make_batch())


ERRORS = {
    "einsum-wrong-axis": (lambda r: nnx.Einsum("bsd,fd->bsf", (128, 128), rngs=r), None,
                          r"proj\.kernel \(module proj; a quantized \[in, out\] kernel of shape \(128, 128\), recipe "
                          r"bf16\): jnp\.einsum\('bsd,fd->bsf'\) contracts kernel axis 1, but a \[in, out\] kernel's "
                          r"'in' axis is 0\. The model reads this kernel as \[out, in\]: declare kernel='out_in'"),
    "einsum-summed-kernel-axis": (lambda r: nnx.Einsum("bsd,df->bs", (128, 128), rngs=r), None,
                                  r"proj\.kernel .*jnp\.einsum\('bsd,df->bs'\): the kernel 'df' must have one axis "
                                  r"contracted with the activation and one output axis"),
    "matmul": (RawMatmul, None, r"proj\.kernel \(module proj; a quantized \[in, out\] kernel .*\): (read as an array|"
                                r"used with the @ operator)"),
    "quantized-embedding": (lambda r: nnx.Linear(128, 128, rngs=r), jqf.flax_rules(r".*(kernel|embedding)"),
                            r"embed\.embedding \(module embed; .*\): read as an array"),
    "stack-as-one-layer": (lambda r: nnx.LinearGeneral(128, (4, 32), use_bias=False, rngs=r),
                           jqf.flax_rules(stacked=r"proj\.kernel"),
                           r"proj\.kernel \(module proj; a stack of 128 quantized \[in, out\] kernels of shape "
                           r"\(128, 4, 32\).*a stacked kernel is used as one layer's kernel"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_what_cannot_run_quantized_is_an_error_naming_it(case):
    make, rules, match = ERRORS[case]
    model = Tiny(make, rngs=nnx.Rngs(0))
    with pytest.raises(jqf.FlaxKernelError, match=match):
        lower(model, jqf.flax_rules() if rules is None else rules)
    assert _attrs() == {n: fn for n, (fn, _) in jqf.intercepted_attributes().items()}


def test_multi_axis_kernels_stay_unquantized_and_out_in_kernels_run():
    """A DenseGeneral-style kernel [embed, heads, head_dim] cannot be quantized (the rules say so, naming it) and
    trains unquantized with ``keep``; an einsum kernel stored [out, in] runs quantized with ``kernel='out_in'``."""
    general = Tiny(lambda r: nnx.LinearGeneral(128, (4, 32), use_bias=False, rngs=r), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"proj\.kernel of shape \(128, 4, 32\): only \[out, in\] weights \(per "
                                         r"layer\) can be quantized"):
        lower(general, jqf.flax_rules())
    rules = jqf.flax_rules(keep=r"proj\.kernel")
    decisions = dict(zip(["embed.embedding", "head.bias", "head.kernel", "proj.kernel"],
                         decide(jqf.flax_params(general), rules=rules, compute_weights="fp8")))
    assert decisions["proj.kernel"].recipe is None and decisions["head.kernel"].recipe == "fp8"
    step, state = make_step(general, jqf.flax_loss(general, tiny_loss), "fp8", rules=rules)
    losses = []
    for _ in range(2):
        state, m = step(state, fl.make_batch())
        losses.append(float(m["loss"]))
    assert losses[1] < losses[0]
    out_in = Tiny(lambda r: nnx.Einsum("bsd,fd->bsf", (128, 128), rngs=r), rngs=nnx.Rngs(0))
    rules = [jq.ParamRule(r"proj\.kernel", quantize=True, kernel="out_in")] + jqf.flax_rules()
    text = lower(out_in, rules, "fp8").as_text()
    assert "f8E4M3FN" in text


class RawContractions(nnx.Module):
    """Contractions written in the model itself: ``jnp.einsum`` and ``jax.lax.dot_general`` looked up at call time
    (intercepted), and an ``einsum`` bound at import (``from jax.numpy import einsum``: not intercepted)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 128, rngs=rngs)
        self.w_einsum = nnx.Param(jax.random.normal(rngs.params(), (128, 4, 32)) / 16)
        self.w_dot = nnx.Param(jax.random.normal(rngs.params(), (4, 32, 128)) / 16)
        self.w_bound = nnx.Param(jax.random.normal(rngs.params(), (128, 128)) / 16)
        self.head = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        h = jnp.einsum("btd,dnh->btnh", x, self.w_einsum[...])
        x = x + jax.lax.dot_general(h, self.w_dot[...], (((2, 3), (0, 1)), ((), ())))
        x = x + _bound_einsum("btd,de->bte", x, self.w_bound[...])
        return self.head(x)


def test_raw_einsum_and_dot_general_on_a_parameter_run_quantized():
    """A loss's own ``jnp.einsum`` / ``jax.lax.dot_general`` on a parameter is a contraction the trace sees (the
    module attributes are intercepted in the scope): quantized by default, and the step's first loss is plain flax's
    within FP8's rounding; an ``einsum`` bound before the scope is not seen, and its kernel stays unquantized with
    the reason in the plan."""
    model = RawContractions(nnx.Rngs(0))
    loss_fn = jq.flax_loss(model, tiny_loss, batch=fl.make_batch())
    views = loss_fn.kernels.views
    assert views["w_einsum"].op == "jnp.einsum('btd,dnh->btnh')" and views["w_einsum"].matrix_shape == (128, 128)
    assert views["w_dot"].op.startswith("jax.lax.dot_general") and views["w_dot"].in_axes == (0, 1)
    assert "w_bound" not in views and "not the weight operand" in loss_fn.kernels.kept["w_bound"]
    step = jq.make_train_step(loss_fn, optax.sgd(LR), mesh=Mesh(np.array(jax.devices()[:8]), ("fsdp",)),
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))
    state = step.init(jq.flax_params(loss_fn))
    recipes = {r["path"]: r["recipe"] for r in step.describe(state, file=False)}
    assert recipes["w_einsum"] == recipes["w_dot"] == "fp8" and recipes["w_bound"] == "kept"
    _, metrics = step(state, fl.make_batch())
    plain = float(jax.jit(tiny_loss)(model, fl.make_batch()))
    np.testing.assert_allclose(float(metrics["loss"]), plain, rtol=2e-2)


def test_flax_rules_decide_like_declared():
    params = jqf.flax_params(fl.nnx_model(True))
    rules = jqf.flax_rules(stacked=STACKED, recipes={r"head\.kernel": "bf16"})
    got = {jqf.dotted_path(p): d for (p, _), d in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                                      decide(params, rules=rules, compute_weights="nvfp4"))}
    # recipe, tp, stacked, transposed, keep_dtype (unquantized leaves reach the model in its own dtype)
    got = {name: tuple(d)[:5] for name, d in got.items()}
    assert got["layers.attn.q.kernel"] == ("nvfp4", None, True, True, False)
    assert got["layers.mlp.down.kernel"] == ("nvfp4", None, True, True, False)
    assert got["layers.attn_norm.scale"] == (None, None, True, False, True)
    assert got["head.kernel"] == ("bf16", None, False, True, False)
    assert got["embed.embedding"] == (None, None, False, False, True)
    assert got["norm.scale"] == (None, None, False, False, True)
    with pytest.raises(ValueError, match=r"flax_rules: stacked is not a regular expression"):
        jqf.flax_rules(stacked="(")


def test_linen_metadata_boxes_are_stripped_for_training_and_put_back():
    class Boxed(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 128, name="embed")(tokens)
            x = nn.Dense(128, use_bias=False, name="proj",
                         kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
            return nn.Dense(64, use_bias=False, name="head")(x)

    variables = Boxed().init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))
    assert isinstance(variables["params"]["proj"]["kernel"], nn.Partitioned)
    params = jqf.flax_params(variables)
    assert isinstance(params["proj"]["kernel"], jax.Array)
    loss = lambda v, batch: fl.cross_entropy(Boxed().apply(v, batch["tokens"]), batch["targets"])
    step, state = make_step(variables, jqf.flax_loss(variables, loss), "fp8")
    state, _ = step(state, fl.make_batch())
    merged = jqf.flax_merge(variables, step.params(state))
    box = merged["params"]["proj"]["kernel"]
    assert isinstance(box, nn.Partitioned) and box.names == ("embed", "mlp")
    np.testing.assert_array_equal(box.value, step.params(state)["proj"]["kernel"])
    with pytest.raises(TypeError, match=r"a linen Module holds no parameters; pass its variables"):
        jqf.flax_params(Boxed())
    with pytest.raises(ValueError, match=r"params: must be like flax_params\(model\); missing \['head\.kernel'\]"):
        jqf.flax_merge(variables, {k: v for k, v in params.items() if k != "head"})
