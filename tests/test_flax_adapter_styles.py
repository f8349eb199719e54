"""Flax models written in the styles people write (tests/flax_styles.py), trained through the adapter with no rule
given: (a) NNX with ``nnx.Einsum`` attention (multi-axis kernels, one kv head, tied embedding, dropout) and (b) linen
with ``nn.DenseGeneral`` attention and logical axis annotations. ``jq.flax_loss(model, loss, batch=...)`` traces the
loss once; every contraction's weight operand is quantized as the 2-D matrix of its contraction, the output head
stays bf16, every other leaf reaches the model in its own dtype; meshes from ``jax.make_mesh`` (Explicit or Auto
axes) give the same step; a step that quantizes nothing is plain flax's; NNX rng streams advance per step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

pytest.importorskip("flax")

from flax import nnx  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.training.flax_adapter import stream_keys  # noqa: E402
from jaxquant.training.plan_view import plan_row  # noqa: E402
from jaxquant.training.rules import ParamRule, decide  # noqa: E402
import flax_styles as fs  # noqa: E402

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

LR, STEPS = 0.1, 2
# one layer of each (a layer's kernels are what is new here; tests/test_flax_models.py trains stacks of them)
EINSUM = fs.StyleConfig(kv_heads=1, layers=1)
DENSE_GENERAL = fs.StyleConfig(kv_heads=2, layers=1)
BATCH = fs.example_batch(EINSUM, batch=8, seed=3)


def model_and_loss(style, dropout=0.0):
    """(model or variables, loss) of style "einsum" (a) or "dense-general" (b) at the CPU size."""
    if style == "einsum":
        return fs.nnx_einsum_model(fs.StyleConfig(kv_heads=1, layers=1, dropout=dropout)), fs.nnx_einsum_loss
    return (fs.linen_dense_general_init(DENSE_GENERAL),
            functools.partial(fs.linen_dense_general_loss, cfg=DENSE_GENERAL))


def mesh_of(devices, axis_type=None):
    types = None if axis_type is None else (axis_type,)
    return jax.make_mesh((devices,), ("fsdp",), axis_types=types, devices=jax.devices()[:devices])


def train(style, cw, devices=8, axis_type=None, steps=STEPS):
    """(losses, params after the steps as numpy, the plan's rows) of SGD on the unchanged model, no rules given (SGD:
    Adam would magnify the rounding of near-zero gradients into whole steps in comparisons)."""
    return trained(style, cw, devices, axis_type, steps)[:3]


@functools.lru_cache(maxsize=None)
def trained(style, cw, devices=8, axis_type=None, steps=STEPS):
    """:func:`train`'s results, then the step and its final state."""
    model, loss = model_and_loss(style)
    loss_fn = jq.flax_loss(model, loss, batch=BATCH)
    step = jq.make_train_step(loss_fn, optax.sgd(LR), mesh=mesh_of(devices, axis_type),
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw))
    state = step.init(jq.flax_params(loss_fn))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, BATCH)
        losses.append(float(metrics["loss"]))
    return losses, jax.tree.map(np.asarray, step.params(state)), step.describe(state, file=False), step, state


def kernel_shapes(style):
    """The 2-D [in, out] matrices the multi-axis kernels of layer 0 are trained as."""
    if style == "einsum":
        c = EINSUM
        return {"layers.0.attn.q.kernel": (c.dim, c.heads * c.head_dim),
                "layers.0.attn.k.kernel": (c.dim, c.kv_heads * c.head_dim),
                "layers.0.attn.out.kernel": (c.heads * c.head_dim, c.dim)}
    c = DENSE_GENERAL
    return {"layers_0.attn.query.kernel": (c.dim, c.heads * c.head_dim),
            "layers_0.attn.key.kernel": (c.dim, c.kv_heads * c.head_dim),
            "layers_0.attn.out.kernel": (c.heads * c.head_dim, c.dim)}


@pytest.mark.all_cases   # issue 53: both models, every recipe, in CI
@pytest.mark.parametrize("style", ["einsum", "dense-general"])
@pytest.mark.parametrize("cw", ["bf16", "fp8", "nvfp4"])
@pytest.mark.fast_cases("fp8-einsum", "nvfp4-dense-general")
def test_models_train_with_no_rule_given_and_every_contraction_weight_quantized(style, cw):
    losses, params, rows = train(style, cw)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    by_path = {r["path"]: r for r in rows}
    contraction = [r for r in rows if r["why"].startswith("weight of ")]
    # (a): 4 attention + 3 MLP kernels a layer, the head tied (kept); (b): the same and the untied head
    assert len(contraction) == 7 + (style == "dense-general"), [r["path"] for r in contraction]
    for r in contraction:
        assert r["recipe"] == ("bf16" if r["path"] == "head.kernel" else cw), r
    for path, shape in kernel_shapes(style).items():
        assert by_path[path]["shape"] == shape and by_path[path]["recipe"] == cw, by_path[path]
    for r in rows:
        if r not in contraction:
            assert r["recipe"] == "kept", r             # embeddings and norm scales, in the model's fp32
    if style == "einsum":
        assert "tied" in by_path["embed.embedding"]["why"] or "not the weight operand" in by_path[
            "embed.embedding"]["why"]
    else:
        assert "output head" in by_path["head.kernel"]["why"]


