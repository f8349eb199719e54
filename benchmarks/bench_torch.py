"""benchmarks/bench_e2e.py's model written in PyTorch and trained the way torchtitan trains it: FSDP2
(``fully_shard`` per block and on the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32
master weights and optimizer state sharded, bf16 compute), ``torch.compile`` per block and of the loss, optional
activation checkpointing per block, and, for ``torch-fp8``, torchao's float8 training (``convert_to_float8_training``,
tensorwise dynamic scaling by default). As torchtitan sets it up: float8 all-gather (FSDP2 gathering each weight
already in float8, ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step: one all-reduce for every
weight's scale) only where FSDP shards, i.e. over more than one rank; on one rank each compiled block casts its bf16
weights itself (``--fp8-all-gather on|off`` forces either way; ``--fp8-recipe rowwise``: torchao's rowwise recipe).

Configurations (bench_e2e.py runs them beside its own, ``--configs torch-bf16,torch-fp8``):
* ``torch-bf16``: the model above in bf16 (the plain baseline's PyTorch twin);
* ``torch-fp8``: the same with every block's four linears in float8 (torchao; missing: one line, exit 2).

Model: bench_e2e's, module for module: ``--layers`` pre-norm blocks, RMSNorm (statistics in fp32), one fused QKV
linear (``[(heads + 2 kv_heads) x 128, hidden]``), ``scaled_dot_product_attention`` (causal; the kv heads repeated
for grouped-query attention), the
output projection, one fused SwiGLU gate/up linear and the down projection, no bias, no embedding; the MSE of the last
block's output against a random fp32 target. Optimizer: Adam (torch's fused AdamW with weight decay 0 on CUDA), lr
1e-4, bench_e2e's. Every rank trains on its own ``--batch`` sequences of ``--seq`` tokens; the step time is the median
of ``--steps`` steps after two warm-up steps, each waited for (``.item()`` of the loss), as bench_e2e times its own.
Rows carry bench_e2e's fields (step ms, tokens/s, TFLOP/s per GPU from bench_e2e's ``model_flops``, peak GiB, compile s
= first step minus a median step, losses).

One process per GPU (``torch.multiprocessing``, NCCL); without a GPU one process on the CPU (gloo; a smoke run, no
``torch.compile`` unless ``--torch-compile on``).

``--profile DIR``: after the timed steps, ``PROFILE_STEPS`` more under ``torch.profiler`` (rank 0's trace in
``DIR/<flag set>/<config>/<config>.trace.json.gz``); the row's ``breakdown`` puts rank 0's kernels in
``breakdown.CATEGORIES`` (ms a step, as bench_e2e's JAX rows), with ``detail`` splitting them by where they were
launched from (``REGIONS``: the compiled blocks' forward / backward, FSDP2's hooks, the optimizer, ...).

    python benchmarks/bench_torch.py --configs torch-bf16,torch-fp8 --steps 6 [--profile DIR] [--json FILE]
    python benchmarks/bench_e2e.py --flags default --configs plain-loop,jq-fp8-loop,torch-bf16,torch-fp8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import bench_e2e as e2e  # noqa: E402
import breakdown  # noqa: E402

CONFIGS = ("torch-bf16", "torch-fp8")
TORCHAO = "torchao==0.18.0"     # the release this benchmark was written against (its float8 API; torch >= 2.11)
FP8_RECIPES = ("tensorwise", "rowwise")
# torchao's fastest recipe (one scale per tensor, cuBLAS's FP8 GEMM), the one torchtitan ran with the all-gather rule
# below until 2026-04; torchtitan's float8 converter has been rowwise only since (--fp8-recipe rowwise)
FP8_RECIPE = "tensorwise"
# auto: float8 all-gather only where FSDP shards (more than one rank), as torchtitan enables it. On one rank nothing
# is gathered, while the float8 cast in FSDP2's pre-all-gather hook runs eagerly, outside the compiled blocks, on the
# fp32 weights (in the forward and again for the backward's re-gather), plus the scales' precompute after each step:
# more kernel time and host time than the compiled blocks casting their bf16 weights themselves
FP8_ALL_GATHER = "auto"
PROFILE_STEPS = 3


def parse_args(argv=None):
    """bench_e2e's options (the shape flags, --steps, --remat, --devices, --tiny, --json) and this file's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto",
                     help="torch.compile each block (auto: on a GPU, not on the CPU)")
    pre.add_argument("--compile-loss", choices=("auto", "on", "off"), default="auto",
                     help="torch.compile the loss (auto: where the blocks are compiled, as torchtitan does)")
    pre.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=FP8_RECIPE, help="torchao's float8 recipe")
    pre.add_argument("--fp8-all-gather", choices=("auto", "on", "off"), default=FP8_ALL_GATHER,
                     help="FSDP2 gathers the weights in float8, their scales precomputed after each step (auto: with "
                          "more than one rank, as torchtitan)")
    m, rest = pre.parse_known_args(argv)
    given = {x.split("=")[0] for x in rest}
    a = e2e.parse_args((["--configs", ",".join(CONFIGS)] if "--configs" not in given else []) + rest)
    a.torch_compile, a.compile_loss = m.torch_compile, m.compile_loss
    a.fp8_recipe, a.fp8_all_gather = m.fp8_recipe, m.fp8_all_gather
    return a


