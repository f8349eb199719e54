"""A flax model's checkpoint and its PyTorch twin (issue 43, "What must be shown"): the NNX Llama of
tests/flax_llama.py, trained unchanged (``jq.flax_params`` / ``jq.flax_loss`` / ``jq.flax_rules``) for 2 steps with
FP8 weights and ``optax.adam`` on 8 FSDP devices, layers in a Python loop and under ``nnx.scan`` (its stacked
parameters, norms included, saved per layer as ``layers.{i}....``); ``step.state_dict(names=...)`` maps flax's
names (``layers.0.attn.q.kernel``) to a ``torch.nn.Module`` twin's own (``layers.0.attention.wq.weight``), the
``[in, out]`` kernels saved as PyTorch's ``[out, in]``.

* JAX -> torch: the twin loads the DCP checkpoint strictly, its parameters and Adam moments are the JAX master's
  and moments bit for bit (transposed, renamed); its fp32 forward is the flax model's fp32 forward at the trained
  parameters (JAX trains with FP8 weights: the comparison that means "the same model" is against the fp32 loss
  the step's ``loss_fn`` computes from plain arrays); and on one gradient (the twin's fp32 gradient, computed
  once) ``torch.optim.Adam`` and optax take the same next step within ``NEXT_STEP_TOL`` (tests/test_state_dict.py).
* torch -> JAX: the twin takes its own step, saves with its names; the flax model's step resumes from it, its
  master and Adam moments the twin's bit for bit, sharded as ``step.init`` shards them, and trains on.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

pytest.importorskip("flax")

import jaxquant as jq  # noqa: E402
from jaxquant import checkpoint as ck  # noqa: E402
from jaxquant.training.rules import dotted_path  # noqa: E402
from jaxquant.training.state_dict import name_map  # noqa: E402
import flax_llama as fl  # noqa: E402
from support.torch_twin import ADAM, NEXT_STEP_TOL, torch_load, torch_required, torch_save  # noqa: E402
from support.flax_twin import adam_of, assert_twin_holds, optax_next, torch_layout  # noqa: E402
from support import flax_twin  # noqa: E402

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

C = fl.CFG
STACKED = r"layers\..*"
FORMS = {"loop": False, "scan": True}

# flax's names -> the twin's (torchtitan's): the attention's q/k/v/o are wq/wk/wv/wo, the MLP's gate/down/up w1/w2/w3
TOP = {"embed.embedding": "tok_embeddings.weight", "norm.scale": "norm.weight", "head.kernel": "output.weight"}
LAYER = {"attn_norm.scale": "attention_norm.weight", "attn.q.kernel": "attention.wq.weight",
         "attn.k.kernel": "attention.wk.weight", "attn.v.kernel": "attention.wv.weight",
         "attn.o.kernel": "attention.wo.weight", "mlp_norm.scale": "ffn_norm.weight",
         "mlp.gate.kernel": "feed_forward.w1.weight", "mlp.down.kernel": "feed_forward.w2.weight",
         "mlp.up.kernel": "feed_forward.w3.weight"}


def to_twin(name):
    """The twin's name of a flax name: ``layers.0.attn.q.kernel`` -> ``layers.0.attention.wq.weight``,
    ``embed.embedding`` -> ``tok_embeddings.weight``."""
    if name in TOP:
        return TOP[name]
    head, i, rest = name.split(".", 2)
    assert head == "layers", name
    return f"layers.{int(i)}.{LAYER[rest]}"


def by_name(tree, scan):
    """{default name: numpy array} of a params-like tree (a stacked leaf split into its layers)."""
    return flax_twin.by_name(tree, scan, C.layers)


def flat_state(state, scan):
    """(master, {"mu", "nu"}) by default name, numpy."""
    return flax_twin.flat_state(state, scan, C.layers)


def from_twin(values, like, scan):
    """A params-like tree (flax layout, stacked under ``scan``) of ``values``: {twin name: [out, in] array}."""
    nm = name_map(like, to_twin)
    flat = {nm.from_torch[n]: torch_layout(nm.from_torch[n], v) for n, v in values.items()}   # .T is its own inverse

    def leaf(path, _):
        name = dotted_path(path)
        if scan and name.startswith("layers."):
            return np.stack([flat[f"layers.{i}.{name[len('layers.'):]}"] for i in range(C.layers)])
        return flat[name]

    return jax.tree_util.tree_map_with_path(leaf, like.master)


# -- the flax model, trained -----------------------------------------------------------------------


def make(scan):
    """(the NNX model, its step: FP8 weights, optax.adam, 8 FSDP devices, the rules flax_rules gives)."""
    model = fl.nnx_model(scan)
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    step = jq.make_train_step(jq.flax_loss(model, fl.nnx_loss), optax.adam(ADAM["lr"]), mesh=mesh,
                              rules=jq.flax_rules(stacked=STACKED if scan else None),
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))
    return model, step


@functools.lru_cache(maxsize=None)
def trained(form):
    """(model, step, state after 2 Adam steps), once per form; tests read the state and never step it (a step
    donates it)."""
    model, step = make(FORMS[form])
    state = step.init(jq.flax_params(model))
    losses = []
    for _ in range(2):
        state, m = step(state, fl.make_batch())
        losses.append(float(m["loss"]))
    assert losses[1] < losses[0], losses
    return model, step, state


# -- the twin --------------------------------------------------------------------------------------


def twin_model():
    """The same Llama in PyTorch with its own names: tok_embeddings, layers.{i}.attention_norm / attention.wq /
    wk / wv / wo / ffn_norm / feed_forward.w1 (gate) / w2 (down) / w3 (up), norm, output; ``nn.Linear`` weights
    ``[out, in]``."""
    import math

    import torch
    from torch import nn

    def rope(x):                                   # fl.rope: [batch, seq, heads, head_dim], halves rotated
        s, d = x.shape[1], x.shape[-1]
        half = d // 2
        freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
        ang = torch.arange(s, dtype=torch.float32)[:, None] * freq[None, :]
        sin, cos = ang.sin()[None, :, None, :], ang.cos()[None, :, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(C.dim, C.dim, bias=False) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            split = lambda t: t.view(b, s, C.heads, C.head_dim)
            q, k, v = rope(split(self.wq(x))), rope(split(self.wk(x))), split(self.wv(x))
            logits = torch.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(math.sqrt(C.head_dim))
            mask = torch.tril(torch.ones(s, s, dtype=torch.bool))
            probs = torch.softmax(logits.masked_fill(~mask, -1e30), dim=-1)
            return self.wo(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, C.dim))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(C.dim, C.ffn, bias=False), nn.Linear(C.dim, C.ffn, bias=False)
            self.w2 = nn.Linear(C.ffn, C.dim, bias=False)

        def forward(self, x):
            return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(C.dim, eps=C.eps), nn.RMSNorm(C.dim, eps=C.eps)
            self.attention, self.feed_forward = Attention(), FeedForward()

        def forward(self, h):
            h = h + self.attention(self.attention_norm(h))
            return h + self.feed_forward(self.ffn_norm(h))

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(C.vocab, C.dim)
            self.layers = nn.ModuleList([Layer() for _ in range(C.layers)])
            self.norm, self.output = nn.RMSNorm(C.dim, eps=C.eps), nn.Linear(C.dim, C.vocab, bias=False)

        def forward(self, tokens, targets):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            logits = self.output(self.norm(h))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, C.vocab), targets.reshape(-1))

    return Twin()


def twin_loss_and_grads(model, batch):
    """The twin's fp32 loss on ``batch`` and its gradient (left in ``p.grad``), {twin name: numpy}."""
    import torch

    model.zero_grad(set_to_none=True)
    tokens, targets = (torch.tensor(np.asarray(batch[k])).long() for k in ("tokens", "targets"))
    loss = model(tokens, targets)
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _fp32_value_and_grad(model):
    """One jitted function per model (the tests call it on several batches and parameters: traced once)."""
    return jax.jit(jax.value_and_grad(jq.flax_loss(model, fl.nnx_loss)))


