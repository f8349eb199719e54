"""Shared fixtures and helpers for the jaxquant test suite.

XLA_FLAGS is extended *before* jax is imported so that the CPU backend exposes 8 host devices
(sharding tests elsewhere in the suite rely on it) and, on a machine without a GPU, compiles with LLVM's
optimisation off (below).
"""

from __future__ import annotations

import importlib.metadata
import os

def _extend_xla_flags(flag: str, unless: str | None = None) -> None:
    """Appends ``flag`` to XLA_FLAGS unless it, or ``unless`` (a flag name the caller chose a value of), is there."""
    if (unless or flag) not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _gpu_plugin_installed() -> bool:
    return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm"))
               for d in importlib.metadata.distributions())


_extend_xla_flags("--xla_force_host_platform_device_count=8")
# On the CPU, most of the suite's time is XLA compiling its programs, and most of that is LLVM's optimisation passes,
# which the tests do not measure: off, the suite runs faster (figures: README.md, the test-time paragraph), and this
# process's children inherit it. The checks that need XLA's default level compile with tests/codegen.py's options.
# Not set where a GPU plugin is installed (the GPU suite compiles as users do) or with JAXQUANT_TEST_XLA_OPT=default.
if os.environ.get("JAXQUANT_TEST_XLA_OPT", "0") != "default" and not _gpu_plugin_installed():
    _extend_xla_flags("--xla_backend_optimization_level=0", unless="--xla_backend_optimization_level")

import functools  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxquant  # noqa: E402
import jaxquant.primitives.ops  # noqa: E402


