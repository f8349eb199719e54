"""Checkpoint names a PyTorch twin loads (jaxquant/training/state_dict.py): ``names=`` maps the default
names (``blocks.0.w1``) to a twin's own (``layers.0.feed_forward.w1.weight``) in ``model``, ``optim.state`` and the
param groups, and back on load; a Llama-style ``torch.nn.Module`` with its own names loads the JAX checkpoint
strictly and takes the same next Adam step, and JAX resumes the twin's checkpoint; optax states under ``chain``,
``masked`` and ``multi_transform`` are sharded like their parameters and named (one torch param group per Adam
state, masked-out parameters in ``model`` only)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from jaxquant import checkpoint as ck
from jaxquant.training.state_dict import name_map
from support.transformer import make_batch
from support.torch_twin import ADAM, NEXT_STEP_TOL, torch_load, torch_required, torch_save

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

V, H, F, L, EPS = 64, 128, 256, 2, 1e-6

# JAX: the [L, H] norms are one vector per layer (stacked=True), as flax's nn.scan stacks them
RULES = [jq.ParamRule(r"embed|norm"), jq.ParamRule(r"blocks\.(attn|ffn)_norm", stacked=True),
         jq.ParamRule(r"blocks\.w[vo12]", quantize=True, stacked=True), jq.ParamRule("head", quantize=True)]

TOP = {"embed": "tok_embeddings.weight", "norm": "norm.weight", "head": "output.weight"}
LAYER = {"attn_norm": "attention_norm.weight", "ffn_norm": "ffn_norm.weight", "wv": "attention.wv.weight",
         "wo": "attention.wo.weight", "w1": "feed_forward.w1.weight", "w2": "feed_forward.w2.weight"}


def to_twin(name):
    """The twin's name of a default name: ``blocks.0.w1`` -> ``layers.0.feed_forward.w1.weight``."""
    if name in TOP:
        return TOP[name]
    _, i, leaf = name.split(".")
    return f"layers.{i}.{LAYER[leaf]}"


def llama_params(seed=0):
    ks = jax.random.split(jax.random.key(seed), 9)
    w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[-1])
    gain = lambda k, shape: 1 + 0.1 * jax.random.normal(k, shape, jnp.float32)
    return {"embed": jax.random.normal(ks[0], (V, H), jnp.float32),
            "blocks": {"attn_norm": gain(ks[1], (L, H)), "ffn_norm": gain(ks[2], (L, H)), "wv": w(ks[3], (L, H, H)),
                       "wo": w(ks[4], (L, H, H)), "w1": w(ks[5], (L, F, H)), "w2": w(ks[6], (L, H, F))},
            "norm": gain(ks[7], (H,)), "head": w(ks[8], (V, H))}


def _rms(x, g):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + EPS) * g


def llama_loss(w, batch, dense=jq.dense):
    """Embedding, per layer attention (over a one-token sequence it is wo(wv(x)): softmax over one key is 1) and
    a SiLU MLP, each behind an RMSNorm, then a final RMSNorm and the head; ``dense``: ``x @ W.T``."""
    h = jnp.take(w["embed"], batch["tokens"], axis=0).astype(jnp.float32)

    def layer(h, p):
        h = h + dense(dense(_rms(h, p["attn_norm"]), p["wv"]), p["wo"], out_dtype=jnp.float32)
        return h + dense(jax.nn.silu(dense(_rms(h, p["ffn_norm"]), p["w1"])), p["w2"], out_dtype=jnp.float32), None

    h, _ = jax.lax.scan(layer, h, w["blocks"])
    logits = dense(_rms(h, w["norm"]), w["head"], out_dtype=jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch["targets"][:, None], axis=-1))


def fp32_loss(params, batch):
    """The same model in fp32 with plain matmuls (what the torch twin computes)."""
    return llama_loss(params, batch, dense=lambda x, w, out_dtype=None: x @ w.T)


def make(opt=None, n=8):
    mesh = Mesh(np.array(jax.devices()[:n]), ("fsdp",))
    return jq.make_train_step(llama_loss, opt or optax.adam(ADAM["lr"]), mesh=mesh, rules=RULES,
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))


def trained(step, steps=2):
    state = step.init(llama_params())
    for s in range(steps):
        state, _ = step(state, make_batch(s + 1))
    return state


@pytest.fixture(scope="module")
def llama():
    """(step, state after 2 Adam steps); tests read the state and never step it (a step donates it)."""
    step = make()
    return step, trained(step)


