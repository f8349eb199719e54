"""Training-step time and tokens/s of the demo transformer with nvfp4 / fp8 / bf16 weights side by side,
and the cost of ``report_nan`` (step time with and without), on all visible devices (fsdp = all, tp = 1).

  python benchmarks/bench_train.py [--steps 30] [--d-model 1024 --d-ff 4096 --layers 4 --seq 512]
                                   [--batch-per-device 8] [--strategy optim_grads_params] [--json out.json]

Defaults are the ``jaxquant demo`` model; pass larger sizes for GEMM-bound timings on GPUs. Times are the
median of ``--steps`` steps after two warm-up (compile) steps; the batch is a fixed synthetic batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np
import optax
from jax.sharding import Mesh

import jaxquant as jq
from jaxquant import demo


def time_steps(step, state, batch, steps: int):
    """(median seconds per step, final state); the first two steps (compile, warm-up) are not timed."""
    for _ in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base = demo.ModelConfig()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--d-model", type=int, default=base.d_model)
    ap.add_argument("--d-ff", type=int, default=base.d_ff)
    ap.add_argument("--heads", type=int, default=base.heads)
    ap.add_argument("--layers", type=int, default=base.layers)
    ap.add_argument("--seq", type=int, default=base.seq)
    ap.add_argument("--vocab", type=int, default=base.vocab)
    ap.add_argument("--batch-per-device", type=int, default=2)
    ap.add_argument("--strategy", default="optim_grads_params",
                    choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = demo.ModelConfig(vocab=args.vocab, d_model=args.d_model, heads=args.heads, d_ff=args.d_ff,
                           layers=args.layers, seq=args.seq)
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tp"))
    batch_size = args.batch_per_device * len(devices)
    batch = demo.SyntheticData(cfg, batch_size).next()
    params = demo.init_params(jax.random.key(0), cfg)
    tokens = batch_size * cfg.seq
    rows = []
    runs = [(r, False) for r in ("nvfp4", "fp8", "bf16")] + [("nvfp4", True)]
    for recipe, report_nan in runs:
        step = jq.make_train_step(demo.loss_fn(cfg), optax.adam(1e-3), mesh=mesh, strategy=args.strategy,
                                  tp_axis="tp", report_nan=report_nan,
                                  policy=jq.MixedPrecisionPolicy(compute_weights=recipe))
        state = step.init(params)
        sent, sent_bf16 = (demo.bytes_gathered(state.plan, recipe) if args.strategy != "no_shard" else (0, 0))
        t, state = time_steps(step, state, batch, args.steps)
        rows.append({"recipe": recipe, "report_nan": report_nan, "step_ms": t * 1e3, "tokens_per_s": tokens / t,
                     "gathered_bytes": sent, "gathered_bytes_bf16": sent_bf16})
        del state
    n_params = sum(int(np.prod(p.shape)) for p in params.values())
    print(f"{len(devices)} x {devices[0].device_kind}, strategy {args.strategy}, {cfg}, {n_params:,} parameters, "
          f"batch {batch_size} x {cfg.seq} tokens")
    print(f"{'weights':8s} {'report_nan':>10s} {'step ms':>9s} {'tokens/s':>12s} {'gathered':>12s} {'vs bf16':>8s}")
    for r in rows:
        print(f"{r['recipe']:8s} {str(r['report_nan']):>10s} {r['step_ms']:9.3f} {r['tokens_per_s']:12,.0f} "
              f"{r['gathered_bytes']:12,d} {r['gathered_bytes'] / max(r['gathered_bytes_bf16'], 1):8.2f}")
    plain = next(r for r in rows if r["recipe"] == "nvfp4" and not r["report_nan"])
    nan = next(r for r in rows if r["report_nan"])
    cost = nan["step_ms"] / plain["step_ms"] - 1
    print(f"report_nan cost (nvfp4): {cost * 100:+.2f}% of step time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": devices[0].device_kind, "num_devices": len(devices), "strategy": args.strategy,
                       "config": dataclasses.asdict(cfg), "rows": rows,
                       "report_nan_cost": cost}, f, indent=1)


if __name__ == "__main__":
    main()
