"""Time the master-weight step (quantize_master_weights) against plain JAX, ratios from one run.

1. The linear weights of one Llama-3-8B layer (PyTorch [out, in]: q 4096x4096, k/v 1024x4096,
   o 4096x4096, gate/up 14336x4096, down 4096x14336; 218M parameters), fp32 master sharded over
   "fsdp": NVFP4 and FP8, rowwise and rowwise + columnwise (built in the step), against the plain-JAX
   baseline ``all_gather(shard.astype(bf16))`` (issue 7 targets: NVFP4 <= 0.5x, + columnwise <= 0.6x,
   FP8 <= 0.7x, + columnwise <= 0.8x of the baseline). Each step also with ``split=False`` (it returns
   the gathered buffers, as the baseline does, and each weight is cut out where it is read).
2. A group of 300 small tensors whose total is one 8192x8192 tensor against that one tensor, both
   through quantize_master_weights on the same mesh (target: <= 1.25x): the weights returned to Python
   (one buffer per output array: ~900 for 300 tensors); "step in jit": one element of the first
   weight read inside jit, so the step runs whole (its custom calls write every result) and nothing
   else does (the step's own cost); "all read in jit": one element of every output array summed
   inside jit, which adds XLA's cost of a consumer taking ~900 buffers (the consumer's launches over
   separate buffers, not the step: docs/performance.md, "Host cost of many results"); "split=False
   returned": the GatheredWeights returned (a few buffers whatever the number of tensors). Each blocked
   and pipelined.

Times: "blocked" waits for each call (latency: host dispatch and the launch of every custom call
included); "pipelined" dispatches ``--iters`` calls back to back and waits once (device throughput, as
inside a jitted training step). ``--profile`` adds a per-kernel breakdown from a jax.profiler trace.

Runs on any number of devices, one included (fsdp = 1):

    python3 benchmarks/bench_distributed.py                       # GPUs (every visible one, or 1)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. \
        python3 benchmarks/bench_distributed.py --small --iters 2  # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.cli.bench import LLAMA3_8B_LAYER, bf16_gather, gather_summary, print_kernel_profile, random_master
from jaxquant.zero.distributed import gathered_bytes, quantize_master_weights
from jaxquant.zero.layout import FlatLayout

def many_small_shapes(side: int, count: int = 300):
    """``count`` tensors [r, side/8] whose element total is side x side: count - 1 of equal height
    (a multiple of 16) and one taller last tensor."""
    cols, total_rows = side // 8, 8 * side
    count = min(count, total_rows // 32)         # --small: fewer tensors, each at least 16 rows
    rows = max(16, (total_rows // count) // 16 * 16)
    while rows * (count - 1) >= total_rows:
        rows -= 16
    return [(rows, cols)] * (count - 1) + [(total_rows - rows * (count - 1), cols)]


def time_fn(fn, arg, iters, warmup=2):
    """(blocked, pipelined) seconds per call: the median of ``iters`` calls each waited for (latency,
    host dispatch included), and ``iters`` calls dispatched back to back then waited for once, divided
    by ``iters`` (device throughput, as inside a training step; median of 3 such batches)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(arg))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - t0)
    batches = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [fn(arg) for _ in range(iters)]
        jax.block_until_ready(outs)
        batches.append((time.perf_counter() - t0) / iters)
        del outs
    return statistics.median(times), statistics.median(batches)