@pytest.mark.parametrize("style,cw", [("einsum", "bf16"), ("dense-general", "nvfp4")])
@pytest.mark.slow
def test_eight_devices_equal_one(style, cw):
    """The same training on 8 FSDP ranks and on 1: losses within fp32 reordering of the per-rank means, parameters
    within a few percent of the two steps' update (bf16 rounding of each rank's weight gradient; FP8 is left out:
    its activations are scaled per rank, tests/test_layerwise.py)."""
    l8, p8, _ = train(style, cw, 8)
    l1, p1, _ = train(style, cw, 1)
    np.testing.assert_allclose(l8, l1, rtol=1e-4)
    init = jq.flax_params(jq.flax_loss(*model_and_loss(style), batch=BATCH))
    for (path, a), b, c in zip(jax.tree_util.tree_flatten_with_path(p8)[0], jax.tree.leaves(p1),
                               jax.tree.leaves(init)):
        update = float(np.max(np.abs(b - np.asarray(c))))
        np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * update + 1e-7, err_msg=jax.tree_util.keystr(path))


def test_explicit_and_auto_meshes_give_the_same_step():
    """``jax.make_mesh``'s default (Explicit axes) and an Auto mesh with the batch placed on it first and the step
    run under ``jax.set_mesh``: the same losses, bit for bit. Model (b) annotates its activations with logical axis
    names (``nn.with_logical_constraint`` under ``nn.logical_axis_rules``): they do not stop the step."""
    explicit = train("dense-general", "fp8", 8)[0]
    assert mesh_of(8).axis_types == (AxisType.Explicit,)
    model, loss = model_and_loss("dense-general")
    loss_fn = jq.flax_loss(model, loss, batch=BATCH)
    mesh = mesh_of(8, AxisType.Auto)
    step = jq.make_train_step(loss_fn, optax.sgd(LR), mesh=mesh, policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))
    placed = jax.device_put(BATCH, NamedSharding(mesh, P("fsdp")))
    with jax.set_mesh(mesh):
        state = step.init(jq.flax_params(loss_fn))
        losses = []
        for _ in range(STEPS):
            state, metrics = step(state, placed)
            losses.append(float(metrics["loss"]))
    assert losses == explicit


@pytest.mark.parametrize("style", ["einsum", "dense-general"])
def test_a_step_that_quantizes_nothing_is_plain_flax(style):
    """Every leaf kept (``rules(keep=".*")``): each reaches the model as the fp32 array it declared, so one SGD step
    on one device is plain flax's (``jax.value_and_grad`` of the same loss) up to fp32 rounding: the two are different
    XLA programs (the step's runs inside shard_map with its gradient bookkeeping), which may order a sum differently;
    nothing is cast, so any real difference (a bf16 copy of a leaf, a changed layout) would be far above it."""
    model, loss = model_and_loss(style)
    loss_fn = jq.flax_loss(model, loss, batch=BATCH)
    step = jq.make_train_step(loss_fn, optax.sgd(LR), mesh=mesh_of(1), rules=loss_fn.rules(keep=".*"))
    state = step.init(jq.flax_params(loss_fn))
    assert {r["recipe"] for r in step.describe(state, file=False)} == {"kept"}
    state, metrics = step(state, BATCH)

    params = jq.flax_params(model)
    if style == "einsum":
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        plain = lambda p: loss(nnx.merge(graphdef, nnx.State(p), rest), BATCH)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    else:
        plain = lambda p: loss({"params": p}, BATCH)
    value, grads = jax.jit(jax.value_and_grad(plain))(params)
    np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=1e-6)
    after = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    got = jq.flax_params(loss_fn.merge(step.params(state)) if style == "einsum" else
                         loss_fn.merge(step.params(state)))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(after)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_dropout_streams_advance_every_step_and_match_plain_flax():
    """Model (a) with dropout: without ``rng=`` the step refuses in one line (the model's own stream would give one
    mask for the whole run); with a new key each step the losses at lr 0 differ from step to step, and the first
    equals plain flax's loss with the key the step hands rank 0's first microbatch (every leaf kept, one device; fp32
    rounding between the two programs: another mask would change the loss by far more)."""
    model, loss = model_and_loss("einsum", dropout=0.3)
    loss_fn = jq.flax_loss(model, loss, batch=BATCH)
    step = jq.make_train_step(loss_fn, optax.sgd(0.0), mesh=mesh_of(1), rules=loss_fn.rules(keep=".*"))
    state = step.init(jq.flax_params(loss_fn))
    with pytest.raises(ValueError, match=r"^loss_fn: the model draws random numbers .* call the step with rng=key"):
        step(state, BATCH)
    state = step.init(jq.flax_params(loss_fn))
    key = jax.random.key(11)
    losses = []
    for i in range(3):
        state, metrics = step(state, BATCH, rng=jax.random.fold_in(key, i))
        losses.append(float(metrics["loss"]))
    assert len(set(losses)) == 3, losses
    # the step's key for rank 0, microbatch 0 of step 0 (make_train_step's rng= contract)
    k0 = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, 0), 0), 1)[0]
    reference = nnx.clone(model)
    nnx.reseed(reference, **stream_keys(loss_fn.rng_streams, k0))
    np.testing.assert_allclose(float(jax.jit(lambda m: loss(m, BATCH, rng=k0))(reference)), losses[0], rtol=1e-6)
    other = nnx.clone(model)
    nnx.reseed(other, **stream_keys(loss_fn.rng_streams, jax.random.key(12)))
    assert abs(float(jax.jit(lambda m: loss(m, BATCH, rng=jax.random.key(12)))(other)) - losses[0]) > 1e-4


