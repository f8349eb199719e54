"""Times each primitive: custom call vs the XLA-fused pure-JAX reference, and vs copy bandwidth.

All ratios come from one run on one device. Bandwidth counts the fewest bytes each op must move
(inputs read once, outputs written once); the copy reference is a jitted ``x + 1`` over an fp32
array of the same size as the op's input (read + write).

  python benchmarks/bench_ops.py [--sizes 8192x8192,4096x14336] [--json out.json]

The quantizers against the memory floor: ``jaxquant bench`` (jaxquant/cli/bench.py, whose timing
helpers this script shares).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import jaxquant as jq
from jaxquant.cli import bench
from jaxquant.primitives import ops


def timeit(fn, *args, iters: int = 30, repeats: int = 5) -> float:
    """Median seconds per call (warm-up, then `repeats` batches of `iters` dispatches)."""
    return bench.median_seconds(fn, *args, iters=iters, repeats=repeats)


def cases(rows: int, cols: int, dtype):
    """(name, fn(impl) -> jitted callable, args, bytes moved)."""
    n = rows * cols
    isz = jnp.dtype(dtype).itemsize
    x = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32).astype(dtype)
    t = jq.quantize_nvfp4(x, impl="reference")
    tile = ops.nvfp4_tile_amax(x, rows=rows, cols=cols, impl="reference")
    zeros = jnp.zeros((n // 2,), jnp.uint8)
    return [
        ("amax", lambda impl: jax.jit(lambda v: ops.amax(v, impl=impl)), (x,), n * isz),
        ("fp8_cast", lambda impl: jax.jit(lambda v: ops.fp8_cast(v, jnp.float32(3.0), impl=impl)[0]), (x,),
         n * isz + n),
        ("fp8_cast+T", lambda impl: jax.jit(lambda v: ops.fp8_cast(v, jnp.float32(3.0), columnwise=True,
                                                                  impl=impl)[::2]), (x,), n * isz + 2 * n),
        ("quantize_fp8", lambda impl: jax.jit(lambda v: jq.quantize_fp8(v, impl=impl)), (x,), 2 * n * isz + n),
        ("nvfp4_tile_amax", lambda impl: jax.jit(lambda v: ops.nvfp4_tile_amax(v, rows=rows, cols=cols, impl=impl)),
         (x,), n * isz),
        ("nvfp4_cast", lambda impl: jax.jit(lambda v, b: ops.nvfp4_cast_partial(
            v, b, t.scale_inv, t.amax, rows=rows, cols=cols, impl=impl)), (x, zeros), n * isz + n // 2),
        ("nvfp4_transpose", lambda impl: jax.jit(lambda d: ops.nvfp4_transpose(d, impl=impl)), (t.data,), n),
        ("quantize_nvfp4", lambda impl: jax.jit(lambda v: jq.quantize_nvfp4(v, impl=impl)), (x,),
         2 * n * isz + n // 2),
        ("quantize_nvfp4+T", lambda impl: jax.jit(lambda v: jq.quantize_nvfp4(v, columnwise=True, impl=impl)), (x,),
         2 * n * isz + n),
    ], tile


def copy_seconds(nbytes: int) -> float:
    """Seconds of a jitted fp32 ``x + 1`` over ``nbytes`` of input."""
    return 2 * nbytes / bench.copy_bandwidth(nbytes // 4, iters=30, repeats=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="8192x8192,4096x14336,1024x4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    rows_out = []
    header = f"{'op':18s} {'shape':>12s} {'dtype':>8s} {'custom us':>10s} {'xla us':>10s} {'xla/custom':>10s} " \
             f"{'GB/s':>8s} {'of copy':>8s}"
    print(header)
    for size in args.sizes.split(","):
        rows, cols = (int(v) for v in size.split("x"))
        for dname in args.dtypes.split(","):
            dtype = jnp.dtype(dname)
            copy_s = copy_seconds(rows * cols * 4)
            copy_bw = 2 * rows * cols * 4 / copy_s
            for name, make, fargs, nbytes in cases(rows, cols, dtype)[0]:
                t_custom = timeit(make("custom_call"), *fargs)
                t_ref = timeit(make("reference"), *fargs)
                bw = nbytes / t_custom
                row = dict(op=name, shape=f"{rows}x{cols}", dtype=dname, custom_us=t_custom * 1e6,
                           xla_us=t_ref * 1e6, speedup=t_ref / t_custom, gbps=bw / 1e9,
                           frac_copy=bw / copy_bw, copy_gbps=copy_bw / 1e9)
                rows_out.append(row)
                print(f"{name:18s} {row['shape']:>12s} {dname:>8s} {row['custom_us']:10.1f} {row['xla_us']:10.1f} "
                      f"{row['speedup']:10.2f} {row['gbps']:8.0f} {row['frac_copy']:8.2f}", flush=True)
            print(f"{'(copy x+1)':18s} {size:>12s} {'float32':>8s} {copy_s * 1e6:10.1f} {'':>10s} {'':>10s} "
                  f"{copy_bw / 1e9:8.0f} {1.0:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                           rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