def step(layout, mesh, recipe, columnwise, impl, consume=False, pieces=None, split=True):
    """The jitted step. ``consume``: return one scalar read inside jit instead of the outputs (as a
    training step that uses the weights inside jit does), from every output (True or "all") or from
    the first weight's data only ("first": the step's custom calls still write every result, and
    no consumer of ~900 buffers is added); the difference to the plain step is the host's cost of
    handing each output buffer back (one per data / scale / amax array). ``split=False``: the step
    returns a GatheredWeights (the gathered buffers; each weight cut out where it is read), as the
    bf16 baseline returns its gathered buffer."""
    def run(x):
        weights = quantize_master_weights(x, layout, mesh=mesh, recipe=recipe, impl=impl, columnwise=columnwise,
                                          manual_post_all_gather_processing=False, gather_pieces=pieces,
                                          split=split)
        if not consume:
            return weights
        leaves = jax.tree.leaves(weights)
        return sum(jnp.ravel(leaf)[0].astype(jnp.float32) for leaf in (leaves[:1] if consume == "first" else leaves))
    return jax.jit(run)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="dims / 32 (for CPU)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--align", type=int, default=1)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--devices", type=int, default=None, help="fsdp size (default: all)")
    ap.add_argument("--skip-group", action="store_true", help="skip the 300-tensor comparison")
    ap.add_argument("--pieces", default="",
                    help="comma-separated gather_pieces values to time besides the automatic choice (e.g. 1,2,8)")
    ap.add_argument("--recipes", default="nvfp4,fp8", help="comma-separated recipes to time (nvfp4, fp8)")
    ap.add_argument("--columnwise", default="off,on", help="comma-separated: off (rowwise), on (+ columnwise)")
    ap.add_argument("--profile-pieces", type=int, default=None,
                    help="gather_pieces of the profiled steps (default: the automatic choice)")
    ap.add_argument("--profile", action="store_true",
                    help="also print a per-kernel breakdown of each step (jax.profiler trace, GPU only)")
    args = ap.parse_args()

    div = 32 if args.small else 1
    devices = jax.devices()[: args.devices or len(jax.devices())]
    S = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    names = [n for n, _ in LLAMA3_8B_LAYER]
    shapes = [(m // div, k // div) for _, (m, k) in LLAMA3_8B_LAYER]
    layout = FlatLayout(shapes, S, align=args.align, names=names)
    master = random_master(layout, mesh)
    numel = sum(m * k for m, k in shapes)
    print(f"devices: {S} x {devices[0].device_kind} ({devices[0].platform}); impl={args.impl}; "
          f"Llama-3-8B layer: {numel / 1e6:.1f}M parameters, shard {layout.shard_size / 1e6:.2f}M elements")

    base, base_p = time_fn(bf16_gather(mesh), master, args.iters)
    print(f"\n{'step':<26} {'blocked us':>10} {'x bf16':>7} {'pipelined us':>12} {'x bf16':>7} {'gathered MB':>12}")
    print(f"{'bf16 cast + all_gather':<26} {base * 1e6:10.1f} {1.0:7.3f} {base_p * 1e6:12.1f} {1.0:7.3f} "
          f"{2 * layout.total_size / 2**20:12.2f}")
    recipes = [r for r in args.recipes.split(",") if r]
    colwise = [{"off": False, "on": True}[c] for c in args.columnwise.split(",") if c]
    for recipe in recipes:
        for columnwise in colwise:
            t, tp = time_fn(step(layout, mesh, recipe, columnwise, args.impl), master, args.iters)
            label = recipe + (" + columnwise" if columnwise else "")
            print(f"{label:<26} {t * 1e6:10.1f} {t / base:7.3f} {tp * 1e6:12.1f} {tp / base_p:7.3f} "
                  f"{gathered_bytes(layout, recipe) / 2**20:12.2f}")
            t, tp = time_fn(step(layout, mesh, recipe, columnwise, args.impl, split=False), master, args.iters)
            print(f"{'  split=False':<26} {t * 1e6:10.1f} {t / base:7.3f} {tp * 1e6:12.1f} {tp / base_p:7.3f}")
            for pieces in [int(v) for v in args.pieces.split(",") if v]:
                t, tp = time_fn(step(layout, mesh, recipe, columnwise, args.impl, pieces=pieces), master, args.iters)
                print(f"{'  gather_pieces=' + str(pieces):<26} {t * 1e6:10.1f} {t / base:7.3f} {tp * 1e6:12.1f} "
                      f"{tp / base_p:7.3f}")
    if args.profile:
        def profile(label, fn, gathered):   # a device receives (S - 1) / S of the gathered bytes
            if line := gather_summary(print_kernel_profile(label, fn, master), gathered * (S - 1) / S):
                print("  " + line)

        profile("bf16 cast + all_gather", bf16_gather(mesh), 2 * layout.total_size)
        for recipe in recipes:
            for columnwise in colwise:
                for split in (True, False):
                    profile(recipe + (" + columnwise" if columnwise else "") + ("" if split else ", split=False"),
                            step(layout, mesh, recipe, columnwise, args.impl, consume=True,
                                 pieces=args.profile_pieces, split=split),
                            gathered_bytes(layout, recipe))

    if args.skip_group:
        return
    side = 8192 // div
    groups = {"one tensor": [(side, side)], f"{len(many_small_shapes(side))} tensors": many_small_shapes(side)}
    print(f"\n{'group (' + str(side) + '^2 elements)':<22} {'recipe':<6} {'returned':>9} {'x one':>6} | step in jit: "
          f"{'blocked':>8} {'x one':>6} {'pipelined':>9} {'x one':>6} | all read in jit: {'blocked':>8} {'x one':>6} "
          f"{'pipelined':>9} {'x one':>6} | split=False returned: {'blocked':>8} {'x one':>6} {'pipelined':>9} "
          f"{'x one':>6}   (µs)")
    for recipe in recipes:
        first = None
        for label, group_shapes in groups.items():
            lay = FlatLayout(group_shapes, S, align=args.align)
            master_g = random_master(lay, mesh)
            t, _ = time_fn(step(lay, mesh, recipe, False, args.impl), master_g, args.iters)
            times = [t]
            for consume in ("first", "all"):
                times += time_fn(step(lay, mesh, recipe, False, args.impl, consume=consume), master_g, args.iters)
            times += time_fn(step(lay, mesh, recipe, False, args.impl, split=False), master_g, args.iters)
            first = first or times
            cells = [f"{v * 1e6:{w}.1f} {v / f:6.3f}" for v, f, w in zip(times, first, (9, 8, 9, 8, 9, 8, 9))]
            print(f"{label:<22} {recipe:<6} {cells[0]} | {'':12} {cells[1]} {cells[2]} | {'':16} {cells[3]} {cells[4]}"
                  f" | split=False returned: {cells[5]} {cells[6]}")
            if args.profile:
                print_kernel_profile(f"{label}, {recipe}, step in jit", step(lay, mesh, recipe, False, args.impl,
                                                                              consume="first"), master_g, top=8)

if __name__ == "__main__":
    main()
