"""Two decoder language models written in styles flax users write, other than tests/flax_llama.py's: the models that
benchmarks/bench_flax.py's ``--model einsum`` / ``--model dense-general`` train with and without jaxquant.

(a) ``nnx_einsum_model``: flax NNX, attention projections as ``nnx.Einsum`` with multi-axis kernels (q
    ``[heads, embed, head_dim]``, k / v ``[kv_heads, embed, head_dim]``, out ``[heads, head_dim, embed]``),
    grouped-query attention (``kv_heads`` 1: multi-query), a gated MLP of ``nnx.Linear``, ``nnx.Dropout``, the
    embedding tied as the output head (``embed.attend``), the blocks in a Python list.
(b) ``linen_dense_general_model``: flax linen, attention projections as ``nn.DenseGeneral`` (q / k / v ``features=
    (heads, head_dim)``, out ``axis=(-2, -1)``), every parameter annotated with logical axis names
    (``nn.with_logical_partitioning``), activations with ``nn.with_logical_constraint`` (resolved by ``LOGICAL_RULES``),
    an untied ``nn.Dense`` head named ``head``.

Both: pre-norm blocks (RMSNorm), rotary position embeddings, causal softmax attention in jnp ops (fp32 softmax), fp32
parameters computing in ``cfg.dtype``. Batches are ``{"tokens": int32 [batch, seq + 1]}``: the model reads
``tokens[:, :-1]``, the loss is the mean cross-entropy of the next token ``tokens[:, 1:]``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class StyleConfig:
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    head_dim: int = 16
    kv_heads: int = 2
    mlp: int = 128
    layers: int = 2
    seq: int = 16
    dropout: float = 0.0
    dtype: Any = jnp.float32       # compute dtype; parameters are fp32
    eps: float = 1e-6
    # (b) only: the ``dot_general_cls`` of its blocks' ``DenseGeneral`` / ``Dense`` layers (None: ``lax.dot_general``),
    # how a linen user turns on flax's own FP8 (``nn.Fp8DirectDotGeneralOp``); the head keeps ``lax.dot_general``
    dot_general_cls: Any = None
    # (a) only: factories ``rngs -> op`` of its blocks' ``nnx.Linear`` ``dot_general`` and ``nnx.Einsum`` ``einsum_op``
    # (None: jax's), where an NNX user plugs in another matmul (flax's FP8 ops through ``nnx.bridge``); the tied head
    # keeps jax's
    nnx_dot_general: Any = None
    nnx_einsum_op: Any = None

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"StyleConfig: {self.heads} query heads do not share {self.kv_heads} kv heads evenly")
        if self.head_dim % 2:
            raise ValueError(f"StyleConfig: head_dim {self.head_dim} must be even (rotary embeddings rotate pairs)")

    def matmul_params(self) -> int:
        """Parameters of the matrices every token multiplies: attention projections, MLP and the output head (tied or
        not; an untied embedding's lookup multiplies nothing), the 6 x params x tokens of a step's FLOPs."""
        q = self.dim * self.heads * self.head_dim
        kv = 2 * self.dim * self.kv_heads * self.head_dim
        return self.layers * (2 * q + kv + 3 * self.dim * self.mlp) + self.vocab * self.dim


# CPU-test sizes: (a) multi-query (one kv head), (b) grouped-query (two)
EINSUM_SMALL = StyleConfig(kv_heads=1)
DENSE_GENERAL_SMALL = StyleConfig(kv_heads=2)


def einsum_gpu_config() -> StyleConfig:
    """(a)'s GPU benchmark size: 6 layers, width 2048, 8 query heads of 256 sharing one kv head, MLP 16384, vocabulary
    32768, 2048-token sequences, bf16 compute, no dropout (~0.73B parameters)."""
    return StyleConfig(vocab=32768, dim=2048, heads=8, head_dim=256, kv_heads=1, mlp=16384, layers=6, seq=2048,
                       dtype=jnp.bfloat16)


def dense_general_gpu_config() -> StyleConfig:
    """(b)'s GPU benchmark size: 4 layers of Llama-3-8B's shapes (bench_flax's default Llama: width 4096, 32 query heads
    of 128, 8 kv heads, FFN 14336), Llama 3's vocabulary (128256), 2048-token sequences, bf16 compute (~1.92B
    parameters, the untied embedding and head 1.05B of them)."""
    return StyleConfig(vocab=128256, dim=4096, heads=32, head_dim=128, kv_heads=8, mlp=14336, layers=4, seq=2048,
                       dtype=jnp.bfloat16)


# ----------------------------------------------------------------------------------------------
# Shared jnp pieces
# ----------------------------------------------------------------------------------------------


def rotary(x):
    """Rotary position embedding of x [batch, seq, heads, head_dim]: each pair (i, i + head_dim/2) rotated by the
    position times its frequency."""
    t, d = x.shape[1], x.shape[-1]
    freq = 10000.0 ** (-jnp.arange(d // 2, dtype=jnp.float32) * 2 / d)
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    lo, hi = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1).astype(x.dtype)


def causal_attention(q, k, v):
    """Softmax attention of q [B, T, N, H] over k, v [B, T, K, H] (N a multiple of K: each kv head serves N / K query
    heads), each position attending to itself and the positions before it; logits and softmax in fp32."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(h)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, n, h)