def test_head_default_and_overrides_in_the_plan():
    """The head is bf16 under FP8 unless ``recipes`` says otherwise; ``keep`` keeps a contraction weight; the plan
    is computed without running a step (``step.plan``)."""
    model, loss = model_and_loss("dense-general")
    loss_fn = jq.flax_loss(model, loss, batch=BATCH)
    params = jq.flax_params(loss_fn)
    step = jq.make_train_step(loss_fn, optax.sgd(LR), mesh=mesh_of(8),
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))
    recipe = lambda rules: {r.path: plan_row(r)["recipe"] for r in
                            jq.make_train_step(loss_fn, optax.sgd(LR), mesh=mesh_of(8), rules=rules,
                                               policy=step.policy).plan(params).rules}
    default = recipe(loss_fn.default_rules())
    assert default["head.kernel"] == "bf16" and default["layers_0.mlp.down.kernel"] == "fp8"
    override = recipe(loss_fn.rules(recipes={r"head\.kernel": "fp8"}, keep=r"layers_0\.mlp\..*"))
    assert override["head.kernel"] == "fp8" and override["layers_0.mlp.down.kernel"] == "kept"


def test_a_multi_axis_leaf_under_plain_rules_names_both_remedies():
    """``ParamRule(quantize=True)`` on a 3-D leaf that is not declared stacked: the error names both readings."""
    params = {"attn": {"q": jnp.zeros((4, 32, 16))}}
    with pytest.raises(ValueError, match=r"declare stacked=True.*flax adapter.*batch=example"):
        decide(params, rules=[ParamRule(".*", quantize=True)], compute_weights="fp8")


def test_a_model_built_from_its_constructor_is_never_whole_on_a_device():
    """``jq.flax_loss(lambda: Model(...), ...)``: the model is built abstractly for the trace, its rng state alone
    for real, and ``step.init`` builds the parameters inside the jit whose outputs are the FSDP shards; every call
    of the constructor sees traced arrays (no concrete whole copy), and training equals the concrete model's."""
    seen = []

    def build():
        model = fs.nnx_einsum_model(EINSUM)
        seen.append(isinstance(model.layers[0].mlp.up.kernel[...], jax.core.Tracer))
        return model

    loss_fn = jq.flax_loss(build, fs.nnx_einsum_loss, batch=BATCH)
    step = jq.make_train_step(loss_fn, optax.sgd(LR), mesh=mesh_of(8), policy=jq.MixedPrecisionPolicy(
        compute_weights="fp8"))
    state = step.init(jq.flax_params(loss_fn))
    assert seen and all(seen), seen
    assert all(len(a.sharding.device_set) == 8 for a in jax.tree.leaves(state.master))
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, BATCH)
        losses.append(float(metrics["loss"]))
    assert losses == train("einsum", "fp8")[0]


def test_the_checkpoint_records_each_parameters_recipe(tmp_path):
    """``step.state_dict`` carries the plan's recipe of every saved parameter (``plan.*`` byte entries, PyTorch's
    names, one per layer); ``ckpt inspect`` shows it per key; loading the state back reads only what it names."""
    from jaxquant import checkpoint as ck
    from jaxquant.checkpoint.inspect import format_report, inspect_dcp

    *_, step, state = trained("dense-general", "fp8")
    sd = step.state_dict(state, hyperparams={"lr": LR, "momentum": 0.0, "weight_decay": 0.0})
    assert sd["plan"]["layers_0.attn.query.kernel"] == "fp8" and sd["plan"]["head.kernel"] == "bf16"
    assert set(sd["plan"]) == set(sd["model"])
    path = ck.save_dcp(str(tmp_path / "ckpt"), sd)
    report = inspect_dcp(path)
    recipe = {k["key"]: k.get("recipe") for k in report["keys"]}
    assert recipe["model.layers_0.attn.query.kernel"] == "fp8" and recipe["model.head.kernel"] == "bf16"
    assert recipe["model.embed.embedding"] == "kept" and report["ok"]
    text = format_report(report)
    assert "recipes the training step used" in text and "plan.head.kernel" not in text
    back = step.load_state_dict(ck.load_dcp(path, step.state_dict_target(state)), like=state)
    for a, b in zip(jax.tree.leaves(back.master), jax.tree.leaves(state.master)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
