"""How long each bench_e2e config takes to lower and compile, without allocating anything: the state and the batch
are ``jax.ShapeDtypeStruct`` s in the shardings the configs would give them, so the 13B shape's 40-layer `scan`
compiles on one GPU that could not hold its Adam state. One process per config (no compilation cache shared).

    python benchmarks/compile_time.py --configs plain-scan,jq-fp8,jq-bf16,jq-nvfp4 --layers 40 --hidden 5120 \\
        --heads 40 --kv-heads 40 --ffn 13824 --remat nothing_saved

Takes bench_e2e.py's options (shapes, ``--flags``, ``--devices``, ``--tiny``); prints a table of lower and compile
seconds and of the compiled program's collectives: how many XLA left synchronous (nothing scheduled under them:
exposed whatever they cost) and how many it made asynchronous. ``--topology N`` compiles for N GPUs of the attached
GPU's kind that need not exist (``jax.experimental.topologies``' compile-only devices; nothing runs), so one GPU shows
a two-GPU step's schedule; ``--hlo DIR`` writes each config's compiled HLO there (``CONFIG.hlo.txt``).

    python benchmarks/compile_time.py --topology 2 --hlo /tmp/hlo --flags default --configs jq-fp8 --layers 40 \\
        --hidden 5120 --heads 40 --kv-heads 40 --ffn 13824 --remat nothing_saved

The issue's bound (the 40-layer `scan` compiles in at most 10 s) is about ``compile s`` (XLA's compile,
autotuning included on a GPU); ``lower s`` is JAX's tracing and lowering to StableHLO.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e as e2e  # noqa: E402
import breakdown  # noqa: E402


def compile_step(a, config):
    """Lower and compile ``config``'s step on abstract inputs (``a`` from :func:`parse_args`; with ``a.topology``, for
    that many compile-only GPUs); (lower seconds, compile seconds, the compiled HLO's text, device count)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if a.topology:
        from jax.experimental import topologies

        devices = np.array(topologies.get_topology_desc(platform="cuda", topology=f"1x1x{a.topology}").devices)
    else:
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
    hlo = lowered.compile().as_text()
    return t1 - t0, time.perf_counter() - t1, hlo, mesh.size


def compile_one(a, config) -> dict:
    """:func:`compile_step`'s seconds and collective counts (``breakdown.collective_counts``); the HLO written to
    ``a.hlo`` when given."""
    import jax

    lower_s, compile_s, hlo, devices = compile_step(a, config)
    if a.hlo:
        os.makedirs(a.hlo, exist_ok=True)
        with open(os.path.join(a.hlo, f"{config}.hlo.txt"), "w") as f:
            f.write(hlo)
    return {"config": config, "lower_s": lower_s, "compile_s": compile_s, "layers": a.layers, "devices": devices,
            "device": jax.devices()[0].device_kind} | breakdown.collective_counts(hlo)


def parse_args(argv=None):
    """bench_e2e.py's options, and this file's ``--topology`` and ``--hlo``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--topology", type=int, default=0, help="compile for N compile-only GPUs (0: the devices here)")
    pre.add_argument("--hlo", default=None, help="directory: each config's compiled HLO")
    own, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    a = e2e.parse_args(rest)
    a.topology, a.hlo = own.topology, own.hlo
    return a


def main(argv=None):
    a = parse_args(argv)
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
    describe = lambda r: (f"lower {r['lower_s']:6.1f} s  compile {r['compile_s']:6.1f} s  collectives sync "
                          f"{r['sync']} / async {r['async']}")
    results = e2e.run_configs(a, configs, flag_sets, __file__, sys.argv[1:] if argv is None else argv, describe)
    print("| flags | config | layers | devices | lower s | compile s | collectives sync / async |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        if "error" not in r:
            print(f"| {r['flags']} | {r['config']} | {r['layers']} | {r['devices']} | {r['lower_s']:.1f} | "
                  f"{r['compile_s']:.1f} | {r['sync']} / {r['async']} |")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
