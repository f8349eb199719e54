"""A small Llama-style language model written as flax users write it, in NNX and in linen, with its layers in a
Python loop or under ``nnx.scan`` / ``nn.scan`` (stacked parameters), and the same model hand-written in pure JAX
with ``jq.dense`` (the reference of tests/test_flax_models.py).

Every block: RMSNorm -> attention (q, k, v, o projections, rotary embeddings, causal softmax) -> residual ->
RMSNorm -> SwiGLU MLP (gate, up, down) -> residual. Kernels are flax's ``[in, out]``; the layers cover
``nnx.Linear`` / ``nn.Dense`` (q, k, v, gate, up), ``nnx.LinearGeneral`` / ``nn.DenseGeneral`` (o) and
``nnx.Einsum`` / ``nn.Einsum`` (down). The NNX model holds rng state (``nnx.Dropout`` with rate 0, as configs
leave it) and an integer counter; the linen one an integer variable in a collection of its own: non-float state
that training must leave alone.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxquant as jq


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 128
    heads: int = 4
    ffn: int = 256
    layers: int = 2
    eps: float = 1e-6

    @property
    def head_dim(self):
        return self.dim // self.heads


CFG = Config()


# ----------------------------------------------------------------------------------------------
# Shared (plain jnp): rotary embeddings and causal attention on [batch, seq, heads, head_dim]
# ----------------------------------------------------------------------------------------------


def rope(x):
    s, d = x.shape[1], x.shape[-1]
    half = d // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(ang)[None, :, None, :], jnp.cos(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q, k, v):
    s, d = q.shape[1], q.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(d))
    mask = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ----------------------------------------------------------------------------------------------
# NNX
# ----------------------------------------------------------------------------------------------


class Counter(nnx.Variable):
    """An integer the model keeps (e.g. steps seen): state, not a parameter."""


class NnxAttention(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.q = nnx.Linear(cfg.dim, cfg.dim, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(cfg.dim, cfg.dim, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(cfg.dim, cfg.dim, use_bias=False, rngs=rngs)
        self.o = nnx.LinearGeneral(cfg.dim, cfg.dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, s, _ = x.shape
        split = lambda t: t.reshape(b, s, self.cfg.heads, self.cfg.head_dim)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        return self.o(causal_attention(rope(q), rope(k), v).reshape(b, s, self.cfg.dim))


class NnxMlp(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.dim, cfg.ffn, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, cfg.ffn, use_bias=False, rngs=rngs)
        self.down = nnx.Einsum("bsf,fd->bsd", (cfg.ffn, cfg.dim), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class NnxBlock(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.eps, rngs=rngs)
        self.attn = NnxAttention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.eps, rngs=rngs)
        self.mlp = NnxMlp(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(0.0, rngs=rngs)

    def __call__(self, x):
        h = x + self.dropout(self.attn(self.attn_norm(x)))
        return h + self.mlp(self.mlp_norm(h))


class NnxLlama(nnx.Module):
    def __init__(self, cfg: Config = CFG, *, scan: bool = False, rngs: nnx.Rngs):
        self.scan = scan
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.0, rngs=rngs)
        self.seen = Counter(jnp.array(7, jnp.int32))
        if scan:
            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return NnxBlock(cfg, rngs=rngs)

            self.layers = make(rngs)
        else:
            self.layers = nnx.List([NnxBlock(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.eps, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.dropout(self.embed(tokens))
        if self.scan:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return block(x)

            x = run(x, self.layers)
        else:
            for block in self.layers:
                x = block(x)
        return self.head(self.norm(x))


def nnx_model(scan=False, seed=0):
    return NnxLlama(CFG, scan=scan, rngs=nnx.Rngs(params=seed, dropout=seed + 100))


def nnx_loss(model, batch):
    return cross_entropy(model(batch["tokens"]), batch["targets"])


# ----------------------------------------------------------------------------------------------
# linen
# ----------------------------------------------------------------------------------------------


class LinenAttention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        c = self.cfg
        split = lambda t: t.reshape(b, s, c.heads, c.head_dim)
        q = split(nn.Dense(c.dim, use_bias=False, name="q")(x))
        k = split(nn.Dense(c.dim, use_bias=False, name="k")(x))
        v = split(nn.Dense(c.dim, use_bias=False, name="v")(x))
        o = causal_attention(rope(q), rope(k), v).reshape(b, s, c.dim)
        return nn.DenseGeneral(c.dim, axis=-1, use_bias=False, name="o")(o)


class LinenMlp(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        gate = nn.Dense(c.ffn, use_bias=False, name="gate")(x)
        up = nn.Dense(c.ffn, use_bias=False, name="up")(x)
        return nn.Einsum((c.ffn, c.dim), "bsf,fd->bsd", use_bias=False, name="down")(jax.nn.silu(gate) * up)


class LinenBlock(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, _=None):
        c = self.cfg
        h = x + LinenAttention(c, name="attn")(nn.RMSNorm(epsilon=c.eps, name="attn_norm")(x))
        out = h + LinenMlp(c, name="mlp")(nn.RMSNorm(epsilon=c.eps, name="mlp_norm")(h))
        return out, None


class LinenLlama(nn.Module):
    cfg: Config = CFG
    scan: bool = False

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        self.variable("counters", "seen", lambda: jnp.array(7, jnp.int32))
        x = nn.Embed(c.vocab, c.dim, name="embed")(tokens)
        if self.scan:
            blocks = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.layers)
            x, _ = blocks(c, name="layers")(x, None)
        else:
            for i in range(c.layers):
                x, _ = LinenBlock(c, name=f"layers_{i}")(x)
        x = nn.RMSNorm(epsilon=c.eps, name="norm")(x)
        return nn.Dense(c.vocab, use_bias=False, name="head")(x)


def linen_variables(scan=False, seed=0):
    return LinenLlama(CFG, scan=scan).init(jax.random.key(seed), jnp.zeros((2, 8), jnp.int32))


def linen_loss(scan):
    module = LinenLlama(CFG, scan=scan)

    def loss(variables, batch):
        return cross_entropy(module.apply(variables, batch["tokens"]), batch["targets"])

    return loss


# ----------------------------------------------------------------------------------------------
# The same model in pure JAX with jq.dense (weights: the step's pytree, flax's names)
# ----------------------------------------------------------------------------------------------


def ref_rms_norm(x, scale, eps=CFG.eps):
    x = x.astype(jnp.promote_types(x.dtype, scale.dtype))
    var = jnp.mean(jax.lax.square(x.astype(jnp.float32)), axis=-1)
    y = x - jnp.zeros_like(var)[..., None]
    mul = jax.lax.rsqrt(var[..., None] + eps) * scale
    return y * mul


def ref_block(x, w, cfg=CFG):
    b, s, _ = x.shape
    split = lambda t: t.reshape(b, s, cfg.heads, cfg.head_dim)
    a = w["attn"]
    n = ref_rms_norm(x, w["attn_norm"]["scale"])
    q, k, v = (split(jq.dense(n, a[p]["kernel"])) for p in ("q", "k", "v"))
    h = x + jq.dense(causal_attention(rope(q), rope(k), v).reshape(b, s, cfg.dim), a["o"]["kernel"])
    m = w["mlp"]
    n = ref_rms_norm(h, w["mlp_norm"]["scale"])
    u = jax.nn.silu(jq.dense(n, m["gate"]["kernel"])) * jq.dense(n, m["up"]["kernel"])
    return h + jq.dense(u, m["down"]["kernel"])


def ref_loss(family, scan):
    """``loss_fn`` of the hand-written model: ``family`` ``"nnx"`` (layers ``layers.{i}``) or ``"linen"``
    (``layers_{i}``); ``scan``: stacked ``layers``. The embedding (gathered in bf16 by the step) is looked up in
    fp32, the dtype the flax models keep it in (``jq.flax_loss`` hands them their parameters in their dtype)."""

    def loss(w, batch):
        x = jnp.take(w["embed"]["embedding"].astype(jnp.float32), batch["tokens"], axis=0)
        if scan:
            x, _ = jax.lax.scan(lambda h, lw: (ref_block(h, lw), None), x, w["layers"])
        else:
            for i in range(CFG.layers):
                x = ref_block(x, w["layers"][i] if family == "nnx" else w[f"layers_{i}"])
        return cross_entropy(jq.dense(ref_rms_norm(x, w["norm"]["scale"]), w["head"]["kernel"]), batch["targets"])

    return loss


def make_batch(seed=1, batch=16, seq=8):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"tokens": jax.random.randint(k1, (batch, seq), 0, CFG.vocab),
            "targets": jax.random.randint(k2, (batch, seq), 0, CFG.vocab)}
