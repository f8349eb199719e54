"""Format constants, layout arithmetic and the scale formulas of docs/numerics.md §1 and §2.

The scale formulas are written once here in jnp and used by every pure-JAX path; the C++/CUDA
side has the same formulas in ``csrc/jaxquant/numerics.h``. Both must agree bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.primitives.recipes import QUANTIZED_RECIPES, RECIPES  # noqa: F401  (formats.RECIPES)

FLT_MAX = np.float32(np.finfo(np.float32).max)
FLT_MIN = np.float32(np.finfo(np.float32).tiny)

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
# 6 * 448: the largest value an NVFP4 element times its E4M3 tile scale can represent.
NVFP4_GLOBAL_RANGE = np.float32(2688.0)
# The fp32 constant 1.0f/6.0f (0x3E2AAAAB) the tile-scale formula uses.
C6 = np.float32(1.0) / np.float32(6.0)

COMPUTE_DTYPE = jnp.dtype(jnp.bfloat16)   # compute weights, their gradients, unquantized GEMM operands

TILE = 16

FP8_DTYPES = {
    jnp.dtype(jnp.float8_e4m3fn): E4M3_MAX,
    jnp.dtype(jnp.float8_e5m2): E5M2_MAX,
}

# E2M1 code -> value, codes 0..15.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def fp8_max(dtype) -> float:
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise TypeError(
            f"dtype: must be float8_e4m3fn or float8_e5m2, got {dtype}"
        )
    return FP8_DTYPES[dtype]


def nvfp4_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded shape of the E4M3 scale array of a [rows, cols] NVFP4 tensor (docs/numerics.md §2.7)."""
    return round_up(rows, 128), round_up(cols // TILE, 4)


def check_nvfp4_shape(rows: int, cols: int, name: str = "shape") -> None:
    """Check that ``[rows, cols]`` is a valid NVFP4 2D-block-scaled shape: both positive multiples of 16.

    The one shape rule of every NVFP4 path (ops, group tables).

    Args:
      rows, cols: the tensor's shape M, K.
      name: what the error message names (default "shape").

    Raises:
      ValueError: naming ``name``, unless both are positive int multiples of 16.
    """
    for what, n in (("M (rows)", rows), ("K (cols)", cols)):
        if not isinstance(n, (int, np.integer)) or n <= 0 or n % TILE:
            raise ValueError(
                f"{name}: NVFP4 2D block scaling needs {what} to be a positive multiple of 16, "
                f"got {rows}x{cols}"
            )


def nvfp4_byte_range(start: int, length: int) -> tuple[int, int]:
    """Bytes [lo, hi) of the packed data that hold flat elements [start, start+length)."""
    return start // 2, (start + length + 1) // 2


# ----------------------------------------------------------------------------------------------
# Correctly rounded fp32 division
# ----------------------------------------------------------------------------------------------


def _mantissa_exponent(u):
    """uint32 bits of a positive finite non-zero float -> (24-bit mantissa, unbiased-ish exponent)."""
    e = (u >> 23).astype(jnp.int32)
    frac = u & jnp.uint32(0x7FFFFF)
    # Subnormal: shift the leading 1 up to bit 23.
    shift = jax.lax.clz(frac).astype(jnp.int32) - 8
    sub = e == 0
    mant = jnp.where(sub, frac << jnp.where(sub, shift, 0).astype(jnp.uint32), frac | jnp.uint32(0x800000))
    exp = jnp.where(sub, 1 - shift, e)
    return mant, exp


def div_rn(a, b):
    """a / b for finite non-zero fp32 a, b, rounded to nearest even, on every backend.

    XLA's GPU backend lowers fp32 division to an approximate instruction (up to 2 ulp off), while
    the contract (and the CUDA kernels, built with IEEE division) need the correctly rounded
    quotient. XLA:CPU divides exactly, so it keeps the native division; elsewhere the mantissas
    are divided in integer arithmetic (``_div_rn_integer``).
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return jax.lax.platform_dependent(a, b, cpu=jnp.divide, default=_div_rn_integer)


def _div_rn_integer(a, b):
    """Restoring division of the mantissas: 26 quotient bits and a sticky bit, then RNE into a
    normal or subnormal result (inf on overflow); the sign is the xor of the operands' signs."""
    ua = jax.lax.bitcast_convert_type(a, jnp.uint32)
    ub = jax.lax.bitcast_convert_type(b, jnp.uint32)
    sign = (ua ^ ub) & jnp.uint32(0x80000000)
    ma, ea = _mantissa_exponent(ua & jnp.uint32(0x7FFFFFFF))
    mb, eb = _mantissa_exponent(ub & jnp.uint32(0x7FFFFFFF))
    exp = ea - eb
    lower = ma < mb
    ma = jnp.where(lower, ma << 1, ma)
    exp = jnp.where(lower, exp - 1, exp)
    q = jnp.zeros_like(ma)
    r = ma
    for _ in range(26):  # q = floor(ma / mb * 2^25), leading 1 at bit 25
        ge = r >= mb
        q = (q << 1) | ge.astype(jnp.uint32)
        r = jnp.where(ge, r - mb, r) << 1
    sticky = r != 0
    biased = exp + 127
    # Normal result: 24 mantissa bits, guard bit, then bit 0 and the sticky bit.
    mant = q >> 2
    guard = (q >> 1) & 1
    up = (guard == 1) & (((q & 1) == 1) | sticky | ((mant & 1) == 1))
    mant = mant + up.astype(jnp.uint32)
    carry = mant >> 24
    mant = jnp.where(carry == 1, mant >> 1, mant)
    biased_n = biased + carry.astype(jnp.int32)
    normal_bits = jnp.where(biased_n >= 255, jnp.uint32(0x7F800000),
                            (jnp.clip(biased_n, 0, 254).astype(jnp.uint32) << 23) | (mant & jnp.uint32(0x7FFFFF)))
    # Subnormal result: count units of 2^-149, q * 2^(exp - 25 + 149) = q >> sh.
    sh = jnp.clip(-(exp + 124), 1, 31).astype(jnp.uint32)
    m = q >> sh
    rem = q & ((jnp.uint32(1) << sh) - 1)
    half = jnp.uint32(1) << (sh - 1)
    up_s = (rem > half) | ((rem == half) & (sticky | ((m & 1) == 1)))
    sub_bits = m + up_s.astype(jnp.uint32)
    bits = jnp.where(biased >= 1, normal_bits, sub_bits) | sign
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


# ----------------------------------------------------------------------------------------------
# Scale formulas (jnp, shared by every pure-JAX path)
# ----------------------------------------------------------------------------------------------


def to_compute_dtype(x: jax.Array, dtype) -> jax.Array:
    """``x`` converted to ``dtype`` (float32 or bfloat16) with RNE, rounding guaranteed.

    XLA's excess-precision rewrite (on by default on the GPU) may drop an f32 -> bf16 -> f32
    round trip inside a fusion, which would quantize the unrounded fp32 values; reduce_precision
    to bf16's 8 exponent and 7 mantissa bits is never dropped.
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(jnp.bfloat16) and jnp.dtype(x.dtype) == jnp.dtype(jnp.float32):
        x = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    return x.astype(dtype)


def abs_ignoring_nan(x: jax.Array) -> jax.Array:
    """|x| in fp32 with NaN replaced by 0, so a max over it ignores NaN (docs/numerics.md §1.1)."""
    x = x.astype(jnp.float32)
    return jnp.where(jnp.isnan(x), jnp.float32(0), jnp.abs(x))


def fp8_scale_from_amax(amax, fp8_max_value: float, amax_epsilon: float = 0.0,
                        force_pow_2_scales: bool = False):
    """docs/numerics.md §1 steps 2-5: returns (scale, scale_inv), fp32 scalars."""
    amax = jnp.asarray(amax, jnp.float32)
    a = jnp.fmax(amax, jnp.float32(amax_epsilon))
    degenerate = (a == 0) | jnp.isinf(a) | jnp.isnan(a)
    safe_a = jnp.where(degenerate, jnp.float32(1), a)
    scale = jnp.where(degenerate, jnp.float32(1), div_rn(jnp.float32(fp8_max_value), safe_a))
    scale = jnp.where(jnp.isposinf(scale), FLT_MAX, scale)
    if force_pow_2_scales:
        bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFF800000)
        scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return scale, div_rn(jnp.float32(1), scale)


def nvfp4_global_encode_scale(amax):
    """docs/numerics.md §2 step 2: S_enc from the global amax (fp32 scalar)."""
    amax = jnp.asarray(amax, jnp.float32)
    degenerate = (amax == 0) | ~jnp.isfinite(amax)
    safe = jnp.where(degenerate, jnp.float32(1), jnp.fmax(amax, FLT_MIN))
    s = jnp.minimum(div_rn(NVFP4_GLOBAL_RANGE, safe), FLT_MAX)
    return jnp.where(degenerate, jnp.float32(1), s)


def nvfp4_global_decode_scale(amax):
    """docs/numerics.md §2 step 3: S_dec = 1 / S_enc."""
    return div_rn(jnp.float32(1), nvfp4_global_encode_scale(amax))


def nvfp4_tile_scale(tile_amax, s_enc):
    """docs/numerics.md §2 step 4 before the E4M3 cast: fp32 tile decode scale."""
    return jnp.fmin(tile_amax * (s_enc * C6), FLT_MAX)  # fmin: a NaN operand is ignored


def nvfp4_tile_encode(s8_value, s_dec):
    """docs/numerics.md §2 step 5: per-tile encode multiplier from the stored E4M3 scale value."""
    denom = s8_value * s_dec
    zero = denom == 0  # s8 == 0, or the product underflowed: 1/0 = inf -> FLT_MAX either way
    safe = jnp.where(zero, jnp.float32(1), denom)
    return jnp.where(zero, FLT_MAX, jnp.minimum(div_rn(jnp.float32(1), safe), FLT_MAX))