def at(tree, default):
    """The value of a default name in a params-like pytree: ``blocks.0.w1`` -> ``tree["blocks"]["w1"][0]``."""
    parts = default.split(".")
    return tree[parts[0]] if len(parts) == 1 else tree[parts[0]][parts[2]][int(parts[1])]


def masters_and_moments(state):
    """{"master" / "mu" / "nu": params-like host tree} of an optax adam state."""
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                if isinstance(s, optax.ScaleByAdamState))
    return {k: jax.device_get(v) for k, v in (("master", state.master), ("mu", adam.mu), ("nu", adam.nu))}


# -- names ---------------------------------------------------------------------------------------


def test_names_rename_model_optim_state_and_param_groups(llama):
    step, state = llama
    nm = name_map(state, to_twin)
    twin = {to_twin(n) for n in nm.to_torch}
    assert len(twin) == 3 + 6 * L and nm.to_torch["blocks.1.w2"] == "layers.1.feed_forward.w2.weight"
    assert nm.from_torch["layers.0.attention_norm.weight"] == "blocks.0.attn_norm"
    plain = step.state_dict(state, hyperparams=ADAM)
    sd = step.state_dict(state, hyperparams=ADAM, names=to_twin)
    assert set(sd["model"]) == set(sd["optim"]["state"]) == set(sd["optim"]["param_groups"][0]["params"]) == twin
    norm = sd["model"]["layers.1.ffn_norm.weight"]
    assert norm.shape == (H,) and sd["model"]["norm.weight"].sharding.spec == jax.sharding.PartitionSpec("fsdp")
    for default, name in nm.to_torch.items():
        np.testing.assert_array_equal(np.asarray(sd["model"][name]), np.asarray(plain["model"][default]))
        for k, v in plain["optim"]["state"][default].items():
            np.testing.assert_array_equal(np.asarray(sd["optim"]["state"][name][k]), np.asarray(v), err_msg=name)
    as_dict = step.state_dict(state, hyperparams=ADAM, names=dict(nm.to_torch))    # a dict: the same
    assert list(as_dict["model"]) == list(sd["model"]) and as_dict["optim"]["param_groups"] == \
        sd["optim"]["param_groups"]
    target = step.state_dict_target(state, names=to_twin)
    assert set(target["model"]) == set(target["optim"]["state"]) == twin
    for name, a in sd["model"].items():
        t = target["model"][name]
        assert (t.shape, t.dtype, t.sharding) == (a.shape, a.dtype, a.sharding), name
    back = step.load_state_dict(sd, like=step.init(llama_params()), names=to_twin)
    assert int(back.step) == 2
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 (back.master, back.opt_state), (state.master, state.opt_state))


def test_names_errors_name_the_parameters(llama):
    step, state = llama
    table = dict(name_map(state, to_twin).to_torch)
    short = {k: v for k, v in table.items() if k != "blocks.1.w2"}
    with pytest.raises(ValueError, match=r"names: no entry for the parameters \['blocks\.1\.w2'\]"):
        step.state_dict(state, hyperparams=ADAM, names=short)
    with pytest.raises(ValueError, match=r"names: \['blocks\.w1'\] are no parameters of this model"):
        step.state_dict_target(state, names=table | {"blocks.w1": "w1"})
    one = lambda n: to_twin("blocks.0.attn_norm" if n == "blocks.0.ffn_norm" else n)
    with pytest.raises(ValueError, match=r"names: 'blocks\.0\.attn_norm' and 'blocks\.0\.ffn_norm' both map to "
                                         r"'layers\.0\.attention_norm\.weight'; the mapping must be one-to-one"):
        step.load_state_dict({}, like=state, names=one)
    with pytest.raises(ValueError, match=r"names: every parameter needs a non-empty str name, got None for 'embed'"):
        step.state_dict(state, hyperparams=ADAM, names=lambda n: None if n == "embed" else n)
    with pytest.raises(ValueError, match=r"got \(\) for 'embed'; a tied parameter takes a tuple of them"):
        step.state_dict(state, hyperparams=ADAM, names=lambda n: () if n == "embed" else n)
    with pytest.raises(ValueError, match=r"names: 'embed' and 'head' both map to 'head'"):     # a tied name taken
        step.state_dict(state, hyperparams=ADAM, names=lambda n: ("embed", "head") if n == "embed" else n)
    with pytest.raises(TypeError, match="names: must be None, a callable"):
        step.state_dict(state, hyperparams=ADAM, names=["embed"])
    # a checkpoint in the default names read with the twin's: the missing twin name, its parameter, and the strays
    with pytest.raises(KeyError, match=r"sd: no tensor for \['layers\.0\.attention_norm\.weight "
                                       r"\(blocks\.0\.attn_norm\)'.*names in sd that no parameter maps to: "
                                       r"\['blocks\.0\.attn_norm'"):
        step.load_state_dict(step.state_dict(state, hyperparams=ADAM), like=state, names=to_twin)


