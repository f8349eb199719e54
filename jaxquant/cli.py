"""The ``jaxquant`` command: ``demo`` (the main job) and ``ckpt`` (checkpoint tools)."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _force_host_devices(n: int) -> None:
    # XLA reads this when the first backend starts, so it must be set before any device use.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _timed(fn, *args, repeats: int = 5):
    import jax

    out = jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return out, best


DEMO_SHAPES = {
    # Linear weights of one transformer layer ([out, in]), scaled down by --scale.
    "q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096), "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096), "up_proj": (14336, 4096), "down_proj": (4096, 14336),
}


def run_demo(args) -> int:
    import jax
    import jax.numpy as jnp

    import jaxquant as jq

    devices = jax.devices()
    print(f"jaxquant {jq.__version__} on {len(devices)} x {devices[0].device_kind}; {jq._ffi.backend_summary()}")
    shapes = {k: (max(16, m // args.scale // 16 * 16), max(16, n // args.scale // 16 * 16))
              for k, (m, n) in DEMO_SHAPES.items()}
    key = jax.random.key(args.seed)
    weights = {}
    for name, shape in shapes.items():
        key, sub = jax.random.split(key)
        weights[name] = jax.random.normal(sub, shape, jnp.float32) * 0.02

    print(f"\n1) single-tensor quantization (compute dtype bf16), impl={args.impl}")
    header = f"{'weight':10s} {'shape':>12s} {'recipe':>7s} {'bytes':>10s} {'vs bf16':>8s} {'rel err':>9s} {'ms':>8s}"
    print(header)
    print("-" * len(header))
    fp8 = jax.jit(lambda w: jq.quantize_fp8(w, columnwise=True, compute_dtype=jnp.bfloat16, impl=args.impl))
    fp4 = jax.jit(lambda w: jq.quantize_nvfp4(w, columnwise=True, compute_dtype=jnp.bfloat16, impl=args.impl))
    for name, w in weights.items():
        ref = w.astype(jnp.bfloat16).astype(jnp.float32)
        bf16_bytes = w.size * 2
        for recipe, fn in (("fp8", fp8), ("nvfp4", fp4)):
            q, secs = _timed(fn, w)
            rowwise_bytes = q.data.nbytes + q.scale_inv.nbytes + q.amax.nbytes
            err = float(jnp.linalg.norm(q.dequantize() - ref) / jnp.linalg.norm(ref))
            print(f"{name:10s} {str(w.shape):>12s} {recipe:>7s} {rowwise_bytes:10d} "
                  f"{rowwise_bytes / bf16_bytes:8.3f} {err:9.4f} {secs * 1e3:8.2f}")

    if not hasattr(jq, "quantize_master_weights"):
        return 0
    return _demo_distributed(args, weights)


def _demo_distributed(args, weights) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxquant as jq

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("fsdp",))
    names = list(weights)
    layout = jq.FlatLayout([weights[n].shape for n in names], num_shards=len(devices))
    flat = jax.device_put(layout.flatten([weights[n] for n in names]), NamedSharding(mesh, P("fsdp")))
    print(f"\n2) ZeRO master weights: {len(names)} params in one flat fp32 buffer, "
          f"{len(devices)} shards of {layout.shard_size} elements")
    ok = True
    for recipe in ("fp8", "nvfp4"):
        fn = jax.jit(lambda f: jq.quantize_master_weights(f, layout, mesh=mesh, axis="fsdp", recipe=recipe,
                                                          compute_dtype=jnp.bfloat16, impl=args.impl))
        out, secs = _timed(fn, flat)
        single = jq.quantize_fp8 if recipe == "fp8" else jq.quantize_nvfp4
        same = all(
            np.array_equal(np.asarray(q.data).view(np.uint8),
                           np.asarray(single(weights[n], compute_dtype=jnp.bfloat16, impl=args.impl).data).view(np.uint8))
            for n, q in zip(names, out))
        ok &= same
        gathered = sum(q.data.nbytes for q in out)
        print(f"   {recipe:6s} gathered {gathered / 2**20:8.2f} MiB (bf16 would be "
              f"{sum(w.size * 2 for w in weights.values()) / 2**20:.2f} MiB)  {secs * 1e3:8.2f} ms  "
              f"bytes == single-tensor quantization: {same}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a layer's weights with both recipes and report sizes, errors, timings")
    demo.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when running on the CPU (default 8; ignored if XLA_FLAGS sets it)")
    demo.add_argument("--scale", type=int, default=8, help="divide the Llama-3-8B layer shapes by this (default 8)")
    demo.add_argument("--impl", choices=("auto", "reference", "custom_call"), default="auto")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=run_demo)
    from jaxquant.bench import configure_parser as configure_bench  # sets func=bench.run
    configure_bench(sub.add_parser("bench", help="time the quantizers against the memory floor and XLA"))
    try:
        from jaxquant.checkpoint.cli import add_ckpt_parser
    except ModuleNotFoundError as e:  # only while the checkpoint package is absent
        if not (e.name or "").startswith("jaxquant.checkpoint"):
            raise
    else:
        add_ckpt_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # First: SIGINT/SIGTERM become one exception (checkpoint writes clean up on it) and end in one line with
    # exit status 128 + signal number, not a traceback.
    from jaxquant.checkpoint.interrupt import Interrupted, cli_handlers, report

    try:
        with cli_handlers():
            args = build_parser().parse_args(argv)
            if getattr(args, "devices", None):
                _force_host_devices(args.devices)
            return int(args.func(args) or 0)
    except Interrupted as e:
        return report(f"jaxquant: interrupted by {e.signame}", e)


if __name__ == "__main__":
    sys.exit(main())
