"""FP8 vs bf16 ``jq.dense`` forward+backward at M = N = K (default 8192) on one GPU.

bf16: ``dense(x, w_bf16)``; FP8: ``dense(x, straight_through(Float8Tensor, master))`` (E4M3 activations
quantized in the step, E5M2 output gradients, three FP8 GEMMs). The weight is quantized once, outside the
timed step, as a training step would receive it from ``quantize_master_weights``.

  python benchmarks/bench_dense.py [--size 8192] [--iters 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import jaxquant as jq
from jaxquant.cli.bench import median_seconds


def timeit(fn, *args, iters: int = 20, repeats: int = 5) -> float:
    """Median seconds per call (jaxquant.cli.bench's timing: batches of back-to-back dispatches)."""
    return median_seconds(fn, *args, iters=iters, repeats=repeats)


def step(weight_of):
    """jitted forward+backward of sum(dense(x, w)**2) w.r.t. x and the (master) weight ``m``;
    ``weight_of(m, *extra)`` builds the weight, ``extra`` are jit arguments (never baked-in constants)."""
    def loss(x, m, *extra):
        return jnp.sum(jnp.square(jq.dense(x, weight_of(m, *extra)).astype(jnp.float32)))
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.size
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, n), jnp.bfloat16)
    w = jax.random.normal(kw, (n, n), jnp.float32) * (n ** -0.5)
    w_bf16 = w.astype(jnp.bfloat16)
    q = jax.jit(lambda w: jq.quantize_fp8(w, columnwise=True))(w)
    sink = jnp.zeros((n, n), jnp.bfloat16)

    bf16 = step(lambda m: m)
    fp8 = step(lambda m, q: jq.straight_through(q, m))
    hlo = fp8.lower(x, sink, q).compile().as_text()
    t_bf16 = timeit(bf16, x, w_bf16, iters=args.iters)
    t_fp8 = timeit(fp8, x, sink, q, iters=args.iters)
    flops = 3 * 2 * n ** 3
    res = {
        "device": jax.devices()[0].device_kind, "size": n,
        "bf16_ms": t_bf16 * 1e3, "fp8_ms": t_fp8 * 1e3,
        "bf16_tflops": flops / t_bf16 / 1e12, "fp8_tflops": flops / t_fp8 / 1e12,
        "speedup": t_bf16 / t_fp8, "fp8_gemm_calls": hlo.count("__cublas$lt$matmul$f8"),
    }
    print(f"dense fwd+bwd {n}^3 on {res['device']}: bf16 {res['bf16_ms']:.3f} ms ({res['bf16_tflops']:.0f} TFLOP/s), "
          f"fp8 {res['fp8_ms']:.3f} ms ({res['fp8_tflops']:.0f} TFLOP/s), speed-up {res['speedup']:.2f}x; "
          f"__cublas$lt$matmul$f8 calls in the FP8 step: {res['fp8_gemm_calls']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
