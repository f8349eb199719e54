"""jq.dense on the CPU: each recipe's forward and backward against the math it is specified as, the
GEMM spelling (float8 operands, fp32 accumulation, no weight transpose), straight-through weight
gradients, the amax reduction scope, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxquant as jq
import jaxquant.tp.sp

B, K, N = 24, 64, 48      # distinct sizes, so the weight's [N, K] / [K, N] shapes are recognisable


def _problem(seed=0):
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (2, B // 2, K), jnp.float32)
    w = jax.random.normal(kw, (N, K), jnp.float32) * 0.1
    ct = jax.random.normal(kc, (2, B // 2, N), jnp.float32)     # output cotangent
    return x, w, ct


def _vjp(fn, x, w, ct):
    y, pull = jax.vjp(fn, x, w)
    return (y,) + pull(ct)


def _f32(t):
    return np.asarray(t, np.float32)


def test_array_weight_is_x_at_w_transposed():
    x, w, ct = _problem()
    y, dx, dw = _vjp(lambda x, w: jq.dense(x, w), x, w, ct)
    ry, rdx, rdw = _vjp(lambda x, w: jnp.einsum("bsk,nk->bsn", x, w), x, w, ct)
    for a, b in ((y, ry), (dx, rdx), (dw, rdw)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    yb = jq.dense(x, w.astype(jnp.bfloat16))              # bf16 operands, fp32 accumulation
    assert yb.dtype == jnp.float32 and yb.shape == (2, B // 2, N)
    ref = jnp.einsum("bsk,nk->bsn", x.astype(jnp.bfloat16).astype(jnp.float32),
                     w.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(yb, ref, rtol=1e-5, atol=1e-5)


def test_fp8_forward_backward_is_the_quantized_math():
    """y = (xq @ wq.T) sx sw with E4M3 current scaling of x; dx = (gq @ wq) sg sw and dW = (gq.T @ xq) sg sx
    with E5M2 current scaling of g; dW goes to the master weight (straight-through)."""
    x, w, ct = _problem()
    q = jq.quantize_fp8(w, columnwise=True)
    y, dx, dw = _vjp(lambda x, m: jq.dense(x, jq.straight_through(q, m)), x, w, ct)
    x2, g2 = x.reshape(-1, K), ct.reshape(-1, N)
    xq = jq.quantize_fp8(x2, compute_dtype=None)
    gq = jq.quantize_fp8(g2, dtype=jnp.float8_e5m2, compute_dtype=None)
    xd, gd, wd = xq.dequantize(), gq.dequantize(), q.dequantize()
    np.testing.assert_allclose(y.reshape(-1, N), xd @ wd.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx.reshape(-1, K), gd @ wd, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, gd.T @ xd, rtol=1e-5, atol=1e-5)
    # ... and it is close to the exact product (FP8 noise only)
    np.testing.assert_allclose(y, jnp.einsum("bsk,nk->bsn", x, w), rtol=0, atol=0.15)


def test_fp8_gemms_take_float8_operands_and_never_transpose_the_weight():
    x, w, ct = _problem()
    q = jq.quantize_fp8(w, columnwise=True)
    fn = lambda x, m: jax.vjp(lambda x, m: jq.dense(x, jq.straight_through(q, m)), x, m)[1](ct)
    jaxpr = jax.make_jaxpr(fn)(x, jnp.zeros(w.shape, jnp.bfloat16))
    dots, transposed = [], []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(eqn)
            if eqn.primitive.name == "transpose":
                transposed.append(tuple(eqn.invars[0].aval.shape))
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
                walk(sub)
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    assert len(dots) == 3, f"expected forward, dgrad and wgrad GEMMs, got {len(dots)}"
    f8 = {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}
    for eqn in dots:
        assert {jnp.dtype(v.aval.dtype) for v in eqn.invars} <= f8, eqn
        assert eqn.params["preferred_element_type"] == jnp.float32
        assert eqn.params["dimension_numbers"][0] == ((1,), (1,))     # TN: both contract their minor axis
    assert (N, K) not in transposed and (K, N) not in transposed, transposed


def test_fp8_recipe_on_the_fly_equals_prequantized_weight():
    """recipe='fp8' on an fp32 weight == quantize_fp8(columnwise) + straight_through, bit for bit."""
    x, w, ct = _problem()
    a = _vjp(lambda x, w: jq.dense(x, w, recipe="fp8"), x, w, ct)
    q = jq.quantize_fp8(w, columnwise=True)
    b = _vjp(lambda x, m: jq.dense(x, jq.straight_through(q, m)), x, w, ct)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_nvfp4_forward_backward_is_the_dequantized_math():
    """bf16 operands value(q)*s8 (exact), fp32 accumulation, global decode amax/2688 on the output."""
    x, w, ct = _problem()
    q = jq.quantize_nvfp4(w, columnwise=True)
    y, dx, dw = _vjp(lambda x, m: jq.dense(x, jq.straight_through(q, m)), x, w, ct)
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    gb = ct.astype(jnp.bfloat16).astype(jnp.float32)
    wd = q.dequantize()
    np.testing.assert_allclose(y, jnp.einsum("bsk,nk->bsn", xb, wd), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, jnp.einsum("bsn,nk->bsk", gb, q.dequantize_t().T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, jnp.einsum("bsn,bsk->nk", gb, xb), rtol=1e-5, atol=1e-5)
    a = _vjp(lambda x, w: jq.dense(x, w, recipe="nvfp4"), x, w, ct)
    for u, v in zip(a, (y, dx, dw)):
        np.testing.assert_array_equal(u, v)


def test_quantized_weight_without_master_gets_no_gradient_and_out_dtype():
    x, w, _ = _problem()
    q = jq.quantize_nvfp4(w, columnwise=True)
    dx = jax.grad(lambda x: jnp.sum(jq.dense(x, q)))(x)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    y = jq.dense(x.astype(jnp.bfloat16), jq.quantize_fp8(w), out_dtype=jnp.float32)   # no data_t: built
    assert y.dtype == jnp.float32


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
def test_amax_scope_is_the_named_axes_only():
    """Under shard_map with the activation's rows split over 'sp': amax_axes='sp' reproduces the
    unsharded call bit for bit; without it each block is scaled by its own amax."""
    x, w, _ = _problem()
    x2 = x.reshape(-1, K).at[0].multiply(50.0)            # one block holds the largest values
    q = jq.quantize_fp8(w, columnwise=True)
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))

    def sharded(axes):
        return jax.jit(jax.shard_map(lambda v: jq.dense(v, q, amax_axes=axes), mesh=mesh,
                                     in_specs=P("sp"), out_specs=P("sp")))(x2)

    whole = jq.dense(x2, q)
    np.testing.assert_array_equal(sharded("sp"), whole)
    per_block = jnp.concatenate([jq.dense(b, q) for b in jnp.split(x2, 4)])
    local = sharded(())
    np.testing.assert_array_equal(local, per_block)
    assert not np.array_equal(local, whole)


def test_bad_input():
    x, w, _ = _problem()
    with pytest.raises(ValueError, match="x: last axis must equal"):
        jq.dense(x[..., :32], w)
    with pytest.raises(ValueError, match="w: must have rank 2"):
        jq.dense(x, w[0])
    with pytest.raises(ValueError, match="recipe"):
        jq.dense(x, w, recipe="int8")
    with pytest.raises(ValueError, match="recipe: 'nvfp4' does not match"):
        jq.dense(x, jq.quantize_fp8(w), recipe="nvfp4")
    # one error style for every layer (jaxquant/primitives/gemm.py resolve_recipe): the argument, the allowed values
    with pytest.raises(ValueError, match=r"^recipe: must be None, 'bf16', 'fp8' or 'nvfp4', got 'int8'$"):
        jq.dense(x, w, recipe="int8")
    with pytest.raises(ValueError, match=r"^recipe: 'bf16' does not match w, a Float8Tensor \(use None or 'fp8'\)$"):
        jq.dense(x, jq.quantize_fp8(w), recipe="bf16")
    with pytest.raises(ValueError, match=r"^recipe: 'fp8' does not match w, an NVFP4Tensor \(use None or 'nvfp4'\)$"):
        jq.dense(x, jq.quantize_nvfp4(w), recipe="fp8")
    with pytest.raises(TypeError, match="x: dtype"):
        jq.dense(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match="master: must have the weight's shape"):
        jq.straight_through(jq.quantize_fp8(w), w.T)


def test_recipe_bf16_is_no_quantization_like_none():
    """recipe="bf16" (the sp layers' name for unquantized GEMMs) with an array weight is None's path:
    the same output and gradients, bitwise, for float32 and bfloat16 weights."""
    x, w, ct = _problem()
    for wd in (w, w.astype(jnp.bfloat16)):
        plain = jax.jit(lambda x, w, ct: _vjp(lambda x, w: jq.dense(x, w), x, w, ct))(x, wd, ct)
        named = jax.jit(lambda x, w, ct: _vjp(lambda x, w: jq.dense(x, w, recipe="bf16"), x, w, ct))(x, wd, ct)
        for a, b in zip(plain, named):
            assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_weight_operands_are_one_function():
    """gemm.weight_operands: what jq.dense reads (the columnwise copy built when missing) and, with
    fill_columnwise=False, what jaxquant.tp.sp reads (no columnwise keys when the tensor lacks them)."""
    from jaxquant.primitives import gemm
    _, w, _ = _problem()
    f8 = jq.quantize_fp8(w)
    assert f8.data_t is None
    filled, bare = gemm.weight_operands(f8), gemm.weight_operands(f8, fill_columnwise=False)
    assert sorted(filled) == ["data", "data_t", "scale_inv"] and sorted(bare) == ["data", "scale_inv"]
    np.testing.assert_array_equal(filled["data_t"].view(np.uint8), f8.data.T.view(np.uint8))
    assert filled["scale_inv"].shape == ()
    n4 = jq.quantize_nvfp4(w)
    assert sorted(gemm.weight_operands(n4, fill_columnwise=False)) == ["data", "dec", "scale_inv"]
    n4c = jq.quantize_nvfp4(w, columnwise=True)
    both = gemm.weight_operands(n4c, fill_columnwise=False)
    assert sorted(both) == ["data", "data_t", "dec", "scale_inv", "scale_inv_t"]
    for k, v in gemm.weight_operands(n4).items():
        assert np.asarray(v).tobytes() == np.asarray(both[k]).tobytes(), k
    with pytest.raises(TypeError, match="w: must be a Float8Tensor or an NVFP4Tensor"):
        gemm.weight_operands(w)
