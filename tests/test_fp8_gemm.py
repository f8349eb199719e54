"""The FP8 GEMM's declaration (``ops.fp8_gemm``: CUDA only, optional, on cuBLASLt) and ``scaled_gemm``'s switch
(``gemm.FP8_GEMM_IMPL``) without a GPU: the op is its reference off CUDA, the switch sends exactly the products
cuBLASLt takes to the custom call in a program lowered for CUDA, and a program with the switch on gives the
reference's bytes on the CPU, ``jq.dense`` included. The GPU side (the custom call == XLA's GEMM, bit for bit) is
tests/test_fp8_gemm_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant.primitives import _ffi, gemm, ops, reference
from support.bitwise import bits
from support.custom_gemm import lowered, pretend_cuda_target, switch_changes_no_byte
from support.fp8_dense import dense_fwd_bwd

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _operands(m=48, k=64, n=32, da=E4M3, db=E4M3, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = (jax.random.normal(ka, (m, k)) * 6).astype(da)
    b = (jax.random.normal(kb, (n, k)) * 6).astype(db)
    return a, b, jnp.float32(0.37), jnp.float32(1.9)


@pytest.fixture
def gemm_on_cuda(monkeypatch):
    """As if the CUDA extension had been built with cuBLASLt: ``jq_fp8_gemm`` registered for CUDA, the switch on."""
    pretend_cuda_target(monkeypatch, "jq_fp8_gemm", "FP8_GEMM_IMPL")
    yield
    jax.clear_caches()


def test_the_op_is_its_reference_off_cuda():
    a, b, sa, sb = _operands()
    want = reference.fp8_gemm(a, b, sa, sb, out_dtype=jnp.bfloat16)
    acc = jax.lax.dot_general(a, b, gemm.TN, preferred_element_type=jnp.float32) * (sa * sb)
    np.testing.assert_array_equal(bits(want), bits(acc.astype(jnp.bfloat16)))
    for impl in ("auto", "reference"):
        np.testing.assert_array_equal(bits(ops.fp8_gemm(a, b, sa, sb, impl=impl)), bits(want))
    got32 = ops.fp8_gemm(a, b, sa.reshape(1), sb.reshape(1), out_dtype=jnp.float32)
    np.testing.assert_array_equal(bits(got32), bits(acc))


@pytest.mark.skipif(_ffi.has_target("cuda", "jq_fp8_gemm"), reason="the CUDA extension here has the GEMM")
def test_custom_call_without_the_gemm_built_says_so():
    a, b, sa, sb = _operands()
    with pytest.raises(_ffi.ExtensionError, match="no built extension has jq_fp8_gemm"):
        ops.fp8_gemm(a, b, sa, sb, impl="custom_call")


@pytest.mark.parametrize("bad,err,match", [
    (dict(da=jnp.bfloat16), TypeError, "a: must be a rank-2 float8"),
    (dict(da=E5M2, db=E5M2), ValueError, "not both float8_e5m2"),
    (dict(n=40), ValueError, "multiples of 16"),
    (dict(k=72), ValueError, "multiples of 16"),
])
def test_the_op_refuses_what_cublaslt_does_not_take(bad, err, match):
    a, b, sa, sb = _operands(**bad)
    with pytest.raises(err, match=match):
        ops.fp8_gemm(a, b, sa, sb)
    with pytest.raises(TypeError, match="out_dtype"):
        ops.fp8_gemm(*_operands()[:2], sa, sb, out_dtype=jnp.float16)
    with pytest.raises(TypeError, match="a_scale"):
        ops.fp8_gemm(*_operands()[:2], jnp.ones((2,)), sb)


def test_switch_sends_bf16_fp8_tn_products_to_the_custom_call_and_runs_the_reference_on_the_cpu(gemm_on_cuda):
    a, b, sa, sb = _operands(m=40, da=E5M2)   # M off the 16-grid: cuBLASLt takes it
    fn = lambda a, b, sa, sb: gemm.scaled_gemm(a, sa, b, sb, out_dtype=jnp.bfloat16)
    text = lowered(fn, a, b, sa, sb)
    call = [line for line in text.splitlines() if "@jq_fp8_gemm" in line]
    assert len(call) == 1 and "fast_accum = true" in call[0] and "x32xbf16>" in call[0], call
    assert "dot_general" not in text
    # the same program for the CPU and CUDA: the CPU branch is the reference
    both = lowered(fn, a, b, sa, sb, platforms=("cpu", "cuda"))
    assert "@jq_fp8_gemm" in both
    jax.clear_caches()
    np.testing.assert_array_equal(bits(jax.jit(fn)(a, b, sa, sb)),
                                  bits(reference.fp8_gemm(a, b, sa, sb, out_dtype=jnp.bfloat16)))


@pytest.mark.parametrize("case", ["xla_switch", "e5m2xe5m2", "n_off_grid", "fp32_result", "nn_dims", "no_scale"])
def test_other_products_stay_xlas_dot(gemm_on_cuda, monkeypatch, case):
    m, k, n, da, db, out, dims = 48, 64, 32, E4M3, E4M3, jnp.bfloat16, gemm.TN
    da, db = (E5M2, E5M2) if case == "e5m2xe5m2" else (da, db)
    n = 40 if case == "n_off_grid" else n
    out = None if case == "fp32_result" else out
    if case == "xla_switch":
        monkeypatch.setattr(gemm, "FP8_GEMM_IMPL", "xla")
    a, b, sa, sb = _operands(m, k, n, da, db)
    if case == "nn_dims":
        dims, b = gemm.NN, b.T
    sb = None if case == "no_scale" else sb
    text = lowered(lambda a, b: gemm.scaled_gemm(a, sa, b, sb, dims=dims, out_dtype=out), a, b)
    assert "jq_fp8_gemm" not in text and "dot_general" in text


def test_a_bad_switch_value_is_refused(monkeypatch):
    monkeypatch.setattr(gemm, "FP8_GEMM_IMPL", "cublas")
    a, b, sa, sb = _operands()
    with pytest.raises(ValueError, match="JAXQUANT_FP8_GEMM: must be one of"):
        gemm.scaled_gemm(a, sa, b, sb, out_dtype=jnp.bfloat16)


def test_dense_with_the_switch_gives_the_same_bytes_on_the_cpu(gemm_on_cuda, monkeypatch):
    fn, args = dense_fwd_bwd(64, 48, 96, seed=3)
    assert lowered(fn, *args).count("@jq_fp8_gemm") == 2   # forward and dgrad in bf16; this wgrad stays fp32
    switch_changes_no_byte(monkeypatch, "FP8_GEMM_IMPL", fn, *args)