def _share_compiled_programs() -> None:
    """On the CPU, one persistent compilation cache for the session, this process and the processes it starts (the
    CLI, checkpoint and multi-process tests): many tests compile the same step or demo, and each compile after the
    first is a cache read (about a quarter of the suite's time). Off with JAXQUANT_TEST_COMPILE_CACHE=0, and
    wherever the caller set a cache directory of their own."""
    if os.environ.get("JAXQUANT_TEST_COMPILE_CACHE", "1") == "0" or jax.default_backend() != "cpu":
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        path = tempfile.mkdtemp(prefix="jaxquant-test-jit-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


_share_compiled_programs()

# The quantizers under test, jitted (one compile per configuration instead of op-by-op dispatch).
# Options are always passed explicitly (compute_dtype None unless a test says otherwise), so the tests
# do not depend on the library's defaults and calls with the same options share one compiled program.
q_nvfp4 = functools.partial(
    jax.jit(jaxquant.quantize_nvfp4, static_argnames=("columnwise", "compute_dtype", "impl")),
    columnwise=False, compute_dtype=None)
q_fp8 = functools.partial(jax.jit(jaxquant.quantize_fp8, static_argnames=(
    "dtype", "columnwise", "amax_epsilon", "force_pow_2_scales", "compute_dtype", "impl")),
    dtype=jnp.float8_e4m3fn, columnwise=False, amax_epsilon=0.0, force_pow_2_scales=False, compute_dtype=None)
fp8_cast_j = jax.jit(jaxquant.primitives.ops.fp8_cast, static_argnames=(
    "dtype", "amax_epsilon", "force_pow_2_scales", "columnwise", "impl"))


def _worker_survives_a_stray_sigint(signum, _frame):
    print(f"tests/conftest.py: a stray signal {signum} reached xdist worker {os.environ['PYTEST_XDIST_WORKER']} "
          f"(pid {os.getpid()}, during {os.environ.get('PYTEST_CURRENT_TEST', 'no test')}) outside any test's own "
          f"handler; ignored", file=sys.stderr, flush=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU backend (skipped elsewhere)")
    # A SIGINT that reaches a worker outside the signal tests' own handlers ended one CI run: Python's default handler
    # raised KeyboardInterrupt inside JAX's GC callback and the worker died mid-test (the sender of that one is not
    # known). execnet itself sends its worker a SIGINT when the worker is still busy 5 s after termination begins, at
    # the end of every run. The controller, not the worker, handles the user's Ctrl-C, so a worker logs such a signal
    # and goes on. Tests that need the default disposition set it themselves (children reset handlers at exec).
    if os.environ.get("PYTEST_XDIST_WORKER") and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _worker_survives_a_stray_sigint)


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" / "not extended" deselect
def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.fast_cases("id", ...)`` on a parametrized test keeps the cases with those ids in the fast
    tier (``-m "not slow"``) and marks its other cases slow.

    The extended tier (``-m extended``), which the README's command (what CI runs) leaves out to stay within its
    time budget on 2 cores: the slow cases of a parametrized test with fast cases (those stand for it), and every
    slow case but the first of one without, unless the test is marked ``all_cases`` (its cases check different
    behaviours, e.g. each model style in each recipe); and tests marked ``extended`` themselves (benchmark smokes).
    The fast tier stays whole."""
    first_seen = set()
    for item in items:
        m = item.get_closest_marker("fast_cases")
        case_id = getattr(getattr(item, "callspec", None), "id", None)
        if m is not None and case_id not in m.args:
            item.add_marker(pytest.mark.slow)
        if case_id is None or item.get_closest_marker("all_cases") is not None:
            continue
        family = item.nodeid.split("[", 1)[0]
        stood_for = family in first_seen or m is not None   # by its first case, or by its fast cases
        if stood_for and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.extended)
        first_seen.add(family)


requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")


def as_bytes(a) -> np.ndarray:
    """The raw bytes of an array (jax or numpy, fp8/bf16/uint8/... included) as a flat uint8 array."""
    a = np.ascontiguousarray(np.atleast_1d(np.asarray(a)))
    return a.reshape(-1).view(np.uint8)


def assert_bytes_equal(actual, expected, what: str = "array") -> None:
    """Byte-for-byte equality of two arrays of the same dtype and shape."""
    actual_np, expected_np = np.asarray(actual), np.asarray(expected)
    assert actual_np.dtype == expected_np.dtype, f"{what}: dtype {actual_np.dtype} != {expected_np.dtype}"
    assert actual_np.shape == expected_np.shape, f"{what}: shape {actual_np.shape} != {expected_np.shape}"
    a, e = as_bytes(actual_np), as_bytes(expected_np)
    if not np.array_equal(a, e):
        bad = np.flatnonzero(a != e)
        itemsize = max(actual_np.dtype.itemsize, 1)
        elems = sorted(set((bad // itemsize).tolist()))[:8]
        flat_a, flat_e = actual_np.reshape(-1), expected_np.reshape(-1)
        detail = ", ".join(
            f"[{np.unravel_index(i, actual_np.shape) if actual_np.ndim else ()}] "
            f"{flat_a[i]!r} vs {flat_e[i]!r}" for i in elems)
        raise AssertionError(
            f"{what}: {len(bad)} of {a.size} bytes differ (first elements: {detail})")


def assert_bytes_equal_nan_aware(actual, expected, what: str = "array") -> None:
    """Same NaN mask (as float values), and identical bytes on every non-NaN element."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: {a.dtype}{a.shape} vs {e.dtype}{e.shape}"
    na, ne = np.isnan(a.astype(np.float32)), np.isnan(e.astype(np.float32))
    np.testing.assert_array_equal(na, ne, err_msg=f"{what}: NaN masks differ")
    assert_bytes_equal(a[~na], e[~ne], what + " (non-NaN elements)")


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


@pytest.fixture
def bytes_equal():
    """The byte-for-byte comparison helper, as a fixture: bytes_equal(actual, expected, what)."""
    return assert_bytes_equal


@pytest.fixture
def bytes_equal_nan_aware():
    return assert_bytes_equal_nan_aware


# ----------------------------------------------------------------------------------------------
# Input builders shared by the test files (plain numpy; import with `from conftest import ...`).
# ----------------------------------------------------------------------------------------------

# Exact ties of the E2M1 grid and the code docs/numerics.md §2.6 sends each to.
E2M1_TIES = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}


def _tile(x, i, j):
    return x[16 * i:16 * i + 16, 16 * j:16 * j + 16]


