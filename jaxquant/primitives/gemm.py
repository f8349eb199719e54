"""GEMMs and GEMM operands shared by the quantized layers (``jq.dense``, ``jaxquant.tp.sp``): the GEMM, the
current-scaling quantizer, a quantized weight's operands (:func:`weight_operands`) and the one recipe
vocabulary (:func:`resolve_recipe`).

Every GEMM is a ``lax.dot_general`` accumulated in fp32 whose per-tensor factors (the FP8
``scale_inv`` of each operand, the NVFP4 global decode factor) multiply the fp32 output, never the
operands: the float8 operands go to the GEMM as they are (docs/numerics.md §1), an NVFP4 operand as
its exact bf16 blockwise value (§2.8). On CUDA the scaled GEMMs with a bf16 result run as jaxquant's cuBLASLt
custom calls (:data:`FP8_GEMM_IMPL`, :data:`BF16_GEMM_IMPL`), which apply the factors inside the GEMM and give the
same bytes.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import _ffi, formats, ops, reference
from jaxquant.primitives.quantize import fp8_columnwise, nvfp4_columnwise
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor
from jaxquant.primitives.varying import mark_varying

FWD_FP8 = jnp.dtype(jnp.float8_e4m3fn)     # activations (and weights) in the forward
BWD_FP8 = jnp.dtype(jnp.float8_e5m2)       # output gradients in the backward
TN = (((1,), (1,)), ((), ()))              # a [M, K] x b [N, K]: both contracted on their minor axis
NN = (((1,), (0,)), ((), ()))              # a [M, K] x b [K, N]

# Which GEMM a scaled float8 x float8 TN product with a bf16 result runs on CUDA (``scaled_gemm``):
#   "xla"       XLA's dot: its cuBLASLt FP8 GEMM writes the fp32 accumulator, the factors and the cast to bf16 are
#               fused into the kernels that read it (4 bytes an element read back);
#   "cublaslt"  (default) jaxquant's custom call (``ops.fp8_gemm``, csrc/cuda_gemm.cu): the same cuBLASLt GEMM, the
#               same bytes, with the factors in its epilogue, writing bf16 (where the CUDA extension was built with
#               it; XLA's dot elsewhere). docs/performance.md, "XLA's FP8 GEMM or jaxquant's", has the A/B.
# Read when a function is traced; the environment variable JAXQUANT_FP8_GEMM sets it at import.
GEMM_IMPLS = ("xla", "cublaslt")           # the values of both switches below
FP8_GEMM_IMPL = os.environ.get("JAXQUANT_FP8_GEMM", "cublaslt")


# Which GEMM a scaled bf16 x bf16 TN or NN product with a bf16 result (NVFP4's GEMMs on Hopper: the operand decoded to
# its exact bf16 value, the global decode factor on the fp32 result, docs/numerics.md §2.8) runs on CUDA:
#   "xla"       (default) XLA's dot writes the fp32 [M, N] result, the factor and the cast to bf16 are fused into the
#               kernels that read it (4 bytes an element read back);
#   "cublaslt"  jaxquant's custom call (``ops.bf16_gemm``, csrc/cuda_gemm.cu): one cuBLASLt GEMM with the factor as its
#               alpha, writing bf16, where the CUDA extension was built with it; XLA's dot elsewhere. Its products have
#               XLA's bytes (tests/test_bf16_gemm_gpu.py; a two-layer NVFP4 step trains to the same masters on an
#               H200), but its gain beside the one-shard NVFP4 path is not measured, so it is opt-in
#               (docs/performance.md, "NVFP4's GEMMs").
# Read when a function is traced; the environment variable JAXQUANT_BF16_GEMM sets it at import.
BF16_GEMM_IMPL = os.environ.get("JAXQUANT_BF16_GEMM", "xla")


def _uses_cublaslt(kind: str, value: str) -> bool:
    """Whether ``value``, the switch ``<kind>_GEMM_IMPL`` ("FP8" / "BF16"), is "cublaslt", checked: another value is
    an error naming the switch and its environment variable."""
    if value not in GEMM_IMPLS:
        raise ValueError(f"gemm.{kind}_GEMM_IMPL / JAXQUANT_{kind}_GEMM: must be one of {GEMM_IMPLS}, got {value!r}")
    return value == "cublaslt"


def _custom_fp8_gemm(a, a_scale, b, b_scale, dims, out_dtype) -> bool:
    """Whether this product runs as ``ops.fp8_gemm`` (:data:`FP8_GEMM_IMPL`): float8 operands cuBLASLt takes, TN,
    both factors, a bf16 result, and a CUDA extension that has the GEMM."""
    return (_uses_cublaslt("FP8", FP8_GEMM_IMPL) and _ffi.has_target("cuda", "jq_fp8_gemm") and dims == TN
            and a_scale is not None and b_scale is not None
            and out_dtype is not None and jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16)
            and ops.single.fp8_gemm_supported(a.shape, b.shape, a.dtype, b.dtype))


def _custom_bf16_gemm(a, a_scale, b, b_scale, dims, out_dtype) -> bool:
    """Whether this product runs as ``ops.bf16_gemm`` (:data:`BF16_GEMM_IMPL`): bf16 operands of rank 2, TN or NN, a
    factor, a bf16 result, N and K multiples of 16, and a CUDA extension that has the GEMM."""
    return (_uses_cublaslt("BF16", BF16_GEMM_IMPL) and _ffi.has_target("cuda", "jq_bf16_gemm") and dims in (TN, NN)
            and (a_scale is not None or b_scale is not None)
            and out_dtype is not None and jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16)
            and ops.single.bf16_gemm_supported(a.shape, b.shape, a.dtype, b.dtype, "nk" if dims == TN else "kn"))


def _factor(a_scale, b_scale):
    """The factor of the product: one operand's, or the product of both (one fp32 rounding, as the reference)."""
    return b_scale if a_scale is None else a_scale if b_scale is None else a_scale * b_scale


