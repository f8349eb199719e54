"""Sequence-parallel tensor-parallel layers (column / row parallel) with FP8 current scaling of the
activations and the communication overlapped with the GEMMs. Design and numerics: docs/sp.md.

Layout on the mesh axis ``tp_axis`` (size n); activations are ``[..., S, H]`` with the sequence at -2:

- ``sp_layernorm_dense``: x sequence-sharded ``[..., S/n, H]`` -> layernorm (bf16 out) -> all-gather
  over the sequence -> GEMM with the column-parallel weight ``[F/n, H]`` -> ``[..., S, F/n]``.
- ``sp_dense_reduce_scatter``: x feature-sharded ``[..., S, F/n]`` -> GEMM with the row-parallel
  weight ``[H, F/n]`` -> reduce-scatter over the sequence -> ``[..., S/n, H]``.

Weights are ``[out, in]`` (PyTorch convention, as ``jq.dense`` and ``quantize_master_weights``), read as
``data`` in the forward GEMM and as ``data_t`` in the dgrad GEMM, both contracted on their minor axis.
Recipes (``recipe=``, the names of ``jq.dense``): None follows the weight's type, "bf16" (no quantization),
"fp8", "nvfp4" (an ``NVFP4Tensor``, read as bf16 blockwise values). FP8 (recipe "fp8"): every quantized
tensor is a per-tensor current-scaled value (docs/numerics.md §1) whose amax is max-reduced over
``tp_axis`` before the local block is quantized once; its bytes and the one ``scale_inv`` travel together
as a ``_Scaled`` pytree through every collective, so a receiver multiplies by the scale that came with
the bytes. Forward operands are E4M3, gradients E5M2. GEMMs, quantizers and the weight operands are
those of ``jq.dense`` (jaxquant/primitives/gemm.py). Residuals for the backward pass are values returned by this
forward call (no quantizer state), so interleaving forward passes of several microbatches cannot change
what a backward pass reads.

Overlap modes: "off" (shard_map, one all_gather / psum_scatter and one GEMM, which XLA schedules under
independent work) and "fused" (bf16 and FP8: collective GEMM kernels that move the chunks themselves,
jaxquant/tp/collective_gemm.py; the forward keeps the gathered activation for the wgrad instead of
gathering it again). Why no other schedule (XLA's windowed einsums, a ppermute ring): docs/sp.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxquant.tp import collective_gemm

from jaxquant.primitives import formats, gemm, ops

from jaxquant.training import fsdp
from jaxquant.training.dense import dense as gemm_dense
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor, split_master
from jaxquant.primitives.varying import vary_like

OVERLAPS = ("off", "fused")
# per weight kind (gemm.weight_kind), the recipes these layers run, the default first: an array weight is
# not quantized to NVFP4 on the fly here; an NVFP4Tensor also accepts "bf16", its former spelling
_FITS = {"array": ("bf16", "fp8"), "fp8": ("fp8",), "nvfp4": ("nvfp4",)}
FWD_DTYPE = gemm.FWD_FP8
GRAD_DTYPE = gemm.BWD_FP8
COMPUTE_DTYPE = formats.COMPUTE_DTYPE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Scaled:
    """A GEMM operand and the per-tensor factor that multiplies the GEMM's output: FP8 bytes and their
    scale_inv (the unit that travels through collectives), or an NVFP4 weight's bf16 blockwise value
    and its global decode factor."""

    data: jax.Array
    scale_inv: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Weight:
    """GEMM operands of a weight ``[out, in]``: ``fwd`` contracted on dim 1 (``in``); ``dgrad`` contracted on
    ``dgrad_contract`` (``out``): ``data_t [in, out]`` on dim 1 where the weight carries it, else ``fwd``
    on dim 0."""

    fwd: object
    dgrad: object
    dgrad_contract: int = dataclasses.field(default=1, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class _Ctx:
    mesh: jax.sharding.Mesh
    axis: str
    n: int
    overlap: str
    impl: str


# ----------------------------------------------------------------------------------------------
# GEMMs
# ----------------------------------------------------------------------------------------------


def _dot(a, b, dims, out_dtype=jnp.float32):
    """fp32-accumulated GEMM -> ``out_dtype``; unscaled operands give ``out_dtype`` straight from the dot
    (one rounding of the fp32 accumulator, as a convert would, with no fp32 output buffer)."""
    parts = [(op.data, op.scale_inv) if isinstance(op, _Scaled) else (op, None) for op in (a, b)]
    if parts[0][1] is None and parts[1][1] is None:
        return lax.dot_general(parts[0][0], parts[1][0], dims, preferred_element_type=out_dtype)
    return gemm.scaled_gemm(*parts[0], *parts[1], dims, out_dtype=out_dtype)


def _shape(op) -> tuple[int, ...]:
    return tuple(int(d) for d in (op.data if isinstance(op, _Scaled) else op).shape)


def _ndim(op) -> int:
    return (op.data if isinstance(op, _Scaled) else op).ndim


def _flat_rows(op):
    """[..., K] -> [M, K]: GEMMs see plain matrices (one contracting dim, as cuBLASLt FP8 wants)."""
    if isinstance(op, _Scaled):
        return _Scaled(_flat_rows(op.data), op.scale_inv)
    return op.reshape(-1, op.shape[-1])


def _matmul(a, b, b_contract: int, out_dtype=jnp.float32):
    """a [..., K] times the 2-D operand b contracting b's dim ``b_contract`` -> ``out_dtype`` [..., N]."""
    lead = _shape(a)[:-1]
    out = _dot(_flat_rows(a), b, (((1,), (b_contract,)), ((), ())), out_dtype)
    return out.reshape(lead + out.shape[-1:])


