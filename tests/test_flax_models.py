"""Flax models unchanged (training/flax_adapter.py): a Llama-style NNX model and linen model (tests/flax_llama.py),
layers in a Python loop and under ``nnx.scan`` / ``nn.scan``, train under ``jq.make_train_step`` on an 8-device
FSDP mesh with bf16 / FP8 / NVFP4 ``[in, out]`` kernels through the interception of flax's dot_general / einsum /
promote_dtype, and equal the same model hand-written with ``jq.dense``; 8 devices equal 1; rng keys and counters
pass through untouched; the interception leaves no trace; what cannot run quantized is an error naming it."""

import functools
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


@pytest.mark.parametrize("family,scan,cw", [("nnx", True, "bf16"), ("nnx", True, "nvfp4"),
                                            ("linen", False, "bf16"), ("linen", False, "nvfp4")],
                         ids=["nnx-scan-bf16", "nnx-scan-nvfp4", "linen-loop-bf16", "linen-loop-nvfp4"])
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


def _codes():
    return {name: fn.__code__ for name, (fn, _) in jqf.intercepted_functions().items()}


def test_the_interception_leaves_no_trace():
    """The swapped functions get their code back when the loss has run (also after an error, nested contexts and
    a context left in another thread); a plain flax forward outside gives the same numbers as before, and inside
    the context calls without a quantized kernel run as before."""
    originals = {name: code for name, (_, code) in jqf.intercepted_functions().items()}
    assert set(originals) == {"jax.lax.dot_general", "jax.numpy.einsum", "flax.nnx.nn.dtypes.promote_dtype",
                              "flax.linen.dtypes.promote_dtype", "jax.lax.with_sharding_constraint"}
    assert _codes() == originals
    tokens = fl.make_batch()["tokens"]
    nnx_model, variables = fl.nnx_model(True), fl.linen_variables(False)
    linen_forward = jax.jit(fl.LinenLlama(fl.CFG).apply)
    before = (np.asarray(nnx_model(tokens)), np.asarray(linen_forward(variables, tokens)))

    for family, scan, model in (("nnx", True, nnx_model), ("linen", False, variables)):   # a traced loss: lower
        step, state = make_step(model, jqf.flax_loss(model, fl.nnx_loss if family == "nnx" else fl.linen_loss(scan)),
                                "nvfp4", scan=scan)
        assert "dot_general" in step.lower(state, fl.make_batch()).as_text()
        assert _codes() == originals
    assert jqf._STATE["depth"] == 0
    after = (np.asarray(nnx_model(tokens)), np.asarray(jax.jit(fl.LinenLlama(fl.CFG).apply)(variables, tokens)))
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)

    with jqf.flax_intercept():
        assert all(_codes()[n] is not originals[n] for n in originals)
        with jqf.flax_intercept():
            np.testing.assert_array_equal(nnx_model(tokens), before[0])       # no quantized kernel: as before
        assert all(_codes()[n] is not originals[n] for n in originals)
        np.testing.assert_array_equal(jax.jit(fl.LinenLlama(fl.CFG).apply)(variables, tokens), before[1])   # traced
    assert _codes() == originals
    with pytest.raises(ZeroDivisionError):
        with jqf.flax_intercept():
            1 / 0
    assert _codes() == originals
    entered, leave = threading.Event(), threading.Event()

    def other():
        with jqf.flax_intercept():
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=other)
    t.start()
    entered.wait(30)
    with jqf.flax_intercept():
        pass
    assert _codes()["jax.lax.dot_general"] is not originals["jax.lax.dot_general"]   # the other thread is inside
    leave.set()
    t.join(30)
    assert _codes() == originals and jqf._STATE["depth"] == 0


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
    assert _codes() == {n: c for n, (_, c) in jqf.intercepted_functions().items()}


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
