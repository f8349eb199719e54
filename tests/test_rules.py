"""Quantization and layout declared, not guessed (jaxquant/training/rules.py): ``jq.ParamRule`` on parameter paths and
optax-style prefix masks give the same step as a full mask; a stacked ``[L, H]`` norm is named per layer; a rule
can give a leaf its own recipe; what the rules leave unclear is an error naming the leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxquant as jq
from support.meshes import fsdp_mesh
from support.transformer import MASK, init_params, loss_scan, make_batch

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

RULES = [jq.ParamRule(r"embed"), jq.ParamRule(r"blocks\.norm", stacked=True),
         jq.ParamRule(r"blocks\..*", quantize=True, stacked=True), jq.ParamRule(r"head", quantize=True)]


def params_2d_norm():
    """test_layerwise's model with the stacked norms as [L, D] (one vector per layer), as flax's nn.scan stacks them."""
    p = init_params()
    return {**p, "blocks": {**p["blocks"], "norm": p["blocks"]["norm"][:, 0, :]}}


def run(params, cw="fp8", steps=2, **kw):
    step = jq.make_train_step(loss_scan, optax.sgd(0.05), mesh=fsdp_mesh(),
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw), **kw)
    state = step.init(params)
    for _ in range(steps):
        state, _ = step(state, make_batch())
    return step, state


def assert_same(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_rules_and_prefix_mask_equal_the_full_mask():
    step_mask, s_mask = run(init_params(), quantize_mask=MASK)
    step_rules, s_rules = run(init_params(), rules=RULES)
    assert [r.quantized for r in s_rules.plan.rules] == [r.quantized for r in s_mask.plan.rules]
    assert_same(step_rules.params(s_rules), step_mask.params(s_mask))
    # optax.masked's prefix convention: one bool for a whole subtree
    prefix = {"embed": False, "blocks": False, "head": True}
    full = {"embed": False, "blocks": {"w1": False, "w2": False, "norm": False}, "head": True}
    step_p, s_p = run(init_params(), quantize_mask=prefix, steps=1)
    assert [r.quantized for r in s_p.plan.rules] == [False, False, False, False, True]   # blocks (3), embed, head
    step_f, s_f = run(init_params(), quantize_mask=full, steps=1)
    assert_same(step_p.params(s_p), step_f.params(s_f))
    assert optax.masked(optax.sgd(0.1), prefix).init(init_params()) is not None   # optax reads the same mask


def test_stacked_2d_norm_is_named_per_layer():
    step, state = run(params_2d_norm(), rules=RULES, steps=1)
    norm_rule = state.plan.rules[[r.name for r in state.plan.rules].index("['blocks']['norm']")]
    assert norm_rule.stacked and not norm_rule.quantized and norm_rule.recipe == "keep"
    assert tuple(norm_rule.spec) == (None, "fsdp")          # each layer's [D] split over fsdp, never the layers
    sd = step.state_dict(state, hyperparams=dict(lr=0.05, momentum=0.0, weight_decay=0.0))
    L, D = params_2d_norm()["blocks"]["norm"].shape
    for i in range(L):
        assert sd["model"][f"blocks.{i}.norm"].shape == (D,)
        np.testing.assert_array_equal(np.asarray(sd["model"][f"blocks.{i}.norm"]),
                                      np.asarray(step.params(state)["blocks"]["norm"][i]))
    assert "blocks.norm" not in sd["model"]
    back = step.load_state_dict(sd, like=step.init(params_2d_norm()), step_count=1)
    assert_same(back.master, state.master)


def test_a_rule_gives_a_leaf_its_own_recipe():
    """The head in bf16 while the policy says NVFP4 (as the NVFP4 pretraining recipe keeps the last layer): the head
    trains as in an all-bf16 run's first step, the blocks do not."""
    rules = RULES[:-1] + [jq.ParamRule("head", quantize="bf16")]
    step, state = run(init_params(), cw="nvfp4", steps=1, rules=rules)
    head_rule = state.plan.rules[[r.name for r in state.plan.rules].index("['head']")]
    assert head_rule.recipe == "bf16" and head_rule.quantized
    step_nv, s_nv = run(init_params(), cw="nvfp4", steps=1, rules=RULES)
    assert not np.array_equal(np.asarray(step.params(state)["head"]), np.asarray(step_nv.params(s_nv)["head"]))


@pytest.mark.parametrize("rules,match", [
    ([jq.ParamRule("embed"), jq.ParamRule("head")], r"no rule matches the parameter blocks\.norm"),
    ([jq.ParamRule("blocks\\..*", quantize=True), jq.ParamRule(".*")],
     r"ParamRule\('blocks\\\\\.\.\*'\) matches blocks\.norm of shape \(3, 1, 128\): only \[out, in\] weights .* "
     r"declare stacked=True"),
    ([jq.ParamRule("embed", tp="col", stacked=True), jq.ParamRule(".*", stacked=True, quantize=True)],
     r"embed of shape \(64, 128\): only \[out, in\] weights \(per layer\) can be split over TP"),
])
def test_unclear_rules_are_errors_naming_the_leaf(rules, match):
    with pytest.raises(ValueError, match=match):
        run(init_params(), rules=rules, steps=0)


def test_rule_and_mask_argument_errors():
    with pytest.raises(ValueError, match="ParamRule.pattern: not a regular expression"):
        jq.ParamRule("(")
    with pytest.raises(ValueError, match=r"quantize: must be True, False or one of"):
        jq.ParamRule("x", quantize="int8")
    with pytest.raises(ValueError, match="rules: give either rules or quantize_mask"):
        run(init_params(), rules=RULES, quantize_mask=MASK, steps=0)
    with pytest.raises(ValueError, match=r"quantize_mask: must be a pytree like params, or a prefix"):
        run(init_params(), quantize_mask={"embed": False, "nope": True}, steps=0)
    with pytest.raises(ValueError, match=r"quantize_mask\['embed'\]: only 2-D .* got shape \(64,\)"):
        run({**init_params(), "embed": jnp.zeros(64)}, quantize_mask={"embed": True, "blocks": False, "head": True},
            steps=0)
