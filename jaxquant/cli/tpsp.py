"""The hand-written TP + SP transformer of ``jaxquant demo --model tp-sp``: every matrix in PyTorch ``[out, in]``
convention and applied with ``jq.dense``, Megatron-style tensor parallel with sequence parallelism.

A decoder-only transformer (token embedding read with ``jnp.take``, ``layers`` pre-norm blocks of causal
attention + GELU MLP stacked into ``[L, out, in]`` leaves and run under ``jax.lax.scan``, output head) trained by
``jq.make_train_step`` (layer-wise FSDP: each layer's weights are quantized and gathered where the scan body uses
them) on an ``(fsdp, tp)`` mesh: the QKV and MLP-up weights are column-parallel (each TP rank holds ``heads/tp``
heads and ``d_ff/tp`` hidden units), the attention output and MLP-down weights row-parallel; embedding, head and
norms are replicated over ``tp``. ``quantize_mask`` keeps the embedding and the norms unquantized (bf16 arrays).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    d_model: int = 64
    heads: int = 4
    d_ff: int = 256
    layers: int = 2
    seq: int = 32


BLOCK_MATRICES = ("q", "k", "v", "o", "up", "down")
TP_SPLIT = {"q": "col", "k": "col", "v": "col", "o": "row", "up": "col", "down": "row"}


def _block_shapes(cfg: ModelConfig) -> dict:
    d, f = cfg.d_model, cfg.d_ff
    return {"attn_norm": (d,), "q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "mlp_norm": (d,),
            "up": (f, d), "down": (d, f)}


def init_params(key, cfg: ModelConfig):
    """fp32 parameters: ``embed`` [vocab, d_model] (rows looked up), ``head`` [vocab, d_model], ``final_norm``
    and ``blocks``, each block leaf stacked over the layers ([L, out, in] matrices, [L, d] norm scales)."""
    import jax
    import jax.numpy as jnp

    def normal(k, shape):
        return jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[-1])

    ks = jax.random.split(key, len(_block_shapes(cfg)) + 2)
    blocks = {name: (jnp.ones((cfg.layers,) + shape, jnp.float32) if len(shape) == 1
                     else normal(k, (cfg.layers,) + shape))
              for k, (name, shape) in zip(ks, sorted(_block_shapes(cfg).items()))}
    return {"embed": jax.random.normal(ks[-2], (cfg.vocab, cfg.d_model), jnp.float32),
            "head": normal(ks[-1], (cfg.vocab, cfg.d_model)),
            "final_norm": jnp.ones((cfg.d_model,), jnp.float32), "blocks": blocks}


def quantize_mask(cfg: ModelConfig):
    """The quantized leaves: the block matrices and the head (the embedding is read by rows, the stacked
    norm scales [L, d] are no GEMM weights)."""
    return {"embed": False, "head": True, "final_norm": False,
            "blocks": {name: name in BLOCK_MATRICES for name in _block_shapes(cfg)}}


def per_layer(params, cfg: ModelConfig) -> dict:
    """Flat ``{name: array}`` with one entry per layer (``blocks.{i}.q``, as a PyTorch model names them and as
    ``step.state_dict`` does)."""
    flat = {n: params[n] for n in ("embed", "head", "final_norm")}
    for name, stack in params["blocks"].items():
        flat |= {f"blocks.{i}.{name}": stack[i] for i in range(cfg.layers)}
    return flat


def _rms_norm(x, scale):
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    return (x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)) * scale).astype(x.dtype)


def _positions(seq, d):
    """Sinusoidal position encodings [seq, d] (fixed, not a parameter)."""
    pos = np.arange(seq)[:, None] / (10000.0 ** (np.arange(0, d, 2)[None, :] / d))
    return np.concatenate([np.sin(pos), np.cos(pos)], axis=1).astype(np.float32)


def param_specs(cfg: ModelConfig):
    """How make_train_step splits each parameter over tp (Megatron: column- then row-parallel)."""
    return {"embed": None, "head": None, "final_norm": None,
            "blocks": {name: TP_SPLIT.get(name) for name in _block_shapes(cfg)}}


def loss_fn(cfg: ModelConfig, tp_axis: str | None = None, tp: int = 1, sequence_parallel: bool = True,
            overlap: str = "off"):
    """loss(weights, batch): mean next-token cross-entropy; batch["tokens"] int32 [B, seq + 1]. With
    ``tp > 1`` it runs on one TP rank's blocks (``param_specs``) and does the TP collectives itself:
    with ``sequence_parallel`` (Megatron SP, ``jq.sp_column_dense`` / ``jq.sp_row_dense``) the residual
    stream, norms and loss hold this rank's ``seq / tp`` positions, the column-parallel GEMMs all-gather
    their input over tp and the row-parallel ones reduce-scatter their bf16 partial sums; without it every
    TP rank holds the whole sequence and the row-parallel partial sums are all-reduced in fp32.
    ``overlap`` goes to the sequence-parallel layers ("fused": the bf16 / FP8 collective GEMM kernels, docs/sp.md)."""
    import jax
    import jax.numpy as jnp

    import jaxquant as jq
    from jaxquant.primitives.varying import mark_varying

    act = jnp.bfloat16
    hd = cfg.d_model // cfg.heads
    heads = cfg.heads // tp                # this TP rank's heads
    amax = (tp_axis,) if tp > 1 else ()    # FP8 statistics of TP-split activations span the whole tensor
    sp = sequence_parallel and tp > 1

    def column_parallel(x, w):
        if sp:
            return jq.sp_column_dense(x, w, tp_axis=tp_axis, out_dtype=act, overlap=overlap)
        if tp > 1:   # Megatron's "f": identity forward; its transpose all-reduces the input gradient over tp
            x = mark_varying(x, (tp_axis,))
        return jq.dense(x, w, out_dtype=act, amax_axes=amax)

    def row_parallel(x, w):   # Megatron's "g": partial products summed over tp
        if sp:
            return jq.sp_row_dense(x, w, tp_axis=tp_axis, out_dtype=act, overlap=overlap)
        y = jq.dense(x, w, out_dtype=jnp.float32, amax_axes=amax)
        return (jax.lax.psum(y, tp_axis) if tp > 1 else y).astype(act)
    pos = _positions(cfg.seq, cfg.d_model)
    mask = np.tril(np.ones((cfg.seq, cfg.seq), bool))

    def block(h, p):
        b = h.shape[0]
        x = _rms_norm(h, p["attn_norm"])
        q, k, v = (column_parallel(x, p[n]).reshape(b, cfg.seq, heads, hd) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
        a = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1).astype(act)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, cfg.seq, heads * hd)
        h = h + row_parallel(o, p["o"])
        x = _rms_norm(h, p["mlp_norm"])
        return h + row_parallel(jax.nn.gelu(column_parallel(x, p["up"])), p["down"]), None

    def loss(w, batch):
        tokens = batch["tokens"]
        inputs, targets, p = tokens[:, :-1], tokens[:, 1:], pos
        if sp:   # this rank's positions of the sequence
            rows = cfg.seq // tp
            start = jax.lax.axis_index(tp_axis) * rows
            local = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, start, rows, axis=axis)
            inputs, targets, p = local(inputs, 1), local(targets, 1), local(jnp.asarray(pos), 0)
        h = jnp.take(w["embed"], inputs, axis=0).astype(act) + p.astype(act)
        h, _ = jax.lax.scan(block, h, w["blocks"])          # one layer's weights gathered per iteration
        logits = jq.dense(_rms_norm(h, w["final_norm"]), w["head"], out_dtype=jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
        return jax.lax.pmean(nll, tp_axis) if sp else nll    # equal shares of the sequence

    return loss


def check_tp(cfg: ModelConfig, tp: int, recipe: str) -> None:
    """The model splits over ``tp`` ranks: whole heads and hidden units, NVFP4 16-element tiles."""
    if cfg.heads % tp or cfg.d_ff % tp or cfg.seq % tp:
        raise ValueError(f"--mesh: tp={tp} must divide the {cfg.heads} heads, d_ff={cfg.d_ff} and the sequence "
                         f"length {cfg.seq} (sequence parallelism)")
    if recipe == "nvfp4" and (cfg.d_model // tp) % 16:
        raise ValueError(f"--mesh: tp={tp} leaves {cfg.d_model // tp} columns per TP rank; NVFP4 needs a "
                         f"multiple of 16 (use tp <= {cfg.d_model // 16})")

