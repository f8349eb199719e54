"""The collective GEMM kernels of ``overlap="fused"`` (jaxquant/tp/collective_gemm.py) alone, per tiling,
against what they replace: XLA's all-gather + GEMM and GEMM + reduce-scatter (NCCL + cuBLAS), over all
GPUs of one host as the tp axis. Kernel times come from a profiler trace of GPU 0, so the ratios are
free of host overhead:

- ``fused / GEMM``: the fused kernel against cuBLAS's GEMM alone. At 1.00 the transfers cost nothing;
  the sp layers' 70% rule needs about ``1 + 0.3 x NCCL / GEMM``.
- ``hides``: (cuBLAS GEMM + NCCL collective - fused kernel) / NCCL collective: the share of the
  collective the fused kernel saves against running the two one after the other.

    python3 benchmarks/bench_collective_gemm.py                      # 2+ Hopper GPUs
    python3 benchmarks/bench_collective_gemm.py --configs all        # every tiling of CONFIGS
    python3 benchmarks/bench_collective_gemm.py --cpu-smoke          # CPU check of the script

Sizes are SEQxHIDDENxFFN as in bench_sp.py: the all-gather GEMM is the column layer's forward
(``[S/tp, H]`` gathered, times the weight ``[F/tp, H]`` contracted on H), the reduce-scatter GEMM the
row layer's (``[S, F/tp]`` times the weight ``[H, F/tp]`` contracted on F/tp); weights are read as
stored (``[out, in]``), as the sp layers pass them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {   # name -> collective_gemm.TileConfig fields ("chosen": the kernels' own choice, TILINGS)
    "chosen": None,
    "default": {},
    "split-n": dict(walk="n", band=8, split="n"),
    "walk-m-4": dict(walk="m", band=4),
    "tile-64x256-walk-m-8": dict(tile_m=64, tile_n=256, walk="m", band=8),
    "epi-tile-s3": dict(epi=None, stages=3),
    "walk-m-8-epi-tile-s3": dict(walk="m", band=8, epi=None, stages=3),
    "split-n-epi-tile-s3": dict(walk="n", band=8, split="n", epi=None, stages=3),
    "tile-64x256-walk-m-8-epi-tile-s3": dict(tile_m=64, tile_n=256, walk="m", band=8, epi=None, stages=3),
    # a tile's store spread over the CTA's next tile's K loop (4 or 8 row strips)
    "epi-tile-s3-spread-4": dict(epi=None, stages=3, spread=4),
    "epi-tile-s3-spread-8": dict(epi=None, stages=3, spread=8),
    # the reduce-scatter kernel's ring steps handed off tile by tile, not as whole steps (that kernel only)
    "spread-4-tile-handoff": dict(epi=None, stages=3, spread=4, handoff="tile"),
    "spread-8-tile-handoff": dict(epi=None, stages=3, spread=8, handoff="tile"),
}


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192x4096x16384,8192x8192x32768")
    ap.add_argument("--configs", default="chosen", help=f"comma list of {tuple(CONFIGS)} or 'all'")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="4 simulated CPU devices, the kernels' plain-JAX "
                    "schedule, a tiny size, no profile")
    return ap.parse_args(argv)


def _kernel_ms(fn, args, iters):
    """(median wall ms of a call, per-call kernel ms by kind on GPU 0 from a profiler trace)."""
    import jax

    from bench_e2e import exposed_collectives
    from bench_sp import _time
    wall, _ = _time(fn, args, iters, warmup=2)
    if jax.default_backend() != "gpu":
        return wall, None
    with tempfile.TemporaryDirectory() as path:
        with jax.profiler.trace(path, create_perfetto_trace=True):
            for _ in range(iters):
                jax.block_until_ready(fn(*args))
        return wall, exposed_collectives(path, steps=iters)


def main(argv=None):
    args = _args(argv)
    if args.cpu_smoke:
        flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
        os.environ["XLA_FLAGS"] = flags.strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxquant.tp import collective_gemm as cg

    devices = jax.devices("cpu")[:4] if args.cpu_smoke else jax.devices()
    if not args.cpu_smoke and (jax.default_backend() != "gpu" or len(devices) < 2):
        print(f"bench_collective_gemm: skipped: needs 2+ GPUs, found {len(devices)} {jax.default_backend()} device(s)")
        return None
    problem = None if args.cpu_smoke else cg.device_problem(devices[0])
    if problem:
        print(f"bench_collective_gemm: skipped: the kernels need {problem}")
        return None
    tp, impl = len(devices), "reference" if args.cpu_smoke else "kernel"
    mesh = Mesh(np.array(devices), ("tp",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    smap = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    sizes = ["1024x128x512"] if args.cpu_smoke else args.sizes.split(",")
    rows = []
    print(f"tp={tp} device={devices[0].device_kind}; per call, GPU 0 kernel ms (wall ms)")
    for size in sizes:
        seq, hidden, ffn = (int(v) for v in size.split("x"))
        keys = jax.random.split(jax.random.key(0), 4)
        unit = lambda k, shape, fan_in: (jax.random.normal(k, shape) / np.sqrt(fan_in)).astype(jnp.bfloat16)
        x = put(jax.random.normal(keys[0], (seq, hidden), jnp.bfloat16), P("tp", None))
        w1 = put(unit(keys[1], (ffn, hidden), hidden), P("tp", None))      # weights [out, in], as stored
        h = put(jax.random.normal(keys[2], (seq, ffn), jnp.bfloat16), P(None, "tp"))
        w2 = put(unit(keys[3], (hidden, ffn), ffn), P(None, "tp"))
        mm = lambda a, w: lax.dot_general(a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)

        def xla_gather(a, b):
            full = lax.all_gather(a, "tp", axis=0, tiled=True)
            return mm(full, b), full

        def xla_scatter(a, b):
            return lax.psum_scatter(mm(a, b), "tp", scatter_dimension=0, tiled=True)

        def fused_gather(cfg):
            return lambda a, w: cg.gather_matmul(a, w, axis="tp", n=tp, contract=1, impl=impl, config=cfg)

        def fused_scatter(cfg):
            return lambda a, w: cg.matmul_reduce_scatter(a, w, axis="tp", n=tp, contract=1, impl=impl, config=cfg)

        cases = {   # operands, in_specs, out_specs, the XLA program, the fused program of a tiling
            "all-gather GEMM": ((x, w1), (P("tp", None), P("tp", None)), (P(None, "tp"), P()),
                                xla_gather, fused_gather),
            "GEMM reduce-scatter": ((h, w2), (P(None, "tp"), P(None, "tp")), P("tp", None),
                                    xla_scatter, fused_scatter),
        }
        for label, (operands, in_specs, out_specs, xla_fn, fused_fn) in cases.items():
            xla = smap(xla_fn, in_specs, out_specs)
            wall, trace = _kernel_ms(xla, operands, args.iters)
            gemm = (trace or {}).get("gemm_kernel_ms", float("nan"))
            coll = (trace or {}).get("collective_ms", float("nan"))
            print(f"{size} {label}: XLA cuBLAS GEMM {gemm:.3f} + NCCL {coll:.3f} ms ({wall:.3f} wall)")
            row = dict(size=size, case=label, tp=tp, xla_wall_ms=wall, gemm_ms=gemm, collective_ms=coll, fused={})
            want = xla(*operands)
            for name in names:
                cfg = None if CONFIGS[name] is None else cg.TileConfig(**CONFIGS[name])
                if cfg is not None and cfg.handoff != "step" and label == "all-gather GEMM":
                    continue   # a reduce-scatter kernel option
                try:
                    fn = smap(fused_fn(cfg), in_specs, out_specs)
                    got = fn(*operands)
                    err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
                              for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
                    wall_f, trace_f = _kernel_ms(fn, operands, args.iters)
                except Exception as e:   # a tiling that does not fit is reported, the others still run
                    print(f"    {name:18} FAILED {type(e).__name__}: {str(e)[:200]}")
                    row["fused"][name] = dict(error=str(e)[:500])
                    continue
                fused = (trace_f or {}).get("collective_gemm_kernel_ms", float("nan"))
                print(f"    {name:18} fused {fused:.3f} ms ({wall_f:.3f} wall)  fused / GEMM {fused / gemm:.2f}  "
                      f"hides {(gemm + coll - fused) / coll:.0%} of NCCL  max |fused - XLA| {err:.3g}")
                row["fused"][name] = dict(kernel_ms=fused, wall_ms=wall_f, max_abs_diff=err)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
