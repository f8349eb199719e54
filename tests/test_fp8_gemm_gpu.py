"""The FP8 GEMM custom call (``ops.fp8_gemm``, csrc/cuda_gemm.cu) on a GPU: the same bytes as XLA's own FP8 GEMM
(``gemm.scaled_gemm`` with ``FP8_GEMM_IMPL="xla"``, compiled as the training step compiles it: cuBLASLt, no Triton
GEMM) for every operand dtype pair cuBLASLt takes, shapes with M off the 16-grid, edge values and factors other than
1; the products cuBLASLt does not take stay XLA's dot; one cuBLASLt in the process (JAX's).

Skipped unless the default backend is a GPU and the CUDA extension was built with cuBLASLt (build.py prints which).
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import pytest

from jaxquant.primitives import _ffi, gemm, ops
from jaxquant.primitives.ops import single
from support.custom_gemm import both, compiled, same_bytes as _same_bytes, wrapped_gives_xlas_bytes
from support.fp8_dense import dense_fwd_bwd

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend"),
              pytest.mark.skipif(not _ffi.has_target("cuda", "jq_fp8_gemm"),
                                 reason="the CUDA extension was built without cuBLASLt (build.py --cuda on says why)")]

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
XLA_FP8_GEMM = "__cublas$lt$matmul$f8"
_compiled = functools.partial(compiled, "FP8_GEMM_IMPL")
_both = functools.partial(both, "FP8_GEMM_IMPL")


def _operand(key, shape, dtype, edge=False):
    """Random float8 values over the format's range (not zeros); ``edge``: a zero row, a zero column and the
    largest finite value of the format at a few places."""
    v = jax.random.normal(key, shape, jnp.float32) * (4.0 if dtype == E4M3 else 64.0)
    if edge:
        top = float(jnp.finfo(dtype).max)
        v = v.at[0, :].set(0.0).at[:, 1].set(0.0).at[2, 3].set(top).at[-1, -1].set(-top)
    return v.astype(dtype)


SHAPES = [(256, 512, 384), (200, 128, 48), (8, 64, 16), (4096, 4096, 4096), (1000, 1024, 2048)]   # (M, K, N)
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


@pytest.mark.parametrize("factor_product", [False, True], ids=["scale_pointers", "factor_product"])
@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS, ids=["e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"])
@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_custom_call_gives_xlas_bytes(m, k, n, a_dtype, b_dtype, factor_product):
    ka, kb = jax.random.split(jax.random.key(m * 7 + k + n))
    a, b = _operand(ka, (m, k), a_dtype, edge=True), _operand(kb, (n, k), b_dtype)
    sa, sb = jnp.float32(1.37 / 64), jnp.float32(3.1)
    xla = _compiled("xla", lambda a, b, sa, sb: gemm.scaled_gemm(a, sa, b, sb, out_dtype=jnp.bfloat16), a, b, sa, sb)
    assert XLA_FP8_GEMM in xla.as_text()
    custom = jax.jit(lambda a, b, sa, sb: ops.fp8_gemm(a, b, sa, sb, factor_product=factor_product,
                                                       impl="custom_call"))
    _same_bytes(xla(a, b, sa, sb), custom(a, b, sa, sb))


@pytest.mark.parametrize("factor_product", [False, True], ids=["scale_pointers", "factor_product"])
def test_fp32_result_gives_xlas_bytes(factor_product):
    ka, kb = jax.random.split(jax.random.key(5))
    a, b = _operand(ka, (512, 1024), E4M3), _operand(kb, (768, 1024), E4M3)
    sa, sb = jnp.float32(0.011), jnp.float32(0.73)
    xla = _compiled("xla", lambda a, b, sa, sb: gemm.scaled_gemm(a, sa, b, sb), a, b, sa, sb)
    custom = jax.jit(lambda a, b, sa, sb: ops.fp8_gemm(a, b, sa, sb, out_dtype=jnp.float32,
                                                       factor_product=factor_product, impl="custom_call"))
    _same_bytes(xla(a, b, sa, sb), custom(a, b, sa, sb))


def test_the_compiled_gemm_keeps_its_latency_hint(monkeypatch):
    """XLA's scheduler reads the estimate from the compiled instruction (tests/test_latency_hints.py)."""
    monkeypatch.setattr(_ffi, "LATENCY_HINTS", True)
    a, b = jnp.ones((1024, 2048), E4M3), jnp.ones((4096, 2048), E4M3)
    s = jnp.float32(1.0)
    text = jax.jit(lambda a, b: ops.fp8_gemm(a, b, s, s, impl="custom_call")).lower(a, b).compile().as_text()
    out = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    want = single.gemm_ns(a, b, out, single.FP8_GEMM_FLOPS_PER_NS)
    assert re.search(rf'custom_call_target="jq_fp8_gemm".*latency_metadata="{want}"', text), text[:2000]