# -- the torch twin ------------------------------------------------------------------------------


def twin_model():
    """A Llama-style module with its own names (torchtitan's): tok_embeddings, layers.{i}.attention_norm /
    attention.wv / attention.wo / ffn_norm / feed_forward.w1 / w2, norm, output."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wv, self.wo = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)

        def forward(self, x):
            return self.wo(self.wv(x))       # one token: softmax over one key is 1

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Linear(H, F, bias=False), nn.Linear(F, H, bias=False)

        def forward(self, x):
            return self.w2(torch.nn.functional.silu(self.w1(x)))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.feed_forward = Attention(), FeedForward()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(H, eps=EPS), nn.RMSNorm(H, eps=EPS)

        def forward(self, h):
            h = h + self.attention(self.attention_norm(h))
            return h + self.feed_forward(self.ffn_norm(h))

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(V, H)
            self.layers = nn.ModuleList([Layer() for _ in range(L)])
            self.norm, self.output = nn.RMSNorm(H, eps=EPS), nn.Linear(H, V, bias=False)

        def forward(self, tokens, targets):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            return torch.nn.functional.cross_entropy(self.output(self.norm(h)), targets)

    return Twin()


def random_grads(like, seed):
    return jax.tree.map(lambda a: np.asarray(jax.random.normal(jax.random.key(seed), a.shape), np.float32), like)


def torch_step(model, opt, grads, nm):
    """One torch optimizer step on ``grads`` (a params-like tree, read through the name map)."""
    import torch

    for name, p in model.named_parameters():
        p.grad = torch.tensor(at(grads, nm.from_torch[name]))
    opt.step()


def assert_twin_is(model, tree, nm, **tol):
    for name, p in model.named_parameters():
        want = at(tree, nm.from_torch[name])
        if tol:
            np.testing.assert_allclose(p.detach().numpy(), want, err_msg=name, **tol)
        else:
            np.testing.assert_array_equal(p.detach().numpy(), want, err_msg=name)


@torch_required
def test_torch_twin_loads_jax_checkpoint_and_steps_like_optax(tmp_path, llama):
    import torch

    step, state = llama
    nm = name_map(state, to_twin)
    path = ck.save_dcp(str(tmp_path / "jax"), step.state_dict(state, hyperparams=ADAM, names=to_twin))
    model = twin_model()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)        # lr and betas come from the checkpoint
    torch_load(model, opt, path)
    assert opt.param_groups[0]["lr"] == ADAM["lr"]
    host = jax.device_get(state.master)
    assert_twin_is(model, host, nm)
    batch = make_batch(7)
    with torch.no_grad():     # the names mean the same layers: the twin's forward is the JAX model's (fp32)
        tokens, targets = (torch.tensor(np.asarray(batch[k])).long() for k in ("tokens", "targets"))
        got = float(model(tokens, targets))
    np.testing.assert_allclose(got, float(jax.jit(fp32_loss)(host, batch)), rtol=1e-5)   # fp32 sum order only

    # the next Adam step on the same gradient, in torch and in optax
    grads = random_grads(state.master, 5)
    updates, _ = optax.adam(ADAM["lr"]).update(grads, state.opt_state, state.master)
    torch_step(model, opt, grads, nm)
    assert_twin_is(model, jax.device_get(optax.apply_updates(state.master, updates)), nm, **NEXT_STEP_TOL)

    # and back: the twin saves under its names, JAX resumes through the same mapping
    torch_save(model, opt, str(tmp_path / "torch"))
    like = step.init(llama_params())
    back = step.load_state_dict(ck.load_dcp(str(tmp_path / "torch"), step.state_dict_target(like, names=to_twin)),
                                like=like, names=to_twin)
    assert int(back.step) == 3
    same = jax.tree.map(lambda a, b: a.sharding == b.sharding, (back.master, back.opt_state),
                        (like.master, like.opt_state))
    assert all(jax.tree.leaves(same))
    have = masters_and_moments(back)
    assert_twin_is(model, have["master"], nm)
    for name, p in model.named_parameters():
        for k, field in (("exp_avg", "mu"), ("exp_avg_sq", "nu")):
            np.testing.assert_array_equal(at(have[field], nm.from_torch[name]), opt.state[p][k].numpy(), err_msg=name)
    grads = random_grads(state.master, 6)     # the same next step again, from the twin's state
    updates, _ = optax.adam(ADAM["lr"]).update(grads, back.opt_state, back.master)
    want = jax.device_get(optax.apply_updates(back.master, updates))
    torch_step(model, opt, grads, nm)
    assert_twin_is(model, want, nm, **NEXT_STEP_TOL)
    back, m = step(back, make_batch())         # and the training step takes it as its own state
    assert int(back.step) == 4 and np.isfinite(float(m["loss"]))


# -- optax states under chain / masked / multi_transform -----------------------------------------

WEIGHTS = lambda p: {"embed": False, "norm": False, "head": True,
                     "blocks": {k: k.startswith("w") for k in p["blocks"]}}
LABELS = lambda p: {"embed": "frozen", "norm": "no_decay", "head": "decay",
                    "blocks": {k: "decay" if k.startswith("w") else "no_decay" for k in p["blocks"]}}
DECAY = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)
NO_DECAY = dict(ADAM, lr=3e-3)
OPTIMIZERS = {
    "chain_clip_adamw": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)),
                         DECAY),
    # masked-out leaves have no Adam state: optax passes their gradient through, torch would not hold them
    "masked_adamw": (lambda: optax.masked(optax.adamw(1e-2, weight_decay=0.1), WEIGHTS), DECAY),
    "multi_transform": (lambda: optax.multi_transform({"decay": optax.adamw(1e-2, weight_decay=0.1),
                                                       "no_decay": optax.adam(3e-3), "frozen": optax.set_to_zero()},
                                                      LABELS), {"decay": DECAY, "no_decay": NO_DECAY}),
}


def adam_states(opt_state):
    return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]


def assert_sharded_like_params(state):
    """Every Adam moment is sharded as its parameter's master (a MaskedNode where optax masked the leaf)."""
    masked = lambda x: isinstance(x, optax.MaskedNode)
    for adam in adam_states(state.opt_state):
        for tree in (adam.mu, adam.nu):
            for (path, m), x in zip(jax.tree_util.tree_flatten_with_path(state.master)[0],
                                    jax.tree.leaves(tree, is_leaf=masked)):
                assert masked(x) or x.sharding == m.sharding, (jax.tree_util.keystr(path), x.sharding, m.sharding)