def _wgrad(a, g):
    """a [..., K], g [..., N] contracting every leading dim -> fp32 [K, N]."""
    return _dot(_flat_rows(a), _flat_rows(g), (((0,), (0,)), ((), ())))


# ----------------------------------------------------------------------------------------------
# Specs and small per-device helpers
# ----------------------------------------------------------------------------------------------


def _seq_spec(ndim, axis):
    return P(*([None] * (ndim - 2)), axis, None)


def _feat_spec(ndim, axis):
    return P(*([None] * (ndim - 1)), axis)


def _op_spec(op, spec):
    """The spec pytree of an operand: the FP8 scale is one replicated scalar."""
    return _Scaled(spec, P()) if isinstance(op, _Scaled) else spec


def _smap(ctx, f, in_specs, out_specs):
    # check_vma off: an FP8 scale is replicated by construction (every rank derives it from the
    # max-reduced amax) but comes out of a cast that also reads the rank's own block, which the
    # type check cannot see. JAX never differentiates these bodies (custom_vjp wraps them).
    # ctx.mesh None: the per-rank layers (sp_column_dense / sp_row_dense), already inside a shard_map
    if ctx.mesh is None:
        return f
    return jax.shard_map(f, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _layernorm_f32(x, gamma, beta, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return (xf - mean) * lax.rsqrt(var + eps) * gamma.astype(jnp.float32) + beta.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Collective GEMMs on global arrays: all-gather -> GEMM (+ wgrad), GEMM -> reduce-scatter
# ----------------------------------------------------------------------------------------------


def _device(ctx):
    """A device of the layer's mesh; for the per-rank layers (no mesh), the default backend's."""
    return jax.devices()[0] if ctx.mesh is None else ctx.mesh.devices.flat[0]


def _fused_impl(ctx) -> str:
    """The fused mode's kernels on GPUs; their plain-JAX schedule for impl="reference" and, under
    impl="auto", on other backends."""
    gpu = _device(ctx).platform == "gpu"
    return "kernel" if ctx.impl == "custom_call" or (ctx.impl == "auto" and gpu) else "reference"


def _rank_major(v, n):
    """[..., n*s, c] -> [n*prod(...)*s, c]: each rank's sequence rows (of every batch entry) contiguous."""
    lead, (rows, c) = v.shape[:-2], v.shape[-2:]
    v = v.reshape(lead + (n, rows // n, c))
    return jnp.moveaxis(v, -3, 0).reshape(-1, c)


def _from_rank_major(v, lead, n):
    """The inverse of ``_rank_major`` for ``lead`` batch dims."""
    v = v.reshape((n,) + lead + (-1, v.shape[-1]))
    v = jnp.moveaxis(v, 0, -3)
    return v.reshape(lead + (-1, v.shape[-1]))


def _fused_operands(a_loc, w_loc, w_contract):
    """(a bytes or bf16, B, B's contracted axis, the factor of the products or None) for the collective
    GEMM kernels: FP8 operands need B K-major, so a weight without its columnwise copy is byte-transposed
    (exact); unscaled products times ``scale_a * scale_w``, as ``gemm.scaled_gemm`` multiplies (every
    rank's scales are equal: each amax was max-reduced over tp)."""
    if not isinstance(a_loc, _Scaled):
        return a_loc, w_loc, w_contract, None
    w_data = w_loc.data if w_contract == 1 else w_loc.data.T
    return a_loc.data, w_data, 1, a_loc.scale_inv * w_loc.scale_inv


def _scaled_back(out, factor):
    return out if factor is None else out.astype(jnp.float32) * factor


def _fused_gather_matmul(ctx, a_loc, w_loc, w_contract):
    """Per rank: (a_full @ w, a_full) through collective_gemm.gather_matmul, ``a_loc [..., s, K]`` (bf16, or
    FP8 bytes with their scale: the gathered bytes come back with it)."""
    a_data, b, contract, factor = _fused_operands(a_loc, w_loc, w_contract)
    lead, k = a_data.shape[:-2], a_data.shape[-1]
    out, full = collective_gemm.gather_matmul(a_data.reshape(-1, k), b, axis=ctx.axis, n=ctx.n,
                                              contract=contract, impl=_fused_impl(ctx))
    full = _from_rank_major(full, lead, ctx.n)
    return (_scaled_back(_from_rank_major(out, lead, ctx.n), factor),
            full if factor is None else _Scaled(full, a_loc.scale_inv))


def _gathered_forward(ctx, a, w, out_dtype):
    """The column layer's fused forward: (out feature-sharded, the gathered ``a`` replicated over tp)."""
    nd = _ndim(a)
    body = lambda a_loc, w_loc: _fused_gather_matmul(ctx, a_loc, w_loc, 1)
    out, full = _smap(ctx, body, (_op_spec(a, _seq_spec(nd, ctx.axis)), _op_spec(w, P(ctx.axis, None))),
                      (_feat_spec(nd, ctx.axis), _op_spec(a, P())))(a, w)
    return out.astype(out_dtype), full


def _wgrad_on_gathered(ctx, g, full):
    """[out/n, in] per rank: ``g`` feature-sharded times the replicated gathered activation."""
    return _smap(ctx, _wgrad, (_op_spec(g, _feat_spec(_ndim(g), ctx.axis)), _op_spec(full, P())),
                 P(ctx.axis, None))(g, full)


def _gather_matmul(ctx, a, w=None, w_contract=0, other=None, gathered_is_lhs=True, out_dtype=jnp.float32):
    """All-gather the sequence-sharded ``a`` [..., S, K] and consume it twice, each optional:

    out = a_full @ w (w [K, N] or [N, K] per ``w_contract``, N sharded) -> ``out_dtype`` [..., S, N/n];
    dw = a_full^T @ other (or other^T @ a_full): ``other`` [..., S, M/n] feature-sharded -> fp32.
    Returns (out or None, dw or None).
    """
    nd, axis = _ndim(a), ctx.axis
    want_out, want_dw = w is not None, other is not None
    dw_spec = P(None, axis) if gathered_is_lhs else P(axis, None)

    def wgrad(full, oth):
        return _wgrad(full, oth) if gathered_is_lhs else _wgrad(oth, full)

    def body(a_loc, w_loc, o_loc):
        if ctx.overlap == "fused" and want_out:
            out, full = _fused_gather_matmul(ctx, a_loc, w_loc, w_contract)
            return out.astype(out_dtype), (wgrad(full, o_loc) if want_dw else None)
        # "off", or the wgrad alone (the column layer's backward): one all-gather, which XLA schedules
        # under independent work (the column layer's dgrad GEMM)
        gather = lambda v: lax.all_gather(v, axis, axis=nd - 2, tiled=True)
        if isinstance(a_loc, _Scaled):
            # each rank's scale travels with its bytes; all are equal (shared amax), so the one
            # GEMM over the gathered buffer uses a travelled scale (that of rank 0)
            full = _Scaled(gather(a_loc.data), lax.all_gather(a_loc.scale_inv, axis)[0])
        else:
            full = gather(a_loc)
        return (_matmul(full, w_loc, w_contract, out_dtype=out_dtype) if want_out else None,
                wgrad(full, o_loc) if want_dw else None)

    a_spec = _op_spec(a, _seq_spec(nd, axis))
    w_spec = P(None, axis) if w_contract == 0 else P(axis, None)   # N (not contracted) is sharded
    in_specs = (a_spec, _op_spec(w, w_spec) if want_out else None,
                _op_spec(other, _feat_spec(nd, axis)) if want_dw else None)
    out_specs = (_feat_spec(nd, axis) if want_out else None, dw_spec if want_dw else None)
    return _smap(ctx, body, in_specs, out_specs)(a, w, other)


def _matmul_reduce_scatter(ctx, a, w, w_contract, wire):
    """a [..., S, K] feature-sharded (K split over tp) @ w (K sharded) -> partial sums reduce-scattered
    over the sequence -> ``wire`` [..., S/n, N]. Partial sums travel in ``wire`` (the layer's output
    dtype, as a bf16 GSPMD program reduces them)."""
    nd, axis, n = _ndim(a), ctx.axis, ctx.n

    def body(a_loc, w_loc):
        if ctx.overlap == "fused":
            a_data, b, contract, factor = _fused_operands(a_loc, w_loc, w_contract)
            out = collective_gemm.matmul_reduce_scatter(_rank_major(a_data, n), b, axis=axis, n=n,
                                                        contract=contract, impl=_fused_impl(ctx))
            out = _scaled_back(out, factor)
            return out.reshape(a_data.shape[:-2] + (-1, out.shape[-1])).astype(wire)
        return lax.psum_scatter(_matmul(a_loc, w_loc, w_contract, out_dtype=wire), axis,
                                scatter_dimension=nd - 2, tiled=True)

    w_spec = P(axis, None) if w_contract == 0 else P(None, axis)   # K (contracted) is sharded
    in_specs = (_op_spec(a, _feat_spec(nd, axis)), _op_spec(w, w_spec))
    return _smap(ctx, body, in_specs, _seq_spec(nd, axis))(a, w)


# ----------------------------------------------------------------------------------------------
# Quantization stages (shard_map: local statistics, one max-reduction over tp, one local cast)
# ----------------------------------------------------------------------------------------------


def _operand(ctx, recipe, v, spec, dtype):
    """The GEMM operand of activation/gradient ``v`` (global, sharded ``spec``): bf16, or FP8 bytes
    with their shared scale."""
    if recipe == "bf16":
        return v.astype(COMPUTE_DTYPE)
    body = lambda v_loc: _Scaled(*gemm.quantize_current(v_loc, dtype, ctx.axis, impl=ctx.impl)[:2])
    return _smap(ctx, body, spec, _Scaled(spec, P()))(v)


def _tp_spec(ctx, tp_dim):
    return P(ctx.axis, None) if tp_dim == 0 else P(None, ctx.axis)


def _nvfp4_value(ctx, data, scale_inv, shape, tp_dim, name):
    """bf16 ``value(q) * s8`` of NVFP4 bytes of logical ``shape``, sharded on ``tp_dim`` over tp.

    Two scale layouts are read: the whole tensor's (``quantize_nvfp4``; decoded as one array) and the
    TP-local one of ``quantize_master_weights(tp_axis=...)`` (each rank's padded scales; decoded per
    rank). They coincide when the TP split is aligned to the scale layout (docs/sp.md)."""
    n, (rows, cols) = ctx.n, shape
    local = (rows // n, cols) if tp_dim == 0 else (rows, cols // n)
    whole = formats.nvfp4_scale_shape(rows, cols)
    per_rank = formats.nvfp4_scale_shape(*local)
    tp_local = (per_rank[0] * n, per_rank[1]) if tp_dim == 0 else (per_rank[0], per_rank[1] * n)
    aligned = local[0] % 128 == 0 if tp_dim == 0 else (local[1] // formats.TILE) % 4 == 0
    got = tuple(int(d) for d in scale_inv.shape)
    if got == whole and (whole != tp_local or aligned):
        return gemm.nvfp4_operand(data, scale_inv)
    if got == tp_local and whole != tp_local and local[tp_dim] % formats.TILE == 0:
        spec = _tp_spec(ctx, tp_dim)
        return _smap(ctx, gemm.nvfp4_operand, (spec, spec), spec)(data, scale_inv)
    raise ValueError(f"{name}: NVFP4 scales of shape {got} match neither the whole-tensor layout {whole} nor, "
                     f"unambiguously, the TP-local layout {tp_local} of a {shape} weight split on dim {tp_dim} "
                     f"over {n} ranks (docs/sp.md, NVFP4 weights)")


def _weight_operands(ctx, recipe, w, tp_dim) -> _Weight:
    """GEMM operands of the global weight ``w [out, in]``, sharded on ``tp_dim`` over tp: a quantized weight's
    arrays are ``gemm.weight_operands``'s (as ``jq.dense`` reads them; a missing columnwise copy is not
    built: the dgrad GEMM reads ``fwd`` on dim 0), an NVFP4 weight's bytes decoded per TP rank here."""
    if isinstance(w, (Float8Tensor, NVFP4Tensor)):
        arrays = gemm.weight_operands(w, fill_columnwise=False)
        if isinstance(w, Float8Tensor):
            fwd = _Scaled(arrays["data"], arrays["scale_inv"])
            dgrad = _Scaled(arrays["data_t"], arrays["scale_inv"]) if "data_t" in arrays else None
        else:
            fwd = _Scaled(_nvfp4_value(ctx, arrays["data"], arrays["scale_inv"], w.shape, tp_dim, "w"), arrays["dec"])
            dgrad = None if "data_t" not in arrays else _Scaled(
                _nvfp4_value(ctx, arrays["data_t"], arrays["scale_inv_t"], w.shape[::-1], 1 - tp_dim, "w (data_t)"),
                arrays["dec"])
        return _Weight(fwd, fwd, 0) if dgrad is None else _Weight(fwd, dgrad)
    if recipe == "bf16":
        wb = w.astype(COMPUTE_DTYPE)
        return _Weight(wb, wb, 0)
    # a float weight under the FP8 recipe: per-tensor current scaling of the TP-sharded weight
    # (bf16 compute dtype, docs/numerics.md §2 "Compute dtype"), rowwise and its byte transpose
    def body(w_loc):
        data, scale_inv, data_t = gemm.quantize_current(w_loc, FWD_DTYPE, ctx.axis, compute_dtype=COMPUTE_DTYPE,
                                                        columnwise=True, impl=ctx.impl)
        return _Weight(_Scaled(data, scale_inv), _Scaled(data_t, scale_inv))
    spec = _tp_spec(ctx, tp_dim)
    out_specs = _Weight(_Scaled(spec, P()), _Scaled(_tp_spec(ctx, 1 - tp_dim), P()))
    return _smap(ctx, body, spec, out_specs)(w)


def _weight_cotangents(wgrad_dtypes, dw):
    """Straight-through (dense.py's rule): dW goes to an array weight itself and to the master of a
    ``straight_through`` tensor; a plain quantized tensor gets none."""
    return tuple(None if d is None else dw.astype(d) for d in wgrad_dtypes)


# ----------------------------------------------------------------------------------------------
# The two layers (custom_vjp over global arrays: the backward collectives are written out)
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _column_layer(ctx: _Ctx, recipe: str, eps: Optional[float], nd: int, out_dtype, wgrad_dtypes):
    """``eps`` None: no layernorm (the per-rank ``sp_column_dense``; gamma and beta are None)."""
    seq, feat = _seq_spec(nd, ctx.axis), _feat_spec(nd, ctx.axis)
    if eps is None:
        layernorm = lambda x, g, b: x
    else:
        layernorm = lambda x, g, b: _layernorm_f32(x, g, b, eps)

    def fwd(x, gamma, beta, w, target):
        wop = _weight_operands(ctx, recipe, w, 0)
        a = _operand(ctx, recipe, layernorm(x, gamma, beta).astype(COMPUTE_DTYPE), seq, FWD_DTYPE)
        if ctx.overlap == "fused":   # the gathered x is kept: the wgrad needs no second gather
            out, a = _gathered_forward(ctx, a, wop.fwd, out_dtype)
        else:
            out, _ = _gather_matmul(ctx, a, wop.fwd, 1, out_dtype=out_dtype)
        return out, (x, gamma, beta, a, wop)

    def bwd(res, g):
        x, gamma, beta, a, wop = res
        gq = _operand(ctx, recipe, g, feat, GRAD_DTYPE)
        # dgrad: GEMM -> reduce-scatter, in x's dtype on the wire
        dy = _matmul_reduce_scatter(ctx, gq, wop.dgrad, wop.dgrad_contract, x.dtype).astype(jnp.float32)
        if ctx.overlap == "fused":
            dw = _wgrad_on_gathered(ctx, gq, a)
        else:
            _, dw = _gather_matmul(ctx, a, other=gq, gathered_is_lhs=False)     # wgrad [out, in] on the re-gathered x
        # the bf16 rounding of the layernorm output passes the gradient straight through
        if eps is None:
            return dy.astype(x.dtype), None, None, *_weight_cotangents(wgrad_dtypes, dw)
        dx, dgamma, dbeta = jax.vjp(layernorm, x, gamma, beta)[1](dy)
        return dx, dgamma, dbeta, *_weight_cotangents(wgrad_dtypes, dw)

    layer = jax.custom_vjp(lambda x, gamma, beta, w, target: fwd(x, gamma, beta, w, target)[0])
    layer.defvjp(fwd, bwd)
    return layer


@functools.lru_cache(maxsize=256)
def _row_layer(ctx: _Ctx, recipe: str, nd: int, dtype, wgrad_dtypes):
    seq, feat = _seq_spec(nd, ctx.axis), _feat_spec(nd, ctx.axis)

    def fwd(x, w, target):
        wop = _weight_operands(ctx, recipe, w, 1)
        a = _operand(ctx, recipe, x, feat, FWD_DTYPE)
        return _matmul_reduce_scatter(ctx, a, wop.fwd, 1, dtype), (a, wop)

    def bwd(res, g):
        a, wop = res
        gq = _operand(ctx, recipe, g, seq, GRAD_DTYPE)
        # one gather of dY feeds both the dgrad GEMM and the wgrad GEMM ([out, in])
        dx, dw = _gather_matmul(ctx, gq, wop.dgrad, wop.dgrad_contract, other=a, gathered_is_lhs=True,
                                out_dtype=dtype)
        return dx, *_weight_cotangents(wgrad_dtypes, dw)

    layer = jax.custom_vjp(lambda x, w, target: fwd(x, w, target)[0])
    layer.defvjp(fwd, bwd)
    return layer


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _check_float(name, a):
    ops.not_quantized(name, a)   # a quantized tensor has a float dtype (its dequantized one) but is no array
    if not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{name}: must be a floating-point array, got "
                        f"{getattr(a, 'dtype', type(a).__name__)}")


def _context(mesh, tp_axis, overlap, impl) -> _Ctx:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh: must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if tp_axis not in mesh.axis_names:
        raise ValueError(f"tp_axis: {tp_axis!r} is not an axis of the mesh (axes {mesh.axis_names})")
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        raise ValueError("mesh: the sp layers need a mesh with Auto axis types (jax.sharding.Mesh(devices, "
                         "names), or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n)); "
                         f"got {mesh.axis_types}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap: must be one of {OVERLAPS}, got {overlap!r}")
    ops.check_impl(impl)
    return _Ctx(mesh, tp_axis, int(mesh.shape[tp_axis]), overlap, impl)


def _weight_and_recipe(w, recipe, n_in: int):
    """Validate ``w [out, in]``: (plain weight, straight-through master or None, recipe, dtypes of the
    weight cotangents (weight, master), None where none is returned)."""
    w, master = split_master(w)
    if recipe == "bf16" and isinstance(w, NVFP4Tensor):
        recipe = "nvfp4"   # the former spelling for an NVFP4 weight (its GEMMs read bf16 values), still accepted
    recipe = gemm.resolve_recipe(w, recipe, _FITS, "w")
    if isinstance(w, Float8Tensor):
        if w.data.ndim != 2:
            raise ValueError(f"w: Float8Tensor data must be [out, in], got shape {tuple(w.data.shape)}")
        if jnp.dtype(w.data.dtype) != jnp.dtype(FWD_DTYPE):
            raise TypeError(f"w: a Float8Tensor weight must be {jnp.dtype(FWD_DTYPE)} (its dgrad GEMM "
                            f"meets E5M2 gradients), got {w.data.dtype}")
    elif not isinstance(w, NVFP4Tensor):
        _check_float("w", w)
    shape = tuple(int(d) for d in w.shape)
    if len(shape) != 2 or shape[1] != n_in:
        raise ValueError(f"w: must be [out, in] with in = {n_in} (the last dim of x), got shape {shape}")
    quantized = isinstance(w, (Float8Tensor, NVFP4Tensor))
    dtypes = (None if quantized else jnp.dtype(w.dtype), None if master is None else jnp.dtype(master.dtype))
    # internally "bf16" = bf16 activations and gradients, which is what an NVFP4 weight's GEMMs take
    return w, master, "bf16" if recipe == "nvfp4" else recipe, dtypes


def _check_divisible(name, what, size, n, tp_axis):
    if size % n:
        raise ValueError(f"{name}: {what} ({size}) must be a multiple of the {tp_axis!r} axis size {n}")


def _check_x(x, ctx):
    _check_float("x", x)
    if x.ndim < 2:
        raise ValueError(f"x: must be [..., S, hidden] (rank >= 2), got shape {tuple(x.shape)}")
    _check_divisible("x", "the sequence length x.shape[-2]", x.shape[-2], ctx.n, ctx.axis)


def _check_fused(ctx, x, w, recipe, hidden, features, rows=None):
    """overlap="fused": bf16 activations, recipe "bf16" (a float weight) or "fp8" (a float weight or a
    Float8Tensor), and per-rank GEMMs that fit the kernels' tiling: [rows, hidden] x [hidden, features/n]
    and [rows, features/n] x [features/n, hidden]."""
    if ctx.overlap != "fused":
        return
    if recipe not in ("bf16", "fp8") or isinstance(w, NVFP4Tensor):
        raise ValueError(f"overlap: 'fused' runs bf16 and FP8 GEMMs (recipe 'bf16' or 'fp8'), got recipe "
                         f"{recipe!r} and a {type(w).__name__} weight; use 'off'")
    if jnp.dtype(x.dtype) != jnp.dtype(collective_gemm.DTYPE):
        raise ValueError(f"x: overlap='fused' takes bf16 activations (its kernels write bf16), got {x.dtype}")
    if _fused_impl(ctx) == "kernel":
        problem = collective_gemm.device_problem(_device(ctx)) or collective_gemm.process_problem(ctx.mesh, ctx.axis)
        if problem:
            raise ValueError(f"impl: overlap='fused' with impl={ctx.impl!r} runs Pallas:Mosaic GPU kernels, which "
                             f"need {problem}; impl='reference' runs their plain-JAX schedule")
    rows = math.prod(x.shape[:-2]) * x.shape[-2] // ctx.n if rows is None else rows
    # all-gather GEMMs: [rows, hidden] @ [hidden, features/n]; GEMM reduce-scatters: [.., features/n] @ [.., hidden]
    operands = FWD_DTYPE if recipe == "fp8" else collective_gemm.DTYPE
    collective_gemm.tiling("gather", "w", rows, hidden, features // ctx.n, operands, ctx.n)
    collective_gemm.tiling("scatter", "w", rows, features // ctx.n, hidden, operands, ctx.n)


def sp_layernorm_dense(x, gamma, beta, w, *, mesh, tp_axis: str = "tp", overlap: str = "off",
                       recipe: Optional[str] = None, eps: float = 1e-5, impl: str = "auto"):
    """Column-parallel layer: layernorm, then all-gather over the sequence, then ``@ w.T``.

    Differentiable in x, gamma, beta and a float w; a quantized w passes dW to the master attached with
    ``jq.straight_through`` (docs/sp.md).

    Args:
      x: float ``[..., S, H]`` sharded on the sequence over ``tp_axis`` (S a multiple of the axis size).
      gamma, beta: the layernorm's float ``[H]`` scale and shift.
      w: ``[F, H]`` (``[out, in]``: a float array, ``Float8Tensor`` or ``NVFP4Tensor``, e.g. from
        ``quantize_master_weights(tp_axis=...)`` with tp_dims "col") sharded ``P(tp_axis, None)``;
        F a multiple of the axis size.
      mesh: the ``jax.sharding.Mesh`` (Auto axis types).
      tp_axis: the tensor-parallel mesh axis (default "tp").
      overlap: how the all-gather meets the GEMM: "off" (default: one all-gather, then one GEMM, which
        XLA overlaps with independent work) or "fused" (bf16 or FP8: collective GEMM kernels on Hopper
        GPUs, their plain-JAX schedule with ``impl="reference"``).
      recipe: the names of ``jq.dense``. None (default) follows the weight's type; "fp8" (E4M3
        activations and weight, E5M2 gradients; a Float8Tensor, or a float weight quantized inside),
        "nvfp4" (an NVFP4Tensor, read as bf16 blockwise values with bf16 activations and gradients; its
        former spelling "bf16" is still accepted) or "bf16" (a float weight, no quantization).
      eps: the layernorm's epsilon (default 1e-5).
      impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

    Returns:
      ``[..., S, F]`` in x's dtype, sharded on the features over ``tp_axis``.

    Raises:
      TypeError: ``mesh`` is not a ``Mesh``, or an operand of the wrong type or dtype.
      ValueError: ``tp_axis`` not in the mesh, shapes that do not match or divide by the axis size, an
        unknown ``overlap``, a recipe the weight cannot run, or a "fused" call the kernels cannot take.
    """
    ctx = _context(mesh, tp_axis, overlap, impl)
    _check_x(x, ctx)
    hidden = int(x.shape[-1])
    for name, v in (("gamma", gamma), ("beta", beta)):
        _check_float(name, v)
        if tuple(v.shape) != (hidden,):
            raise ValueError(f"{name}: must have shape ({hidden},) (the last dim of x), got {tuple(v.shape)}")
    w, master, recipe, dtypes = _weight_and_recipe(w, recipe, hidden)
    _check_divisible("w", "the output features w.shape[0]", w.shape[0], ctx.n, tp_axis)
    _check_fused(ctx, x, w, recipe, hidden, int(w.shape[0]))
    layer = _column_layer(ctx, recipe, float(eps), x.ndim, jnp.dtype(x.dtype), dtypes)
    return layer(x, gamma, beta, w, master)


def sp_dense_reduce_scatter(x, w, *, mesh, tp_axis: str = "tp", overlap: str = "off",
                            recipe: Optional[str] = None, impl: str = "auto"):
    """Row-parallel layer: ``x @ w.T`` with the partial sums reduce-scattered over the sequence.

    Weight gradients as in :func:`sp_layernorm_dense`.

    Args:
      x: float ``[..., S, F]`` sharded on the features over ``tp_axis`` (S and F multiples of the axis
        size).
      w: ``[H, F]`` (``[out, in]``, tp_dims "row") sharded ``P(None, tp_axis)``; the weight types of
        :func:`sp_layernorm_dense`.
      mesh, tp_axis, overlap, recipe, impl: as in :func:`sp_layernorm_dense` (defaults "tp", "off",
        None, "auto"); the overlap modes apply to the reduce-scatter.

    Returns:
      ``[..., S, H]`` in x's dtype, sharded on the sequence over ``tp_axis``.

    Raises:
      TypeError, ValueError: as :func:`sp_layernorm_dense`.
    """
    ctx = _context(mesh, tp_axis, overlap, impl)
    _check_x(x, ctx)
    _check_divisible("x", "the features x.shape[-1]", x.shape[-1], ctx.n, tp_axis)
    w, master, recipe, dtypes = _weight_and_recipe(w, recipe, int(x.shape[-1]))
    _check_fused(ctx, x, w, recipe, int(w.shape[0]), int(x.shape[-1]))
    layer = _row_layer(ctx, recipe, x.ndim, jnp.dtype(x.dtype), dtypes)
    return layer(x, w, master)


def sp_mlp(x, gamma, beta, w1, w2, *, mesh, tp_axis: str = "tp", overlap: str = "off",
           recipe: Optional[str] = None, activation=jax.nn.gelu, eps: float = 1e-5, impl: str = "auto"):
    """``sp_dense_reduce_scatter(activation(sp_layernorm_dense(x, gamma, beta, w1)), w2)``.

    The activation runs on feature-sharded values without communication.

    Args:
      x: float ``[..., S, H]`` sharded on the sequence over ``tp_axis``.
      gamma, beta: the layernorm's ``[H]`` scale and shift.
      w1: ``[F, H]`` (``[out, in]``) column-parallel weight, sharded ``P(tp_axis, None)``.
      w2: ``[H, F]`` (``[out, in]``) row-parallel weight, sharded ``P(None, tp_axis)``.
      mesh, tp_axis, overlap, recipe, eps, impl: as in :func:`sp_layernorm_dense`, for both layers.
      activation: elementwise function between the layers (default ``jax.nn.gelu``).

    Returns:
      ``[..., S, H]`` sequence-sharded (add the residual yourself).

    Raises:
      TypeError, ValueError: as the two layers.
    """
    kw = dict(mesh=mesh, tp_axis=tp_axis, overlap=overlap, recipe=recipe, impl=impl)
    h = activation(sp_layernorm_dense(x, gamma, beta, w1, eps=eps, **kw))
    return sp_dense_reduce_scatter(h, w2, **kw)


# ----------------------------------------------------------------------------------------------
# Inside shard_map (per-rank values): sequence parallelism in a training step's loss_fn
# ----------------------------------------------------------------------------------------------


def _seq_axis(v, name):
    if v.ndim < 2:
        raise ValueError(f"{name}: must be [..., S, features] (rank >= 2), got shape {tuple(v.shape)}")
    return v.ndim - 2


def _per_rank_fused_call(kind, x, w, tp_axis, recipe, out_dtype, impl):
    """sp_column_dense / sp_row_dense with overlap="fused": the sp layers' own custom VJP (their
    quantization, operands and collective GEMM kernels) run per rank, inside the caller's shard_map."""
    ops.check_impl(impl)
    n = int(lax.axis_size(tp_axis))
    ctx = _Ctx(None, tp_axis, n, "fused", impl)
    _seq_axis(x, "x")
    if isinstance(w, fsdp.ShardedWeight):   # gathered over fsdp; its gradient goes back through the gather
        w = w.gather()
    w, master, recipe, dtypes = _weight_and_recipe(w, recipe, int(x.shape[-1]))
    # dW is computed per rank: typed varying like x, so JAX sums it over the axes the weight is replicated on
    if master is not None:
        master = vary_like(master, x)
    elif not isinstance(w, (Float8Tensor, NVFP4Tensor)):
        w = vary_like(w, x)
    out_f, in_f = (int(d) for d in w.shape)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if kind == "column":   # this rank's rows [.., s, in] gathered, times [out/n, in]
        _check_fused(ctx, x, w, recipe, in_f, out_f * n, rows=math.prod(x.shape[:-1]))
        return _column_layer(ctx, recipe, None, x.ndim, out_dtype, dtypes)(x, None, None, w, master)
    if out_dtype != jnp.dtype(x.dtype):   # the row layer's dX comes out in its output (wire) dtype
        raise ValueError(f"out_dtype: sp_row_dense with overlap='fused' writes x's dtype ({x.dtype}), the dtype its "
                         f"partial sums travel in; got {out_dtype}")
    _check_fused(ctx, x, w, recipe, out_f, in_f * n, rows=math.prod(x.shape[:-1]) // n)
    return _row_layer(ctx, recipe, x.ndim, out_dtype, dtypes)(x, w, master)


def sp_column_dense(x, w, *, tp_axis: str, recipe: Optional[str] = None, out_dtype=None, overlap: str = "off",
                    impl: str = "auto"):
    """Per-rank column-parallel layer of sequence parallelism, for code already inside ``shard_map``.

    For the ``loss_fn`` of ``make_train_step(..., tp_axis=...)``: this rank's sequence rows are
    all-gathered over ``tp_axis`` (in x's dtype) and multiplied by this rank's output rows of ``w``. The
    FP8/NVFP4 activation amax is max-reduced over ``tp_axis``. JAX's transpose of the all-gather
    reduce-scatters dX back to the sequence rows (Megatron's "g" with sequence parallelism).

    Args:
      x: this rank's sequence rows, ``[..., S/n, in]``.
      w: this rank's output rows, ``[out/n, in]``: anything ``jq.dense`` takes, a ``ShardedWeight``
        included.
      tp_axis: the tensor-parallel axis name of the enclosing ``shard_map``.
      recipe: as in ``jq.dense`` (default None: follow the weight's type).
      out_dtype: the output dtype (default None: x's dtype).
      overlap: "off" (default: ``lax.all_gather``, then ``jq.dense``) or "fused" (bf16 x; a bf16 or FP8
        weight, recipe "bf16" or "fp8"; a ``ShardedWeight`` is gathered first): the all-gather GEMM and,
        in the backward, the GEMM reduce-scatter as collective GEMM kernels on Hopper GPUs (their
        plain-JAX schedule elsewhere or with ``impl="reference"``; docs/sp.md), the sp layers' own custom
        VJP per rank, keeping the gathered ``x`` for the weight gradient.
      impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

    Returns:
      ``[..., S, out/n]``.

    Raises:
      ValueError: an ``overlap`` other than "off" / "fused", ``x`` of rank < 2, or a "fused" call the
        kernels cannot take; ``jq.dense``'s errors for the weight.
    """
    if overlap == "fused":
        return _per_rank_fused_call("column", x, w, tp_axis, recipe, out_dtype, impl)
    if overlap != "off":
        raise ValueError(f"overlap: sp_column_dense takes 'off' or 'fused', got {overlap!r}")
    full = lax.all_gather(x, tp_axis, axis=_seq_axis(x, "x"), tiled=True)
    return gemm_dense(full, w, recipe=recipe, out_dtype=out_dtype, amax_axes=(tp_axis,))


def sp_row_dense(x, w, *, tp_axis: str, recipe: Optional[str] = None, out_dtype=None, overlap: str = "off",
                 impl: str = "auto"):
    """Per-rank row-parallel layer of sequence parallelism, for code already inside ``shard_map``.

    ``x`` times this rank's input columns of ``w``, the partial sums reduce-scattered over ``tp_axis``
    onto the sequence rows. JAX's transpose of the reduce-scatter all-gathers dY for the backward GEMMs.

    Args:
      x: ``[..., S, in/n]``, the features this rank holds.
      w: this rank's input columns, ``[out, in/n]``: anything ``jq.dense`` takes.
      tp_axis: the tensor-parallel axis name of the enclosing ``shard_map``.
      recipe: as in ``jq.dense`` (default None: follow the weight's type).
      out_dtype: the dtype the partial sums travel and come out in (default None: x's dtype, i.e. bf16
        partial sums on the wire, as Megatron); with "fused" it must be x's dtype.
      overlap: "off" (default: ``jq.dense``, then ``lax.psum_scatter``) or "fused" (bf16 or FP8): the GEMM
        reduce-scatter and, in the backward, the all-gather GEMM (dY gathered once for both backward
        GEMMs) as collective GEMM kernels, as in :func:`sp_column_dense`.
      impl: "auto" (default), "custom_call" or "reference" (``jaxquant.primitives.ops``).

    Returns:
      ``[..., S/n, out]``.

    Raises:
      ValueError: an ``overlap`` other than "off" / "fused", ``x`` of rank < 2, or a "fused" call the
        kernels cannot take; ``jq.dense``'s errors for the weight.
    """
    if overlap == "fused":
        return _per_rank_fused_call("row", x, w, tp_axis, recipe, out_dtype, impl)
    if overlap != "off":
        raise ValueError(f"overlap: sp_row_dense takes 'off' or 'fused', got {overlap!r}")
    y = gemm_dense(x, w, recipe=recipe, out_dtype=out_dtype, amax_axes=(tp_axis,))   # fp32 GEMM, rounded once
    return lax.psum_scatter(y, tp_axis, scatter_dimension=_seq_axis(x, "x"), tiled=True)
