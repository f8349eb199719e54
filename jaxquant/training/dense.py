"""``jq.dense``: ``y = x @ W.T`` for a PyTorch-convention weight ``W [out, in]`` that is a bf16/fp32 array,
a ``Float8Tensor`` or an ``NVFP4Tensor``, with a hand-written backward pass (``jax.custom_vjp``).

GEMMs, all ``lax.dot_general`` with fp32 accumulation and both operands contracted on their last axis
(the "TN" layout cuBLASLt's FP8 GEMM needs), so the weight is read as ``data`` in the forward and as
``data_t`` (its stored transpose) in the backward and never transposed at step time:

* FP8 (docs/numerics.md §1): activations quantized to E4M3 with current scaling in the forward, output
  gradients to E5M2 in the backward (amax by XLA, ``ops.fp8_quantize``: one pass writes the bytes and their
  transpose, which the weight-gradient GEMM reads); the three GEMMs take the
  float8 operands and the product of the two ``scale_inv`` multiplies the fp32 output.
* NVFP4 (docs/numerics.md §2): each weight element becomes ``value(q) * s8``, exact in bf16 (a 2-bit
  by 4-bit significand product), the GEMM runs on bf16 operands, and the global decode factor
  ``amax * (1/2688)`` of §2.8 multiplies the fp32 output.
* bf16/fp32 arrays: the GEMMs run in the weight's dtype (the activation is cast to it).

Weight gradients are straight-through: quantization is treated as the identity, so ``dW = g.T @ x``
(computed from the quantized activation and gradient in the FP8 case) is delivered to the weight that
was quantized: the array itself with ``recipe=`` (quantized on the fly), or the ``master`` attached
with :func:`straight_through` to an already quantized tensor.

One quantization per activation: the activation operand (the FP8 bytes and scale of ``x``, or its bf16 / weight-dtype
copy) is made outside the GEMM's ``custom_vjp``, once per ``x`` for every ``dense`` call of the same trace that reads
that ``x`` with the same recipe and amax axes (q / k / v, gate / up: :func:`shared_activation`), and the backward's
weight-gradient GEMMs read the same bytes (FP8: their transpose, written by the same cast pass; the output gradient
likewise). Each call still returns its own ``dx``; JAX sums them for ``x``.

Amax scope: activation and gradient statistics are those of the ``x``/``g`` this call sees (under
``shard_map``: the local block), max-reduced over ``amax_axes`` (the mesh axes that shard the activation,
e.g. TP/SP). ``make_train_step`` calls the loss per data-parallel rank, so the data-parallel axis is left
out unless a caller names it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import NamedTuple, Optional

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from jaxquant.primitives import formats, ops

from jaxquant.training import fsdp
from jaxquant.primitives.gemm import (BWD_FP8, FWD_FP8, NN, TN, nvfp4_global_decode, nvfp4_operand,  # noqa: F401
                           quantize_current, resolve_recipe, scaled_gemm, weight_operands)
from jaxquant.primitives.quantize import quantize_fp8, quantize_nvfp4
from jaxquant.primitives.varying import vary_like
from jaxquant.training.remat import GEMM_OUTPUT, QUANTIZED_ACTIVATION
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor, split_master


# ----------------------------------------------------------------------------------------------
# Public entry point, then a layer-wise FSDP weight's call (its life: jaxquant/training/fsdp.py)
# ----------------------------------------------------------------------------------------------


def dense(x, w, *, recipe: Optional[str] = None, out_dtype=None, amax_axes=()):
    """``y = x @ W.T`` for ``x [..., in]`` and a weight ``W [out, in]`` (PyTorch convention), with its own backward.

    Args:
      x: the activation ``[..., in]``, float32 or bfloat16.
      w: a float32/bfloat16 array, a ``Float8Tensor`` (E4M3), an ``NVFP4Tensor``, or one layer's
        ``jq.ShardedWeight`` from ``make_train_step`` (quantized and all-gathered here, gathered again in the
        backward unless ``reshard_after_forward=False``, its gradient reduced into ``w.grad``; docs/fsdp.md).
        A ``ShardedWeight`` of an ``[in, out]`` kernel (``ParamRule(kernel="in_out")``) gives ``x @ W``.
      recipe: None (follow the weight's type), ``"bf16"``, ``"fp8"`` or ``"nvfp4"``; with an array weight it is
        quantized on the fly (``compute_dtype`` bf16, as ``quantize_master_weights``) and receives dW.
      out_dtype: dtype of ``y`` (default ``x.dtype``).
      amax_axes: mesh axis name(s) over which the FP8 activation / gradient amax is max-reduced (inside
        ``shard_map``; default: none).

    Returns:
      ``y [..., out]``. A quantized weight gets no gradient unless it comes from :func:`straight_through`.

    Raises:
      ValueError / TypeError naming the argument: shapes that do not match, a recipe the weight cannot take.
    """
    if isinstance(w, fsdp.ShardedWeight):
        return _dense_sharded_entry(x, w, recipe, out_dtype, amax_axes)
    kind, on_the_fly = _check_recipe(w, recipe)
    n_out, n_in = (int(d) for d in w.shape)
    out_dtype = _check_x_out(x, n_in, w.shape, out_dtype)
    if isinstance(amax_axes, str):
        amax_axes = (amax_axes,)
    w, target = split_master(w)
    cfg = _Config(kind, on_the_fly, out_dtype, tuple(amax_axes), jnp.dtype(x.dtype),
                  jnp.dtype(w.dtype) if kind == "array" or on_the_fly else None,
                  None if target is None else jnp.dtype(target.dtype))
    lead = x.shape[:-1]
    act, saved = shared_activation(x, cfg.kind, jnp.dtype(w.dtype) if cfg.kind == "array" else None, cfg.amax_axes)
    x2 = x.reshape(-1, n_in)
    if target is not None:   # dW varies over every axis x does: a target replicated over one sums over it
        target = vary_like(target, x2)
    y = _dense2d(x2, act, saved, w, target, cfg)
    return checkpoint_name(y.reshape(*lead, n_out), GEMM_OUTPUT)


def _dense_sharded_entry(x, w, recipe, out_dtype, amax_axes):
    """``dense`` with a layer-wise FSDP weight (``jaxquant.training.fsdp``): gathered here, and again in the backward
    unless its spec keeps the gathered operands (``reshard_after_forward=False``)."""
    fsdp.check_layer(w, "w")
    if w.spec.transposed and recipe is not None and recipe != w.spec.recipe:
        raise ValueError(f"recipe: an [in, out] ShardedWeight is read in its own recipe {w.spec.recipe!r}, got "
                         f"{recipe!r} (use None)")
    if recipe in formats.QUANTIZED_RECIPES and w.spec.recipe == "bf16":   # quantized on the fly, as an array is
        return dense(x, w.gather(), recipe=recipe, out_dtype=out_dtype, amax_axes=amax_axes)
    if recipe is not None and recipe != w.spec.recipe:
        raise ValueError(f"recipe: {recipe!r} does not match the ShardedWeight's recipe {w.spec.recipe!r} "
                         f"(use None)")
    n_in, n_out = w.shape if w.spec.transposed else w.shape[::-1]
    out_dtype = _check_x_out(x, n_in, w.shape, out_dtype, w.spec.transposed)
    if isinstance(amax_axes, str):
        amax_axes = (amax_axes,)
    kind = "array" if w.spec.recipe == "bf16" else w.spec.recipe
    cfg = _Config(kind, False, out_dtype, tuple(amax_axes), jnp.dtype(x.dtype), None, None, w.spec.transposed)
    act, saved = shared_activation(x, kind, fsdp.COMPUTE_DTYPE if kind == "array" else None, cfg.amax_axes)
    x2 = x.reshape(-1, n_in)
    y = _dense_sharded(x2, act, saved, w.shard, vary_like(w.grad, x2), w.gathered, w.local, w.amax, cfg, w.spec)
    return checkpoint_name(y.reshape(*x.shape[:-1], n_out), GEMM_OUTPUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _dense_sharded(x2, act, saved, shard, grad, gathered, local, amax, cfg: _Config, spec: fsdp.WeightSpec):
    return _dense_sharded_fwd(x2, act, saved, shard, grad, gathered, local, amax, cfg, spec)[0]


def _dense_sharded_fwd(x2, act, saved, shard, grad, gathered, local, amax, cfg: _Config, spec: fsdp.WeightSpec):
    """The weight as the forward GEMM reads it (``fsdp.forward_weight``: quantized, gathered; or the step's
    once-a-step operands; ``amax``: the FP8 weight's precomputed amax or None), the GEMM on the (shared) activation
    operand ``act``; residuals: its named copy ``saved`` (:func:`shared_activation`) and what the backward needs of the
    weight. ``x2`` is here for its gradient only."""
    wops, kept = fsdp.forward_weight(shard, gathered, local, spec, amax)
    return _forward(act, wops, cfg).astype(cfg.out_dtype), (saved, kept)


def _dense_sharded_bwd(cfg: _Config, spec: fsdp.WeightSpec, res, g):
    """The weight as the backward GEMMs read it (``fsdp.backward_weight``), the GEMMs, and ``dW`` reduce-scattered
    right after its GEMM (``fsdp.reduce_grad``; the sums over axes the weight is replicated on come from the
    caller's ``vary_like`` of ``grad``)."""
    act, kept = res
    dx, dw = _backward(act, fsdp.backward_weight(kept, spec), g, cfg, fsdp.COMPUTE_DTYPE)
    dw = formats.to_compute_dtype(dw, fsdp.COMPUTE_DTYPE)   # the weight gradient of a bf16 layer
    # act, saved: no cotangent (made from stop_gradient(x)); x's gradient is dx
    return (dx.astype(cfg.x_dtype), None, None, None, fsdp.reduce_grad(dw, spec, sum_vary_axes=False), None, None,
            None)


_dense_sharded.defvjp(_dense_sharded_fwd, _dense_sharded_bwd)


# ----------------------------------------------------------------------------------------------
# Arrays and quantized tensors
# ----------------------------------------------------------------------------------------------


def _check_recipe(w, recipe) -> tuple[str, bool]:
    """(kind, on_the_fly) from the weight's type and ``recipe`` (gemm.resolve_recipe: one vocabulary with
    jaxquant.tp.sp; "bf16" with an array weight is None's no quantization)."""
    recipe = resolve_recipe(w, recipe, {"array": formats.RECIPES, "fp8": ("fp8",), "nvfp4": ("nvfp4",)})
    if isinstance(w, Float8Tensor):
        if w.data.ndim != 2 or jnp.dtype(w.data.dtype) != FWD_FP8:
            raise ValueError(f"w: a Float8Tensor weight must hold float8_e4m3fn data of rank 2, got "
                             f"{w.data.dtype} {tuple(w.data.shape)}")
        return "fp8", False
    if isinstance(w, NVFP4Tensor):
        return "nvfp4", False
    if not hasattr(w, "dtype") or not hasattr(w, "shape"):
        raise TypeError(f"w: must be an array, a Float8Tensor or an NVFP4Tensor, got {type(w).__name__}")
    if w.ndim != 2:
        raise ValueError(f"w: must have rank 2 ([out, in]), got shape {tuple(w.shape)}")
    if jnp.dtype(w.dtype) not in ops.INPUT_DTYPES:
        raise TypeError(f"w: dtype must be float32 or bfloat16, got {w.dtype}")
    return ("array", False) if recipe == "bf16" else (recipe, True)


def _check_x_out(x, n_in, w_shape, out_dtype, transposed=False):
    ops.check_input("x", x)
    if x.ndim < 1:
        raise ValueError("x: must have rank >= 1 ([..., in]), got a scalar")
    if x.shape[-1] != n_in:
        layout = "[in, out]" if transposed else "[out, in]"
        raise ValueError(f"x: last axis must equal the weight's 'in' size {n_in} (w is {layout} = "
                         f"{tuple(w_shape)}), got x of shape {tuple(x.shape)}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"out_dtype: must be a floating dtype, got {out_dtype}")
    return out_dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _dense2d(x2, act, saved, w, target, cfg: _Config):
    return _forward(act, _weight_operands(w, cfg), cfg).astype(cfg.out_dtype)


def _dense2d_fwd(x2, act, saved, w, target, cfg: _Config):
    """The GEMM on the activation operand ``act``; residuals: its named copy ``saved`` (:func:`shared_activation`)
    and the weight's packed bytes. ``x2`` is here for its gradient only."""
    wops = _weight_operands(w, cfg)
    y = _forward(act, wops, cfg)
    return y.astype(cfg.out_dtype), (saved, backward_operands(wops, cfg.kind))


def _dense2d_bwd(cfg: _Config, res, g):
    dx, dw = _backward(*res, g, cfg, cfg.w_grad_dtype)
    w_ct = None if cfg.w_grad_dtype is None else dw.astype(cfg.w_grad_dtype)      # arrays: the weight itself
    target_ct = None if cfg.target_dtype is None else dw.astype(cfg.target_dtype)  # straight_through master
    # act, saved: no cotangent (made from stop_gradient(x)); x's gradient is dx
    return dx.astype(cfg.x_dtype), None, None, w_ct, target_ct


_dense2d.defvjp(_dense2d_fwd, _dense2d_bwd)


# ----------------------------------------------------------------------------------------------
# The GEMMs and their operands
# ----------------------------------------------------------------------------------------------


class _Config(NamedTuple):
    kind: str                 # "array" | "fp8" | "nvfp4"
    on_the_fly: bool          # the weight operand is an array quantized inside the call
    out_dtype: np.dtype
    amax_axes: tuple
    x_dtype: np.dtype
    w_grad_dtype: Optional[np.dtype]       # gradient of the weight argument (arrays), else None
    target_dtype: Optional[np.dtype]       # gradient of the straight_through master, else None
    transposed: bool = False               # the weight is stored [in, out] (flax's kernels): y = x @ W


def _weight_operands(w, cfg: _Config):
    """The weight as the GEMMs read it: a dict of arrays (quantizing an array weight on the fly)."""
    if cfg.kind == "array":
        return {"w": w}
    if cfg.on_the_fly:
        fn = quantize_fp8 if cfg.kind == "fp8" else quantize_nvfp4
        w = fn(w, columnwise=True, compute_dtype=jnp.bfloat16)
    return weight_operands(w)   # jaxquant/primitives/gemm.py, shared with jaxquant.tp.sp


def _forward(act, wops, cfg: _Config):
    """y [B, N] from the activation operand ``act`` (:func:`shared_activation`), in ``cfg.out_dtype`` where
    :func:`scaled_gemm` writes it (16-bit), else fp32. A transposed weight ``K [in, out]`` is read as ``W = K.T``: FP8
    from its columnwise bytes (TN), NVFP4 and arrays from ``K`` itself contracted on axis 0."""
    if cfg.kind == "array":
        (xc,) = act
        return scaled_gemm(xc, None, wops["w"], None, dims=NN if cfg.transposed else TN, out_dtype=cfg.out_dtype)
    if cfg.kind == "fp8":   # written in the output dtype (scaled_gemm: on CUDA the GEMM can round to bf16 itself)
        xq, sx = act
        return scaled_gemm(xq, sx, wops["data_t" if cfg.transposed else "data"], wops["scale_inv"],
                           out_dtype=cfg.out_dtype)
    (xb,) = act
    dims = NN if cfg.transposed else TN
    # the bf16 operand a one-shard weight's forward made (fsdp.dequantizes_once), else decoded here
    w = wops["operand"] if "operand" in wops else nvfp4_operand(wops["data"], wops["scale_inv"])
    # written in the output dtype (scaled_gemm: on CUDA the GEMM applies the decode factor and rounds to bf16 itself)
    return scaled_gemm(xb, None, w, wops["dec"], dims=dims, out_dtype=cfg.out_dtype)


# ----------------------------------------------------------------------------------------------
# The activation operand, made once per activation tensor for every GEMM that reads it
# ----------------------------------------------------------------------------------------------


# The activation and gradient amaxes are left to XLA (the pure-JAX statistics, the same value: a max is exact), which
# fuses a reduction into the fusion that produces the tensor (the SwiGLU, the gradients' elementwise fusions, in an
# H200 profile: docs/performance.md) instead of reading it again in a pass of its own; a tensor a custom call
# produces (cuDNN attention's output) keeps a reduction of its own.
ACTIVATION_AMAX_IMPL = "reference"


class _Made(NamedTuple):
    x: weakref.ref          # the activation they were made from (the key holds its id)
    trace: object           # jax.extend.core.get_opaque_trace_state() when they were made
    arrays: tuple           # weak references to the operand's arrays, then to their named copies


class _Memo(threading.local):
    def __init__(self):
        self.made: dict = {}


_MEMO = _Memo()


def shared_activation(x, kind: str, dtype, amax_axes: tuple) -> tuple:
    """``(act, saved)``: the activation operand the GEMMs read of ``x [..., in]`` (rows ``[B, in]``): FP8
    ``(E4M3 bytes, scale_inv)`` with the amax max-reduced over ``amax_axes``, NVFP4 ``(bf16 x,)``, arrays
    ``(x in dtype,)``; and what the backward's weight-gradient GEMM reads, named ``QUANTIZED_ACTIVATION`` (the remat
    policies' name): FP8 ``(the transposed E4M3 bytes [in, B], scale_inv)``, written by the same cast pass (TN
    layout), otherwise the same arrays. Two values because ``jax.checkpoint`` sends a saved value that its forward
    also reads through ``reduce_precision`` at the dtype's ``finfo``, which XLA applies with IEEE exponents: E4M3
    values whose exponent field is all ones (finite in E4M3) become NaN. Both are made from ``stop_gradient(x)``: each
    GEMM's ``custom_vjp`` returns its own ``dx``, and JAX sums them for ``x``.

    Made once per ``x``: a call in the same trace with the same ``x`` (the same traced value, as flax models and
    models written on ``jq.dense`` pass to q / k / v and to gate / up) and the same ``kind`` / ``dtype`` /
    ``amax_axes`` returns the first call's arrays, so the traced step holds one amax pass, one cast and one saved copy
    per activation tensor however many GEMMs read it. The memo keeps nothing alive (weak references to ``x`` and to
    the arrays) and returns only arrays made in the trace now current (never a finished trace's, an outer or inner
    trace's, or another thread's); a miss makes them again, with the same bytes."""
    key = (id(x), kind, dtype, tuple(amax_axes))
    traced = isinstance(x, jax.core.Tracer)
    if traced:
        trace = jax.extend.core.get_opaque_trace_state()
        made = _MEMO.made.get(key)
        if made is not None and made.x() is x and made.trace == trace:
            arrays = tuple(r() for r in made.arrays)
            if all(a is not None for a in arrays):
                return arrays[: len(arrays) // 2], arrays[len(arrays) // 2:]
    x2 = jax.lax.stop_gradient(x).reshape(-1, x.shape[-1])
    if kind == "fp8":
        # one pass writes the forward's bytes and the transpose the weight-gradient GEMM reads (TN)
        xq, sx, xq_t = quantize_current(x2, FWD_FP8, amax_axes, columnwise=True, amax_impl=ACTIVATION_AMAX_IMPL)
        act, kept = (xq, sx), (xq_t, sx)
    else:
        act = kept = (x2.astype(jnp.bfloat16 if kind == "nvfp4" else dtype),)
    saved = tuple(checkpoint_name(a, QUANTIZED_ACTIVATION) for a in kept)
    if traced:   # the entry goes when x does
        memo = _MEMO.made
        memo[key] = _Made(weakref.ref(x, lambda _, k=key, m=memo: m.pop(k, None)), trace,
                          tuple(weakref.ref(a) for a in act + saved))
    return act, saved


BACKWARD_OPERANDS = {"array": ("w",), "fp8": ("data_t", "scale_inv"), "nvfp4": ("data_t", "scale_inv_t", "dec")}


def backward_operands(wops, kind: str) -> dict:
    """The part of the weight operands the backward reads (the columnwise copy, not a bf16 one)."""
    return {k: wops[k] for k in BACKWARD_OPERANDS[kind]}


def _backward(act, wops, g, cfg: _Config, dw_dtype=None):
    """(dx [B, K], dW [N, K], or [K, N] for a transposed weight) from the output gradient ``g [B, N]``: fp32, except
    where a GEMM has no scale factor (an unquantized layer's dx and dW, NVFP4's dW), is an FP8 GEMM or is NVFP4's dx:
    it writes dx in ``x``'s dtype and dW in ``dw_dtype``, the dtypes the callers cast them to, when those are 16-bit
    (:func:`scaled_gemm`)."""
    def wgrad(a, sa, b, sb, out_dtype=None):
        return scaled_gemm(b, sb, a, sa, out_dtype=out_dtype) if cfg.transposed else \
            scaled_gemm(a, sa, b, sb, out_dtype=out_dtype)    # dK = dW.T
    if cfg.kind == "array":
        (xc,), w = act, wops["w"]
        gc = g.astype(w.dtype)
        # dx = g @ W; dW = g.T @ x, both written TN.
        return (scaled_gemm(gc, None, w if cfg.transposed else w.T, None, out_dtype=cfg.x_dtype),
                wgrad(gc.T, None, xc.T, None, out_dtype=dw_dtype))
    if cfg.kind == "fp8":
        xq_t, sx = act
        gq, sg, gq_t = quantize_current(g, BWD_FP8, cfg.amax_axes, columnwise=True, amax_impl=ACTIVATION_AMAX_IMPL)
        w_t = wops["data"] if cfg.transposed else wops["data_t"]      # W.T's bytes [in, out], K-major for TN
        return (scaled_gemm(gq, sg, w_t, wops["scale_inv"], out_dtype=cfg.x_dtype),
                wgrad(gq_t, sg, xq_t, sx, out_dtype=dw_dtype))
    (xb,) = act
    gb = g.astype(jnp.bfloat16)
    # dx = g @ W: the weight's bf16 operand and how it is contracted
    if "operand" in wops:   # the forward's bf16 operand (fsdp.dequantizes_once): W read NN, K [in, out] TN
        w, dims = wops["operand"], TN if cfg.transposed else NN
    elif cfg.transposed:   # K [in, out] contracted on its minor axis: TN
        w, dims = nvfp4_operand(wops["data"], wops["scale_inv"]), TN
    elif "data_t" in wops:
        w, dims = nvfp4_operand(wops["data_t"], wops["scale_inv_t"]), TN
    else:   # the rowwise bytes read transposed: the same bf16 values (a 16x16 tile's scale is its transpose's)
        w, dims = nvfp4_operand(wops["data"], wops["scale_inv"]), NN
    dx = scaled_gemm(gb, None, w, wops["dec"], dims=dims, out_dtype=cfg.x_dtype)
    return dx, wgrad(gb.T, None, xb.T, None, out_dtype=dw_dtype)
