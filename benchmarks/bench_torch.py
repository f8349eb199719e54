"""benchmarks/bench_e2e.py's model written in PyTorch and trained the way a PyTorch user would train it at scale:
FSDP2 (``fully_shard`` per block and on the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32
master weights and optimizer state sharded, bf16 compute), ``torch.compile`` per block, optional activation
checkpointing per block, and, for ``torch-fp8``, torchao's float8 training (``convert_to_float8_training`` with
tensorwise dynamic scaling, FSDP2 gathering the weights in float8, ``precompute_float8_dynamic_scale_for_fsdp`` after
each optimizer step: one all-reduce for every weight's scale).

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

    python benchmarks/bench_torch.py --configs torch-bf16,torch-fp8 --steps 6
    python benchmarks/bench_e2e.py --flags default --configs plain-loop,jq-fp8-loop,torch-bf16,torch-fp8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import bench_e2e as e2e  # noqa: E402

CONFIGS = ("torch-bf16", "torch-fp8")
TORCHAO = "torchao==0.18.0"     # the release this benchmark was written against (its float8 API; torch >= 2.11)


def parse_args(argv=None):
    """bench_e2e's options (the shape flags, --steps, --remat, --devices, --tiny, --json) and this file's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto",
                     help="torch.compile each block (auto: on a GPU, not on the CPU)")
    m, rest = pre.parse_known_args(argv)
    given = {x.split("=")[0] for x in rest}
    a = e2e.parse_args((["--configs", ",".join(CONFIGS)] if "--configs" not in given else []) + rest)
    a.torch_compile = m.torch_compile
    return a


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
    if config == "torch-fp8":
        from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                    precompute_float8_dynamic_scale_for_fsdp)

        # tensorwise dynamic scaling (the default recipe), FSDP2 gathering each weight already in float8; on the CPU
        # torchao emulates the float8 GEMMs (torch._scaled_mm needs a GPU of compute capability 8.9 or more)
        fp8 = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=model_device(model).type != "cuda")
        convert_to_float8_training(model, config=fp8)
        after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        if a.remat is not None:
            block = Checkpointed(block)
        if compile_blocks:
            # the wrapper compiled, FSDP's gather and free hooks on it stay outside the compiled graph
            block = torch.compile(block, fullgraph=True)
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

    def step():
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
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
    for _ in range(a.steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = a.batch * world * a.seq
    return {"config": config, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
            "tflops_per_gpu": e2e.model_flops(a, tokens) / step_s / world / 1e12, "compile_s": first - step_s,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else 0.0, "loss": losses[-1],
            "devices": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu", "trace": None,
            "clocks": None, "processes": world, "losses": losses, "torch": torch.__version__,
            "torchao": _torchao_version() if config == "torch-fp8" else None, "compiled": compile_blocks}


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
    if a.profile or a.pipelined or a.process_counts != [1]:
        return "bench_torch.py: --profile, --pipelined and --processes are not supported"
    return None


def main(argv=None):
    a = parse_args(argv)
    configs = [a.one] if a.one else [c.strip() for c in a.configs.split(",") if c.strip()]
    problem = check_args(a, configs) or next(filter(None, map(missing_requirement, configs)), None)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    for config in configs:
        row = run_config(a, config)
        print(("RESULT " + json.dumps(row)) if a.one else
              f"{config:12s} {row['step_ms']:8.1f} ms  {row['tflops_per_gpu']:6.0f} TFLOP/s  "
              f"{row['peak_gib']:6.1f} GiB  compile {row['compile_s']:6.1f} s  loss {row['loss']:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