def groups_by_name(sd):
    return {n: i for i, g in enumerate(sd["optim"]["param_groups"]) for n in g["params"]}


@pytest.mark.parametrize("which", list(OPTIMIZERS))
@pytest.mark.fast_cases("multi_transform")
def test_optax_wrappers_are_sharded_named_and_resume_bitwise(tmp_path, which):
    opt, hyper = OPTIMIZERS[which]
    step = make(opt())
    state = trained(step)
    assert_sharded_like_params(state)        # after init and after the step's sharding constraint
    nm = name_map(state, to_twin)
    sd = step.state_dict(state, hyperparams=hyper, names=to_twin)
    groups, weights = groups_by_name(sd), {n for d, n in nm.to_torch.items() if d.split(".")[-1][0] in "wh"}
    norms = {n for d, n in nm.to_torch.items() if "norm" in d}
    assert set(sd["model"]) == set(nm.from_torch)
    if which == "chain_clip_adamw":
        assert set(sd["optim"]["state"]) == set(groups) == set(nm.from_torch)
        assert sd["optim"]["param_groups"][0]["weight_decay"] == 0.1
    elif which == "masked_adamw":       # the norms and the embedding: no Adam state, in no group
        assert set(sd["optim"]["state"]) == set(groups) == weights
    else:                               # two groups in label order; the frozen embedding in neither
        assert set(sd["optim"]["state"]) == set(groups) == weights | norms
        assert {groups[n] for n in weights} == {0} and {groups[n] for n in norms} == {1}
        assert [g["lr"] for g in sd["optim"]["param_groups"]] == [1e-2, 3e-3]
        assert [g["weight_decay"] for g in sd["optim"]["param_groups"]] == [0.1, 0.0]
    path = ck.save_dcp(str(tmp_path / "ckpt"), sd)
    like = step.init(llama_params())
    assert_sharded_like_params(like)
    loaded = step.load_state_dict(ck.load_dcp(path, step.state_dict_target(like, names=to_twin)), like=like,
                                  names=to_twin)
    assert jax.tree.structure(loaded.opt_state) == jax.tree.structure(state.opt_state)
    same = jax.tree.map(lambda a, b: a.sharding == b.sharding, loaded.opt_state, like.opt_state)
    assert all(jax.tree.leaves(same))
    assert [int(a.count) for a in adam_states(loaded.opt_state)] == [2] * len(adam_states(state.opt_state))
    cont, resumed = step(state, make_batch(3))[0], step(loaded, make_batch(3))[0]
    jax.tree.map(np.testing.assert_array_equal, step.params(resumed), step.params(cont))


