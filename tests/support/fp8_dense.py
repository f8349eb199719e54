"""One FP8 ``jq.dense`` forward and backward on random operands, the case the FP8 GEMM tests compare between GEMM
implementations (CPU: against the reference; GPU: XLA's GEMM against jaxquant's)."""

import jax
import jax.numpy as jnp

import jaxquant as jq


def dense_fwd_bwd(rows, out, inner, seed):
    """``(fn, (x, m))``: ``fn(x, m)`` gives ``jq.dense``'s output of ``x [rows, inner]`` against an FP8 weight
    ``[out, inner]`` (columnwise copy made) and the gradients of both operands for a random output gradient."""
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, inner), jnp.bfloat16)
    w = jax.random.normal(kw, (out, inner), jnp.float32) * 0.05
    q = jq.quantize_fp8(w, columnwise=True)
    ct = jax.random.normal(kg, (rows, out), jnp.bfloat16)

    def fn(x, m):
        y, vjp = jax.vjp(lambda x, m: jq.dense(x, jq.straight_through(q, m)), x, m)
        return (y,) + vjp(ct)

    return fn, (x, jnp.zeros(w.shape, jnp.bfloat16))
