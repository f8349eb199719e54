"""End-to-end training step: plain JAX bf16 (what a user writes without jaxquant) beside ``make_train_step``
with bf16 / FP8 / NVFP4 weights, on Llama-shaped decoder blocks, each configuration in its own process.

Model: ``--layers`` pre-norm decoder blocks (RMSNorm, attention with ``--heads`` query and ``--kv-heads``
key/value heads of 128, cuDNN flash attention on GPU, SwiGLU MLP of width ``--ffn``), MSE loss on the
last block's output, fp32 master weights + optax Adam, FSDP over every device (``--batch`` sequences of
``--seq`` tokens per device). No embedding (the issue's model; ``jaxquant demo`` has one).

Configurations:
* ``plain-loop``: fp32 params, one leaf per layer and matrix, ``NamedSharding(mesh, P("fsdp", None))``,
  cast to bf16 inside the loss, ``jax.jit`` (XLA inserts the gathers and reduce-scatters);
* ``plain-scan``: the same with stacked ``[L, out, in]`` params sharded ``P(None, "fsdp", None)`` under
  ``jax.lax.scan`` (MaxText's form);
* ``jq-bf16`` / ``jq-fp8`` / ``jq-nvfp4``: ``make_train_step`` (layer-wise FSDP) over stacked params under
  ``scan``; ``jq-*-loop`` the same with per-layer leaves. Gradients travel in bf16 (``--grad-comm``), as
  the plain step's do. ``jq-*-keep[-loop]``: ``reshard_after_forward=False`` (the backward reads the
  weights the forward gathered, as the plain step does, instead of gathering them again).

``× plain`` divides the fastest plain form's step time (same XLA flags) by the config's. TFLOP/s per GPU
counts model FLOPs: 6 x matrix parameters x tokens + 12 x layers x seq x hidden x tokens (attention
scores and values, forward + backward, causal mask not discounted); recomputation is not counted.

    python benchmarks/bench_e2e.py                       # every config, default XLA flags and MaxText's
    python benchmarks/bench_e2e.py --configs jq-fp8 --layers 40 --hidden 5120 --heads 40 --kv-heads 40 \\
        --ffn 13824 --remat                              # Llama-2-13B-shaped
CPU smoke: ``--tiny``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime

# the trace reading and interval logic (one copy, also the per-HLO-op breakdown of a profile); this folder
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import breakdown  # noqa: E402
from breakdown import (BARRIER_KERNEL, COLLECTIVE_GEMM_KERNEL, GEMM_KERNEL, collective_times, covered,  # noqa: E402
                       gpu0_events, idle_gaps, load_trace, merge)

CONFIGS = ("plain-loop", "plain-scan", "jq-bf16-loop", "jq-fp8-loop", "jq-nvfp4-loop", "jq-bf16", "jq-fp8", "jq-nvfp4")
# with --tp > 1: tensor parallelism inside make_train_step, with sequence parallelism (jq.sp_column_dense /
# jq.sp_row_dense: seq/tp positions per rank between the GEMMs) or without it (row-parallel psum)
# "-keep": make_train_step(reshard_after_forward=False), each layer's gathered weight kept for its backward
# "-once": make_train_step(quantize_once=True), every layer quantized once a step before the first microbatch
# (one packed amax all-reduce); "-peruse": quantize_once=False, every layer quantized where it is read (from the
# amax the update computed); neither: the library's default (None: NVFP4 once a step, FP8 where read)
# "-spfused": the sequence-parallel layers with overlap="fused" (collective GEMM kernels, docs/sp.md)
EXTRA_CONFIGS = (
    "jq-bf16-sp-loop", "jq-fp8-sp-loop", "jq-nvfp4-sp-loop", "jq-bf16-sp", "jq-fp8-sp", "jq-nvfp4-sp",
    "jq-bf16-spfused-loop", "jq-fp8-spfused-loop", "jq-bf16-spfused", "jq-fp8-spfused") + \
    tuple(f"jq-{r}-{mode}{form}" for mode in ("keep", "once", "peruse") for r in ("bf16", "fp8", "nvfp4")
          for form in ("-loop", ""))
# PyTorch peers of the same model (benchmarks/bench_torch.py, each config its own processes, one per GPU): FSDP2 +
# torch.compile in bf16, and the same with torchao's float8 training
TORCH_CONFIGS = ("torch-bf16", "torch-fp8")
EXTRA_CONFIGS += TORCH_CONFIGS
TP_SPLIT = {"w_qkv": "col", "w_o": "row", "w_gate_up": "col", "w_down": "row"}


def _tp_split(path):
    """"col", "row" or None: how the leaf at ``path`` splits over tp."""
    return TP_SPLIT.get(str(getattr(path[-1], "key", "")))


# MaxText's recommended XLA GPU flags (those this XLA still has)
MAXTEXT_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false "
                 "--xla_gpu_enable_while_loop_double_buffering=true --xla_gpu_enable_pipelined_all_gather=true "
                 "--xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_pipelined_all_reduce=true "
                 "--xla_gpu_all_gather_combine_threshold_bytes=134217728 "
                 "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728")
# "sync": every collective synchronous (nothing overlaps communication): the no-overlap baseline of a step
SYNC_FLAGS = "--xla_gpu_disable_async_collectives=ALLCOLLECTIVES"
# "pipelined-rs": only XLA's collective pipeliner for reduce-scatters in while loops (a scan iteration's gradient
# reduce-scatter moved into the next iteration, under its GEMMs), without MaxText's other flags
PIPELINED_RS_FLAGS = "--xla_gpu_enable_pipelined_reduce_scatter=true"
# "pipelined": the pipeliner for both a scan iteration's last reduce-scatter and its first all-gather (the next
# iteration's gather issued in this one), still without MaxText's combine thresholds and double buffering
PIPELINED_FLAGS = PIPELINED_RS_FLAGS + " --xla_gpu_enable_pipelined_all_gather=true"
# Scheduling A/Bs (none gained on 2 x H200: docs/fsdp.md): "overlap2", XLA's latency-hiding scheduler may keep two
# asynchronous collectives in flight at once (its default is one); "multistream", XLA runs collectives on more than
# one stream; "overlap2-multistream", both; "early", every collective started as early as its operands allow
OVERLAP2_FLAGS = "--xla_gpu_experimental_parallel_collective_overlap_limit=2"
EARLY_FLAGS = "--xla_gpu_experimental_collective_start_as_early_as_possible=true"
MULTISTREAM_FLAGS = "--xla_gpu_experimental_enable_collective_multi_streaming=true"
FLAG_SETS = {"default": "", "maxtext": MAXTEXT_FLAGS, "sync": SYNC_FLAGS, "pipelined-rs": PIPELINED_RS_FLAGS,
             "pipelined": PIPELINED_FLAGS, "overlap2": OVERLAP2_FLAGS, "multistream": MULTISTREAM_FLAGS,
             "overlap2-multistream": OVERLAP2_FLAGS + " " + MULTISTREAM_FLAGS, "early": EARLY_FLAGS}
# With --profile every config runs without CUDA command buffers: a kernel launched from a command buffer carries no
# HLO op in the trace, so breakdown.py could attribute only the kernels named after their fusion (most of a step went
# to "unattributed" on an H200 with jax 0.11.2); XLA then launches each kernel itself (docs/performance.md says what
# that changes in the step time).
PROFILE_FLAGS = "--xla_gpu_enable_command_buffer="


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {CONFIGS + EXTRA_CONFIGS}")
    p.add_argument("--flags", default="default,maxtext", help=f"comma list of XLA flag sets {tuple(FLAG_SETS)}")
    p.add_argument("--layers", type=int, default=4, help="decoder blocks")
    p.add_argument("--hidden", type=int, default=4096, help="model width")
    p.add_argument("--heads", type=int, default=32, help="query heads (of 128)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (of 128)")
    p.add_argument("--ffn", type=int, default=14336, help="SwiGLU hidden width")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per device")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (mesh fsdp x tp; the plain step shards "
                                                   "column/row-parallel weights over tp and lets GSPMD place the rest)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--pipelined", action="store_true", help="the mean of --steps steps dispatched back to back "
                   "and waited for once (a training loop that does not read each loss), not the median of steps "
                   "each waited for")
    p.add_argument("--remat", nargs="?", const="nothing_saved", default=None,
                   choices=("nothing_saved", "gemm_outputs", "quantized_activations"),
                   help="jax.checkpoint around each block with this jq.remat_policy (bare: nothing_saved); the plain "
                        "step keeps its dots' outputs for gemm_outputs and nothing otherwise")
    p.add_argument("--unroll", type=int, default=1, help="jax.lax.scan's unroll for the scan configs (layers per "
                   "while-loop iteration)")
    p.add_argument("--processes", default="1", help="comma list of process counts: each config runs once per count "
                   "(N > 1: N processes on this host under jax.distributed, one GPU each; --tiny: one CPU device "
                   "each) and the table compares each count's losses and step time with the first count's")
    p.add_argument("--devices", type=int, default=0, help="with one process, use the first N devices (0: all): "
                   "the 1-process reference of a --processes run on fewer devices than the machine has")
    p.add_argument("--grad-comm", default="bfloat16", choices=("bfloat16", "float32"),
                   help="jaxquant's grad_comm_dtype (the plain step reduce-scatters bf16 gradients)")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model (smoke test)")
    p.add_argument("--profile", default=None, help="directory: trace 3 steps of each config; report the exposed "
                                                   "collective time and the per-HLO-op breakdown from the trace (every "
                                                   "config then runs without CUDA command buffers: PROFILE_FLAGS)")
    p.add_argument("--gemms", nargs="?", const="", default=None, metavar="DIR",
                   help="after the timed steps, compile the step again (from the persistent compilation cache this "
                        "run then writes) and count its GEMMs by kind (gemm_kinds): whether XLA made FP8 cuBLASLt "
                        "calls of a config's FP8 ops; with DIR, also write each config's compiled HLO there")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--pgle", type=int, default=0, metavar="N",
                   help="JAX's profile-guided latency estimation: the step's first N runs are profiled and it is "
                        "compiled again with the measured op times, so that XLA's scheduler knows what custom calls "
                        "(jaxquant's GEMMs) cost when it overlaps collectives with them; N more warm-up steps")
    p.add_argument("--clocks", action="store_true", help="sample the GPUs' SM clock, power and temperature with "
                                                       "nvidia-smi while the steps are timed")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)     # child process: run this config
    p.add_argument("--nproc", type=int, default=1, help=argparse.SUPPRESS)   # child: its process count
    p.add_argument("--flag-set", default="default", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        # seq 256: each rank's 2 x 256 / tp rows fill the fused kernels' 256-row tiles at tp 2
        args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.seq, args.batch = 2, 256, 4, 2, 512, 256, 2
    args.head_dim = 128
    args.process_counts = [int(c) for c in args.processes.split(",")]
    args.processes = args.nproc
    return args


# ----------------------------------------------------------------------------------------------
# The model (one definition for both sides: ``matmul(x, w)`` is the only difference)
# ----------------------------------------------------------------------------------------------


def shapes(a):
    """Megatron / TransformerEngine layout: Q, K and V in one weight, the SwiGLU gate and up in one."""
    hd, e = a.head_dim, a.hidden
    return {"w_qkv": ((a.heads + 2 * a.kv_heads) * hd, e), "w_o": (e, a.heads * hd),
            "w_gate_up": (2 * a.ffn, e), "w_down": (e, a.ffn)}


def init_params(a, stacked: bool):
    import jax
    import jax.numpy as jnp

    layers = []
    for i in range(a.layers):
        ks = jax.random.split(jax.random.key(i), len(shapes(a)))
        layer = {n: jax.random.normal(k, s, jnp.float32) / math.sqrt(s[1]) for k, (n, s) in zip(ks, shapes(a).items())}
        layer |= {"attn_norm": jnp.ones((1, a.hidden), jnp.float32), "mlp_norm": jnp.ones((1, a.hidden), jnp.float32)}
        layers.append(layer)
    if stacked:
        return {"blocks": jax.tree.map(lambda *x: jnp.stack(x), *layers)}
    return {"blocks": layers}


def block(a, h, p, matmul, row=None, tp=1, constrain=None):
    """One decoder block; ``matmul`` the column-parallel (and, without ``row``, every) GEMM. Under TP
    (``tp`` > 1, per rank inside make_train_step) each rank holds ``heads / tp`` query and ``kv_heads / tp``
    key/value heads of its rows of the fused weights (a reordering of the plain model's rows: same FLOPs).
    ``constrain``: applied to q, k and v (the plain step's sharding constraint)."""
    import jax
    import jax.numpy as jnp

    row = row or matmul

    def norm(x, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * w).astype(jnp.bfloat16)

    heads, kv = a.heads // tp, a.kv_heads // tp
    x = norm(h, p["attn_norm"])
    qkv = matmul(x, p["w_qkv"])
    b, s = qkv.shape[:2]            # the whole sequence (sequence parallelism gathers it)
    qkv = qkv.reshape(b, s, heads + 2 * kv, a.head_dim)
    q, k, v = jnp.split(qkv, [heads, heads + kv], axis=2)
    if constrain is not None:
        q, k, v = constrain(q), constrain(k), constrain(v)
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl).reshape(b, s, -1)
    h = h + row(o, p["w_o"])
    gate, up = jnp.split(matmul(norm(h, p["mlp_norm"]), p["w_gate_up"]), 2, axis=-1)
    return h + row(jax.nn.silu(gate) * up, p["w_down"])


def forward(a, params, x, matmul, scan: bool, row=None, tp=1, plain=False, constrain=None):
    import jax

    import jaxquant as jq

    body = lambda h, p: (block(a, h, p, matmul, row, tp, constrain), None)
    if a.remat:
        policies = jax.checkpoint_policies
        policy = (({"gemm_outputs": policies.dots_with_no_batch_dims_saveable}).get(a.remat, policies.nothing_saveable)
                  if plain else jq.remat_policy(a.remat))
        body = jax.checkpoint(body, policy=policy)
    if scan:
        return jax.lax.scan(body, x, params["blocks"], unroll=a.unroll)[0]
    for p in params["blocks"]:
        x = body(x, p)[0]
    return x


def mse(y, target):
    import jax.numpy as jnp

    return jnp.mean(jnp.square(y.astype(jnp.float32) - target))


def model_flops(a, tokens):
    matrix_params = a.layers * sum(r * c for r, c in shapes(a).values())
    return 6 * matrix_params * tokens + 12 * a.layers * a.seq * a.hidden * tokens


# ----------------------------------------------------------------------------------------------
# One config (child process)
# ----------------------------------------------------------------------------------------------


def plain_opt_state(opt, params, param_shardings, mesh, abstract=False):
    """(state, shardings) of optax ``opt``'s state for the plain baselines, every moment sharded like its parameter
    (``param_shardings``: a tree of shardings like ``params``) and the rest (step counts) replicated. A bare
    ``jax.jit(opt.init)(params)`` returns the moments whole on the first device (the zeros read none of the sharded
    values; seen on 8 CPU devices: ``SingleDeviceSharding``, uncommitted). The first step's jit then places them
    as it chooses (seen: like the parameters), but device 0 held a whole copy of Adam's state first: in its peak
    memory, and out of memory where that copy does not fit one device. Jit the step with ``plain_step_shardings``:
    the moments then stay sharded because the step says so, not by XLA's choice."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    replicated = NamedSharding(mesh, P())
    shardings = optax.tree_map_params(opt, lambda _, s: s, jax.eval_shape(opt.init, params), param_shardings,
                                      transform_non_params=lambda x: jax.tree.map(lambda _: replicated, x))
    init = jax.jit(opt.init, out_shardings=shardings)
    return (jax.eval_shape(init, params) if abstract else init(params)), shardings


def plain_step_shardings(mesh, param_shardings, opt_shardings):
    """``out_shardings`` of a plain step returning ``((params, opt_state), loss)``: parameters and moments as
    ``plain_opt_state`` made them, step after step (left to XLA's propagation, nothing holds the moments sharded),
    the loss replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    return (param_shardings, opt_shardings), NamedSharding(mesh, P())


def _make_plain(a, mesh, scan, abstract=False):
    """(jitted step, state) of the plain baseline; ``abstract``: the state as ``jax.ShapeDtypeStruct`` s in its
    shardings (nothing allocated: for lowering and compiling a model that does not fit)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    lead = (None,) if scan else ()
    fsdp = int(mesh.shape["fsdp"])

    def spec(path, x):
        split = _tp_split(path) if a.tp > 1 else None
        if split == "col":      # [out, in]: out over tp, in over fsdp
            return P(*lead, "tp", "fsdp")
        if split == "row":      # in over tp, out over fsdp
            return P(*lead, "fsdp", "tp")
        return P(*lead, "fsdp", None) if x.shape[-2] % fsdp == 0 and x.shape[-2] > 1 else P()
    shapes_ = jax.eval_shape(lambda: init_params(a, stacked=scan))
    shardings = jax.tree_util.tree_map_with_path(lambda k, x: NamedSharding(mesh, spec(k, x)), shapes_)
    opt = adam()
    if abstract:
        params = abstract_like(shapes_, shardings)
        opt_state, opt_shardings = plain_opt_state(opt, params, shardings, mesh, abstract=True)
    else:     # built sharded (a large model does not fit one device whole)
        params = jax.jit(lambda: init_params(a, stacked=scan), out_shardings=shardings)()
        opt_state, opt_shardings = plain_opt_state(opt, params, shardings, mesh)
    state = (params, opt_state)
    matmul = lambda x, w: x @ w.astype(jnp.bfloat16).T
    # q, k and v split over the batch, as a JAX user pins activations: left to propagation, the fused QKV output of
    # the 13B shape (scan and loop alike) came sharded along its heads, split unevenly into q / k / v, which the
    # cuDNN attention refuses ("Query, key and value should have same sharding").
    batch_split = None if a.tp > 1 else (
        lambda t: jax.lax.with_sharding_constraint(t, NamedSharding(mesh, P("fsdp"))))

    def step(state, batch):
        params, opt_state = state
        loss_of = lambda p: mse(forward(a, p, batch["x"], matmul, scan, plain=True, constrain=batch_split), batch["y"])
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    out = plain_step_shardings(mesh, shardings, opt_shardings)
    return jax.jit(step, donate_argnums=0, out_shardings=out), state


def _tp_loss(a, scan, sp, overlap="off"):
    """The per-rank loss of make_train_step(tp_axis="tp"): with ``sp`` sequence parallelism (this rank's
    seq / tp positions between the GEMMs, the layers' ``overlap``; loss averaged over tp), else Megatron
    TP (row-parallel psum)."""
    import jax
    import jax.numpy as jnp

    import jaxquant as jq
    from jaxquant.primitives.varying import mark_varying

    if sp:
        col = lambda x, w: jq.sp_column_dense(x, w, tp_axis="tp", overlap=overlap)
        row = lambda x, w: jq.sp_row_dense(x, w, tp_axis="tp", overlap=overlap)
    else:
        col = lambda x, w: jq.dense(mark_varying(x, ("tp",)), w, amax_axes=("tp",))
        row = lambda x, w: jax.lax.psum(jq.dense(x, w, out_dtype=jnp.float32, amax_axes=("tp",)), "tp").astype(x.dtype)

    def loss(w, batch):
        x, y = batch["x"], batch["y"]
        if sp:
            rows = a.seq // a.tp
            start = jax.lax.axis_index("tp") * rows
            x, y = (jax.lax.dynamic_slice_in_dim(v, start, rows, axis=1) for v in (x, y))
        out = mse(forward(a, w, x, col, scan, row, a.tp), y)
        return jax.lax.pmean(out, "tp") if sp else out

    return loss


def _make_jq(a, mesh, recipe, scan, sp=False, keep=False, overlap="off", quantize_once=None, abstract=False):
    import jax

    import jaxquant as jq

    shapes_ = jax.eval_shape(lambda: init_params(a, stacked=scan))
    mask = jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), shapes_)
    # gradients travel in bf16, as the plain step's (the transpose of its bf16 weight gather)
    policy = jq.MixedPrecisionPolicy(compute_weights=recipe, grad_comm_dtype=a.grad_comm)
    if a.tp > 1:
        specs = jax.tree_util.tree_map_with_path(lambda k, _: _tp_split(k), shapes_)
        step = jq.make_train_step(_tp_loss(a, scan, sp, overlap), adam(), mesh=mesh, quantize_mask=mask,
                                  policy=policy, tp_axis="tp", param_specs=specs, reshard_after_forward=not keep,
                                  quantize_once=quantize_once)
    else:
        loss = lambda w, batch: mse(forward(a, w, batch["x"], jq.dense, scan), batch["y"])
        step = jq.make_train_step(loss, adam(), mesh=mesh, quantize_mask=mask, policy=policy,
                                  reshard_after_forward=not keep, quantize_once=quantize_once)
    return jq_runner(step, lambda: init_params(a, stacked=scan), abstract)


def adam():
    """Every config's optimizer: optax Adam, lr 1e-4, its update under the name scope that benchmarks/breakdown.py
    reports as ``optimizer`` (metadata only: the same compiled code)."""
    import optax

    return breakdown.scoped_optimizer(optax.adam(1e-4))


def jq_runner(step, init, abstract=False):
    """(run, state) of a make_train_step ``step``: the parameters built directly in the step's shardings (a large
    model does not fit one device whole); ``run(state, batch) -> (state, loss)``; ``run.lower(state, batch)`` the
    step's ``jax.stages.Lowered``. ``abstract``: the state as ``jax.ShapeDtypeStruct`` s in the shardings
    ``step.init`` gives (nothing allocated)."""
    import jax

    shapes_ = jax.eval_shape(init)
    shardings = step.master_shardings(shapes_)
    if abstract:
        params = abstract_like(shapes_, shardings)
        placed = jax.jit(step.init).lower(params).compile().output_shardings
        state = abstract_like(jax.eval_shape(step.init, params), placed)
    else:
        state = step.init(jax.jit(init, out_shardings=shardings)())

    def run(state, batch):
        state, metrics = step(state, batch)
        return state, metrics["loss"]

    run.lower = step.lower
    return run, state


def abstract_like(shapes, shardings):
    """``jax.ShapeDtypeStruct`` s of ``shapes``' shapes and dtypes in ``shardings`` (two trees alike): a state to lower
    and compile with, nothing allocated."""
    import jax

    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)


def make_config(a, mesh, config, abstract=False):
    """(jitted step, state) of a plain or jaxquant ``config`` (its name says the form and options: ``-loop``, the
    recipe, ``-sp`` / ``-spfused``, ``-keep``, ``-once``); ``abstract``: the state as ``jax.ShapeDtypeStruct`` s."""
    scan = not config.endswith("-loop")
    if config.startswith("plain"):
        return _make_plain(a, mesh, scan, abstract=abstract)
    return _make_jq(a, mesh, config.split("-")[1], scan, sp="-sp" in config, keep="-keep" in config,
                    overlap="fused" if "-spfused" in config else "off", quantize_once=_quantize_once(config),
                    abstract=abstract)


def _quantize_once(config):
    """``make_train_step``'s ``quantize_once`` for a config name: ``-once`` True, ``-peruse`` False, else None."""
    return True if "-once" in config else False if "-peruse" in config else None


def run_one(a, config, make_batch=None, flops=None):
    """Time ``config``'s step; ``make_batch(a, mesh)``: the batch the step reads (default: this model's x and y),
    ``flops(a, tokens)``: the model FLOPs of a step over ``tokens`` tokens (default ``model_flops``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if a.processes > 1:   # one device per process (GPU: the process's rank), as cluster launchers start them
        rank = int(os.environ["JQ_BENCH_RANK"])
        if a.tiny:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{os.environ['JQ_BENCH_PORT']}", num_processes=a.processes,
                                   process_id=rank, local_device_ids=None if a.tiny else [rank])
    devices = np.array(jax.devices()[:a.devices] if a.processes == 1 and a.devices else jax.devices())
    if len(devices) % a.tp:
        raise SystemExit(f"--tp {a.tp} does not divide the {len(devices)} devices")
    mesh = Mesh(devices.reshape(-1, a.tp), ("fsdp", "tp")) if a.tp > 1 else Mesh(devices, ("fsdp",))
    n = mesh.size
    if a.pgle:
        jax.config.update("jax_enable_pgle", True)
        jax.config.update("jax_pgle_profiling_runs", a.pgle)
    if a.gemms is not None:   # the second compile (below) reads this run's executable back, not compiling again
        import tempfile

        try:
            jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="bench-gemms-"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        except (AttributeError, ValueError) as err:    # another JAX: the second compile compiles again
            print(f"bench_e2e.py: --gemms without the persistent cache ({err})", file=sys.stderr)
    fn, state = make_config(a, mesh, config)
    kx, ky = jax.random.split(jax.random.key(7))
    shape = (a.batch * n, a.seq, a.hidden)
    # made in place (every process its own rows, the tp ranks of an fsdp rank the same rows)
    xy = lambda: {"x": jax.random.normal(kx, shape, jnp.bfloat16), "y": jax.random.normal(ky, shape, jnp.float32)}
    batch = make_batch(a, mesh) if make_batch else jax.jit(xy, out_shardings=NamedSharding(mesh, P("fsdp")))()
    t0 = time.perf_counter()
    state, loss = fn(state, batch)
    jax.block_until_ready(loss)
    first = time.perf_counter() - t0
    losses = [float(loss)]
    state, loss = fn(state, batch)
    losses.append(float(loss))
    for _ in range(a.pgle):   # the profiled runs; the step after them compiles again
        state, loss = fn(state, batch)
        losses.append(float(loss))
    times = []
    with ClockSampler(a.clocks) as clocks:
        if a.pipelined:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                state, loss = fn(state, batch)
            jax.block_until_ready((state, loss))
            times = [(time.perf_counter() - t0) / a.steps]
        else:
            for _ in range(a.steps):
                t0 = time.perf_counter()
                state, loss = fn(state, batch)
                jax.block_until_ready(loss)
                times.append(time.perf_counter() - t0)
                losses.append(float(loss))
    step_s = statistics.median(times)
    trace = parts = None
    if a.profile:
        path = os.path.join(a.profile, a.flag_set, config)
        with jax.profiler.trace(path, create_perfetto_trace=True):
            for _ in range(3):
                state, loss = fn(state, batch)
            jax.block_until_ready(loss)
        trace = exposed_collectives(path, steps=3)
        # the program traced, beside its trace: the HLO ops the breakdown attributes the kernels to
        hlo = fn.lower(state, batch).compile().as_text()
        with open(os.path.join(path, f"{config}.hlo.txt"), "w") as f:
            f.write(hlo)
        parts = breakdown.breakdown(path, hlo, steps=3)
        if trace is not None:     # what XLA's scheduler left synchronous (exposed whatever it costs)
            trace["collective_counts"] = breakdown.collective_counts(hlo)
    gemms = None
    if a.gemms is not None:
        hlo = fn.lower(state, batch).compile().as_text()
        gemms = gemm_kinds(hlo)
        if a.gemms:
            with open(os.path.join(a.gemms, f"{config}.hlo.txt"), "w") as f:
                f.write(hlo)
    stats = jax.local_devices()[0].memory_stats() or {}
    tokens = a.batch * n * a.seq
    return {"config": config, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
            "tflops_per_gpu": (flops or model_flops)(a, tokens) / step_s / n / 1e12, "compile_s": first - step_s,
            "peak_gib": stats.get("peak_bytes_in_use", 0) / 2 ** 30, "loss": float(loss), "devices": n,
            "device": jax.local_devices()[0].device_kind, "trace": trace, "clocks": clocks.summary(),
            "processes": a.processes, "losses": losses} | ({"breakdown": parts} if a.profile else {}) \
        | ({"gemms": gemms} if gemms is not None else {})


def gemm_kinds(hlo: str) -> dict:
    """GEMMs of a compiled (optimized) HLO module's text by kind, one count per instruction: ``cublaslt_f8``, XLA's
    FP8 cuBLASLt calls (``__cublas$lt$matmul$f8``, the FP8 GEMMs of a GPU); ``cublas_other``, its other cuBLAS GEMM
    calls (bf16 / fp32); ``dot`` and ``dot_f8``, dot instructions left in the module (in fusions XLA emits itself, on
    the CPU every GEMM), those with an FP8 operand apart."""
    counts = dict.fromkeys(("cublaslt_f8", "cublas_other", "dot", "dot_f8"), 0)
    for line in hlo.splitlines():
        if 'custom_call_target="__cublas$lt$matmul$f8"' in line:
            counts["cublaslt_f8"] += 1
        elif 'custom_call_target="__cublas$' in line:
            counts["cublas_other"] += 1
        elif " dot(" in line:
            operands = line.split(" dot(", 1)[1]
            counts["dot_f8" if "f8e4m3" in operands or "f8e5m2" in operands else "dot"] += 1
    return counts


class ClockSampler:
    """With ``on``, nvidia-smi samples the visible GPUs' SM clock, instantaneous power draw, temperature
    and clock-event reasons every 20 ms while the context is open; ``summary()`` summarizes the samples
    taken inside the context's body, ``between(t0, t1)`` those of any ``time.time()`` window (None when
    off, without nvidia-smi, or without samples): whether a step slows down because the GPUs clock down
    under sustained load, and whether the power cap is what clocks them down. (``power.draw`` is a
    one-second average, too slow for a window of a few hundred ms; ``power.draw.instant`` is not.)"""
    QUERY = "timestamp,index,clocks.sm,power.draw.instant,temperature.gpu,clocks_event_reasons.active"

    def __init__(self, on=True):
        self.exe = shutil.which("nvidia-smi") if on else None
        self.proc, self.text, self.window = None, "", (0.0, 0.0)

    def __enter__(self):
        if self.exe:
            gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            self.proc = subprocess.Popen([self.exe, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                          "-lms", "20", *(["-i", gpus] if gpus else [])],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            time.sleep(0.5)   # nvidia-smi's start-up, before the window opens
        self.window = (time.time(), 0.0)
        return self

    def __exit__(self, *exc):
        self.window = (self.window[0], time.time())
        if self.proc:
            self.proc.terminate()
            self.text = self.proc.communicate(timeout=10)[0]
        return False

    def between(self, t0, t1):
        return clock_summary(self.text, t0, t1)

    def summary(self):
        return self.between(*self.window)


def joules_per_step(clocks, step_ms):
    """Energy one GPU spends on a step, estimated as the mean instantaneous power of the timed window
    (``clock_summary``) times the step time; None without samples. Under the power cap a step takes
    about its energy over the cap, whatever overlaps."""
    return None if not clocks else round(clocks["power_w_mean"] * step_ms / 1e3, 3)


POWER_CAP_REASONS = 0x4 | 0x80   # nvidia-smi clock-event reasons: software power cap, hardware power brake


def clock_summary(text, t0, t1):
    """Mean and lowest SM clock (MHz), mean and highest power (W), highest temperature (C) and the share
    of samples clocked down by the power cap (None where nvidia-smi gave no reasons) over every GPU's
    nvidia-smi samples (``ClockSampler.QUERY`` lines, local-time stamps) taken between t0 and t1."""
    rows, capped = [], []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            stamp = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            mhz, watts, celsius = float(fields[2]), float(fields[3]), float(fields[4])
        except (ValueError, IndexError):   # a header, a cut line, "[N/A]"
            continue
        if t0 <= stamp <= t1:
            rows.append((mhz, watts, celsius))
            try:
                capped.append(bool(int(fields[5], 16) & POWER_CAP_REASONS))
            except (ValueError, IndexError):
                pass
    if not rows:
        return None
    mhz, watts, celsius = zip(*rows)
    return {"sm_mhz_mean": round(statistics.mean(mhz)), "sm_mhz_min": min(mhz),
            "power_w_mean": round(statistics.mean(watts), 1), "power_w_max": max(watts),
            "temp_c_max": max(celsius), "power_capped": round(sum(capped) / len(capped), 2) if capped else None,
            "samples": len(rows)}


def exposed_collectives(path, steps):
    """From the Perfetto trace of ``steps`` steps: per step, ms of collective (NCCL) kernels on GPU 0 and ms
    of them not overlapped by any other kernel of GPU 0 (exposed); kernel ms per kind: GEMM, collective
    GEMM (overlap="fused"'s kernels), cross-GPU barrier and other; the time GPU 0 runs no kernel between
    its first and last kernel (idle) and the largest such gaps with the kernels either side. (The trace reading
    and interval logic are benchmarks/breakdown.py's, which also attributes each kernel by its HLO op.)"""
    events = load_trace(path)
    if events is None:
        return None
    kernels = gpu0_events(events)
    if not kernels:
        return None
    by_kind = dict.fromkeys(("gemm", "collective_gemm", "barrier", "other"), 0.0)
    comm, comp, others, named, comm_named, every = [], [], {}, [], [], {}
    for e in kernels:
        name = e.get("name", "")
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        named.append((iv, name))
        ms_count = every.setdefault(name[:70], [0.0, 0])
        ms_count[0] += float(e["dur"])
        ms_count[1] += 1
        # the barrier's kernel name mentions NCCL too; it is the fused kernels' launch cost, not a collective
        if "nccl" in name.lower() and not BARRIER_KERNEL.search(name):
            comm.append(iv)
            comm_named.append((iv, name))
            continue
        comp.append(iv)
        kind = ("collective_gemm" if COLLECTIVE_GEMM_KERNEL.search(name)
                else "barrier" if BARRIER_KERNEL.search(name)
                else "gemm" if GEMM_KERNEL.search(name) else "other")
        by_kind[kind] += float(e["dur"])
        if kind == "other":
            others[name[:70]] = others.get(name[:70], 0.0) + float(e["dur"])
    total, hidden = collective_times(comm, comp)
    comp_u = merge(sorted(comp))
    busy_u = merge(sorted(comm + comp))
    busy = sum(b - a for a, b in busy_u)
    top = sorted(others.items(), key=lambda kv: -kv[1])[:6]
    exposed_by = {}   # per collective kernel: the time no computation overlaps it
    for (a, b), name in comm_named:
        key = name[:40]
        exposed_by[key] = exposed_by.get(key, 0.0) + (b - a) - covered(a, b, comp_u)
    # kernel times summed (GEMM and other kernels may overlap each other on several streams)
    return {"collective_ms": total / steps / 1e3, "exposed_collective_ms": (total - hidden) / steps / 1e3,
            "busy_ms": busy / steps / 1e3, "gemm_kernel_ms": by_kind["gemm"] / steps / 1e3,
            "other_kernel_ms": by_kind["other"] / steps / 1e3,
            "collective_gemm_kernel_ms": by_kind["collective_gemm"] / steps / 1e3,
            "barrier_kernel_ms": by_kind["barrier"] / steps / 1e3,
            "top_other_kernels": [(n, round(t / steps / 1e3, 3)) for n, t in top],
            "top_exposed_collectives": [(n, round(t / steps / 1e3, 3)) for n, t
                                        in sorted(exposed_by.items(), key=lambda kv: -kv[1])[:4] if t > 0],
            # every kernel of GPU 0 by name: (name, ms a step, launches a step), longest first; and the launches
            # a step in all (where a scan's step and a loop's step spend their time differently)
            "kernels": [(n, round(t / steps / 1e3, 3), round(c / steps, 1)) for n, (t, c)
                        in sorted(every.items(), key=lambda kv: -kv[1][0])],
            "kernels_per_step": len(named) // steps,
            **idle_gaps(busy_u, named, steps)}


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    a = parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(run_one(a, a.one)), flush=True)
        return 0
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS + EXTRA_CONFIGS]
    if a.tp == 1 and any("-sp" in c for c in configs):
        print("the -sp configs need --tp > 1 (sequence parallelism splits over the tp axis)", file=sys.stderr)
        return 2
    flag_sets = [f.strip() for f in a.flags.split(",") if f.strip()]
    bad += [f for f in flag_sets if f not in FLAG_SETS]
    if bad:
        print(f"unknown config or flag set: {bad}", file=sys.stderr)
        return 2
    results = run_configs(a, configs, flag_sets, __file__, sys.argv[1:] if argv is None else argv, describe)
    print_table(results, a)
    if a.profile:
        breakdown.report(results, a.profile)
    return 1 if any("error" in r for r in results) else 0


def describe(r) -> str:
    """A result's progress line after its flags and config."""
    t = r.get("trace")
    return (f"{r['step_ms']:8.1f} ms  {r['tflops_per_gpu']:6.0f} TFLOP/s  {r['peak_gib']:6.1f} GiB  "
            f"compile {r['compile_s']:6.1f} s"
            + (f"  collectives exposed / all {t['exposed_collective_ms']:.2f} / {t['collective_ms']:.2f} ms, "
               f"exposed most {t['top_exposed_collectives']}, "
               f"idle {t['idle_ms']:.2f} ms, largest gaps {t['largest_gaps']}" if t else "")
            + (f", collectives left synchronous / asynchronous {counts['sync']} / {counts['async']}"
               if (counts := (t or {}).get("collective_counts")) else "")
            + (f"  clocks {r['clocks']}, ~{joules_per_step(r['clocks'], r['step_ms'])} J a step a GPU"
               if r.get("clocks") else "")
            + (f"  GEMMs {r['gemms']}" if r.get("gemms") else ""))


def run_configs(a, configs, flag_sets, script, argv, describe):
    """Every config under every flag set, each in its own process of ``script`` (``--one CONFIG``, the flag set's
    XLA flags); prints ``describe(result)`` per config and writes ``--json`` after each (a run stopped by a time
    limit keeps what it measured). Returns the results (``{"error": ...}`` for a config that failed)."""
    results = []
    for flags in flag_sets:
        for config in configs:
            torch_peer = config in TORCH_CONFIGS
            if torch_peer and flags != flag_sets[0]:
                continue              # XLA's flags do not touch PyTorch: once is enough
            for nproc in getattr(a, "process_counts", [1])[:1] if torch_peer else getattr(a, "process_counts", [1]):
                env = dict(os.environ)
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG_SETS[flags]
                                    + (" --xla_force_host_platform_device_count=1" if nproc > 1 else "")
                                    + (" " + PROFILE_FLAGS if getattr(a, "profile", None) else "")).strip()
                child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_torch.py") if torch_peer \
                    else os.path.abspath(script)
                cmd = [sys.executable, child, *argv, "--one", config, "--flag-set", flags, "--nproc", str(nproc)]
                t0 = time.perf_counter()
                runs = run_processes(cmd, env, nproc)
                line = [l for l in runs[0][1].splitlines() if l.startswith("RESULT ")]   # process 0 reports
                label = config + (f" {nproc}x1" if nproc > 1 else "")
                # the first process that failed, else process 0 (no RESULT line)
                code, out, err = next((run for run in runs if run[0]), runs[0])
                if code or not line:
                    lines = (err or out).strip().splitlines()
                    # the last lines, and the error's own line when a long traceback pushed it out of them
                    cause = [l for l in lines[:-6] if re.search(r"Error|RESOURCE_EXHAUSTED|out of memory", l)][-1:]
                    tail = "\n".join(cause + lines[-6:])
                    took = time.perf_counter() - t0
                    print(f"{flags:8s} {label:16s} FAILED (exit {code}, {took:.0f} s):\n{tail}", flush=True)
                    results.append({"config": config, "flags": flags, "processes": nproc, "error": tail})
                else:
                    r = json.loads(line[0][7:]) | {"flags": flags}
                    results.append(r)
                    print(f"{flags:8s} {label:16s} {describe(r)}", flush=True)
                write_json(a, results)
    return results


