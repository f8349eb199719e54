"""Flax models with multi-axis kernels and their PyTorch twins of ``nn.Linear`` s: tests/flax_styles.py's model (b)
(linen, ``nn.DenseGeneral`` attention: q / k / v kernels ``[embed, heads, head_dim]``, out ``[heads, head_dim,
embed]``, an untied head) and model (a) (NNX, ``nnx.Einsum`` attention: q / k / v ``[heads, embed, head_dim]``,
out ``[heads, head_dim, embed]``, the embedding tied as the head), each trained unchanged through the adapter
(``jq.flax_loss(model, loss, batch=...)``, no rules: its ``default_rules``) for 2 steps with FP8 weights and
``optax.adam`` on 8 FSDP devices of ``jax.make_mesh``.

* The plan: every attention and MLP kernel fp8 as the 2-D ``[in, out]`` matrix of its contraction (q ``[embed,
  heads*head_dim]``, out ``[heads*head_dim, embed]``), (b)'s head bf16, the embedding and the norm scales kept;
  ``loss_fn.merge`` gives the model each kernel in its own N-D shape back, the same values.
* JAX -> torch: ``step.state_dict(names=...)`` written with ``save_dcp`` loads strictly into a twin built from
  ``torch.nn.Linear`` / ``nn.Embedding`` (torchtitan's names, ``layers.0.attention.wq.weight``) and
  ``torch.optim.Adam``; its parameters and moments are the JAX master's and moments bit for bit (the 2-D views
  transposed to ``[out, in]``); the flax model's fp32 loss (and gradient) at the merged parameters is the twin's;
  one optax Adam step and one torch Adam step on the twin's gradient agree within ``NEXT_STEP_TOL``
  (tests/test_state_dict.py).

The test reads each multi-axis kernel as a matrix its own way (:func:`as_matrix`: the contracted axes, known from
the model's code, moved first, then a row-major flatten), not through the adapter's views.
"""

import dataclasses
import functools
import math
import re

import jax
import numpy as np
import optax
import pytest

pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant import checkpoint as ck  # noqa: E402
from jaxquant.training.rules import dotted_path  # noqa: E402
from jaxquant.training.state_dict import name_map  # noqa: E402
import flax_styles as fs  # noqa: E402
from support.flax_twin import assert_twin_holds, by_name, flat_state, optax_next, torch_layout  # noqa: E402
from support.torch_twin import ADAM, NEXT_STEP_TOL, torch_load, torch_required  # noqa: E402

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