def next_token_loss(logits, tokens):
    """Mean cross-entropy of ``tokens[:, 1:]`` under ``logits`` [B, T, vocab] (of ``tokens[:, :-1]``)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def example_batch(cfg: StyleConfig, batch: int = 8, seed: int = 0):
    """Random tokens ``{"tokens": int32 [batch, cfg.seq + 1]}``."""
    return {"tokens": jax.random.randint(jax.random.key(seed), (batch, cfg.seq + 1), 0, cfg.vocab, jnp.int32)}


# ----------------------------------------------------------------------------------------------
# (a) NNX, nnx.Einsum attention, tied embedding
# ----------------------------------------------------------------------------------------------


class EinsumAttention(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        # lecun-normal over the contracted axes: the default treats a [heads, embed, head_dim] kernel's heads as a
        # receptive field and would scale it by 1 / sqrt(heads) more
        def proj(spec, shape, contracted, kept):
            init = nnx.initializers.lecun_normal(in_axis=contracted, out_axis=kept)
            op = {} if cfg.nnx_einsum_op is None else {"einsum_op": cfg.nnx_einsum_op(rngs)}
            return nnx.Einsum(spec, shape, dtype=cfg.dtype, kernel_init=init, rngs=rngs, **op)

        n, k, d, h = cfg.heads, cfg.kv_heads, cfg.dim, cfg.head_dim
        self.q = proj("BTD,NDH->BTNH", (n, d, h), 1, (0, 2))
        self.k = proj("BTD,NDH->BTNH", (k, d, h), 1, (0, 2))
        self.v = proj("BTD,NDH->BTNH", (k, d, h), 1, (0, 2))
        self.out = proj("BTNH,NHD->BTD", (n, h, d), (0, 1), 2)

    def __call__(self, x):
        return self.out(causal_attention(rotary(self.q(x)), rotary(self.k(x)), self.v(x)))


class GatedMlp(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        op = lambda: {} if cfg.nnx_dot_general is None else {"dot_general": cfg.nnx_dot_general(rngs)}
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=cfg.dtype, rngs=rngs, **op())
        self.gate, self.up, self.down = linear(cfg.dim, cfg.mlp), linear(cfg.dim, cfg.mlp), linear(cfg.mlp, cfg.dim)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.gate(x)) * self.up(x))


class EinsumBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        norm = lambda: nnx.RMSNorm(cfg.dim, epsilon=cfg.eps, dtype=cfg.dtype, rngs=rngs)
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = norm(), EinsumAttention(cfg, rngs=rngs), norm(), \
            GatedMlp(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x, rngs=None):
        x = x + self.dropout(self.attn(self.attn_norm(x)), rngs=rngs)
        return x + self.dropout(self.mlp(self.mlp_norm(x)), rngs=rngs)


class EinsumLM(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=cfg.dtype, rngs=rngs)
        self.layers = nnx.data([EinsumBlock(cfg, rngs=rngs) for _ in range(cfg.layers)])   # a plain Python list
        self.norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.eps, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens, rngs=None):
        """Logits [batch, seq, vocab] of int tokens [batch, seq]; ``rngs``: the dropout keys (default: the model's
        own ``dropout`` stream)."""
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, rngs=rngs)
        return self.embed.attend(self.norm(x))       # the embedding, tied, as the output head


def nnx_einsum_model(cfg: StyleConfig = EINSUM_SMALL, rngs: nnx.Rngs | None = None) -> EinsumLM:
    """Model (a); ``rngs`` default ``nnx.Rngs(params=0, dropout=1)``."""
    return EinsumLM(cfg, rngs=rngs if rngs is not None else nnx.Rngs(params=0, dropout=1))


def nnx_einsum_loss(model: EinsumLM, batch, rng=None):
    """Mean next-token cross-entropy of ``batch["tokens"]`` (int32 [B, T + 1]); ``rng`` (a key, what
    ``jq.make_train_step`` hands its loss as ``rng=``): the dropout masks' seed, else the model's own stream."""
    rngs = None if rng is None else nnx.Rngs(dropout=rng)
    return next_token_loss(model(batch["tokens"][:, :-1], rngs=rngs), batch["tokens"])


# ----------------------------------------------------------------------------------------------
# (b) linen, nn.DenseGeneral attention, logical axis names, untied head
# ----------------------------------------------------------------------------------------------


# logical axis -> mesh axis: only the batch is split (over "fsdp"); every parameter axis is left to whoever shards the
# parameters (the plain benchmark, jaxquant's FSDP)
LOGICAL_RULES = (("batch", "fsdp"), ("length", None), ("embed", None), ("heads", None), ("kv_heads", None),
                 ("kv", None), ("mlp", None), ("vocab", None))


def _logical(init, names):
    return nn.with_logical_partitioning(init, names)


class DenseGeneralAttention(nn.Module):
    cfg: StyleConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        init = nn.initializers.lecun_normal()      # DenseGeneral inits the kernel flattened to [in, out]

        def proj(features, names, name, axis=-1):
            return nn.DenseGeneral(features, axis=axis, use_bias=False, dtype=c.dtype, name=name,
                                   kernel_init=_logical(init, names), dot_general_cls=c.dot_general_cls)

        q = proj((c.heads, c.head_dim), ("embed", "heads", "kv"), "query")(x)
        k = proj((c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv"), "key")(x)
        v = proj((c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv"), "value")(x)
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "kv"))
        o = nn.with_logical_constraint(causal_attention(rotary(q), rotary(k), v), ("batch", "length", "heads", "kv"))
        return proj(c.dim, ("heads", "kv", "embed"), "out", axis=(-2, -1))(o)


class DenseGeneralMlp(nn.Module):
    cfg: StyleConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        dense = lambda features, names, name: nn.Dense(
            features, use_bias=False, dtype=c.dtype, name=name, dot_general_cls=c.dot_general_cls,
            kernel_init=_logical(nn.initializers.lecun_normal(), names))
        h = jax.nn.silu(dense(c.mlp, ("embed", "mlp"), "gate")(x)) * dense(c.mlp, ("embed", "mlp"), "up")(x)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        return dense(c.dim, ("mlp", "embed"), "down")(h)


def _rms_norm(c: StyleConfig, name: str):
    return nn.RMSNorm(epsilon=c.eps, dtype=c.dtype, name=name, scale_init=_logical(nn.initializers.ones, ("embed",)))


class DenseGeneralBlock(nn.Module):
    cfg: StyleConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        x = x + DenseGeneralAttention(c, name="attn")(_rms_norm(c, "attn_norm")(x))
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        x = x + DenseGeneralMlp(c, name="mlp")(_rms_norm(c, "mlp_norm")(x))
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class DenseGeneralLM(nn.Module):
    cfg: StyleConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        embed = nn.Embed(c.vocab, c.dim, dtype=c.dtype, name="embed",
                         embedding_init=_logical(nn.initializers.normal(1.0), ("vocab", "embed")))
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        for i in range(c.layers):
            x = DenseGeneralBlock(c, name=f"layers_{i}")(x)
        x = _rms_norm(c, "norm")(x)
        logits = nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, name="head",
                          kernel_init=_logical(nn.initializers.lecun_normal(), ("embed", "vocab")))(x)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def linen_dense_general_model(cfg: StyleConfig = DENSE_GENERAL_SMALL) -> DenseGeneralLM:
    """Model (b), the module; its variables: ``linen_dense_general_init``."""
    return DenseGeneralLM(cfg)


def linen_dense_general_init(cfg: StyleConfig = DENSE_GENERAL_SMALL, seed: int = 0):
    """Model (b)'s variables ``{"params": ...}``, each parameter boxed with its logical axis names
    (``nn.LogicallyPartitioned``; ``nn.unbox`` gives the arrays)."""
    tokens = jnp.zeros((1, cfg.seq), jnp.int32)
    with nn.logical_axis_rules(LOGICAL_RULES):
        return linen_dense_general_model(cfg).init(jax.random.key(seed), tokens)


def linen_dense_general_loss(variables, batch, *, cfg: StyleConfig = DENSE_GENERAL_SMALL):
    """Mean next-token cross-entropy of ``batch["tokens"]`` (int32 [B, T + 1]) under model (b) of ``cfg`` (another
    size than the default: bind it, ``functools.partial(linen_dense_general_loss, cfg=...)``)."""
    with nn.logical_axis_rules(LOGICAL_RULES):
        logits = linen_dense_general_model(cfg).apply(variables, batch["tokens"][:, :-1])
    return next_token_loss(logits, batch["tokens"])