def random_tiled(rng, rows, cols, lo_exp=-8.0, hi_exp=8.0):
    """Normal values with a log-uniform magnitude per 16x16 tile (exercises every E4M3 scale range:
    zero, subnormal, normal and saturated tile scales), a few exact zeros and negative zeros."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    mag = 10.0 ** rng.uniform(lo_exp, hi_exp, size=(rows // 16, cols // 16))
    x *= np.repeat(np.repeat(mag, 16, 0), 16, 1).astype(np.float32)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=max(2, flat.size // 64), replace=False)
    flat[idx[: len(idx) // 2]] = 0.0
    flat[idx[len(idx) // 2:]] = -0.0
    return x


def nvfp4_grid_case(rng):
    """[32, 48] with global amax 2688 (S_enc = 1) and special tiles:

    (0,0) holds 2688 and random values; (0,1) amax 6 (s8 = 1, enc = 1): exact E2M1 ties, their
    fp32 neighbours, grid values and signed zeros; (0,2) amax 7 (s8 = 1.125, 7 * enc > 6): values
    that saturate; (1,0) all +0; (1,1) all -0; (1,2) tiny values (tile scale rounds to 0).
    """
    x = np.zeros((32, 48), np.float32)
    t = _tile(x, 0, 0)
    t[...] = rng.uniform(-2000, 2000, size=(16, 16)).astype(np.float32)
    t[3, 5] = 2688.0
    t[7, 1] = -2687.0
    vals = []
    for v in E2M1_TIES:
        v = np.float32(v)
        vals += [v, -v, np.nextafter(v, np.float32(0)), np.nextafter(v, np.float32(10)),
                 -np.nextafter(v, np.float32(0)), -np.nextafter(v, np.float32(10))]
    vals += [np.float32(g) for g in (0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6)]
    vals += [np.float32(0.0), np.float32(-0.0), np.float32(1e-30), np.float32(-1e-30),
             np.float32(0.2), np.float32(-0.2), np.float32(5.9), np.float32(-5.9)]
    t = _tile(x, 0, 1).reshape(-1)
    t[: len(vals)] = np.array(vals, np.float32)
    t[len(vals):] = np.resize(np.array(vals, np.float32), t.size - len(vals))
    _tile(x, 0, 1)[...] = t.reshape(16, 16)
    t = _tile(x, 0, 2)
    t[...] = rng.uniform(-7, 7, size=(16, 16)).astype(np.float32)
    t[0, :8] = np.array([7, -7, 6.75, -6.75, 6.5, -6.5, 6.3, -6.3], np.float32)
    _tile(x, 1, 0)[...] = 0.0
    _tile(x, 1, 1)[...] = -0.0
    t = _tile(x, 1, 2)
    t[...] = rng.uniform(-1e-6, 1e-6, size=(16, 16)).astype(np.float32)
    t[0, 0] = 1e-6
    return x


def nvfp4_tiny_next_to_large(rng):
    """[32, 48]: a tile of amax 1e4 next to a tile of amax 1e-6 (its E4M3 scale rounds to 0)."""
    x = rng.uniform(-1, 1, size=(32, 48)).astype(np.float32)
    x[:16, :16] *= np.float32(1e4)
    x[0, 0] = 1e4
    x[:16, 16:32] *= np.float32(1e-6)
    x[1, 17] = -1e-6
    x[2, 18] = -0.0
    x[16:, 16:32] *= np.float32(1e-3)
    return x


def nvfp4_huge(rng):
    """[32, 48] with values up to 3e38 and tiles from 1e36 down to 1 (scales near FLT_MAX)."""
    x = rng.uniform(-1, 1, size=(32, 48)).astype(np.float32)
    x[:16, :16] *= np.float32(3e38)
    x[0, 0] = 3e38
    x[1, 1] = -3e38
    x[:16, 16:32] *= np.float32(1e36)
    x[16:, :16] *= np.float32(1e30)
    x[16:, 32:] *= np.float32(1e37)
    return x


def nvfp4_with_inf(rng):
    """[32, 48]: +inf and -inf in one tile (global amax inf -> S_enc = 1), ordinary values elsewhere."""
    x = rng.uniform(-100, 100, size=(32, 48)).astype(np.float32)
    x[3, 4] = np.inf
    x[5, 6] = -np.inf
    x[20, 40] = np.inf
    return x


def nvfp4_edge_inputs(rng) -> dict:
    """name -> fp32 [32, 48] input (finite or ±inf; no NaN) for the NVFP4 bit-exact checks.

    All have the same shape so that a jitted quantizer compiles once for all of them."""
    return {
        "grid_ties": nvfp4_grid_case(rng),
        "tiny_next_to_large": nvfp4_tiny_next_to_large(rng),
        "huge": nvfp4_huge(rng),
        "with_inf": nvfp4_with_inf(rng),
        "all_zero": np.zeros((32, 48), np.float32),
        "all_neg_zero": np.full((32, 48), -0.0, np.float32),
        "wide_range": random_tiled(rng, 32, 48, -12, 12),
    }


def fp8_edge_inputs(rng) -> dict:
    """name -> fp32 [48, 80] input for the FP8 checks (NaN only in 'with_nan')."""
    base = rng.standard_normal((48, 80)).astype(np.float32) * np.float32(3)
    huge = base.copy() * np.float32(1e37)
    huge[0, 0], huge[1, 1] = 3e38, -3e38
    inf = base.copy()
    inf[0, 0], inf[2, 3] = np.inf, -np.inf
    nan = base.copy()
    nan[0, 1], nan[4, 7], nan[-1, -1] = np.nan, np.nan, -np.nan
    zeros = np.zeros((48, 80), np.float32)
    zeros[::2, ::3] = -0.0
    wide = random_tiled(rng, 48, 80, -6, 6)
    return {"normal": base, "huge": huge, "with_inf": inf, "with_nan": nan, "zeros": zeros,
            "wide_range": wide}
