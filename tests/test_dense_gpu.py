"""jq.dense on a GPU: the FP8 forward and both backward GEMMs reach cuBLASLt's FP8 GEMM (XLA's, or jaxquant's custom
call under ``gemm.FP8_GEMM_IMPL = "cublaslt"``).

Skipped unless the default backend is a GPU. Hopper or newer is needed for FP8 GEMMs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")]

FP8_GEMM = "__cublas$lt$matmul$f8"


def _fp8_problem(m=256, k=512, n=384):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (n, k), jnp.float32) * 0.05
    return x, jq.quantize_fp8(w, columnwise=True), w


def test_fp8_dense_fwd_bwd_compiles_to_cublaslt_fp8():
    # Training-sized GEMMs: at toy sizes XLA's autotuner may pick its own Triton GEMM for an FP8 dot.
    x, q, w = _fp8_problem(4096, 4096, 4096)
    loss = lambda x, m, q: jnp.sum(jq.dense(x, jq.straight_through(q, m)).astype(jnp.float32) ** 2)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    hlo = fn.lower(x, jnp.zeros(w.shape, jnp.bfloat16), q).compile().as_text()
    # forward, dgrad and wgrad: three FP8 GEMM custom calls, XLA's or (gemm.FP8_GEMM_IMPL "cublaslt") jaxquant's
    found = hlo.count(FP8_GEMM) + hlo.count('"jq_fp8_gemm"')
    assert found >= 3, f"expected 3 '{FP8_GEMM}' or 'jq_fp8_gemm' calls in the compiled HLO, found {found}"


def test_fp8_dense_gpu_matches_dequantized_math():
    x, q, w = _fp8_problem()
    y = jax.jit(lambda x, q: jq.dense(x, q, out_dtype=jnp.float32))(x, q)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    xq = jq.quantize_fp8(x.astype(jnp.float32), compute_dtype=None)
    ref = xq.dequantize() @ q.dequantize().T
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-3, atol=2e-3 * float(amax))


def test_nvfp4_dense_gpu_matches_dequantized_math():
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (256, 512), jnp.bfloat16)
    q = jq.quantize_nvfp4(jax.random.normal(kw, (384, 512), jnp.float32) * 0.05, columnwise=True)
    fwd = lambda v, w: jq.dense(v, w, out_dtype=jnp.float32)
    # q an argument, not a constant
    y, dx = jax.jit(lambda v, w: (fwd(v, w), jax.grad(lambda u: jnp.sum(fwd(u, w)))(v)))(x, q)
    xf = x.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(xf @ q.dequantize().T), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(jnp.ones((256, 384)) @ q.dequantize_t().T),
                               rtol=1e-2, atol=1e-2)