def test_scaled_gemm_switch_sends_bf16_fp8_products_to_the_custom_call():
    ka, kb = jax.random.split(jax.random.key(2))
    a, b = _operand(ka, (384, 256), E4M3), _operand(kb, (128, 256), E5M2)
    sa, sb = jnp.float32(0.5), jnp.float32(0.125)
    fn = lambda a, b, sa, sb: gemm.scaled_gemm(a, sa, b, sb, out_dtype=jnp.bfloat16)
    x, y, hlo_xla, hlo_custom = _both(fn, a, b, sa, sb)
    assert "jq_fp8_gemm" in hlo_custom and XLA_FP8_GEMM not in hlo_custom
    assert "jq_fp8_gemm" not in hlo_xla
    _same_bytes(x, y)


@pytest.mark.parametrize("case", ["e5m2xe5m2", "n_off_grid", "k_off_grid", "fp32_result", "nn_dims"])
def test_products_cublaslt_does_not_take_stay_xlas(case):
    m, k, n, da, db, out, dims = 64, 128, 64, E4M3, E4M3, jnp.bfloat16, gemm.TN
    if case == "e5m2xe5m2":
        da = db = E5M2
    elif case == "n_off_grid":
        n = 40
    elif case == "k_off_grid":
        k = 72
    elif case == "fp32_result":
        out = None
    ka, kb = jax.random.split(jax.random.key(3))
    a = _operand(ka, (m, k), da)
    b = _operand(kb, (n, k), db) if case != "nn_dims" else _operand(kb, (k, n), db)
    if case == "nn_dims":
        dims = gemm.NN
    fn = lambda a, b: gemm.scaled_gemm(a, jnp.float32(2.0), b, jnp.float32(0.25), dims=dims, out_dtype=out)
    x, y, _, hlo = _both(fn, a, b)
    assert "jq_fp8_gemm" not in hlo
    _same_bytes(x, y)
    if case in ("e5m2xe5m2", "n_off_grid", "k_off_grid"):
        with pytest.raises(ValueError, match="cuBLASLt's FP8 GEMM takes"):
            ops.fp8_gemm(a, b, jnp.float32(1), jnp.float32(1))


def test_under_shard_map_scan_remat_and_vmap():
    """What the step wraps the GEMM in: shard_map over a 1-device mesh (every axis manual), scan, remat; and vmap
    (the op's batching rule runs the batch item by item)."""
    ka, kb = jax.random.split(jax.random.key(4))
    a = jnp.stack([_operand(k, (128, 256), E4M3) for k in jax.random.split(ka, 3)])
    b = _operand(kb, (64, 256), E4M3)
    sa, sb = jnp.float32(0.3), jnp.float32(0.6)
    wrapped_gives_xlas_bytes("FP8_GEMM_IMPL", "jq_fp8_gemm",
                             lambda x, b: gemm.scaled_gemm(x, sa, b, sb, out_dtype=jnp.bfloat16), a, b)


def test_in_a_command_buffer():
    """A program of several GEMMs and fusions, which XLA runs as a CUDA graph it records by capturing the stream: the
    handler's first call (library, handle, algorithm) happens inside that capture."""
    keys = jax.random.split(jax.random.key(8), 7)
    x = _operand(keys[0], (256, 512), E4M3)
    ws = [_operand(k, (512, 512), E4M3) for k in keys[1:]]
    s = jnp.float32(1 / 64)

    def chain(x, *ws):
        outs = []
        for w in ws:
            y = gemm.scaled_gemm(x, s, w, s, out_dtype=jnp.bfloat16)
            outs.append(y)
            x = (jnp.tanh(y.astype(jnp.float32)) * 100).astype(jnp.float8_e4m3fn)
        return outs

    got_xla, got_custom, _, hlo = _both(chain, x, *ws)
    assert hlo.count('"jq_fp8_gemm"') == len(ws)
    for u, v in zip(got_xla, got_custom):
        _same_bytes(u, v)


def test_dense_fwd_bwd_same_bytes_with_the_custom_call():
    fn, (x, m) = dense_fwd_bwd(512, 768, 1024, seed=6)
    x_res, y_res, _, hlo = _both(fn, x, m)
    assert hlo.count("jq_fp8_gemm") >= 2   # forward and dgrad write bf16; this wgrad keeps fp32 (master's dtype)
    for u, v in zip(x_res, y_res):
        _same_bytes(u, v)


def test_one_cublaslt_in_the_process_and_it_is_jaxs():
    import jaxquant._jaxquant_cuda as ext
    a = _operand(jax.random.key(7), (64, 64), E4M3)
    jax.block_until_ready(ops.fp8_gemm(a, a, jnp.float32(1), jnp.float32(1), impl="custom_call"))
    used = os.path.realpath(ext.cublaslt_library())
    with open("/proc/self/maps") as maps:
        mapped = {os.path.realpath(line.split()[-1]) for line in maps if "libcublasLt.so" in line}
    print(f"cuBLASLt used by jq_fp8_gemm: {used}; mapped in the process: {sorted(mapped)}")
    assert mapped == {used}
