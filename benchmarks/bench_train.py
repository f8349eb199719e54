"""Training-step time and tokens/s of the demo transformer with nvfp4 / fp8 / bf16 weights side by side,
and the cost of ``report_nan`` (step time with and without), on all visible devices (fsdp = all, tp = 1).

  python benchmarks/bench_train.py [--steps 30] [--d-model 1024 --d-ff 4096 --layers 4 --seq 512]
                                   [--batch-per-device 8] [--strategy optim_grads_params] [--json out.json]

Defaults are the ``jaxquant demo`` model; pass larger sizes for GEMM-bound timings on GPUs. Times are the
median of ``--steps`` steps after two warm-up (compile) steps (nvfp4 with and without ``report_nan``
timed interleaved); the batch is a fixed synthetic batch. On GPUs it also counts the FP8 step's GEMMs
by kind (cuBLASLt FP8, Triton, other cuBLAS).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import time

import jax
import numpy as np
import optax
from jax.sharding import Mesh

import jaxquant as jq
from jaxquant.cli import demo
from jaxquant.cli.bench import kernel_profile


def time_steps(steps_and_states, batch, rounds: int, per_round: int = 1, warmup: int = 2):
    """Median seconds per step of each (step, state) pair over ``rounds`` rounds, each dispatching
    ``per_round`` steps back to back and waiting for the last: ``per_round=1`` waits for every step;
    more overlaps host dispatch with the device, as a loop does that does not read the loss every step.
    Pairs are interleaved round by round, so that clock and thermal drift fall on all alike; each
    pair's ``warmup`` first steps (compile) are not timed. Returns (medians, final states)."""
    runs = [list(pair) for pair in steps_and_states]
    for run in runs:
        for _ in range(warmup):
            run[1], metrics = run[0](run[1], batch)
            jax.block_until_ready(metrics["loss"])
    times = [[] for _ in runs]
    for _ in range(rounds):
        for run, ts in zip(runs, times):
            t0 = time.perf_counter()
            for _ in range(per_round):
                run[1], metrics = run[0](run[1], batch)
            jax.block_until_ready(metrics["loss"])
            ts.append((time.perf_counter() - t0) / per_round)
    return [statistics.median(ts) for ts in times], [run[1] for run in runs]


def profile_steps(step, state, batch) -> dict:
    """kernel_profile of the step, run on a carried state (the step donates it)."""
    box = [state]

    def run(_):
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    return kernel_profile(run, None)


def print_report_nan_difference(plain: dict, nan: dict, top: int = 12):
    """The events whose device time differs most between the step without and with report_nan."""
    if not plain or not nan:
        return
    # stream ids differ between two executables: compare HLO ops, and kernels over all streams
    def merged(prof):
        kernels = collections.defaultdict(lambda: (0.0, 0))
        for line, events in prof.items():
            for name, (us, n) in events.items() if line.startswith("Stream") else ():
                kernels[name] = (kernels[name][0] + us, kernels[name][1] + n)
        return {"XLA Ops": prof.get("XLA Ops", {}), "kernels, all streams": dict(kernels)}

    plain, nan = merged(plain), merged(nan)
    for line in plain:
        a, b = plain[line], nan[line]
        busy_a, busy_b = (sum(us for us, _ in d.values()) for d in (a, b))
        print(f"\nreport_nan, [{line}]: busy {busy_a:.1f} -> {busy_b:.1f} µs per step "
              f"({busy_b - busy_a:+.1f} µs, {busy_b / max(busy_a, 1e-9) - 1:+.2%})")
        diff = {k: b.get(k, (0.0, 0))[0] - a.get(k, (0.0, 0))[0] for k in set(a) | set(b)}
        for name, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"    {d:+9.1f}  {name[:100]}")


