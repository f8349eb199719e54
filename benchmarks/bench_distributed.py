"""Time quantize_master_weights for the linear weights of one Llama-3-8B layer.

Weights (PyTorch [out, in]): q 4096x4096, k/v 1024x4096, o 4096x4096, gate/up 14336x4096,
down 4096x14336 (218M parameters). The fp32 master buffer is sharded over every device along "fsdp".
Compares impl="auto" (custom calls where built) with impl="reference" (XLA only), for NVFP4 and FP8.

    python3 benchmarks/bench_distributed.py               # GPUs (e.g. 2 x H200)
    JAXQUANT_REFERENCE_ONLY=1 XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        PYTHONPATH=. python3 benchmarks/bench_distributed.py --small     # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxquant.distributed import gathered_bytes, quantize_master_weights
from jaxquant.layout import FlatLayout

LLAMA3_8B_LAYER = [
    ("q_proj", (4096, 4096)),
    ("k_proj", (1024, 4096)),
    ("v_proj", (1024, 4096)),
    ("o_proj", (4096, 4096)),
    ("gate_proj", (14336, 4096)),
    ("up_proj", (14336, 4096)),
    ("down_proj", (4096, 14336)),
]


def time_fn(fn, arg, iters, warmup=2):
    for _ in range(warmup):
        jax.block_until_ready(fn(arg))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="dims / 32 (for CPU)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--align", type=int, default=1)
    ap.add_argument("--recipes", default="nvfp4,fp8")
    ap.add_argument("--impls", default="auto,reference")
    ap.add_argument("--devices", type=int, default=None, help="fsdp size (default: all)")
    ap.add_argument("--check-finite", action="store_true")
    args = ap.parse_args()

    div = 32 if args.small else 1
    names = [n for n, _ in LLAMA3_8B_LAYER]
    shapes = [(m // div, k // div) for _, (m, k) in LLAMA3_8B_LAYER]
    devices = jax.devices()[: args.devices or len(jax.devices())]
    S = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    layout = FlatLayout(shapes, S, align=args.align, names=names)
    numel = sum(m * k for m, k in shapes)
    key = jax.random.key(0)
    master = jax.jit(lambda k: jax.random.normal(k, (layout.total_size,), jnp.float32) * 0.02,
                     out_shardings=NamedSharding(mesh, P("fsdp")))(key)
    print(f"devices: {S} x {devices[0].device_kind} ({devices[0].platform}); "
          f"{numel / 1e6:.1f}M parameters, shard {layout.shard_size / 1e6:.2f}M elements")

    rows = []
    for recipe in args.recipes.split(","):
        results = {}
        for impl in args.impls.split(","):
            fn = jax.jit(lambda x, impl=impl, recipe=recipe: quantize_master_weights(
                x, layout, mesh=mesh, recipe=recipe, impl=impl, check_finite=args.check_finite))
            t0 = time.perf_counter()
            fn.lower(master).compile()
            compile_s = time.perf_counter() - t0
            med, best = time_fn(fn, master, args.iters)
            results[impl] = med
            rows.append((recipe, impl, med * 1e3, best * 1e3, compile_s, gathered_bytes(layout, recipe)))
        base = results.get("reference")
        for i, r in enumerate(rows):
            if r[0] == recipe and len(r) == 6:
                ratio = (base / results[r[1]]) if base else float("nan")
                rows[i] = r + (ratio,)

    bf16_bytes = 2 * layout.total_size
    print(f"\n{'recipe':<7} {'impl':<11} {'median ms':>10} {'min ms':>9} {'compile s':>10} "
          f"{'gathered MB':>12} {'vs bf16':>8} {'speedup vs reference':>21}")
    for recipe, impl, med, best, comp, nbytes, ratio in rows:
        print(f"{recipe:<7} {impl:<11} {med:10.3f} {best:9.3f} {comp:10.2f} {nbytes / 2**20:12.2f} "
              f"{nbytes / bf16_bytes:8.3f} {ratio:21.2f}x")


if __name__ == "__main__":
    main()
