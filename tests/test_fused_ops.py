"""The fused single-tensor stages (ops.fp8_stats / fp8_quantize / nvfp4_stats / nvfp4_quantize).

Each stage is one custom call that reads x once with the compute-dtype rounding fused in; the
reference is the composition of the pure-JAX primitives (the executable spec). Custom call ==
reference bit for bit on random inputs and edge cases. The file runs unchanged on a GPU backend,
where "custom_call" is the CUDA kernel.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.primitives._ffi
from jaxquant.primitives import ops
from conftest import (E2M1_TIES, assert_bytes_equal, assert_bytes_equal_nan_aware, fp8_edge_inputs,
                      nvfp4_edge_inputs, random_tiled)

FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
IMPLS = ("reference", "custom_call")
COMPUTE = {"none": None, "bf16": jnp.bfloat16}

fp8_stats_j = jax.jit(ops.fp8_stats, static_argnames=("compute_dtype", "impl"))
fp8_quantize_j = jax.jit(ops.fp8_quantize, static_argnames=(
    "dtype", "compute_dtype", "amax_epsilon", "force_pow_2_scales", "columnwise", "impl"))
nvfp4_stats_j = jax.jit(ops.nvfp4_stats, static_argnames=("compute_dtype", "impl"))
nvfp4_quantize_j = jax.jit(ops.nvfp4_quantize, static_argnames=("compute_dtype", "columnwise", "impl"))


def bf16_rounding_cases(shape) -> np.ndarray:
    """fp32 values that stress the fused fp32 -> bf16 rounding: exact ties (both parities), values
    one ulp either side, overflow to inf (FLT_MAX), subnormals, signed zeros."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    bits = x.reshape(-1).view(np.uint32)
    n = bits.size
    bits[0: n: 5] = (bits[0: n: 5] & 0xFFFF0000) | 0x8000                 # tie, round to even
    bits[1: n: 5] = (bits[1: n: 5] & 0xFFFE0000) | 0x18000                # tie, odd -> up
    bits[2: n: 5] = (bits[2: n: 5] & 0xFFFF0000) | 0x7FFF                 # just below a tie
    flat = bits.view(np.float32)
    specials = np.array([3.4028235e38, -3.4028235e38, 3.39e38, 1e-40, -1e-40, 1.5e-45, 0.0, -0.0,
                         np.float32(np.nextafter(np.float32(1.0), np.float32(2.0)))], np.float32)
    flat[3: 3 + len(specials)] = specials[: max(0, min(len(specials), n - 3))]
    return flat.reshape(shape)