def fp8_gemm_kinds(step, state, batch) -> dict:
    """How many GEMMs of the compiled step are cuBLASLt FP8 GEMMs, Triton GEMM fusions, other cuBLAS calls."""
    hlo = step.lower(state, batch).compile().as_text()
    return {"cublaslt_f8": hlo.count('custom_call_target="__cublas$lt$matmul$f8"'),
            "triton_gemm": sum(1 for ln in hlo.splitlines() if " fusion(" in ln and "triton_gemm" in ln),
            "cublas_other": sum(1 for ln in hlo.splitlines() if 'custom_call_target="__cublas' in ln
                                and "$f8" not in ln)}


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
    # the demo's model (scan over stacked blocks, embedding lookup) needs the layer-wise step
    ap.add_argument("--strategy", default="optim_grads_params", choices=("optim_grads_params",))
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="GPU: the kernels whose device time report_nan changes most (jax.profiler traces)")
    args = ap.parse_args()
    cfg = demo.ModelConfig(vocab=args.vocab, d_model=args.d_model, heads=args.heads, d_ff=args.d_ff,
                           layers=args.layers, seq=args.seq)
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tp"))
    batch_size = args.batch_per_device * len(devices)
    batch = demo.SyntheticData(cfg, batch_size).next()
    params = demo.init_params(jax.random.key(0), cfg)
    tokens = batch_size * cfg.seq
    rows, gemms = [], None

    def make(recipe, report_nan):
        step = jq.make_train_step(demo.loss_fn(cfg), optax.adam(1e-3), mesh=mesh, strategy=args.strategy,
                                  tp_axis="tp", report_nan=report_nan, quantize_mask=demo.quantize_mask(cfg),
                                  policy=jq.MixedPrecisionPolicy(compute_weights=recipe))
        return step, step.init(params)

    def row(recipe, report_nan, state, t):
        sent, sent_bf16 = demo.bytes_gathered(state.plan, recipe)
        return {"recipe": recipe, "report_nan": report_nan, "step_ms": t * 1e3, "tokens_per_s": tokens / t,
                "gathered_bytes": sent, "gathered_bytes_bf16": sent_bf16}

    # nvfp4 with and without report_nan, timed interleaved (their ratio is the report_nan cost)
    pairs = [make("nvfp4", False), make("nvfp4", True)]
    (t_plain, t_nan), states = time_steps(pairs, batch, args.steps)
    (p_plain, p_nan), states = time_steps([(s, st) for (s, _), st in zip(pairs, states)], batch, 5,
                                          per_round=args.steps, warmup=0)
    rows += [row("nvfp4", False, states[0], t_plain), row("nvfp4", True, states[1], t_nan)]
    if args.profile:
        profiles = [profile_steps(step, state, batch) for (step, _), state in zip(pairs, states)]
        print_report_nan_difference(*profiles)
    del pairs, states
    for recipe in ("fp8", "bf16"):
        step, state = make(recipe, False)
        (t,), (state,) = time_steps([(step, state)], batch, args.steps)
        rows.append(row(recipe, False, state, t))
        if recipe == "fp8" and devices[0].platform == "gpu":
            gemms = fp8_gemm_kinds(step, state, batch)
        del state
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    print(f"{len(devices)} x {devices[0].device_kind}, strategy {args.strategy}, {cfg}, {n_params:,} parameters, "
          f"batch {batch_size} x {cfg.seq} tokens")
    print(f"{'weights':8s} {'report_nan':>10s} {'step ms':>9s} {'tokens/s':>12s} {'gathered':>12s} {'vs bf16':>8s}")
    for r in rows:
        print(f"{r['recipe']:8s} {str(r['report_nan']):>10s} {r['step_ms']:9.3f} {r['tokens_per_s']:12,.0f} "
              f"{r['gathered_bytes']:12,d} {r['gathered_bytes'] / max(r['gathered_bytes_bf16'], 1):8.2f}")
    plain = next(r for r in rows if r["recipe"] == "nvfp4" and not r["report_nan"])
    nan = next(r for r in rows if r["report_nan"])
    cost = nan["step_ms"] / plain["step_ms"] - 1
    cost_pipelined = p_nan / p_plain - 1
    print(f"report_nan cost (nvfp4, timed interleaved): {cost * 100:+.2f}% of step time (each step waited for); "
          f"{cost_pipelined * 100:+.2f}% with steps dispatched back to back "
          f"({p_plain * 1e3:.3f} -> {p_nan * 1e3:.3f} ms)")
    if gemms is not None:
        print(f"fp8 step GEMMs: {gemms}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": devices[0].device_kind, "num_devices": len(devices), "strategy": args.strategy,
                       "config": dataclasses.asdict(cfg), "rows": rows,
                       "report_nan_cost": cost, "report_nan_cost_pipelined": cost_pipelined,
                       "fp8_gemms": gemms}, f, indent=1)


if __name__ == "__main__":
    main()