def fp8_all_gather(a, world):
    """Whether FSDP2 gathers the float8 weights in float8 (and their scales are precomputed after each step)."""
    return a.fp8_all_gather == "on" or (a.fp8_all_gather == "auto" and world > 1)


def float8_config(a, world, emulate):
    """torchao's ``Float8LinearConfig`` for ``a.fp8_recipe`` (``emulate``: matmuls in high precision, for the CPU)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    if a.fp8_recipe == "rowwise":
        return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    return Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather(a, world), emulate=emulate)


def missing_requirement(config):
    """None, or the one line saying what ``config`` needs that this Python lacks."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return f"bench_torch.py: {config} needs PyTorch (pip install torch); it is not installed"
    if config == "torch-fp8":
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            return (f"bench_torch.py: torch-fp8 needs torchao's float8 training (pip install {TORCHAO}, for torch "
                    f">= 2.11); torchao is not installed")
    return None


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


def build_model(a, init=None, device="cpu"):
    """The model (fp32 parameters, made on ``device``): ``init`` bench_e2e's ``init_params(a, stacked=False)`` as numpy
    arrays (``{"blocks": [{"w_qkv": [out, in], ..., "attn_norm": [1, hidden], ...}]}``; torch's Linear weight is the
    same ``[out, in]``), or None: bench_e2e's distribution (normal / sqrt(in), norm scales 1) from torch's generator."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    shapes = e2e.shapes(a)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(a.hidden))

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.float()).to(x.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            linear = lambda name: nn.Linear(shapes[name][1], shapes[name][0], bias=False)
            self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
            self.w_qkv, self.w_o, self.w_gate_up, self.w_down = (linear(n) for n in
                                                                 ("w_qkv", "w_o", "w_gate_up", "w_down"))

        def forward(self, h):
            b, s, _ = h.shape
            qkv = self.w_qkv(self.attn_norm(h)).view(b, s, a.heads + 2 * a.kv_heads, a.head_dim)
            q, k, v = (t.transpose(1, 2) for t in qkv.split([a.heads, a.kv_heads, a.kv_heads], dim=2))
            # each kv head serves heads / kv_heads consecutive query heads (jax.nn.dot_product_attention's grouping),
            # repeated as torchtitan's Llama does, so that SDPA's flash kernels take it
            k, v = (t.repeat_interleave(a.heads // a.kv_heads, dim=1) for t in (k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.w_o(o.transpose(1, 2).reshape(b, s, -1))
            gate, up = self.w_gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
            return h + self.w_down(F.silu(gate) * up)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    with torch.device(device):
        model = Model()
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            for name, param in block.named_parameters():
                key = name.split(".")[0]
                if init is not None:
                    param.copy_(torch.from_numpy(np.array(init["blocks"][i][key], np.float32)).reshape(param.shape))
                elif key.startswith("w_"):
                    param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]))
    return model


def mse(y, target):
    return (y.float() - target).pow(2).mean()


# ----------------------------------------------------------------------------------------------
# One config, one process per device
# ----------------------------------------------------------------------------------------------


def prepare(a, config, model, mesh, compile_blocks):
    """Apply, in torchtitan's order, float8 (torch-fp8), activation checkpointing (``--remat``), ``torch.compile``
    and FSDP2 to ``model`` (on its device); returns the optimizer and the after-step hook."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    after_step = lambda: None
    inductor = {}   # inductor options, given through torch.compile's public ``options``
    if config == "torch-fp8":
        from torchao.float8 import convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

        # on the CPU torchao emulates the float8 GEMMs (torch._scaled_mm needs a GPU of compute capability 8.9 or more)
        fp8 = float8_config(a, mesh.size(), emulate=model_device(model).type != "cuda")
        convert_to_float8_training(model, config=fp8)
        if fp8.enable_fsdp_float8_all_gather:
            after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)
        if a.fp8_recipe == "rowwise":
            # torchtitan's setting for rowwise: inductor rounds its casts as eager does (pytorch/pytorch#150859)
            inductor["emulate_precision_casts"] = True
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if compile_blocks:
        # each block is compiled on its own and dynamo counted blocks past the first as recompiles of the same code:
        # past its limit (8) a fullgraph compile fails (seen at 40 layers with torchao's Float8Linear on 2 GPUs).
        # torch has no public setting for the limit; this is the one its torch.compile troubleshooting page names.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(model.blocks) + 8)
    for i, block in enumerate(model.blocks):
        if a.remat is not None:
            block = Checkpointed(block)
        if compile_blocks:
            # the wrapper compiled (its Float8Linears with it: their input and gradient casts are fused into the
            # block's kernels), FSDP's gather and free hooks on it stay outside the compiled graph
            block = torch.compile(block, fullgraph=True, options=inductor or None)
        fully_shard(block, mesh=mesh, mp_policy=policy)
        model.blocks[i] = block
    fully_shard(model, mesh=mesh, mp_policy=policy)
    fused = model_device(model).type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=fused)
    return opt, after_step