def scaled_gemm(a, a_scale, b, b_scale, dims=TN, out_dtype=None):
    """``dot_general(a, b, dims)`` in fp32 times the operands' per-tensor factors (None: no factor).

    ``out_dtype`` (bf16 / f16): the dtype the caller casts the result to. An unscaled bf16 x bf16 GEMM then writes it
    itself off the CPU, as plain JAX's ``x @ w`` does: cuBLAS rounds its fp32 accumulator once, which is the cast of
    the fp32 result, and the fp32 result is never written or read. A scaled float8 x float8 GEMM to bf16 does the
    same on CUDA with :data:`FP8_GEMM_IMPL` "cublaslt" (``ops.fp8_gemm``: the same bytes as XLA's dot, the factors
    applied inside the GEMM), and a scaled bf16 x bf16 GEMM to bf16 (NVFP4's) with :data:`BF16_GEMM_IMPL`
    "cublaslt" (``ops.bf16_gemm``: the factor as the GEMM's alpha). The result has dtype ``out_dtype`` either way."""
    if _custom_fp8_gemm(a, a_scale, b, b_scale, dims, out_dtype):
        return ops.fp8_gemm(a, b, a_scale, b_scale, out_dtype=out_dtype)
    if _custom_bf16_gemm(a, a_scale, b, b_scale, dims, out_dtype):
        return ops.bf16_gemm(a, b, _factor(a_scale, b_scale), b_layout="nk" if dims == TN else "kn")
    if a.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16:
        if a_scale is None and b_scale is None and out_dtype is not None and jnp.dtype(out_dtype).itemsize == 2:
            # on the CPU reference.bf16_dot_f32's GEMM, then the cast (the same bytes)
            direct = lambda: jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)
            cpu = lambda: reference.bf16_dot_f32(a, b, dims).astype(out_dtype)
            return jax.lax.platform_dependent(cpu=cpu, default=direct)
        acc = reference.bf16_dot_f32(a, b, dims)
    else:
        acc = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    if a_scale is not None or b_scale is not None:
        acc = acc * _factor(a_scale, b_scale)
    return acc if out_dtype is None else reference.round_result(acc, out_dtype)


def quantize_current(v, dtype, amax_axes=(), *, compute_dtype=None, columnwise=False, impl="auto",
                     amax_impl=None):
    """FP8 current scaling of a block: (data, scale_inv, data_t or None). The amax is the block's,
    max-reduced over the mesh ``amax_axes`` first, so every rank derives the same scale and quantizes
    its own block once (docs/numerics.md §1.1-§1.6). ``amax_impl`` (default ``impl``) computes the amax:
    ``"reference"`` leaves it to XLA, which can fuse the reduction into the kernel that produces ``v``
    (the same value: a max is exact)."""
    amax, _ = ops.fp8_stats(v, compute_dtype=compute_dtype, impl=impl if amax_impl is None else amax_impl)
    if amax_axes:
        # varying again after the reduction: ops' custom-call and reference branches must agree on it
        amax = mark_varying(jax.lax.pmax(amax, amax_axes), amax_axes)
    return ops.fp8_quantize(v, amax, dtype=dtype, compute_dtype=compute_dtype, columnwise=columnwise, impl=impl)