@torch_required
def test_torch_twin_with_two_param_groups_steps_like_multi_transform(tmp_path):
    """multi_transform({decay: adamw, no_decay: adam, frozen: set_to_zero}) is torch.optim.Adam with two param
    groups (decoupled weight decay on the weights) and the embedding frozen; the next step agrees, and back."""
    import torch

    opt_fn, hyper = OPTIMIZERS["multi_transform"]
    step = make(opt_fn())
    state = trained(step)
    nm = name_map(state, to_twin)
    path = ck.save_dcp(str(tmp_path / "jax"), step.state_dict(state, hyperparams=hyper, names=to_twin))
    model = twin_model()
    model.tok_embeddings.weight.requires_grad_(False)
    params = dict(model.named_parameters())
    kind = lambda n: nm.from_torch[n].split(".")[-1]
    decay = [p for n, p in params.items() if kind(n)[0] in "wh"]
    opt = torch.optim.Adam([{"params": decay, "weight_decay": 0.5, "decoupled_weight_decay": True},
                            {"params": [p for n, p in params.items() if "norm" in kind(n)]}], lr=1.0)
    torch_load(model, opt, path)
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3] and opt.param_groups[0]["weight_decay"] == 0.1
    grads = random_grads(state.master, 5)
    updates, _ = opt_fn().update(grads, state.opt_state, state.master)
    want = jax.device_get(optax.apply_updates(state.master, updates))
    params["tok_embeddings.weight"].grad = None      # frozen in both
    for name, p in params.items():
        if p.requires_grad:
            p.grad = torch.tensor(at(grads, nm.from_torch[name]))
    opt.step()
    assert_twin_is(model, want, nm, **NEXT_STEP_TOL)
    torch_save(model, opt, str(tmp_path / "torch"))
    like = step.init(llama_params())
    back = step.load_state_dict(ck.load_dcp(str(tmp_path / "torch"), step.state_dict_target(like, names=to_twin)),
                                like=like, names=to_twin)
    assert [int(a.count) for a in adam_states(back.opt_state)] == [3, 3]
    assert_twin_is(model, jax.device_get(back.master), nm)


def test_adamw_weight_decay_mask_resumes():
    """optax.adamw(mask=...) wraps its weight decay in optax.masked around an empty state: one Adam state over every
    parameter, one group (the mask is not in the state: a torch twin splits its decay / no-decay groups itself)."""
    step = make(optax.adamw(1e-2, weight_decay=0.1, mask=WEIGHTS))
    state = step.init(llama_params())
    sd = step.state_dict(state, hyperparams=DECAY, names=to_twin)
    assert len(sd["optim"]["param_groups"]) == 1 and set(sd["optim"]["state"]) == set(sd["model"])
    back = step.load_state_dict(sd, like=step.init(llama_params()), names=to_twin)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 (back.master, back.opt_state), (state.master, state.opt_state))


def test_unmappable_optax_states_are_errors():
    mixed = make(optax.multi_transform({"decay": optax.adam(1e-2), "no_decay": optax.sgd(0.1, momentum=0.9),
                                        "frozen": optax.set_to_zero()}, LABELS))
    with pytest.raises(ValueError, match="optimizer: both an Adam and a momentum trace state"):
        mixed.state_dict(mixed.init(llama_params()), hyperparams=ADAM)
    twice = make(optax.chain(optax.adam(1e-2), optax.adam(1e-2)))
    with pytest.raises(ValueError, match=r"optimizer: 2 Adam / momentum states cover the parameter blocks\.attn_norm"):
        twice.state_dict_target(twice.init(llama_params()))
    multi = make(OPTIMIZERS["multi_transform"][0]())
    state = multi.init(llama_params())
    with pytest.raises(ValueError, match=r"hyperparams\['no_decay'\]: PyTorch's param_groups need \['lr', 'betas'"):
        multi.state_dict(state, hyperparams={"decay": DECAY})
    with pytest.raises(ValueError, match=r"hyperparams: a dict of dicts is keyed by the optax.multi_transform labels "
                                         r"of the groups \(\['decay', 'no_decay'\]\); \['nodecay'\]"):
        multi.state_dict(state, hyperparams={"decay": DECAY, "nodecay": NO_DECAY})