def _checkpointed_class():
    import torch
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        """Full activation checkpointing of one block: only its input is kept for the backward, which runs the
        block's forward again."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    return Checkpointed


def Checkpointed(inner):  # noqa: N802 (a class made where torch is imported)
    return _checkpointed_class()(inner)


def model_device(model):
    return next(model.parameters()).device


def train(a, config, rank=0, world=1, init=None, batch=None, cpu=False):
    """Run ``config`` in this process as rank ``rank`` of ``world`` (the process group already initialized); returns
    bench_e2e's result row (rank 0's memory). ``init``: bench_e2e's parameters (numpy), ``batch``: ``{"x": [batch,
    seq, hidden], "y": ...}`` numpy arrays of this rank's rows (default: random, seeded by the rank)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import record_function

    cuda = torch.cuda.is_available() and not cpu
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    compile_blocks = a.torch_compile == "on" or (a.torch_compile == "auto" and cuda)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)                               # every rank builds the same model before sharding it
    model = build_model(a, init, device)
    opt, after_step = prepare(a, config, model, mesh, compile_blocks)
    if batch is None:
        gen = torch.Generator(device=device).manual_seed(7 + rank)
        shape = (a.batch, a.seq, a.hidden)
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
        y = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    else:
        x = torch.from_numpy(np.array(batch["x"], np.float32)).to(device, torch.bfloat16)
        y = torch.from_numpy(np.array(batch["y"], np.float32)).to(device)

    compile_loss = a.compile_loss == "on" or (a.compile_loss == "auto" and compile_blocks)
    # torchtitan compiles the loss beside the blocks: its casts, square and mean, forward and backward, fused.
    # fullgraph, as the blocks: a graph break raises instead of running part of the step eagerly unseen
    loss_fn = torch.compile(mse, fullgraph=True) if compile_loss else mse

    def step():
        # the record_function scopes name where rank 0's kernels came from in --profile's breakdown
        out = model(x)
        with record_function("bench_torch::loss"):
            loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with record_function("bench_torch::precompute_scales"):
            after_step()
        # every rank's own loss averaged, as the JAX step's loss is the mean over the global batch
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM)
        return float(loss) / (1 if cuda else world)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses = [step()]
    first = time.perf_counter() - t0
    losses.append(step())
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(a.steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    # a step bound by the host (FSDP2's hooks, the compiled graphs' wrappers) varies from step to step and from run
    # to run: every step's time and the process's minor page faults a step (fresh host buffers) show it
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / max(a.steps, 1)
    step_s = statistics.median(times)
    tokens = a.batch * world * a.seq
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else 0.0
    parts = profile_steps(a, config, step, rank, cuda) if a.profile else None
    return {"config": config, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
            "tflops_per_gpu": e2e.model_flops(a, tokens) / step_s / world / 1e12, "compile_s": first - step_s,
            "peak_gib": peak, "loss": losses[-1],
            "devices": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu", "trace": None,
            "clocks": None, "processes": world, "losses": losses, "torch": torch.__version__,
            "torchao": _torchao_version() if config == "torch-fp8" else None, "compiled": compile_blocks,
            "compiled_loss": compile_loss, "step_ms_each": [t * 1e3 for t in times],
            "minor_faults_per_step": faults,
            **({"fp8_recipe": a.fp8_recipe, "fp8_all_gather": fp8_all_gather(a, world)} if config == "torch-fp8"
               else {}),
            **({"breakdown": parts} if parts is not None else {})}


# ----------------------------------------------------------------------------------------------
# --profile: where rank 0's kernel time goes
# ----------------------------------------------------------------------------------------------

# Where a kernel was launched from: the first rule any enclosing CPU scope (a ``record_function`` range or an op on
# the launching thread) matches, by name prefix, else ``eager_other`` (the loss's backward when it is not compiled,
# zero_grad, the loss's all-reduce). The compiled loss's backward runs as a ``CompiledFunctionBackward`` too.
REGIONS = (("optimizer", ("Optimizer.",)), ("fp8_scales", ("bench_torch::precompute_scales",)),
           ("loss", ("bench_torch::loss",)), ("fsdp_hooks", ("FSDP::",)),
           ("compiled_bwd", ("CompiledFunctionBackward",
                             "autograd::engine::evaluate_function: CompiledFunctionBackward")),
           ("compiled_fwd", ("CompiledFunction", "Torch-Compiled Region", "## Call CompiledFxGraph")))
# scopes whose kernels are float8 casting: torchao's cast to float8 (eager in FSDP2's pre-all-gather hook)
QUANT_SCOPES = ("_ToFloat8ConstrFunc",)
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
AMAX_OPS = {"aten::abs", "aten::amax", "aten::max", "aten::linalg_vector_norm", "aten::_foreach_norm"}
GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|wgmma|^triton_tem", re.I)
LOW_PRECISION_KERNEL = re.compile(r"e4m3|e5m2|f8f8|fp8|float8", re.I)
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|sdpa", re.I)
# inductor names a fused kernel after the aten ops in it: an amax reads abs + max, a float8 cast clamps
QUANT_TRITON = re.compile(r"abs|amax|clamp|reciprocal")
COPY_KERNEL = re.compile(r"copy|memcpy|memset|cat|split_with_sizes|fill", re.I)


def kernel_kind(name, op, scopes, region):
    """One of ``breakdown.CATEGORIES``' kernel categories for a kernel ``name`` launched by the aten op ``op`` (''
    when unknown) under the CPU ``scopes`` (names) in ``region`` (``REGIONS``'), or ``copy`` (counted with
    ``norm_elementwise``, as breakdown counts XLA's copies) or ``collective``."""
    if "nccl" in name.lower():
        return "collective"
    if op == "aten::_scaled_mm":
        return "fp8_gemm"
    if op in GEMM_OPS:
        return "bf16_gemm"
    if any(t in op for t in ATTENTION_OPS) or ATTENTION_KERNEL.search(name):
        return "attention"
    if GEMM_KERNEL.search(name):
        return "fp8_gemm" if LOW_PRECISION_KERNEL.search(name) else "bf16_gemm"
    if region == "optimizer":
        return "optimizer"
    if region == "fp8_scales" or op in AMAX_OPS or any(q in s for s in scopes for q in QUANT_SCOPES) \
            or (name.startswith("triton_") and QUANT_TRITON.search(name)):
        return "quantize"
    if COPY_KERNEL.search(name) and not name.startswith("triton_"):
        return "copy"
    return "norm_elementwise"


def torch_breakdown(events, steps, wall_s=None):
    """bench_e2e's ``breakdown`` dict (``breakdown.CATEGORIES``, ms a step) of a torch.profiler chrome trace's
    ``events`` over ``steps`` steps: every GPU kernel, memcpy and memset by ``kernel_kind``; the collectives' total
    and exposed time and the idle time by breakdown's interval logic. ``detail``: the span and wall time a step,
    kernels a step, each region's ms by kind (``REGIONS``; a kernel is tied to its launch through the CUDA
    runtime / driver call of the same ``correlation``, and to its aten op through ``External id``), the idle ms
    by the region of the kernel after each gap (``idle_before``), the largest kernels and gaps."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ms = {c: 0.0 for c in breakdown.CATEGORIES}
    detail = {"span_ms": 0.0, "wall_ms": wall_s * 1e3 / steps if wall_s else None, "kernels_per_step": 0.0,
              "regions": {}, "copy_ms": 0.0, "top_kernels": [], "largest_gaps": [], "idle_before": {},
              "attributed_by": {"launch": 0, "name": 0}}
    if not gpu:
        return ms | {"detail": detail}
    ops = {e["args"]["External id"]: e["name"] for e in events
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    prefixes = tuple(p for _, ps in REGIONS for p in ps) + QUANT_SCOPES
    scopes_by_thread = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and e["name"].startswith(prefixes):
            scopes_by_thread.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e["dur"],
                                                                                 e["name"]))
    per = lambda us: us / 1e3 / steps
    comm, comp, named, by_name, starts = [], [], [], {}, []
    for k in gpu:
        args = k.get("args", {})
        launch = launches.get(args.get("correlation"))
        t = launch["ts"] if launch else None
        scopes = [n for a, b, n in scopes_by_thread.get((launch.get("pid"), launch.get("tid")), ()) if a <= t <= b] \
            if launch else []
        detail["attributed_by"]["launch" if launch else "name"] += 1
        region = next((r for r, ps in REGIONS if any(n.startswith(ps) for n in scopes)), "eager_other")
        kind = kernel_kind(k["name"], ops.get(args.get("External id"), ""), scopes, region)
        if k.get("cat") == "gpu_memset":
            kind = "other"
        iv = (k["ts"], k["ts"] + k["dur"])
        named.append((iv, k["name"]))
        starts.append((iv, region))
        (comm if kind == "collective" else comp).append(iv)
        if kind != "collective":
            ms["norm_elementwise" if kind == "copy" else kind] += per(k["dur"])
        detail["copy_ms"] += per(k["dur"]) if kind == "copy" else 0.0
        cell = detail["regions"].setdefault(region, {})
        cell[kind] = cell.get(kind, 0.0) + per(k["dur"])
        total, count = by_name.get(k["name"], (0.0, 0))
        by_name[k["name"]] = (total + k["dur"], count + 1)
    total, hidden = breakdown.collective_times(comm, comp)
    ms["collective_total"], ms["collective_exposed"] = per(total), per(total - hidden)
    busy = breakdown.merge(sorted(iv for iv, _ in named))
    gaps = breakdown.idle_gaps(busy, named, steps)
    ms["idle"] = gaps["idle_ms"]
    detail["largest_gaps"] = gaps["largest_gaps"]
    # what the GPU waited for: each idle gap counted to the region of the kernel that ends it (a gap before FSDP's
    # post-backward kernels is the host still in that hook while the GPU has run out of work)
    idle_before, end = {}, None
    for (a, b), region in sorted(starts):
        if end is not None and a > end:
            idle_before[region] = idle_before.get(region, 0.0) + per(a - end)
        end = b if end is None else max(end, b)
    detail["idle_before"] = idle_before
    detail["span_ms"] = per(busy[-1][1] - busy[0][0])
    detail["kernels_per_step"] = len(gpu) / steps
    detail["top_kernels"] = [(n[:80], round(per(t), 3), c // steps) for n, (t, c) in
                             sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]]
    return ms | {"detail": detail}


def profile_steps(a, config, step, rank, cuda, steps=PROFILE_STEPS):
    """``steps`` more steps under torch.profiler; rank 0 writes the trace (``--profile``'s folder) and returns
    ``torch_breakdown``'s dict of it (the other ranks None)."""
    import gzip

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if rank != 0:
        return None
    folder = os.path.join(a.profile, a.flag_set, config)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{config}.trace.json.gz")
    prof.export_chrome_trace(path)
    with gzip.open(path) as f:
        events = json.load(f)
    try:
        parts = torch_breakdown(events.get("traceEvents", events) if isinstance(events, dict) else events, steps,
                                wall)
    except Exception as err:          # a trace this reading does not know: the run's numbers stand, the trace is kept
        print(f"bench_torch.py: {config}: no breakdown of {path}: {type(err).__name__}: {err}", file=sys.stderr)
        return None
    with open(os.path.join(folder, "breakdown.json"), "w") as f:
        json.dump(parts, f, indent=1)
    return parts


def region_table(rows):
    """Markdown: ms a step of each (region, kind) cell of the rows' ``breakdown["detail"]["regions"]``, one column
    per (name, breakdown) row."""
    cells = sorted({(r, k) for _, b in rows for r, kinds in b["detail"]["regions"].items() for k in kinds})
    out = ["| region / kind | " + " | ".join(n for n, _ in rows) + " |", "| --- |" + " ---: |" * len(rows)]
    for r, k in cells:
        out.append(f"| {r} / {k} | " + " | ".join(f"{b['detail']['regions'].get(r, {}).get(k, 0.0):.2f}"
                                               for _, b in rows) + " |")
    return "\n".join(out)


def _torchao_version():
    import torchao

    return getattr(torchao, "__version__", "unknown")


def _worker(rank, world, port, a, config, queue):
    """One process of a run: the process group, ``train``, rank 0's row (or the error) onto ``queue``."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))
    try:
        row = train(a, config, rank, world)
        if rank == 0:
            queue.put(("ok", row))
    except BaseException as err:                       # the parent prints it
        queue.put(("error", f"rank {rank}: {type(err).__name__}: {err}"))
        raise
    finally:
        dist.destroy_process_group()


def run_config(a, config):
    """``config``'s row, one process per visible GPU (``--devices N``: the first N), or one CPU process."""
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() or 1
    if a.devices:
        world = min(world, a.devices)
    with socket.socket() as sock:       # a free port for the process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, a, config, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    messages = []
    while any(p.is_alive() for p in procs) or not queue.empty():
        # read while they run: a rank blocked on a full pipe would never exit
        while not queue.empty():
            messages.append(queue.get())
        for p in procs:
            p.join(timeout=0.2)
    errors = [msg for kind, msg in messages if kind == "error"]
    rows = [msg for kind, msg in messages if kind == "ok"]
    if errors or not rows or any(p.exitcode for p in procs):
        raise SystemExit(errors[0][:2000] if errors else
                         f"bench_torch.py: {config}: ranks exited with {[p.exitcode for p in procs]}")
    return rows[0]


def run_in_process(a, config, init=None, batch=None):
    """``train`` in this process as the only rank of a gloo group on the CPU (the tests' entry)."""
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        return train(a, config, init=init, batch=batch, cpu=True)
    finally:
        dist.destroy_process_group()


def check_args(a, configs):
    """None, or the one line saying why these options cannot run here."""
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        return f"bench_torch.py: unknown config {bad} (configs: {CONFIGS})"
    if a.tp != 1:
        return "bench_torch.py: --tp is not supported (FSDP2 over every GPU only)"
    if a.remat not in (None, "nothing_saved"):
        return f"bench_torch.py: --remat {a.remat}: only nothing_saved (full activation checkpointing per block)"
    if a.pipelined or a.process_counts != [1]:
        return "bench_torch.py: --pipelined and --processes are not supported"
    if "torch-fp8" in configs and a.fp8_recipe != "tensorwise" and a.fp8_all_gather == "on":
        return ("bench_torch.py: --fp8-all-gather on needs --fp8-recipe tensorwise (torchao gathers float8 weights "
                "with one scale each)")
    return None


def main(argv=None):
    a = parse_args(argv)
    configs = [a.one] if a.one else [c.strip() for c in a.configs.split(",") if c.strip()]
    problem = check_args(a, configs) or next(filter(None, map(missing_requirement, configs)), None)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    rows = []
    for config in configs:
        row = run_config(a, config)
        rows.append(row)
        print(("RESULT " + json.dumps(row)) if a.one else
              f"{config:12s} {row['step_ms']:8.1f} ms  {row['tflops_per_gpu']:6.0f} TFLOP/s  "
              f"{row['peak_gib']:6.1f} GiB  compile {row['compile_s']:6.1f} s  loss {row['loss']:.6f}", flush=True)
        if a.json and not a.one:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "results": rows}, f, indent=1)
    profiled = [(r["config"], r["breakdown"]) for r in rows if r.get("breakdown")]
    if profiled and not a.one:
        print("\nWhere the step's time goes (rank 0's kernels, ms a step; benchmarks/breakdown.py's categories):")
        print(breakdown.table(profiled))
        print("\nBy where the kernels were launched from (bench_torch.REGIONS):")
        print(region_table(profiled))
        for name, b in profiled:
            d = b["detail"]
            waited = {r: round(ms, 2) for r, ms in sorted(d["idle_before"].items(), key=lambda kv: -kv[1])}
            print(f"{name}: wall {d['wall_ms']:.2f} ms a profiled step, {d['kernels_per_step']:.0f} kernels a step, "
                  f"idle ms a step before the kernels of {waited}, largest gaps {d['largest_gaps']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