def nvfp4_operand(data, scale_inv):
    """bf16 ``[rows, cols]`` from packed ``data [rows, cols/2]``: ``value(q) * s8`` per element, exact in
    bf16 (a 2-bit by 4-bit significand product, within bf16's exponent range); the global factor is
    left out. Elementwise and next to the GEMM that reads it, so XLA can fuse it into the operand."""
    rows, cols = data.shape[0], data.shape[1] * 2
    s8 = jax.lax.bitcast_convert_type(scale_inv[:rows, : cols // formats.TILE], jnp.float8_e4m3fn)
    # the codes' values built as bit patterns (integer ops that fuse, no table), exact in bf16
    values = reference.e2m1_code_to_fp32(reference.unpack_codes(data)).astype(jnp.bfloat16)
    return values * jnp.repeat(s8.astype(jnp.bfloat16), formats.TILE, axis=1)


def nvfp4_global_decode(amax):
    """docs/numerics.md §2.8: the global factor ``amax * (1/2688)`` of the dequantization."""
    return jnp.reshape(amax, ()).astype(jnp.float32) * (np.float32(1) / formats.NVFP4_GLOBAL_RANGE)


# ----------------------------------------------------------------------------------------------
# One vocabulary for both layer families: recipe names, and a quantized weight's GEMM operands
# ----------------------------------------------------------------------------------------------



def weight_kind(w) -> str:
    """"fp8" (a ``Float8Tensor``), "nvfp4" (an ``NVFP4Tensor``) or "array" (anything else)."""
    return "fp8" if isinstance(w, Float8Tensor) else "nvfp4" if isinstance(w, NVFP4Tensor) else "array"


_KIND_WORDS = {"fp8": "a Float8Tensor", "nvfp4": "an NVFP4Tensor", "array": "a float array"}


def _choices(names) -> str:
    quoted = ["None", *(repr(n) for n in names)]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def resolve_recipe(w, recipe, fits: dict, name: str = "w") -> str:
    """The recipe name for weight ``name`` = ``w`` under the argument ``recipe``: None follows the weight's
    type (``fits[kind][0]``, :func:`weight_kind`); a name must be one of :data:`formats.RECIPES` and one of
    ``fits[kind]`` (what the calling layer does with that kind of weight). One error style for every
    layer: the argument, the allowed values and what was given."""
    if recipe is not None and recipe not in formats.RECIPES:
        raise ValueError(f"recipe: must be {_choices(formats.RECIPES)}, got {recipe!r}")
    kind = weight_kind(w)
    if recipe is None:
        return fits[kind][0]
    if recipe not in fits[kind]:
        raise ValueError(f"recipe: {recipe!r} does not match {name}, {_KIND_WORDS[kind]} (use "
                         f"{_choices(fits[kind])})")
    return recipe


def weight_operands(w, *, fill_columnwise: bool = True) -> dict:
    """The arrays the GEMMs read from a ``Float8Tensor`` / ``NVFP4Tensor`` weight ``[out, in]``.

    FP8: ``data``, ``data_t``, ``scale_inv`` (a scalar). NVFP4: ``data``, ``scale_inv``, ``data_t``,
    ``scale_inv_t`` and ``dec`` (the global decode factor, :func:`nvfp4_global_decode`); the packed bytes
    as stored (:func:`nvfp4_operand` decodes them next to the GEMM). A missing columnwise copy is built
    from the rowwise bytes with ``fill_columnwise``, else its keys are left out (the caller reads the
    rowwise operand transposed)."""
    if isinstance(w, Float8Tensor):
        if w.data_t is None and fill_columnwise:
            w = fp8_columnwise(w)
        out = {"data": w.data, "data_t": w.data_t, "scale_inv": jnp.reshape(w.scale_inv, ())}
        return {k: v for k, v in out.items() if v is not None}
    if not isinstance(w, NVFP4Tensor):
        raise TypeError(f"w: must be a Float8Tensor or an NVFP4Tensor, got {type(w).__name__}")
    if (w.data_t is None or w.scale_inv_t is None) and fill_columnwise:
        w = nvfp4_columnwise(w)
    out = {"data": w.data, "scale_inv": w.scale_inv}
    if w.data_t is not None and w.scale_inv_t is not None:
        out.update(data_t=w.data_t, scale_inv_t=w.scale_inv_t)
    out["dec"] = nvfp4_global_decode(w.amax)
    return out