def _fp8_inputs(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(3)
    return {"random": x, "bf16_ties": bf16_rounding_cases(shape),
            "zeros": np.where(rng.random(shape) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)}


def _as_input(x, dtype):
    return jnp.asarray(x).astype(dtype)


# ----------------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("compute", list(COMPUTE))
@pytest.mark.parametrize("shape", [(48, 80), (65, 63), (3, 5, 7)])
def test_fp8_stats_custom_equals_reference(rng, in_dtype, compute, shape):
    """amax and the non-finite count, any rank, after the fused compute-dtype rounding."""
    inputs = _fp8_inputs(rng, shape)
    if len(shape) == 2 and shape[0] >= 48:
        inputs.update({k: v for k, v in fp8_edge_inputs(rng).items() if v.shape == shape})
    for name, x in inputs.items():
        v = _as_input(x, in_dtype)
        ref = fp8_stats_j(v, compute_dtype=COMPUTE[compute], impl="reference")
        cus = fp8_stats_j(v, compute_dtype=COMPUTE[compute], impl="custom_call")
        assert_bytes_equal(cus[0], ref[0], f"{name} amax")
        assert_bytes_equal(cus[1], ref[1], f"{name} count")


@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_fp8_stats_large_tensor_every_position(rng, in_dtype):
    """A tensor large enough that every block of the GPU pass reads several rounds (2^24 + 2^20 + 7
    elements: a partial last round and a scalar tail): the largest value at the first element, the
    last element of the vectors, the scalar tail and random places is found, and NaN anywhere is
    counted."""
    n = 2**24 + 2**20 + 7
    base = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    vec = 16 // jnp.dtype(in_dtype).itemsize   # elements in the pass's 16-byte vectors
    nvec_end = n - n % vec
    for where in (0, nvec_end - 1, n - 1, *rng.integers(0, n, 3).tolist()):
        x = base.copy()
        x[where] = -3.5
        nan_at = rng.integers(0, n, 5)
        nan_at = nan_at[nan_at != where]
        x[nan_at] = np.nan
        v = jnp.asarray(x).astype(in_dtype)
        ref = fp8_stats_j(v, compute_dtype=jnp.bfloat16, impl="reference")
        cus = fp8_stats_j(v, compute_dtype=jnp.bfloat16, impl="custom_call")
        assert float(ref[0]) == 3.5 and int(ref[1]) == len(set(nan_at.tolist())), where
        assert_bytes_equal(cus[0], ref[0], f"amax, max at {where}")
        assert_bytes_equal(cus[1], ref[1], f"count, max at {where}")


def test_fp8_stats_bf16_overflow_counts_as_nonfinite():
    """FLT_MAX rounds to inf in bf16: with the bf16 compute dtype it is non-finite and amax is inf."""
    x = jnp.asarray(np.array([[1.0, 3.4028235e38]], np.float32))
    for impl in IMPLS:
        a, n = fp8_stats_j(x, compute_dtype=jnp.bfloat16, impl=impl)
        assert np.isinf(float(a)) and int(n) == 1, impl
        a, n = fp8_stats_j(x, compute_dtype=None, impl=impl)
        assert float(a) == np.float32(3.4028235e38) and int(n) == 0, impl


# (format, input dtype, compute dtype, shape): every option appears, shapes on and off the 4- and
# 64-element vector/tile grids.
FP8_CASES = [("e4m3", jnp.float32, "bf16", (48, 80)), ("e4m3", jnp.float32, "none", (48, 80)),
             ("e5m2", jnp.float32, "bf16", (48, 80)), ("e4m3", jnp.bfloat16, "none", (48, 80)),
             ("e5m2", jnp.bfloat16, "bf16", (64, 64)), ("e4m3", jnp.float32, "bf16", (65, 63)),
             ("e4m3", jnp.bfloat16, "none", (1, 1)), ("e5m2", jnp.float32, "none", (130, 36))]


def _case_id(case) -> str:
    """e.g. "e4m3-float32-bf16-48x80" (the sanitizer run in scripts/gpu_suite.sh selects by shape)."""
    return "-".join(c if isinstance(c, str) else "x".join(map(str, c)) if isinstance(c, tuple)
                    else jnp.dtype(c).name for c in case)


@pytest.mark.parametrize("fmt,in_dtype,compute,shape", FP8_CASES, ids=[_case_id(c) for c in FP8_CASES])
def test_fp8_quantize_custom_equals_reference(rng, fmt, in_dtype, compute, shape):
    """data, scale_inv and data_t (one pass), shapes on and off the 4/64-element vector grid."""
    inputs = _fp8_inputs(rng, shape)
    if shape == (48, 80):
        inputs.update(fp8_edge_inputs(rng))
    for name, x in inputs.items():
        v = _as_input(x, in_dtype)
        amax, _ = fp8_stats_j(v, compute_dtype=COMPUTE[compute], impl="reference")
        for columnwise in (False, True):
            kw = dict(dtype=FP8[fmt], compute_dtype=COMPUTE[compute], columnwise=columnwise)
            ref = fp8_quantize_j(v, amax, impl="reference", **kw)
            cus = fp8_quantize_j(v, amax, impl="custom_call", **kw)
            what = f"{fmt} {name} columnwise={columnwise}"
            assert_bytes_equal_nan_aware(cus[0], ref[0], f"{what} data")
            assert_bytes_equal(cus[1], ref[1], f"{what} scale_inv")
            assert (cus[2] is None) == (not columnwise)
            if columnwise:
                assert_bytes_equal_nan_aware(cus[2], ref[2], f"{what} data_t")
                assert_bytes_equal(np.asarray(cus[2]), np.asarray(cus[0]).T, f"{what} data_t is the transpose")


def test_fp8_quantize_scale_edges(rng):
    """Scales from amax 0 / tiny / inf / NaN / huge, with epsilon and power-of-2 scales."""
    x = jnp.asarray(rng.standard_normal((48, 80)).astype(np.float32))
    for amax, pow2, eps in ((0.0, False, 0.0), (1e-30, True, 0.0), (np.inf, False, 0.0), (np.nan, False, 0.0),
                            (3e38, True, 0.0), (1e-30, False, 1e-3)):
        kw = dict(dtype=jnp.float8_e4m3fn, compute_dtype=jnp.bfloat16, amax_epsilon=eps, force_pow_2_scales=pow2,
                  columnwise=True)
        ref = fp8_quantize_j(x, jnp.float32(amax), impl="reference", **kw)
        cus = fp8_quantize_j(x, jnp.float32(amax), impl="custom_call", **kw)
        for i, field in enumerate(("data", "scale_inv", "data_t")):
            assert_bytes_equal_nan_aware(cus[i], ref[i], f"amax={amax} pow2={pow2} eps={eps} {field}")


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------

# (input dtype, compute dtype, shape): shapes on and just off the 64/128 grids (K = 48, 80 and
# 1040 are not multiples of 64); the [32, 48] edge inputs run with every dtype combination.
NVFP4_CASES = [(jnp.float32, "bf16", (32, 48)), (jnp.float32, "none", (32, 48)), (jnp.bfloat16, "none", (32, 48)),
               (jnp.bfloat16, "bf16", (32, 48)), (jnp.float32, "bf16", (16, 16)), (jnp.float32, "none", (128, 128)),
               (jnp.bfloat16, "none", (144, 80)), (jnp.float32, "bf16", (16, 1040)), (jnp.float32, "bf16", (272, 64)),
               (jnp.bfloat16, "bf16", (768, 528))]  # 12 block items, 48 tile rows (scale_inv_t rows of 48 bytes)


def _nvfp4_inputs(rng, shape):
    rows, cols = shape
    out = {"random": random_tiled(rng, rows, cols), "bf16_ties": bf16_rounding_cases(shape),
           "zeros": np.zeros(shape, np.float32)}
    if shape == (32, 48):
        out.update(nvfp4_edge_inputs(rng))
    return out


@pytest.mark.parametrize("in_dtype,compute,shape", NVFP4_CASES, ids=[_case_id(c) for c in NVFP4_CASES])
@pytest.mark.fast_cases("float32-bf16-32x48", "bfloat16-none-144x80", "float32-bf16-16x1040")  # others: slow
def test_nvfp4_stages_custom_equal_reference(rng, in_dtype, compute, shape):
    """stats (tile amax, amax, count) and quantize (data, scale_inv, data_t, scale_inv_t)."""
    cd = COMPUTE[compute]
    for name, x in _nvfp4_inputs(rng, shape).items():
        v = _as_input(x, in_dtype)
        ref_stats = nvfp4_stats_j(v, compute_dtype=cd, impl="reference")
        cus_stats = nvfp4_stats_j(v, compute_dtype=cd, impl="custom_call")
        for field, a, b in zip(("tile_amax", "amax", "count"), cus_stats, ref_stats):
            assert_bytes_equal(a, b, f"{name} {field}")
        tiles, amax, _ = ref_stats
        for columnwise in (False, True):
            ref = nvfp4_quantize_j(v, tiles, amax, compute_dtype=cd, columnwise=columnwise, impl="reference")
            cus = nvfp4_quantize_j(v, tiles, amax, compute_dtype=cd, columnwise=columnwise, impl="custom_call")
            for field, a, b in zip(("data", "scale_inv", "data_t", "scale_inv_t"), cus, ref):
                assert (a is None) == (b is None) == (not columnwise and field.endswith("_t"))
                if a is not None:
                    assert_bytes_equal(a, b, f"{name} columnwise={columnwise} {field}")


@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("compute", list(COMPUTE))
def test_nvfp4_stats_nonfinite_tiles(in_dtype, compute):
    """Tiles holding NaN, ±inf or values at the bf16 overflow threshold (0x7F7F7FFF stays finite,
    0x7F7F8000 rounds to inf) beside finite tiles: each tile's amax and the count equal the
    reference (the GPU kernel takes such tiles apart element by element, the rest by magnitude bits)."""
    x = np.random.default_rng(11).standard_normal((80, 96)).astype(np.float32)
    bits = lambda b: np.array(b, np.uint32).view(np.float32)
    x[0, 0] = np.nan                      # tile (0, 0): NaN beside finite values
    x[17, 35] = -np.inf                   # tile (1, 2)
    x[33, 50], x[34, 51] = np.nan, -np.nan  # tile (2, 3): two NaNs
    x[50, 70] = bits(0x7F7F7FFF)          # tile (3, 4): largest value that stays finite in bf16
    x[66, 90] = -bits(0x7F7F8000)         # tile (4, 5): rounds to -inf in bf16
    x[79, 95] = np.inf                    # the last tile, last element
    v = _as_input(x, in_dtype)
    cd = COMPUTE[compute]
    ref = nvfp4_stats_j(v, compute_dtype=cd, impl="reference")
    cus = nvfp4_stats_j(v, compute_dtype=cd, impl="custom_call")
    for field, a, b in zip(("tile_amax", "amax", "count"), cus, ref):
        assert_bytes_equal(a, b, field)
    nonfinite = 5 + (in_dtype == jnp.bfloat16 or compute == "bf16")   # 3 NaN, ±inf; + the one rounded to -inf
    assert int(ref[2]) == nonfinite


def test_nvfp4_quantize_e2m1_rounding_sweep():
    """Every E2M1 decision: with tile amax 6 and global amax 2688 each tile's encode multiplier is
    exactly 1, so the codes are the E2M1 rounding of x itself: a dense sweep of [-8, 8], the ties
    (which must go to the codes of docs/numerics.md §2.6) and their fp32 neighbours."""
    sweep = np.linspace(-8, 8, 64 * 64 - 64, dtype=np.float32)
    near = []
    for t in E2M1_TIES:
        t = np.float32(t)
        near += [t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(9)), -t]
    tail = np.array(near + [0.0, -0.0, 1e-40, -1e-40, 7.0, -7.0, 1e30, -1e30], np.float32)
    x = np.concatenate([sweep, tail, np.zeros(64 - tail.size % 64 if tail.size % 64 else 0, np.float32)])
    x = x[: x.size // 64 * 64].reshape(-1, 64)
    x = x[: x.shape[0] // 16 * 16]
    rows, cols = x.shape
    tiles = jnp.full((rows // 16, cols // 16), 6.0, jnp.float32)
    amax = jnp.asarray([2688.0], jnp.float32)
    ref = nvfp4_quantize_j(jnp.asarray(x), tiles, amax, compute_dtype=None, columnwise=False, impl="reference")
    cus = nvfp4_quantize_j(jnp.asarray(x), tiles, amax, compute_dtype=None, columnwise=False, impl="custom_call")
    assert_bytes_equal(cus[0], ref[0], "data")
    codes = np.stack([np.asarray(cus[0]) & 0xF, np.asarray(cus[0]) >> 4], -1).reshape(rows, cols)
    flat_x, flat_c = x.reshape(-1), codes.reshape(-1)
    for t, code in E2M1_TIES.items():
        hits = flat_x == np.float32(t)
        assert hits.any() and (flat_c[hits] == code).all(), f"tie {t} -> {flat_c[hits]}, want {code}"


def test_nvfp4_quantize_from_given_stats(rng):
    """The quantize stage uses the statistics it is given (a sharded caller passes the reduced amax)."""
    x = jnp.asarray(random_tiled(rng, 32, 48))
    tiles, amax, _ = nvfp4_stats_j(x, compute_dtype=None, impl="reference")
    bigger = amax * 4
    ref = nvfp4_quantize_j(x, tiles, bigger, compute_dtype=None, columnwise=True, impl="reference")
    cus = nvfp4_quantize_j(x, tiles, bigger, compute_dtype=None, columnwise=True, impl="custom_call")
    for field, a, b in zip(("data", "scale_inv", "data_t", "scale_inv_t"), cus, ref):
        assert_bytes_equal(a, b, field)
    own = nvfp4_quantize_j(x, tiles, amax, compute_dtype=None, columnwise=False, impl="custom_call")
    assert not np.array_equal(np.asarray(own[1]), np.asarray(cus[1])), "scales must follow the given amax"


# ----------------------------------------------------------------------------------------------
# Structure: one custom call per stage, no separate convert pass
# ----------------------------------------------------------------------------------------------


def _custom_call_targets(fn, *args) -> list[str]:
    hlo = jax.jit(fn).lower(*args).as_text()
    return re.findall(r'custom_call_target\s*=\s*"([^"]+)"', hlo) + re.findall(
        r'stablehlo\.custom_call\s*@(\w+)', hlo)


@pytest.mark.parametrize("columnwise", [False, True])
def test_quantizers_are_two_custom_calls(columnwise):
    """quantize_fp8 / quantize_nvfp4 (default bf16 compute dtype, fp32 input) lower to exactly the
    stats call and the quantize call, with no reduce_precision/convert of x in between."""
    x = jnp.zeros((64, 128), jnp.float32)
    suffix = "_t" if columnwise else ""
    for name, fn in (("fp8", jq.quantize_fp8), ("nvfp4", jq.quantize_nvfp4)):
        f = functools.partial(fn, columnwise=columnwise, impl="custom_call")
        targets = _custom_call_targets(f, x)
        assert sorted(targets) == sorted([f"jq_{name}_stats", f"jq_{name}_quantize{suffix}"]), targets
        hlo = jax.jit(f).lower(x).as_text()
        assert "reduce_precision" not in hlo, f"{name}: the bf16 rounding must be fused into the kernels"


@pytest.mark.skipif(jax.default_backend() != "cpu" or "cpu" not in jq.primitives._ffi.built_platforms(),
                    reason="impl='auto' on the CPU backend with the CPU extension built")
def test_auto_on_the_cpu_runs_the_faster_implementation_of_each_op(rng):
    """On the CPU, impl="auto" keeps the stats passes as custom calls and runs the casts, the rowwise NVFP4
    quantization and the transposes as the pure-JAX reference, which XLA makes faster there
    (the targets declared cpu_auto="reference"): no custom call for them in the lowered module, and the same bytes."""
    x = jnp.asarray(random_tiled(rng, 64, 128))
    exercised = set()   # the targets the custom_call runs below call: every one declared cpu_auto="reference"
    for name, fn, columnwise, want in (
            ("fp8", jq.quantize_fp8, False, ["jq_fp8_stats"]),
            ("fp8", jq.quantize_fp8, True, ["jq_fp8_stats"]),
            ("nvfp4", jq.quantize_nvfp4, False, ["jq_nvfp4_stats"]),
            ("nvfp4", jq.quantize_nvfp4, True, ["jq_nvfp4_quantize_t", "jq_nvfp4_stats"])):   # (custom: faster)
        auto = functools.partial(fn, columnwise=columnwise)
        assert sorted(_custom_call_targets(auto, x)) == want, (name, columnwise)
        exercised.update(_custom_call_targets(functools.partial(auto, impl="custom_call"), x))
        got, custom = jax.jit(auto)(x), jax.jit(functools.partial(auto, impl="custom_call"))(x)
        for field in ("data", "scale_inv", "amax", "data_t") + (("scale_inv_t",) if name == "nvfp4" else ()):
            if getattr(custom, field) is not None:
                assert_bytes_equal_nan_aware(getattr(got, field), getattr(custom, field), f"{name} {field}")
    q = jq.quantize_nvfp4(x, impl="reference")
    flat = x.reshape(-1)[8:200]
    lo, hi = 4, 100
    primitives = {
        "fp8_cast": lambda v, impl: ops.fp8_cast(v, q.amax, impl=impl),
        "fp8_cast columnwise": lambda v, impl: ops.fp8_cast(v, q.amax, columnwise=True, impl=impl),
        "nvfp4_tile_amax": lambda v, impl: ops.nvfp4_tile_amax(flat, rows=64, cols=128, start=8, impl=impl),
        "nvfp4_scale": lambda v, impl: ops.nvfp4_scale(ops.nvfp4_tile_amax(v, rows=64, cols=128, impl="reference"),
                                                       q.amax, rows=64, cols=128, impl=impl),
        "nvfp4_cast_partial": lambda v, impl: ops.nvfp4_cast_partial(flat, q.data.reshape(-1)[lo:hi], q.scale_inv,
                                                                     q.amax, rows=64, cols=128, start=8, impl=impl),
        "nvfp4_transpose": lambda v, impl: ops.nvfp4_transpose(q.data, impl=impl),
        "nvfp4_scale_transpose": lambda v, impl: ops.nvfp4_scale_transpose(q.scale_inv, rows=64, cols=128, impl=impl),
    }
    for name, fn in primitives.items():
        auto, custom_call = functools.partial(fn, impl="auto"), functools.partial(fn, impl="custom_call")
        assert _custom_call_targets(auto, x) == [], name
        exercised.update(_custom_call_targets(custom_call, x))
        got, custom = jax.jit(auto)(x), jax.jit(custom_call)(x)
        for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(custom))):
            assert_bytes_equal_nan_aware(a, b, f"{name} output {i}")
    missing = ops.cpu_auto_reference() - exercised
    assert not missing, f"declared cpu_auto='reference' with no case here: {sorted(missing)}"


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_stage_argument_errors(impl):
    x = jnp.zeros((32, 48), jnp.float32)
    tiles, amax = jnp.zeros((2, 3), jnp.float32), jnp.ones((1,), jnp.float32)
    with pytest.raises(ValueError, match=r"x: NVFP4 2D block scaling needs K \(cols\)"):
        ops.nvfp4_stats(jnp.zeros((32, 40)), impl=impl)
    with pytest.raises(ValueError, match="tile_amax: shape must be"):
        ops.nvfp4_quantize(x, jnp.zeros((3, 2), jnp.float32), amax, impl=impl)
    with pytest.raises(TypeError, match="amax: must be a float32 scalar"):
        ops.nvfp4_quantize(x, tiles, jnp.ones((2,), jnp.float32), impl=impl)
    with pytest.raises(TypeError, match="compute_dtype: must be None, float32 or bfloat16"):
        ops.fp8_stats(x, compute_dtype=jnp.float16, impl=impl)
    with pytest.raises(TypeError, match="x: dtype must be float32 or bfloat16"):
        ops.fp8_quantize(x.astype(jnp.float16), jnp.float32(1), impl=impl)
    with pytest.raises(ValueError, match="x: columnwise=True needs a rank-2 tensor"):
        ops.fp8_quantize(jnp.zeros((8,)), jnp.float32(1), columnwise=True, impl=impl)
    with pytest.raises(ValueError, match="x: must have rank 2"):
        ops.nvfp4_quantize(jnp.zeros((16, 16, 16)), tiles, amax, impl=impl)