@dataclasses.dataclass(frozen=True)
class Style:
    """One of flax_styles' models as this test sees it.

    Attributes:
      cfg: its size.
      attn: its attention kernels' names (q, k, v, out) in flax (``query`` / ``q`` ...).
      q_contracted: the contracted axis of its q / k / v kernels (``nn.DenseGeneral`` ``[embed, heads, head_dim]``:
        0; ``nnx.Einsum`` ``"BTD,NDH->BTNH"``: 1); the out kernel ``[heads, head_dim, embed]`` contracts (0, 1).
      tied: the embedding is the output head (no head kernel).
      gelu: the MLP's gate activation (tanh-approximated gelu, ``jax.nn.gelu``'s default) instead of silu.
    """

    cfg: fs.StyleConfig
    attn: tuple
    q_contracted: int
    tied: bool
    gelu: bool

    @property
    def q(self):
        return self.cfg.heads * self.cfg.head_dim

    @property
    def kv(self):
        return self.cfg.kv_heads * self.cfg.head_dim

    def layer_rest(self) -> dict:
        """{a layer's flax name after ``layers.{i}.``: the twin's}."""
        q, k, v, o = self.attn
        return {"attn_norm.scale": "attention_norm.weight", f"attn.{q}.kernel": "attention.wq.weight",
                f"attn.{k}.kernel": "attention.wk.weight", f"attn.{v}.kernel": "attention.wv.weight",
                f"attn.{o}.kernel": "attention.wo.weight", "mlp_norm.scale": "ffn_norm.weight",
                "mlp.gate.kernel": "feed_forward.w1.weight", "mlp.down.kernel": "feed_forward.w2.weight",
                "mlp.up.kernel": "feed_forward.w3.weight"}

    def top(self) -> dict:
        """{flax name outside the layers: the twin's}; the tied embedding has two names, the twin's ``output.weight``
        being ``tok_embeddings.weight`` itself (torch's ``state_dict`` lists a tied tensor under both)."""
        if self.tied:
            return {"embed.embedding": ("tok_embeddings.weight", "output.weight"), "norm.scale": "norm.weight"}
        return {"embed.embedding": "tok_embeddings.weight", "norm.scale": "norm.weight",
                "head.kernel": "output.weight"}

    def to_twin(self, name):
        """The twin's name of a flax name: ``layers_0.attn.query.kernel`` (linen) / ``layers.0.attn.q.kernel``
        (NNX, a list) -> ``layers.0.attention.wq.weight``; ``embed.embedding`` -> ``tok_embeddings.weight``."""
        if name in self.top():
            return self.top()[name]
        m = re.fullmatch(r"layers[._](\d+)\.(.+)", name)
        assert m, name
        return f"layers.{int(m[1])}.{self.layer_rest()[m[2]]}"

    def kernels_2d(self) -> dict:
        """{layer rest name: the [in, out] matrix shape of its contraction}."""
        c, (q, k, v, o) = self.cfg, self.attn
        return {f"attn.{q}.kernel": (c.dim, self.q), f"attn.{k}.kernel": (c.dim, self.kv),
                f"attn.{v}.kernel": (c.dim, self.kv), f"attn.{o}.kernel": (self.q, c.dim),
                "mlp.gate.kernel": (c.dim, c.mlp), "mlp.up.kernel": (c.dim, c.mlp), "mlp.down.kernel": (c.mlp, c.dim)}

    def kernels_nd(self) -> dict:
        """{layer rest name: the model's own shape} of the multi-axis kernels."""
        c, (q, k, v, o) = self.cfg, self.attn
        kv = [c.kv_heads, c.head_dim]
        kv.insert(self.q_contracted, c.dim)
        qs = [c.heads, c.head_dim]
        qs.insert(self.q_contracted, c.dim)
        return {f"attn.{q}.kernel": tuple(qs), f"attn.{k}.kernel": tuple(kv), f"attn.{v}.kernel": tuple(kv),
                f"attn.{o}.kernel": (c.heads, c.head_dim, c.dim)}

    def as_matrix(self, name, a):
        """A model parameter as the 2-D ``[in, out]`` matrix of its contraction, by this test's own reading of the
        model: the contracted axes first, the rest flattened row-major; 2-D kernels and vectors as they are."""
        a = np.asarray(a)
        if a.ndim <= 2:
            return a
        contracted = (0, 1) if name.endswith(f"attn.{self.attn[3]}.kernel") else (self.q_contracted,)
        a = np.moveaxis(a, contracted, range(len(contracted)))
        return a.reshape(math.prod(a.shape[:len(contracted)]), -1)

    # -- the model, its loss ---------------------------------------------------------------------

    def flax_loss(self):
        """``jq.flax_loss`` of the unchanged model and its loss, traced on an example batch."""
        if self.tied:
            return jq.flax_loss(fs.nnx_einsum_model(self.cfg), fs.nnx_einsum_loss, batch=self.batch(0))
        return jq.flax_loss(fs.linen_dense_general_init(self.cfg),
                            functools.partial(fs.linen_dense_general_loss, cfg=self.cfg), batch=self.batch(0))

    def batch(self, seed):
        return jax.device_get(fs.example_batch(self.cfg, 8, seed))

    def model_params(self, merged):
        """{flax name: numpy} of the model's own parameters (N-D kernels) from ``loss_fn.merge``'s model."""
        tree = nnx.to_pure_dict(nnx.state(merged, nnx.Param)) if self.tied else nn.unbox(merged)["params"]
        return {dotted_path(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}

    def fp32_loss_and_grads(self, merged, batch):
        """The model's fp32 loss on ``batch`` with ``loss_fn.merge``'s parameters, straight through flax_styles'
        loss, and its gradient, {flax name: numpy} in the model's own (N-D) shapes."""
        if self.tied:
            graphdef, params, rest = nnx.split(merged, nnx.Param, ...)
            f = lambda p, b: fs.nnx_einsum_loss(nnx.merge(graphdef, p, rest), b)
            value, grads = _value_and_grad(f)(jax.device_get(params), batch)
            grads = nnx.to_pure_dict(grads)
        else:
            merged = jax.device_get(merged)
            value = fs.linen_dense_general_loss(merged, batch, cfg=self.cfg)    # the variables merge gives, boxed
            f = lambda p, b: fs.linen_dense_general_loss({"params": p}, b, cfg=self.cfg)
            again, grads = _value_and_grad(f)(nn.unbox(merged)["params"], batch)
            np.testing.assert_allclose(float(again), float(value), rtol=1e-6)
        return float(value), {dotted_path(p): np.asarray(g) for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}


STYLES = {"linen-dense-general": Style(fs.DENSE_GENERAL_SMALL, ("query", "key", "value", "out"), 0, False, False),
          "nnx-einsum": Style(fs.EINSUM_SMALL, ("q", "k", "v", "out"), 1, True, True)}


def _value_and_grad(f):
    return jax.jit(jax.value_and_grad(f))


# -- the flax model, trained -----------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def trained(style):
    """(loss_fn, step, state after 2 Adam steps, the losses) of ``STYLES[style]``: FP8 weights, no rules. Tests read
    the state and never step it (a step donates it)."""
    s = STYLES[style]
    loss_fn = s.flax_loss()
    step = jq.make_train_step(loss_fn, optax.adam(ADAM["lr"]), mesh=jax.make_mesh((8,), ("fsdp",)),
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))
    state = step.init(jq.flax_params(loss_fn))
    losses = []
    for seed in (1, 2):
        state, m = step(state, s.batch(seed))
        losses.append(float(m["loss"]))
    return loss_fn, step, state, losses


