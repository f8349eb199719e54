"""Wall clock of one `jaxquant bench` op, custom call against the XLA-fused reference, measured in
alternating order (custom first in even rounds, XLA first in odd ones) so that neither side always
runs on a GPU the other has just warmed. Two loops per op: each output freed by the next call
(`rebind`) or all kept until the batch ends (`keep`).

    python3 benchmarks/bench_alternating.py quantize_fp8:16384x16384:float32 fp8_quantize:8192x8192:bfloat16

Each argument is OP:ROWSxCOLS:DTYPE with OP one of `jaxquant bench`'s ops (stages included).
Used for the A/B that chose the FP8 rowwise cast's grid (docs/decisions.md, "The FP8 rowwise cast launches
one warp span per warp"), through scripts/ab_bench.sh's BENCH_CMD.
"""
import argparse
import statistics

import jax
import jax.numpy as jnp

from jaxquant.cli import bench


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="OP:ROWSxCOLS:DTYPE")
    parser.add_argument("--iters", type=int, default=20, help="dispatches per timed batch")
    parser.add_argument("--rounds", type=int, default=9, help="timed batches per side; the median is printed")
    args = parser.parse_args()
    for case in args.cases:
        name, size, dtype = case.split(":")
        rows, cols = (int(v) for v in size.lower().split("x"))
        x = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32).astype(dtype)
        ops = {op: fn for op, fn, _ in bench.cases(x, stages=True)}
        if name not in ops:
            parser.error(f"cases: unknown op {name!r} (one of {', '.join(ops)})")
        fns = {impl: jax.jit(lambda v, i=impl, f=ops[name]: f(v, i)) for impl in ("custom_call", "reference")}
        for fn in fns.values():  # compile, then one untimed call
            jax.block_until_ready(fn(x))
            jax.block_until_ready(fn(x))
        for loop, keep in (("rebind", False), ("keep", True)):
            times = {impl: [] for impl in fns}
            for r in range(args.rounds):
                for impl in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    times[impl].append(bench.batch_seconds(fns[impl], x, iters=args.iters, keep=keep))
            custom, xla = (statistics.median(times[i]) * 1e6 for i in ("custom_call", "reference"))
            print(f"{case:36s} {loop:7s} custom {custom:8.1f} us  xla {xla:8.1f} us  "
                  f"custom/xla {custom / xla:.3f}", flush=True)


if __name__ == "__main__":
    main()
