"""The scaled bf16 GEMM's declaration (``ops.bf16_gemm``: CUDA only, optional, on cuBLASLt; NVFP4's GEMMs on Hopper)
and ``scaled_gemm``'s switch (``gemm.BF16_GEMM_IMPL``) without a GPU: the op is its reference off CUDA, the switch
sends exactly the products the GEMM takes to the custom call in a program lowered for CUDA, ``jq.dense``'s NVFP4
forward and dgrad among them, and a program with the switch on gives the reference's bytes on the CPU. The GPU side
(the custom call == XLA's dot, bit for bit) is tests/test_bf16_gemm_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.primitives import _ffi, gemm, ops, reference
from support.bitwise import bits
from support.custom_gemm import lowered, pretend_cuda_target, switch_changes_no_byte


def _operands(m=48, k=64, n=32, layout="nk", seed=0):
    ka, kb, kf = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (n, k) if layout == "nk" else (k, n), jnp.bfloat16)
    return a, b, jnp.float32(0.37)


@pytest.fixture
def gemm_on_cuda(monkeypatch):
    """As if the CUDA extension had been built with cuBLASLt: ``jq_bf16_gemm`` registered for CUDA, the switch on."""
    pretend_cuda_target(monkeypatch, "jq_bf16_gemm", "BF16_GEMM_IMPL")
    yield
    jax.clear_caches()


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_the_op_is_its_reference_off_cuda(layout):
    a, b, f = _operands(layout=layout)
    want = reference.bf16_gemm(a, b, f, b_layout=layout)
    bf = b.astype(jnp.float32) if layout == "nk" else b.astype(jnp.float32).T
    acc = a.astype(jnp.float32) @ bf.T * f   # exact products, fp32 sums: the same GEMM
    np.testing.assert_array_equal(bits(want), bits(acc.astype(jnp.bfloat16)))
    for impl in ("auto", "reference"):
        np.testing.assert_array_equal(bits(ops.bf16_gemm(a, b, f, b_layout=layout, impl=impl)), bits(want))
    np.testing.assert_array_equal(bits(ops.bf16_gemm(a, b, f.reshape(1), b_layout=layout)), bits(want))


@pytest.mark.skipif(_ffi.has_target("cuda", "jq_bf16_gemm"), reason="the CUDA extension here has the GEMM")
def test_custom_call_without_the_gemm_built_says_so():
    a, b, f = _operands()
    with pytest.raises(_ffi.ExtensionError, match="no built extension has jq_bf16_gemm"):
        ops.bf16_gemm(a, b, f, impl="custom_call")


@pytest.mark.parametrize("bad,err,match", [
    (dict(a=jnp.float32), TypeError, "a: must be a rank-2 bfloat16"),
    (dict(b=jnp.float8_e4m3fn), TypeError, "b: must be a rank-2 bfloat16"),
    (dict(n=40), ValueError, "multiples of 16"),
    (dict(k=72), ValueError, "multiples of 16"),
    (dict(layout="kn"), ValueError, r"b \[N, K\]"),      # b [K, N] = [64, 32] read as [N, K]
    (dict(b_layout="nn"), ValueError, "b_layout: must be one of"),
    (dict(factor=jnp.ones((2,))), TypeError, "factor: must be a float32 scalar"),
    (dict(factor=jnp.bfloat16(1)), TypeError, "factor: must be a float32 scalar"),
])
def test_the_op_refuses_what_it_does_not_take(bad, err, match):
    a, b, f = _operands(n=bad.get("n", 32), k=bad.get("k", 64), layout=bad.get("layout", "nk"))
    a = a.astype(bad.get("a", a.dtype))
    b = b.astype(bad.get("b", b.dtype))
    with pytest.raises(err, match=match):
        ops.bf16_gemm(a, b, bad.get("factor", f), b_layout=bad.get("b_layout", "nk"))


@pytest.mark.parametrize("dims", ["tn", "nn"])
def test_switch_sends_scaled_bf16_products_to_the_custom_call_and_runs_the_reference_on_the_cpu(gemm_on_cuda, dims):
    a, b, f = _operands(m=40, layout="nk" if dims == "tn" else "kn")   # M off the 16-grid: cuBLASLt takes it
    d = gemm.TN if dims == "tn" else gemm.NN
    for sa, sb in ((None, f), (f, None), (jnp.float32(2.0), f)):
        fn = lambda a, b: gemm.scaled_gemm(a, sa, b, sb, dims=d, out_dtype=jnp.bfloat16)
        text = lowered(fn, a, b)
        call = [line for line in text.splitlines() if "@jq_bf16_gemm" in line]
        assert len(call) == 1 and f"b_kn = {str(dims == 'nn').lower()}" in call[0] and "x32xbf16>" in call[0], call
        assert "dot_general" not in text
        # the same program for the CPU and CUDA: the CPU branch is the reference
        assert "@jq_bf16_gemm" in lowered(fn, a, b, platforms=("cpu", "cuda"))
        jax.clear_caches()
        want = reference.bf16_gemm(a, b, f if sa is None else sa if sb is None else sa * sb,
                                   b_layout="nk" if dims == "tn" else "kn")
        np.testing.assert_array_equal(bits(jax.jit(fn)(a, b)), bits(want))


@pytest.mark.parametrize("case", ["xla_switch", "fp32_result", "no_factor", "n_off_grid", "k_off_grid", "fp32_operand",
                                  "rank3", "other_dims"])
def test_other_products_stay_xlas_dot(gemm_on_cuda, monkeypatch, case):
    m, k, n, out, dims = 48, 64, 32, jnp.bfloat16, gemm.TN
    n = 40 if case == "n_off_grid" else n
    k = 72 if case == "k_off_grid" else k
    out = None if case == "fp32_result" else out
    if case == "xla_switch":
        monkeypatch.setattr(gemm, "BF16_GEMM_IMPL", "xla")
    a, b, f = _operands(m, k, n)
    if case == "fp32_operand":
        b = b.astype(jnp.float32)
    if case == "rank3":
        a, dims = a.reshape(2, m // 2, k), (((2,), (1,)), ((), ()))
    if case == "other_dims":   # a [K, M] contracted on its major axis
        a, dims = a.T, (((0,), (1,)), ((), ()))
    f = None if case == "no_factor" else f
    text = lowered(lambda a, b: gemm.scaled_gemm(a, None, b, f, dims=dims, out_dtype=out), a, b)
    assert "jq_bf16_gemm" not in text and "dot_general" in text


def test_a_bad_switch_value_is_refused(monkeypatch):
    monkeypatch.setattr(gemm, "BF16_GEMM_IMPL", "cublas")
    a, b, f = _operands()
    with pytest.raises(ValueError, match="JAXQUANT_BF16_GEMM: must be one of"):
        gemm.scaled_gemm(a, None, b, f, out_dtype=jnp.bfloat16)


def _nvfp4_dense(rows, out, inner, x_dtype=jnp.bfloat16, seed=3):
    """``(fn, (x, m))``: ``jq.dense``'s output of ``x [rows, inner]`` against an NVFP4 weight ``[out, inner]`` and the
    gradients of both operands for a random output gradient."""
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, inner), x_dtype)
    q = jq.quantize_nvfp4(jax.random.normal(kw, (out, inner), jnp.float32) * 0.05, columnwise=True)
    ct = jax.random.normal(kg, (rows, out), x_dtype)

    def fn(x, m):
        y, vjp = jax.vjp(lambda x, m: jq.dense(x, jq.straight_through(q, m)), x, m)
        return (y,) + vjp(ct)

    return fn, (x, jnp.zeros((out, inner), jnp.bfloat16))


@pytest.mark.parametrize("x_dtype,calls", [(jnp.bfloat16, 2), (jnp.float32, 0)], ids=["bf16", "fp32"])
def test_dense_nvfp4_with_the_switch_gives_the_same_bytes_on_the_cpu(gemm_on_cuda, monkeypatch, x_dtype, calls):
    """bf16 activations: the forward and the dgrad write bf16 through the custom call (the wgrad has no factor); fp32
    activations keep their fp32 results, from XLA's dot."""
    fn, args = _nvfp4_dense(64, 48, 96, x_dtype)
    assert lowered(fn, *args).count("@jq_bf16_gemm") == calls
    switch_changes_no_byte(monkeypatch, "BF16_GEMM_IMPL", fn, *args)