# -- the twin --------------------------------------------------------------------------------------


def twin_model(s: Style):
    """``s``'s model in PyTorch, fp32, with its own names: tok_embeddings, layers.{i}.attention_norm /
    attention.wq / wk / wv / wo / ffn_norm / feed_forward.w1 (gate) / w2 (down) / w3 (up), norm, output (tied: its
    weight is ``tok_embeddings.weight``, as torchtitan and Hugging Face tie a head); every projection an
    ``nn.Linear`` (weight ``[out, in]``: wq ``[heads*head_dim, embed]``), the heads split from its output."""
    import torch
    from torch import nn as tnn

    c, F = s.cfg, torch.nn.functional

    def rotary(x):                     # fs.rotary: [batch, seq, heads, head_dim], pair (i, i + head_dim/2) rotated
        t, d = x.shape[1], x.shape[-1]
        freq = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float32) * 2 / d)
        angle = torch.arange(t, dtype=torch.float32)[:, None] * freq
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        lo, hi = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)

    class RMSNorm(tnn.Module):
        def __init__(self):
            super().__init__()
            self.weight = tnn.Parameter(torch.ones(c.dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.eps) * self.weight

    class Attention(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wo = tnn.Linear(c.dim, s.q, bias=False), tnn.Linear(s.q, c.dim, bias=False)
            self.wk, self.wv = tnn.Linear(c.dim, s.kv, bias=False), tnn.Linear(c.dim, s.kv, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q = rotary(self.wq(x).view(b, t, c.heads, c.head_dim))
            k = rotary(self.wk(x).view(b, t, c.kv_heads, c.head_dim))
            v = self.wv(x).view(b, t, c.kv_heads, c.head_dim)
            group = c.heads // c.kv_heads        # query head n reads kv head n // group
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
            logits = torch.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(c.head_dim)
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            return self.wo(torch.einsum("bnqk,bknh->bqnh", probs, v).reshape(b, t, s.q))

    class FeedForward(tnn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = tnn.Linear(c.dim, c.mlp, bias=False), tnn.Linear(c.dim, c.mlp, bias=False)
            self.w2 = tnn.Linear(c.mlp, c.dim, bias=False)

        def forward(self, x):
            gate = F.gelu(self.w1(x), approximate="tanh") if s.gelu else F.silu(self.w1(x))
            return self.w2(gate * self.w3(x))

    class Layer(tnn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.attention = RMSNorm(), Attention()
            self.ffn_norm, self.feed_forward = RMSNorm(), FeedForward()

        def forward(self, h):
            h = h + self.attention(self.attention_norm(h))
            return h + self.feed_forward(self.ffn_norm(h))

    class Twin(tnn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = tnn.Embedding(c.vocab, c.dim)
            self.layers = tnn.ModuleList([Layer() for _ in range(c.layers)])
            self.norm = RMSNorm()
            self.output = tnn.Linear(c.dim, c.vocab, bias=False)
            if s.tied:       # as torchtitan / Hugging Face tie a head: one Parameter under two names
                self.output.weight = self.tok_embeddings.weight

        def forward(self, tokens):
            """Mean next-token cross-entropy of int tokens [batch, seq + 1]."""
            h = self.tok_embeddings(tokens[:, :-1])
            for layer in self.layers:
                h = layer(h)
            h = self.norm(h)
            logits = self.output(h)
            return F.cross_entropy(logits.reshape(-1, c.vocab), tokens[:, 1:].reshape(-1))

    return Twin()


def twin_loss_and_grads(model, batch):
    """The twin's fp32 loss on ``batch`` and its gradient (left in ``p.grad``), {twin name: numpy}."""
    import torch

    model.zero_grad(set_to_none=True)
    loss = model(torch.tensor(np.asarray(batch["tokens"])).long())
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def twin_from_jax(tmp_path, s, step, state):
    """The twin and its ``torch.optim.Adam`` loaded strictly from ``step.state_dict(state, names=s.to_twin)``
    written with ``save_dcp``."""
    import torch

    path = ck.save_dcp(str(tmp_path / "jax"), step.state_dict(state, hyperparams=ADAM, names=s.to_twin))
    model = twin_model(s)
    opt = torch.optim.Adam(model.parameters(), lr=1.0)         # lr and betas come from the checkpoint
    torch_load(model, opt, path)
    return model, opt


def from_twin(s, values, like):
    """A tree like ``like.master`` (the step's 2-D ``[in, out]`` kernels) of ``values``: {twin name: [out, in]}."""
    nm = name_map(like, s.to_twin)
    flat = {nm.from_torch[n]: torch_layout(nm.from_torch[n], v) for n, v in values.items()}   # .T is its own inverse
    return jax.tree_util.tree_map_with_path(lambda path, _: flat[dotted_path(path)], like.master)


def layer_rest(name):
    m = re.fullmatch(r"layers[._]\d+\.(.+)", name)
    return m[1] if m else None


# -- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.fast_cases("linen-dense-general")
def test_plan_reads_multi_axis_kernels_as_their_contractions(style):
    s = STYLES[style]
    loss_fn, step, state, losses = trained(style)
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0], losses
    rows = {r["path"]: r for r in step.describe(state, file=False)}
    assert set(rows) == set(s.top()) | {f"layers{'.' if s.tied else '_'}{i}.{n}" for i in range(s.cfg.layers)
                                        for n in s.layer_rest()}
    for name, row in rows.items():
        assert row["padding"] == 0, row         # every leaf splits over 8 evenly: the master is the 2-D view as is
        if layer_rest(name) in s.kernels_2d():
            assert (row["recipe"], tuple(row["shape"])) == ("fp8", s.kernels_2d()[layer_rest(name)]), row
        elif name == "head.kernel":
            assert (row["recipe"], tuple(row["shape"])) == ("bf16", (s.cfg.dim, s.cfg.vocab)), row
        else:                                   # the embedding (tied or not), the norm scales
            assert row["recipe"] == "kept", row
    assert tuple(rows["embed.embedding"]["shape"]) == (s.cfg.vocab, s.cfg.dim)
    assert tuple(rows["norm.scale"]["shape"]) == (s.cfg.dim,)

    # the step's params and the model's: merge gives each kernel its own N-D shape back, the same values
    master = by_name(state.master, False)
    merged = s.model_params(loss_fn.merge(step.params(state)))
    assert set(merged) == set(master)
    for name, a in merged.items():
        assert a.shape == s.kernels_nd().get(layer_rest(name), master[name].shape), name
        np.testing.assert_array_equal(s.as_matrix(name, a), master[name], err_msg=name)


@torch_required
@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.fast_cases("linen-dense-general")
def test_torch_twin_of_linears_loads_the_checkpoint_and_steps_like_optax(tmp_path, style):
    s = STYLES[style]
    c = s.cfg
    loss_fn, step, state, _ = trained(style)
    nm = name_map(state, s.to_twin)
    twin = twin_model(s)
    twin_names = set(twin.state_dict())                # a tied tensor under both of its names
    twin_params = {n for n, _ in twin.named_parameters()}    # ... and once here, as torch's optimizer keys it
    assert set(nm.from_torch) == twin_names and len(twin_names) == 3 + 9 * c.layers
    assert twin_names - twin_params == ({"output.weight"} if s.tied else set())
    sd = step.state_dict(state, hyperparams=ADAM, names=s.to_twin)
    assert set(sd["model"]) == twin_names
    assert set(sd["optim"]["state"]) == set(sd["optim"]["param_groups"][0]["params"]) == twin_params
    # the multi-axis kernels as 2-D [out, in]: what nn.Linear(embed, heads*head_dim).weight is
    assert sd["model"]["layers.0.attention.wq.weight"].shape == (s.q, c.dim)
    assert sd["model"]["layers.0.attention.wk.weight"].shape == (s.kv, c.dim)
    assert sd["model"]["layers.1.attention.wo.weight"].shape == (c.dim, s.q)
    assert sd["model"]["output.weight"].shape == (c.vocab, c.dim)
    if s.tied:
        assert sd["model"]["output.weight"] is sd["model"]["tok_embeddings.weight"]

    model, opt = twin_from_jax(tmp_path, s, step, state)
    assert opt.param_groups[0]["lr"] == ADAM["lr"] and opt.param_groups[0]["betas"] == ADAM["betas"]
    master, moments = flat_state(state, False)
    assert_twin_holds(model, opt, master, nm, moments)                  # bit for bit, transposed and renamed
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {2.0}

    # the model's own kernels, from merge: each twin Linear is the N-D kernel read as [in, out], transposed
    merged = loss_fn.merge(step.params(state))
    own = s.model_params(merged)
    q, _, _, o = s.attn
    for attr, rest in (("wq", f"attn.{q}.kernel"), ("wo", f"attn.{o}.kernel")):
        name = f"layers{'.' if s.tied else '_'}1.{rest}"
        assert own[name].ndim == 3, name
        np.testing.assert_array_equal(getattr(model.layers[1].attention, attr).weight.detach().numpy(),
                                      s.as_matrix(name, own[name]).T, err_msg=name)

    # the same function: the twin's fp32 loss is flax's fp32 loss of the model at the trained parameters, and so is
    # its gradient (flax's on the N-D kernels, read as [in, out] by as_matrix, then as [out, in])
    batch = s.batch(7)
    t_loss, t_grads = twin_loss_and_grads(model, batch)
    j_loss, j_grads = s.fp32_loss_and_grads(merged, batch)
    np.testing.assert_allclose(t_loss, j_loss, rtol=1e-5)                  # fp32 summation order only
    for name, g in t_grads.items():
        default = nm.from_torch[name]
        want = torch_layout(default, s.as_matrix(default, j_grads[default]))
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))), err_msg=name)

    # the next Adam step on one gradient (the twin's fp32 one, already in p.grad), in torch and in optax
    new_master, adam = optax_next(from_twin(s, t_grads, state), state)
    opt.step()
    new_flat = by_name(new_master, False)
    assert_twin_holds(model, opt, new_flat, nm, {"mu": by_name(adam.mu, False), "nu": by_name(adam.nu, False)},
                      **NEXT_STEP_TOL)
    moved = max(float(np.max(np.abs(new_flat[d] - master[d]))) for d in master)
    assert moved > 1e3 * NEXT_STEP_TOL["atol"], moved                       # the step moved them far more than that
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {3.0}
