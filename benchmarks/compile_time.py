"""How long each bench_e2e config takes to lower and compile, without allocating anything: the state and the batch
are ``jax.ShapeDtypeStruct`` s in the shardings the configs would give them, so the 13B shape's 40-layer `scan`
compiles on one GPU that could not hold its Adam state. One process per config (no compilation cache shared).

    python benchmarks/compile_time.py --configs plain-scan,jq-fp8,jq-bf16,jq-nvfp4 --layers 40 --hidden 5120 \\
        --heads 40 --kv-heads 40 --ffn 13824 --remat nothing_saved

Takes bench_e2e.py's options (shapes, ``--flags``, ``--devices``, ``--tiny``); prints a table of lower and compile
seconds. The issue's bound (the 40-layer `scan` compiles in at most 10 s) is about ``compile s`` (XLA's compile,
autotuning included on a GPU); ``lower s`` is JAX's tracing and lowering to StableHLO.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e as e2e  # noqa: E402


def compile_one(a, config) -> dict:
    """Lower and compile ``config``'s step on abstract inputs; the seconds each took."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = np.array(jax.devices()[:a.devices] if a.devices else jax.devices())
    mesh = Mesh(devices, ("fsdp",))
    fn, state = e2e.make_config(a, mesh, config, abstract=True)
    rows = NamedSharding(mesh, P("fsdp"))
    shape = (a.batch * mesh.size, a.seq, a.hidden)
    batch = {"x": jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rows),
             "y": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows)}
    t0 = time.perf_counter()
    lowered = fn.lower(state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"config": config, "lower_s": t1 - t0, "compile_s": t2 - t1, "layers": a.layers, "devices": mesh.size,
            "device": jax.devices()[0].device_kind}


def main(argv=None):
    a = e2e.parse_args(argv)
    if a.tp > 1 or a.process_counts != [1]:
        print("compile_time.py: one process, --tp 1 (the FSDP configs)", file=sys.stderr)
        return 2
    if a.one:
        print("RESULT " + json.dumps(compile_one(a, a.one)), flush=True)
        return 0
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    flag_sets = [f.strip() for f in a.flags.split(",") if f.strip()]
    bad = [c for c in configs if c not in e2e.CONFIGS + e2e.EXTRA_CONFIGS or "-sp" in c] + \
        [f for f in flag_sets if f not in e2e.FLAG_SETS]
    if bad:
        print(f"unknown or unsupported config or flag set: {bad}", file=sys.stderr)
        return 2
    describe = lambda r: f"lower {r['lower_s']:6.1f} s  compile {r['compile_s']:6.1f} s"
    results = e2e.run_configs(a, configs, flag_sets, __file__, sys.argv[1:] if argv is None else argv, describe)
    print("| flags | config | layers | lower s | compile s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in results:
        if "error" not in r:
            print(f"| {r['flags']} | {r['config']} | {r['layers']} | {r['lower_s']:.1f} | {r['compile_s']:.1f} |")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
