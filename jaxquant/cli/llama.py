"""A small Llama-style decoder written as flax NNX users write it: the model ``jaxquant demo`` and
benchmarks/bench_convergence.py train.

``nnx.Embed`` token embedding -> ``layers`` pre-norm blocks (``nnx.RMSNorm`` -> causal self-attention with
``nnx.Linear`` q / k / v / o projections, ``[in, out]`` kernels, rotary embeddings on q and k -> residual ->
``nnx.RMSNorm`` -> SwiGLU MLP, ``nnx.Linear`` gate / up / down -> residual) -> ``nnx.RMSNorm`` -> untied
``nnx.Linear`` output head. The blocks are created by ``nnx.vmap`` (each parameter stacked ``[layers, ...]``) and
run under ``nnx.scan`` (compile time flat in the layer count). Parameters are fp32, the computation bf16
(``param_dtype`` / ``dtype``, as mixed-precision flax models are written); the attention softmax is fp32.

Nothing here knows about jaxquant: ``jq.make_train_step(jq.flax_loss(model, lm_loss), ..., rules=rules())`` trains
it (``rules``: every kernel quantized, the stacked leaves declared stacked), and so does a plain ``jax.jit`` step
(benchmarks/bench_convergence.py's baseline).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

STACKED = r"layers\..*"     # the parameters nnx.vmap stacked: [layers, ...], one layer per scan iteration


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The model's sizes. ``seq``: the training sequence length (the model itself takes any length)."""
    vocab: int = 64
    dim: int = 128
    heads: int = 4
    ffn: int = 256
    layers: int = 2
    seq: int = 32
    eps: float = 1e-6
    rope_base: float = 10000.0

    def __post_init__(self):
        for name in ("vocab", "dim", "heads", "ffn", "layers", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name}: must be positive, got {getattr(self, name)}")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(f"LlamaConfig: dim={self.dim} must split into {self.heads} heads of an even size "
                             f"(rotary embeddings rotate pairs)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def num_params(self) -> int:
        d, f = self.dim, self.ffn
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        return self.layers * per_layer + 2 * self.vocab * d + d


def rope(x, base: float):
    """Rotary position embeddings of ``x`` [batch, seq, heads, head_dim] (halves rotated, as Llama does)."""
    s, d = x.shape[1], x.shape[-1]
    half = d // 2
    freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attention_impl(dtype):
    # cuDNN's fused attention on GPU (it takes bf16 / fp16); XLA's elsewhere
    return "cudnn" if jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16) else None


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        linear = lambda: nnx.Linear(cfg.dim, cfg.dim, use_bias=False, dtype=dtype, rngs=rngs)
        self.q, self.k, self.v, self.o = linear(), linear(), linear(), linear()

    def __call__(self, x):
        b, s, _ = x.shape
        c = self.cfg
        heads = lambda t: t.reshape(b, s, c.heads, c.head_dim)
        q, k, v = rope(heads(self.q(x)), c.rope_base), rope(heads(self.k(x)), c.rope_base), heads(self.v(x))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=_attention_impl(q.dtype))
        return self.o(out.reshape(b, s, c.dim))


class Mlp(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.dim, cfg.ffn, use_bias=False, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, cfg.ffn, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(cfg.ffn, cfg.dim, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.eps, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.eps, dtype=dtype, rngs=rngs)
        self.mlp = Mlp(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):      # one Block whose parameters are stacked [layers, ...]
            return Block(cfg, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.eps, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        """Logits [batch, seq, vocab] (fp32) of int tokens [batch, seq]."""
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        x = run(self.embed(tokens), self.layers)
        return self.head(self.norm(x)).astype(jnp.float32)


def llama(cfg: LlamaConfig = LlamaConfig(), seed: int = 0, *, dtype=jnp.bfloat16) -> Llama:
    """The model with its parameters drawn from ``seed`` (the same seed, the same parameters)."""
    return Llama(cfg, dtype=dtype, rngs=nnx.Rngs(params=seed))


def lm_loss(model, batch):
    """Mean next-token cross-entropy; ``batch["tokens"]`` int [batch, seq + 1] (inputs, then shifted targets)."""
    tokens = batch["tokens"]
    logp = jax.nn.log_softmax(model(tokens[:, :-1]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def rules():
    """``make_train_step``'s rules for this model: every kernel quantized (``[in, out]``, flax's layout), the
    embedding and norm scales kept as arrays, the ``nnx.vmap``-stacked leaves declared stacked (saved per layer as
    ``layers.{i}....``)."""
    import jaxquant as jq

    return jq.flax_rules(stacked=STACKED)