def jax_fp32_loss_and_grads(model, params, batch):
    """The loss the step trains (``jq.flax_loss`` of the unchanged flax model) on plain fp32 arrays: no kernel is
    quantized, flax computes in fp32 with the given parameters."""
    loss, grads = _fp32_value_and_grad(model)(jax.device_get(params), batch)
    return float(loss), grads


def twin_from_jax(tmp_path, step, state):
    """A twin and its ``torch.optim.Adam`` loaded strictly from ``step.state_dict(state, names=to_twin)`` written
    with ``save_dcp``."""
    import torch

    path = ck.save_dcp(str(tmp_path / "jax"), step.state_dict(state, hyperparams=ADAM, names=to_twin))
    model = twin_model()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)         # lr and betas come from the checkpoint
    torch_load(model, opt, path)
    return model, opt


# -- tests -----------------------------------------------------------------------------------------


@torch_required
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.fast_cases("loop")
def test_torch_twin_loads_the_flax_checkpoint_and_steps_like_optax(tmp_path, form):
    scan = FORMS[form]
    flax_model, step, state = trained(form)
    nm = name_map(state, to_twin)
    twin_names = {n for n, _ in twin_model().named_parameters()}
    assert set(nm.from_torch) == twin_names and len(twin_names) == 3 + 9 * C.layers
    assert nm.to_torch["layers.1.attn.q.kernel"] == "layers.1.attention.wq.weight"
    sd = step.state_dict(state, hyperparams=ADAM, names=to_twin)
    assert set(sd["model"]) == set(sd["optim"]["state"]) == set(sd["optim"]["param_groups"][0]["params"]) == \
        twin_names
    assert sd["model"]["layers.1.feed_forward.w1.weight"].shape == (C.ffn, C.dim)      # [out, in]
    assert sd["model"]["layers.1.ffn_norm.weight"].shape == (C.dim,)                   # one vector per layer

    model, opt = twin_from_jax(tmp_path, step, state)
    assert opt.param_groups[0]["lr"] == ADAM["lr"] and opt.param_groups[0]["betas"] == ADAM["betas"]
    master, moments = flat_state(state, scan)
    assert_twin_holds(model, opt, master, nm, moments)                  # bit for bit, transposed and renamed
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {2.0}

    # the same function: the twin's fp32 forward (and backward) is the flax model's fp32 forward at the trained
    # parameters (the step's own loss_fn on plain arrays; the FP8 step's loss differs by the weights' quantization)
    batch = fl.make_batch(7)
    t_loss, t_grads = twin_loss_and_grads(model, batch)
    j_loss, j_grads = jax_fp32_loss_and_grads(flax_model, state.master, batch)
    np.testing.assert_allclose(t_loss, j_loss, rtol=1e-5)                 # fp32 summation order only
    j_flat = by_name(j_grads, scan)
    for name, g in t_grads.items():
        default = nm.from_torch[name]
        want = torch_layout(default, j_flat[default])
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))), err_msg=name)

    # the next Adam step on one gradient (the twin's fp32 one, already in p.grad), in torch and in optax
    new_master, adam = optax_next(from_twin(t_grads, state, scan), state)
    opt.step()
    assert_twin_holds(model, opt, by_name(new_master, scan), nm,
                      {"mu": by_name(adam.mu, scan), "nu": by_name(adam.nu, scan)}, **NEXT_STEP_TOL)
    moved = max(float(np.max(np.abs(by_name(new_master, scan)[d] - master[d]))) for d in master)
    assert moved > 1e3 * NEXT_STEP_TOL["atol"], moved                       # the step moved them far more than that
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {3.0}


