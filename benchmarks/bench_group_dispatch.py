"""Why a group of 300 small tensors costs more than one tensor of the same total when steps are
dispatched back to back: the master-weight step (consumed inside jit, as a training step uses it) for
one 8192^2 tensor and for 300 tensors of the same total, timed blocked and pipelined, with the host
events of a pipelined trace (jax.profiler: which host work each dispatch pays for) and the device busy
time. Run it under different XLA_FLAGS (e.g. command buffers off) to compare.

``--split-results 3,300,900``: instead, the host cost of one custom call's result count alone: one
group_split of a 32 MiB buffer into N equal results, one scalar read from the first (the call
writes all N), pipelined; then the same N results taken as XLA slices.

    python3 benchmarks/bench_group_dispatch.py [--recipe nvfp4] [--top 20] [--split-results 3,300,900]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_distributed import many_small_shapes, step, time_fn  # noqa: E402
from jaxquant.primitives import ops  # noqa: E402
from jaxquant.cli.bench import print_kernel_profile, random_master  # noqa: E402
from jaxquant.zero.layout import FlatLayout  # noqa: E402


def split_results(counts, iters):
    import jax.numpy as jnp
    total = 32 << 20
    src = jnp.zeros((total,), jnp.uint8)
    for n in counts:
        size = total // n
        pieces = [((size,), ((0, i * size, size),)) for i in range(n)]
        first = jax.jit(lambda s: ops.group_split([s], pieces)[0][0])
        all_ = jax.jit(lambda s: sum(o[0].astype(jnp.int32) for o in ops.group_split([s], pieces)))
        sliced = jax.jit(lambda s: sum(s[i * size:(i + 1) * size][0].astype(jnp.int32) for i in range(n)))
        row = [f"split into {n:4d} results:"]
        for label, fn in (("first read", first), ("all read", all_), ("XLA slices, all read", sliced)):
            blocked, pipelined = time_fn(fn, src, iters)
            row.append(f"{label} {blocked * 1e6:7.1f} / {pipelined * 1e6:7.1f} µs")
        print("  ".join(row) + "  (blocked / pipelined)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--side", type=int, default=8192)
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--consume", default="all", choices=("all", "first"),
                    help="read one element of every output inside jit, or of the first weight only")
    ap.add_argument("--split-results", default="", help="comma-separated result counts (see above)")
    args = ap.parse_args()
    if args.split_results:
        return split_results([int(v) for v in args.split_results.split(",")], args.iters)
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    groups = {"one tensor": [(args.side, args.side)],
              f"{args.count} tensors": many_small_shapes(args.side, args.count)}
    first = None
    for label, shapes in groups.items():
        layout = FlatLayout(shapes, len(devices))
        master = random_master(layout, mesh)
        fn = step(layout, mesh, args.recipe, False, "auto", consume=args.consume)
        blocked, pipelined = time_fn(fn, master, args.iters)
        first = first or (blocked, pipelined)
        print(f"\n{label}, {args.recipe}, consumed ({args.consume}): "
              f"blocked {blocked * 1e6:.1f} µs ({blocked / first[0]:.3f}x), "
              f"pipelined {pipelined * 1e6:.1f} µs ({pipelined / first[1]:.3f}x)")
        print_kernel_profile(f"{label}, pipelined", fn, master, args.iters, args.top, pipelined=True, host=True)

if __name__ == "__main__":
    main()
