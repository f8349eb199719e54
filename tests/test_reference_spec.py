"""Independent check of the pure-JAX reference against docs/numerics.md §1 (FP8) and §2 (NVFP4).

The oracle below is written from docs/numerics.md in plain numpy + ml_dtypes; no jaxquant code is used to compute
expected values, jaxquant is only called (with impl="reference") to produce the results under test.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant
import jaxquant.primitives.formats
import jaxquant.primitives.ops
import jaxquant.primitives.reference
from conftest import (E2M1_TIES, assert_bytes_equal, assert_bytes_equal_nan_aware, fp8_cast_j, fp8_edge_inputs,
                      nvfp4_edge_inputs, q_fp8, q_nvfp4, random_tiled)

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
FLT_MIN = np.finfo(np.float32).tiny
C6 = F32(1.0) / F32(6.0)
GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
NP_FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, jnp.float8_e4m3fn, 448.0),
          "e5m2": (ml_dtypes.float8_e5m2, jnp.float8_e5m2, 57344.0)}



# Known library bug off the CPU (seen on an H200): XLA:GPU's xla_allow_excess_precision (on by default)
# elides the fp32 -> bf16 -> fp32 round trip of compute_dtype=bfloat16 inside the pure-JAX reference, so
# the reference quantizes the unrounded fp32 values. Strict: the marker must go once that is fixed.


# ----------------------------------------------------------------------------------------------
# The oracle (docs/numerics.md §1 and §2 in numpy; all arithmetic fp32 as numpy performs it, IEEE, RNE)
# ----------------------------------------------------------------------------------------------


def np_amax(x) -> np.float32:
    a = np.abs(np.asarray(x, np.float32)).reshape(-1)
    a = a[~np.isnan(a)]
    return F32(a.max()) if a.size else F32(0)


def np_fp8_scale(amax, fp8_max, eps=0.0, pow2=False):
    a = np.fmax(F32(amax), F32(eps))
    if a == 0 or not np.isfinite(a):
        scale = F32(1)
    else:
        with np.errstate(over="ignore"):
            scale = F32(fp8_max) / a
        if np.isposinf(scale):
            scale = FLT_MAX
    if pow2:
        scale = np.array([scale], np.float32).view(np.uint32) & np.uint32(0xFF800000)
        scale = scale.view(np.float32)[0]
    return F32(scale), F32(1) / F32(scale)


def np_to_fp8(v, np_dtype, fp8_max):
    """fp32 -> fp8, RNE, saturating (clip first, as ml_dtypes' cast alone does not saturate)."""
    v = np.asarray(v, np.float32)
    return np.clip(v, F32(-fp8_max), F32(fp8_max)).astype(np_dtype)


def np_fp8_quantize(x, fmt, eps=0.0, pow2=False, amax=None):
    np_dtype, _, fmax = NP_FP8[fmt]
    x = np.asarray(x, np.float32)
    amax = np_amax(x) if amax is None else F32(amax)
    scale, scale_inv = np_fp8_scale(amax, fmax, eps, pow2)
    with np.errstate(over="ignore", invalid="ignore"):
        data = np_to_fp8(x * scale, np_dtype, fmax)
    return data, scale_inv, amax


def np_e2m1_code(v) -> np.ndarray:
    """E2M1 code of each fp32 value: nearest grid value, ties to the even code, saturating at 6."""
    v = np.asarray(v, np.float32)
    a = np.abs(v).astype(np.float64)
    d = np.abs(a[..., None] - GRID)
    dmin = d.min(axis=-1, keepdims=True)
    codes = np.arange(8)
    # Among the nearest grid values prefer the even code (ties are always between neighbours).
    key = np.where(d == dmin, codes % 2, 2)
    code = np.argmin(key, axis=-1)
    code = np.where(a >= 6, 7, code).astype(np.uint8)
    return np.where(np.signbit(v), code | 8, code).astype(np.uint8)


def np_pack(codes) -> np.ndarray:
    codes = np.asarray(codes, np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def np_unpack(packed) -> np.ndarray:
    packed = np.asarray(packed, np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def ru(a, b):
    return -(-a // b) * b


def np_nvfp4_quantize(x):
    """docs/numerics.md §2 steps 1-7: returns dict of data, scale_inv, amax, data_t, scale_inv_t, s8 value."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    a = np.abs(x)
    a = np.where(np.isnan(a), F32(0), a)
    tile_amax = a.reshape(m // 16, 16, k // 16, 16).max(axis=(1, 3))
    amax = np_amax(x)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if amax == 0 or not np.isfinite(amax):
            s_enc = F32(1)
        else:
            s_enc = np.fmin(F32(2688) / np.fmax(amax, FLT_MIN), FLT_MAX)
        s_dec = F32(1) / s_enc
        s = np.fmin(tile_amax * (s_enc * C6), FLT_MAX)
        s8 = np_to_fp8(s, ml_dtypes.float8_e4m3fn, 448.0)
        s8v = s8.astype(np.float32)
        enc = np.where(s8v == 0, FLT_MAX, np.fmin(F32(1) / (s8v * s_dec), FLT_MAX)).astype(np.float32)
        scaled = x * np.repeat(np.repeat(enc, 16, 0), 16, 1)
    codes = np_e2m1_code(scaled)
    s8_bits = s8.view(np.uint8)
    scale_inv = np.zeros((ru(m, 128), ru(k // 16, 4)), np.uint8)
    scale_inv[:m, : k // 16] = np.repeat(s8_bits, 16, 0)
    scale_inv_t = np.zeros((ru(k, 128), ru(m // 16, 4)), np.uint8)
    scale_inv_t[:k, : m // 16] = np.repeat(s8_bits.T, 16, 0)
    return dict(data=np_pack(codes), scale_inv=scale_inv, amax=np.array([amax], np.float32),
                data_t=np_pack(codes.T), scale_inv_t=scale_inv_t, codes=codes, s8=s8v)


E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def np_nvfp4_dequantize(data, scale_inv, amax, shape):
    m, k = shape
    vals = E2M1_VALUES[np_unpack(data)]
    s8 = np.asarray(scale_inv, np.uint8)[0:m:16, : k // 16].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s8 = np.repeat(np.repeat(s8, 16, 0), 16, 1)
    g = F32(np.asarray(amax, np.float32).reshape(())) * (F32(1) / F32(2688))
    return (vals * s8) * g


def bf16_round(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def check_nvfp4(t, exp, columnwise, what=""):
    assert_bytes_equal(t.data, exp["data"], what + " data")
    assert_bytes_equal(t.scale_inv, exp["scale_inv"], what + " scale_inv")
    assert_bytes_equal(t.amax, exp["amax"], what + " amax")
    if columnwise:
        assert_bytes_equal(t.data_t, exp["data_t"], what + " data_t")
        assert_bytes_equal(t.scale_inv_t, exp["scale_inv_t"], what + " scale_inv_t")
    else:
        assert t.data_t is None and t.scale_inv_t is None


# ----------------------------------------------------------------------------------------------
# Self-checks of the oracle against docs/numerics.md tables (so a wrong oracle cannot mask a wrong reference)
# ----------------------------------------------------------------------------------------------


def test_oracle_e2m1_tie_table():
    ties = np.array(list(E2M1_TIES), np.float32)
    expected = np.array(list(E2M1_TIES.values()), np.uint8)
    np.testing.assert_array_equal(np_e2m1_code(ties), expected)
    np.testing.assert_array_equal(np_e2m1_code(-ties), expected | 8)
    assert F32(1) / F32(6) == np.array([0x3E2AAAAB], np.uint32).view(np.float32)[0]


# ----------------------------------------------------------------------------------------------
# E2M1 conversion and packing of the reference (docs/numerics.md §2 header, §2.6)
# ----------------------------------------------------------------------------------------------


def test_e2m1_tie_table():
    ties = jnp.asarray(np.array(list(E2M1_TIES), np.float32))
    expected = np.array(list(E2M1_TIES.values()), np.uint8)
    np.testing.assert_array_equal(np.asarray(jaxquant.primitives.reference.fp32_to_e2m1_code(ties)), expected)
    np.testing.assert_array_equal(np.asarray(jaxquant.primitives.reference.fp32_to_e2m1_code(-ties)), expected | 8)


def test_e2m1_all_16_code_values():
    spec = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    spec = np.concatenate([spec, -spec])
    got = np.asarray(jaxquant.primitives.reference.e2m1_code_to_fp32(jnp.arange(16, dtype=jnp.uint8)))
    assert_bytes_equal(got, spec, "code values")  # code 8 is -0.0 (sign bit set)
    assert np.signbit(got[8]) and not np.signbit(got[0])
    np.testing.assert_array_equal(jaxquant.primitives.formats.E2M1_VALUES.view(np.uint32), spec.view(np.uint32))
    # Each grid value encodes to its own code and back.
    codes = np.asarray(jaxquant.primitives.reference.fp32_to_e2m1_code(jnp.asarray(spec)))
    np.testing.assert_array_equal(codes, np.arange(16, dtype=np.uint8))


def test_e2m1_negative_zero_and_sign_of_values_rounding_to_zero():
    v = jnp.asarray(np.array([-0.0, 0.0, -0.1, 0.1, -0.25, 0.25, -1e-30], np.float32))
    got = np.asarray(jaxquant.primitives.reference.fp32_to_e2m1_code(v))
    np.testing.assert_array_equal(got, np.array([8, 0, 8, 0, 8, 0, 8], np.uint8))


def test_e2m1_saturation_and_random_values(rng):
    v = np.concatenate([
        np.array([6, 6.5, 7, 100, 3e38, np.inf, -6, -6.5, -1e10, -np.inf], np.float32),
        rng.uniform(-8, 8, size=4000).astype(np.float32),
        (rng.integers(-24, 25, size=400) / np.float32(4)).astype(np.float32),  # quarters: many ties
    ])
    got = np.asarray(jaxquant.primitives.reference.fp32_to_e2m1_code(jnp.asarray(v)))
    np.testing.assert_array_equal(got, np_e2m1_code(v))
    np.testing.assert_array_equal(got[:6], 7)
    np.testing.assert_array_equal(got[6:10], 15)


def test_packing_order_low_nibble_is_even_element():
    x = np.zeros((16, 16), np.float32)
    x[0, 0], x[0, 1] = 0.5, -6.0  # codes 1 and 15 -> byte 0xF1
    x[0, 2], x[0, 3] = 6.0, 0.0   # codes 7 and 0 -> byte 0x07
    x[1, 14], x[1, 15] = -0.0, 1.0  # codes 8 and 2 -> byte 0x28
    # amax 6 -> S_enc 448, s8 = 448, enc = 1/(448 * (1/448)) ~ 1: the codes are those of the grid values.
    t = q_nvfp4(jnp.asarray(x), impl="reference")
    data = np.asarray(t.data)
    assert data[0, 0] == 0xF1 and data[0, 1] == 0x07 and data[1, 7] == 0x28
    # pack/unpack helpers of the reference agree with the numpy packing
    codes = rng_codes = np.random.default_rng(1).integers(0, 16, size=(4, 10)).astype(np.uint8)
    assert_bytes_equal(jaxquant.primitives.reference.pack_codes(jnp.asarray(codes)), np_pack(codes), "pack")
    assert_bytes_equal(jaxquant.primitives.reference.unpack_codes(jnp.asarray(np_pack(rng_codes))), codes, "unpack")


# ----------------------------------------------------------------------------------------------
# NVFP4 end to end (docs/numerics.md §2)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(16, 16), (48, 80), (144, 48)])
def test_nvfp4_random_matches_spec(rng, shape):
    x = random_tiled(rng, *shape)
    t = q_nvfp4(jnp.asarray(x), columnwise=True, compute_dtype=None, impl="reference")
    exp = np_nvfp4_quantize(x)
    check_nvfp4(t, exp, True)
    # the random inputs really do exercise zero, subnormal, normal and saturated tile scales
    if shape == (144, 48):
        s8 = exp["s8"]
        assert (s8 == 0).any() and ((s8 > 0) & (s8 < 2.0 ** -6)).any() and (s8 == 448).any()


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_nvfp4_compute_dtype_bf16_matches_spec(rng, input_dtype):
    x = rng.standard_normal((48, 80)).astype(np.float32)
    xin = jnp.asarray(x).astype(input_dtype)
    t = q_nvfp4(xin, columnwise=True, compute_dtype=jnp.bfloat16, impl="reference")
    check_nvfp4(t, np_nvfp4_quantize(bf16_round(x)), True)
    # a bf16 input with compute_dtype=None is quantized from its (exact) fp32 values
    if input_dtype == "bfloat16":
        t2 = q_nvfp4(xin, compute_dtype=None, impl="reference")
        check_nvfp4(t2, np_nvfp4_quantize(bf16_round(x)), False)


def test_nvfp4_edge_cases_match_spec(rng):
    for name, x in nvfp4_edge_inputs(rng).items():
        t = q_nvfp4(jnp.asarray(x), columnwise=True, compute_dtype=None, impl="reference")
        check_nvfp4(t, np_nvfp4_quantize(x), True, name)


def test_nvfp4_rowwise_only_matches_spec(rng):
    x = nvfp4_edge_inputs(rng)["grid_ties"]
    t = q_nvfp4(jnp.asarray(x), columnwise=False, compute_dtype=None, impl="reference")
    check_nvfp4(t, np_nvfp4_quantize(x), False)


def test_nvfp4_grid_case_hits_exact_ties(rng):
    """The constructed tile really has s8 = 1 and enc = 1, so its elements are exact ties."""
    x = nvfp4_edge_inputs(rng)["grid_ties"]
    t = q_nvfp4(jnp.asarray(x), compute_dtype=None, impl="reference")
    assert float(t.amax[0]) == 2688.0
    s8 = np.asarray(t.scale_inv)[0:32:16, :3].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert s8[0, 1] == 1.0 and s8[0, 2] == 1.125 and s8[1, 0] == 0 and s8[1, 1] == 0 and s8[1, 2] == 0
    codes = np_unpack(np.asarray(t.data))[:16, 16:32].reshape(-1)
    for i, (v, c) in enumerate(E2M1_TIES.items()):
        assert codes[6 * i] == c and codes[6 * i + 1] == c | 8, v
    # saturating tile: 7 * enc = 7 / 1.125 > 6 -> code 7 / 15
    sat = np_unpack(np.asarray(t.data))[0, 32:36]
    np.testing.assert_array_equal(sat, [7, 15, 7, 15])
    # the all -0.0 tile keeps the sign: every code is 8
    np.testing.assert_array_equal(np_unpack(np.asarray(t.data))[16:, 16:32], 8)
    np.testing.assert_array_equal(np_unpack(np.asarray(t.data))[16:, :16], 0)


def test_nvfp4_nan_input_amax_and_scales_ignore_nan(rng):
    """NaN elements are ignored by amax and tile amax (§2.1); their codes are outside the contract."""
    x = random_tiled(rng, 32, 48, -2, 2)
    x[0, 0] = x[17, 20] = np.nan
    x[31, 47] = -np.nan
    nan_mask = np.isnan(x)
    t = q_nvfp4(jnp.asarray(x), compute_dtype=None, impl="reference")
    exp = np_nvfp4_quantize(x)
    assert_bytes_equal(t.amax, exp["amax"], "amax")
    assert np.isfinite(exp["amax"]).all()
    assert_bytes_equal(t.scale_inv, exp["scale_inv"], "scale_inv")
    got_codes = np_unpack(np.asarray(t.data))
    np.testing.assert_array_equal(got_codes[~nan_mask], exp["codes"][~nan_mask])


def test_nvfp4_all_nan_gives_zero_amax():
    x = jnp.full((32, 48), jnp.nan, jnp.float32)
    t = q_nvfp4(x, columnwise=True, compute_dtype=None, impl="reference")
    assert_bytes_equal(t.amax, np.zeros(1, np.float32), "amax")
    assert_bytes_equal(t.scale_inv, np.zeros((128, 4), np.uint8), "scale_inv")


def test_nvfp4_layout_shapes_and_padding(rng):
    x = random_tiled(rng, 144, 48, -1, 1)
    t = q_nvfp4(jnp.asarray(x), columnwise=True, compute_dtype=None, impl="reference")
    assert t.data.shape == (144, 24) and t.data.dtype == jnp.uint8
    assert t.scale_inv.shape == (256, 4) and t.scale_inv_t.shape == (128, 12)
    assert t.data_t.shape == (48, 72) and t.amax.shape == (1,) and t.amax.dtype == jnp.float32
    s, st = np.asarray(t.scale_inv), np.asarray(t.scale_inv_t)
    assert not s[144:].any() and not s[:, 3:].any() and not st[48:].any() and not st[:, 9:].any()
    assert s[:144, :3].all()  # amax within a decade: no tile scale is 0
    for r in range(144):
        np.testing.assert_array_equal(s[r, :3], s[(r // 16) * 16, :3])
    for k in range(48):
        np.testing.assert_array_equal(st[k, :9], s[0:144:16, k // 16])


def test_nvfp4_dequantize_formula(rng):
    x = random_tiled(rng, 48, 80, -3, 3)
    t = q_nvfp4(jnp.asarray(x), columnwise=True, compute_dtype=None, impl="reference")
    exp = np_nvfp4_dequantize(np.asarray(t.data), np.asarray(t.scale_inv), np.asarray(t.amax), (48, 80))
    assert_bytes_equal(t.dequantize(), exp, "dequantize")
    assert_bytes_equal(t.dequantize_t(), exp.T, "dequantize_t")
    assert t.dequantize(jnp.bfloat16).dtype == jnp.bfloat16
    # sanity: dequantized values are close to the input (E2M1 has 1 mantissa bit)
    rel = np.abs(exp - x) / np.maximum(np.abs(x), 1e-30)
    assert np.median(rel) < 0.2


# ----------------------------------------------------------------------------------------------
# FP8 (docs/numerics.md §1)
# ----------------------------------------------------------------------------------------------


def check_fp8(t, x, fmt, eps=0.0, pow2=False, columnwise=False, what=""):
    data, scale_inv, amax = np_fp8_quantize(x, fmt, eps, pow2)
    assert t.data.dtype == NP_FP8[fmt][1]
    assert_bytes_equal_nan_aware(t.data, data, what + " data")
    assert_bytes_equal(t.scale_inv, scale_inv, what + " scale_inv")
    assert_bytes_equal(t.amax, amax, what + " amax")
    if columnwise:
        assert_bytes_equal_nan_aware(t.data_t, data.T, what + " data_t")
    else:
        assert t.data_t is None


@pytest.mark.parametrize("fmt,pow2,eps", [("e4m3", False, 0.0), ("e4m3", True, 0.0), ("e4m3", False, 1e4),
                                          ("e5m2", False, 0.0), ("e5m2", True, 1e-3)])
def test_fp8_edge_cases_match_spec(rng, fmt, pow2, eps):
    for name, x in fp8_edge_inputs(rng).items():
        t = q_fp8(jnp.asarray(x), dtype=NP_FP8[fmt][1], amax_epsilon=eps, force_pow_2_scales=pow2,
                  columnwise=True, compute_dtype=None, impl="reference")
        check_fp8(t, x, fmt, eps, pow2, columnwise=True, what=name)


def test_fp8_rowwise_only_has_no_data_t(rng):
    x = fp8_edge_inputs(rng)["normal"]
    t = q_fp8(jnp.asarray(x), compute_dtype=None, impl="reference")
    check_fp8(t, x, "e4m3", columnwise=False)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_compute_dtype_bf16_matches_spec(rng, fmt):
    x = rng.standard_normal((32, 48)).astype(np.float32)
    t = q_fp8(jnp.asarray(x), dtype=NP_FP8[fmt][1], compute_dtype=jnp.bfloat16,
                              impl="reference")
    check_fp8(t, bf16_round(x), fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_saturation(fmt):
    np_dtype, jdtype, fmax = NP_FP8[fmt]
    x = np.array([fmax, -fmax, fmax * 1.01, -fmax * 1.01, 1e30, -1e30, np.inf, -np.inf, np.nan, 1.0],
                 np.float32)
    # amax = 1 -> scale = fmax: everything beyond 1 saturates
    data, scale_inv, _ = fp8_cast_j(jnp.asarray(x), jnp.float32(1.0), dtype=jdtype,
                                               impl="reference")
    assert float(scale_inv) == np.float32(1) / np.float32(fmax)
    got = np.asarray(data).astype(np.float32)
    np.testing.assert_array_equal(got[:8], [fmax, -fmax] * 4)
    assert np.isnan(got[8]) and got[9] == fmax
    exp, _, _ = np_fp8_quantize(x, fmt, amax=1.0)
    assert_bytes_equal_nan_aware(data, exp, "saturated data")
    # with the tensor's own amax (inf -> scale 1), finite values beyond max and ±inf become ±max
    t = q_fp8(jnp.asarray(x.reshape(2, 5)), dtype=jdtype, impl="reference")
    assert float(t.scale_inv) == 1.0 and float(t.amax) == np.inf
    got = np.asarray(t.data).astype(np.float32).reshape(-1)
    np.testing.assert_array_equal(got[[0, 1, 2, 3, 4, 5, 6, 7, 9]],
                                  [fmax, -fmax, fmax, -fmax, fmax, -fmax, fmax, -fmax, 1.0])
    assert np.isnan(got[8])


def test_fp8_force_pow_2_scales():
    x = jnp.asarray(np.array([[3.0, -1.0]], np.float32))  # scale = 448/3 = 149.33 -> 128
    t = q_fp8(x, force_pow_2_scales=True, impl="reference")
    assert float(t.scale_inv) == 1 / 128
    t = q_fp8(x, force_pow_2_scales=False, impl="reference")
    assert float(t.scale_inv) == np.float32(1) / (np.float32(448) / np.float32(3))
    # e5m2: 57344/3 = 19114.67 -> 16384
    t = q_fp8(x, dtype=jnp.float8_e5m2, force_pow_2_scales=True, impl="reference")
    assert float(t.scale_inv) == 1 / 16384


def test_fp8_amax_epsilon():
    x = jnp.asarray(np.array([[1e-3, -5e-4]], np.float32))
    t = q_fp8(x, amax_epsilon=0.5, impl="reference")  # a = fmax(1e-3, 0.5) = 0.5
    assert float(t.scale_inv) == np.float32(1) / (np.float32(448) / np.float32(0.5))
    assert float(t.amax) == np.float32(1e-3)  # amax itself is not changed by epsilon
    t = q_fp8(x, amax_epsilon=1e-4, impl="reference")  # epsilon below amax: no effect
    assert float(t.scale_inv) == np.float32(1) / (np.float32(448) / np.float32(1e-3))
    z = jnp.zeros((2, 2), jnp.float32)  # amax 0: epsilon gives a real scale instead of 1
    t = q_fp8(z, amax_epsilon=2.0, impl="reference")
    assert float(t.scale_inv) == np.float32(1) / np.float32(224)
    t = q_fp8(z, impl="reference")
    assert float(t.scale_inv) == 1.0


def test_fp8_amax_ignores_nan_and_degenerate_scales():
    x = np.array([[np.nan, 2.0, -3.0, np.nan]], np.float32)
    t = q_fp8(jnp.asarray(x), impl="reference")
    assert float(t.amax) == 3.0
    assert float(t.scale_inv) == np.float32(1) / (np.float32(448) / np.float32(3))
    # all-NaN: amax 0, scale 1
    t = q_fp8(jnp.full((4, 4), jnp.nan), impl="reference")
    assert float(t.amax) == 0.0 and float(t.scale_inv) == 1.0
    assert np.isnan(np.asarray(t.data).astype(np.float32)).all()
    # empty: amax 0, scale 1
    t = q_fp8(jnp.zeros((0, 16), jnp.float32), impl="reference")
    assert float(t.amax) == 0.0 and float(t.scale_inv) == 1.0 and t.data.shape == (0, 16)
    assert float(jaxquant.primitives.ops.amax(jnp.zeros((0,), jnp.float32), impl="reference")) == 0.0
    # inf amax -> scale 1
    t = q_fp8(jnp.asarray(np.array([[np.inf, 1.0]], np.float32)), impl="reference")
    assert float(t.amax) == np.inf and float(t.scale_inv) == 1.0
    # amax value NaN passed to the cast directly: fmax(NaN, 0) = 0 -> scale 1
    _, si, _ = fp8_cast_j(jnp.ones((2, 2)), jnp.float32(np.nan), impl="reference")
    assert float(si) == 1.0


def test_fp8_scale_overflow_clamps_to_flt_max():
    """448 / 1e-37 overflows to +inf -> scale FLT_MAX (docs/numerics.md §1.3); data = fp8(x * FLT_MAX)."""
    x = np.full((2, 2), 1e-37, np.float32)
    data, _, _ = fp8_cast_j(jnp.asarray(x), jnp.float32(1e-37), impl="reference")
    exp, _, _ = np_fp8_quantize(x, "e4m3")
    assert_bytes_equal(data, exp, "data")  # 1e-37 * FLT_MAX = 34.03 -> 32 or 36


def test_fp8_dequantize_formula(rng):
    x = rng.standard_normal((16, 32)).astype(np.float32)
    for fmt in ("e4m3", "e5m2"):
        t = q_fp8(jnp.asarray(x), dtype=NP_FP8[fmt][1], impl="reference")
        exp = np.asarray(t.data).astype(np.float32) * np.float32(np.asarray(t.scale_inv))
        assert_bytes_equal(t.dequantize(), exp, fmt + " dequantize")
        np.testing.assert_allclose(exp, x, rtol=0.07 if fmt == "e4m3" else 0.13, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Subnormals (docs/decisions.md, "Subnormals"): XLA:CPU runs with FTZ/DAZ, so the reference on the CPU may flush
# them; the C++/CUDA handlers must follow IEEE and are checked against the oracle here.
# ----------------------------------------------------------------------------------------------


def _subnormal_cases():
    fp8_tiny = np.full((16, 16), 1e-37, np.float32)       # 448/amax overflows: scale_inv = 1/FLT_MAX
    fp8_sub = np.full((16, 16), 1e-39, np.float32)        # subnormal input, amax subnormal
    fp8_sub[0, :4] = [-1e-39, 5e-40, -0.0, 1e-44]
    nv_tiny = np.full((16, 32), 1e-37, np.float32)        # S_enc = FLT_MAX, S_dec = 1/FLT_MAX
    nv_tiny[0, 0], nv_tiny[3, 20] = 2e-37, -3e-37
    nv_sub = np.ones((16, 32), np.float32)                # a tile of subnormals next to a normal tile
    nv_sub[:, 16:] = 1e-39
    nv_sub[0, 16:20] = [-1e-39, 2e-39, -0.0, 1e-44]
    return {"fp8_tiny_amax": ("fp8", fp8_tiny), "fp8_subnormal_input": ("fp8", fp8_sub),
            "nvfp4_tiny_amax": ("nvfp4", nv_tiny), "nvfp4_subnormal_tile": ("nvfp4", nv_sub)}


def _check_against_oracle(kind, x, impl):
    if kind == "fp8":
        t = q_fp8(jnp.asarray(x), columnwise=True, compute_dtype=None, impl=impl)
        check_fp8(t, x, "e4m3", columnwise=True)
    else:
        t = q_nvfp4(jnp.asarray(x), columnwise=True, compute_dtype=None, impl=impl)
        check_nvfp4(t, np_nvfp4_quantize(x), True)


def test_subnormal_oracle_is_ieee():
    """The oracle itself keeps subnormals (so the cases below do test something)."""
    cases = _subnormal_cases()
    _, scale_inv, _ = np_fp8_quantize(cases["fp8_tiny_amax"][1], "e4m3")
    assert scale_inv == np.float32(2.938736e-39) and scale_inv < FLT_MIN
    data, _, amax = np_fp8_quantize(cases["fp8_subnormal_input"][1], "e4m3")
    assert amax == np.float32(1e-39) and (data.astype(np.float32) != 0).any()
    exp = np_nvfp4_quantize(cases["nvfp4_subnormal_tile"][1])
    assert (exp["codes"][:, 16:] % 8 != 0).any()  # 1e-39 * FLT_MAX = 0.34 -> code 1, not 0


@pytest.mark.parametrize("name", sorted(_subnormal_cases()))
def test_subnormal_cases_custom_call_match_ieee_oracle(name):
    kind, x = _subnormal_cases()[name]
    _check_against_oracle(kind, x, "custom_call")


@pytest.mark.parametrize("name", sorted(_subnormal_cases()))
@pytest.mark.skipif(jax.default_backend() == "cpu",
                    reason="docs/decisions.md #8: the reference on XLA:CPU flushes subnormals (FTZ/DAZ)")
def test_subnormal_cases_reference_match_ieee_oracle_off_cpu(name):
    kind, x = _subnormal_cases()[name]
    _check_against_oracle(kind, x, "reference")


# ----------------------------------------------------------------------------------------------
# Compute dtype default (docs/numerics.md §2, "Compute dtype": defaults to bfloat16)
# ----------------------------------------------------------------------------------------------


def test_compute_dtype_defaults_to_bfloat16(rng):
    """Eager calls (the cast is its own XLA program, so no excess-precision elision can hide it)."""
    x = rng.standard_normal((16, 32)).astype(np.float32)
    t = jaxquant.quantize_nvfp4(jnp.asarray(x), impl="reference")  # library default compute_dtype
    check_nvfp4(t, np_nvfp4_quantize(bf16_round(x)), False, "nvfp4 default")
    t = jaxquant.quantize_fp8(jnp.asarray(x), impl="reference")
    check_fp8(t, bf16_round(x), "e4m3", what="fp8 default")