@torch_required
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.fast_cases("loop")
def test_flax_llama_resumes_the_twins_checkpoint(tmp_path, form):
    scan = FORMS[form]
    flax_model, step, state = trained(form)
    nm = name_map(state, to_twin)
    model, opt = twin_from_jax(tmp_path, step, state)
    twin_loss_and_grads(model, fl.make_batch(3))
    opt.step()                                   # the twin trains on: its own fp32 step 3
    torch_save(model, opt, str(tmp_path / "torch"))

    like = step.init(jq.flax_params(fl.nnx_model(scan)))
    back = step.load_state_dict(ck.load_dcp(str(tmp_path / "torch"), step.state_dict_target(like, names=to_twin)),
                                like=like, names=to_twin)
    assert int(back.step) == 3 and int(adam_of(back.opt_state).count) == 3
    same = jax.tree.map(lambda a, b: a.sharding == b.sharding, (back.master, back.opt_state),
                        (like.master, like.opt_state))
    assert all(jax.tree.leaves(same))
    master, moments = flat_state(back, scan)
    assert_twin_holds(model, opt, master, nm, moments)                  # bit for bit, transposed and renamed
    merged = jq.flax_merge(flax_model, step.params(back))              # the flax model with the twin's weights
    q = merged.layers.attn.q.kernel[...][1] if scan else merged.layers[1].attn.q.kernel[...]
    np.testing.assert_array_equal(np.asarray(q).T, model.layers[1].attention.wq.weight.detach().numpy())

    # the resumed optimizer is the twin's: the same next step on one gradient, and the forward at its parameters
    batch = fl.make_batch(8)
    t_loss, t_grads = twin_loss_and_grads(model, batch)
    np.testing.assert_allclose(t_loss, jax_fp32_loss_and_grads(flax_model, back.master, batch)[0], rtol=1e-5)
    new_master, adam = optax_next(from_twin(t_grads, back, scan), back)
    opt.step()
    assert_twin_holds(model, opt, by_name(new_master, scan), nm,
                      {"mu": by_name(adam.mu, scan), "nu": by_name(adam.nu, scan)}, **NEXT_STEP_TOL)
    back, m = step(back, fl.make_batch(4))      # and the FP8 step trains on from it
    assert int(back.step) == 4 and np.isfinite(float(m["loss"]))