def run_processes(cmd, env, nproc):
    """(exit code, stdout, stderr) of each of ``nproc`` processes of ``cmd`` (more than one: ranks 0.. under
    jax.distributed on a free localhost port; output into files, not pipes, so that no process stalls the
    others' collectives on a full pipe)."""
    import socket
    import tempfile

    if nproc == 1:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        return [(proc.returncode, proc.stdout, proc.stderr)]
    with socket.socket() as sock:   # a free port for the coordinator
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nproc)]
    procs = [subprocess.Popen(cmd, text=True, stdout=out, stderr=err,
                              env={**env, "JQ_BENCH_RANK": str(rank), "JQ_BENCH_PORT": str(port)})
             for rank, (out, err) in enumerate(logs)]
    results = []
    for p, (out, err) in zip(procs, logs):
        p.wait()
        out.seek(0), err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results


def write_json(a, results):
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


def print_table(results, a):
    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    print(f"\n{ok[0]['device']} x {ok[0]['devices']} (tp {a.tp}), {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, "
          f"seq {a.seq} x {a.batch} per device{f', remat {a.remat}' if a.remat else ''}")
    print("| flags | config | step ms | tokens/s | x plain | TFLOP/s/GPU | peak GiB | compile s | exposed coll. ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in ok:
        plains = [p["step_ms"] for p in ok if p["flags"] == r["flags"] and p["config"].startswith("plain")]
        ratio = f"{min(plains) / r['step_ms']:.2f}" if plains else "-"
        t = r.get("trace") or {}
        exposed = f"{t['exposed_collective_ms']:.2f} / {t['collective_ms']:.2f}" if t else "-"
        config = r["config"] + (f" ({r['processes']} processes)" if r.get("processes", 1) > 1 else "")
        print(f"| {r['flags']} | {config} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {ratio} | "
              f"{r['tflops_per_gpu']:.0f} | {r['peak_gib']:.1f} | {r['compile_s']:.1f} | {exposed} |")
    for line in overlap_rule(ok):
        print(line)
    for line in peer_rule(ok):
        print(line)
    for line in process_rule(ok):
        print(line)


def peer_rule(ok):
    """Per jaxquant config, same flags, against the PyTorch peer of its recipe (torch-bf16 for bf16 and NVFP4, which
    computes in bf16 on Hopper; torch-fp8 for FP8), and torch-fp8 against torch-bf16: the peer's step time over the
    config's."""
    torch_rows = {r["config"]: r for r in ok if r["config"] in TORCH_CONFIGS}
    for r in ok:
        if r["config"].startswith("jq-"):
            peer = torch_rows.get("torch-fp8" if r["config"].split("-")[1] == "fp8" else "torch-bf16")
            if peer:
                yield (f"{r['config']} ({r['flags']}): {peer['step_ms'] / r['step_ms']:.2f}x {peer['config']} "
                       f"({r['step_ms']:.1f} vs {peer['step_ms']:.1f} ms)")
    if len(torch_rows) == 2:
        bf16, fp8 = torch_rows["torch-bf16"], torch_rows["torch-fp8"]
        yield f"torch-fp8: {bf16['step_ms'] / fp8['step_ms']:.2f}x torch-bf16"


def process_rule(ok):
    """Per config run with several process counts: each count's step time and losses against the first
    count's (the issue's rule: N processes x 1 GPU within 3% of 1 process x N GPUs, the same losses)."""
    for r in ok:
        base = next((b for b in ok if b["config"] == r["config"] and b["flags"] == r["flags"]), None)
        if base is None or base is r or base.get("processes", 1) == r.get("processes", 1):
            continue
        diff = max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(r["losses"], base["losses"])), default=float("nan"))
        yield (f"{r['config']} ({r['flags']}): {r['processes']} processes x 1 device {r['step_ms']:.1f} ms vs "
               f"{base.get('processes', 1)} process {base['step_ms']:.1f} ms ({r['step_ms'] / base['step_ms']:.3f}x); "
               f"losses over {len(r['losses'])} steps differ by at most {diff:.2e} (relative)")


def overlap_rule(ok):
    """Per config measured under "sync" (no overlap) with a trace, and another run of it (or of its
    "-spfused" form: the same step with the tp collectives inside the GEMM kernels): what the overlap
    saves against the time the sync step spends in collective kernels (the issue's rule: >= 70%)."""
    sync = {r["config"]: r for r in ok if r["flags"] == "sync" and r.get("trace")}
    for r in ok:
        for base_config in dict.fromkeys((r["config"], r["config"].replace("-spfused", "-sp"))):
            base = sync.get(base_config)
            if base is None or base is r:
                continue
            coll, saved = base["trace"]["collective_ms"], base["step_ms"] - r["step_ms"]
            yield (f"{r['config']} ({r['flags']}) vs {base_config} (sync): saves {saved:.2f} ms of {coll:.2f} ms "
                   f"sync collectives ({saved / max(coll, 1e-9):.0%}; "
                   f"{'meets' if saved >= 0.7 * coll else 'MISSES'} the 70% rule)")


if __name__ == "__main__":
    sys.exit(main())
