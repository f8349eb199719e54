"""One rank of a 4-process (gloo, CPU) PyTorch FSDP2 training job for tests/test_state_dict_fsdp2.py.

Usage: python torch_fsdp_train_worker.py WORKDIR      env: RANK, WORLD_SIZE (4), MASTER_PORT.

WORKDIR/job.json: {"model": {vocab, d, heads, ff, layers}, "adam": {lr, betas, eps, weight_decay},
"jobs": [{"mode": "resume" | "train", "ckpt": DIR, "out": NAME}]}; WORKDIR/batches.npz: tokens<i>, targets<i>
(i = 1..4, global batches [B, T]); WORKDIR/init.npz: the initial parameters under their state-dict names.

The model is the one of test_state_dict_fsdp2.py (``fsdp2_loss``): parameters named as the JAX state dict names
them (embed, blocks.<i>.{norm1,wq,wk,wv,wo,norm2,w1,w2}, head), every block and the root under
``fully_shard`` on a 1-D mesh of the 4 ranks, ``torch.optim.Adam``. It reproduces what the layer-wise JAX step
computes on 8 devices with ``compute_weights="bf16"``:

* each weight is read through ``BF16Weight``: forward ``w.bfloat16().float()`` (the bf16 compute weight, used in
  fp32), backward ``grad.bfloat16().float()`` (the JAX step rounds each device's weight gradient to bf16);
* rank r processes the two 1/8 slices of the global batch that JAX devices 2r and 2r+1 hold, as two backward
  passes (the first without gradient sync, so the two accumulate in fp32), each on the slice's mean loss, as
  the JAX loss_fn sees it per device; FSDP2 then sums the 4 ranks' gradients (``set_force_sum_reduction_for_comms``)
  and divides by 8 (``set_gradient_divide_factor(8)``): the mean over the 8 slices, which is JAX's 1/(ranks x
  microbatches) scale (a power of two: scaling before or after the sum gives the same bits).

Modes: "resume": ``dcp.load`` of the checkpoint into ``get_state_dict(model, opt)``, ``set_state_dict``, one step on
batch 4. "train": parameters from init.npz, steps on batches 1..3, ``dcp.save(get_state_dict(model, opt))`` to the
checkpoint, then step 4. Outputs: ``<out>_params.npz`` (rank 0: ``p3/<name>``, ``p4/<name>``, ``m4/<name>``,
``v4/<name>``: parameters before and after step 4, Adam's exp_avg / exp_avg_sq after it) and
``<out>_grads_rank<r>.npz`` (``g<slice>/<name>``: each of the rank's slices' bf16-rounded gradient in step 4,
before any reduction; the test bounds the JAX / torch difference with them).
"""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

CAPTURE = {}     # name -> the bf16-rounded gradient of the last backward pass (while capturing)


class BF16Weight(torch.autograd.Function):
    """The bf16 compute weight in fp32; its gradient rounded to bf16 (what the JAX step does per device)."""

    @staticmethod
    def forward(ctx, w, name):
        ctx.name = name
        return w.detach().to(torch.bfloat16).float()

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(torch.bfloat16).float()
        if ctx.name in CAPTURE:
            CAPTURE[ctx.name] = g.clone()
        return g, None


def rms(h):
    return h * torch.rsqrt(torch.mean(h * h, -1, keepdim=True) + 1e-6)


class Block(nn.Module):
    def __init__(self, m, i):
        super().__init__()
        d, f = m["d"], m["ff"]
        self.heads, self.prefix = m["heads"], f"blocks.{i}."
        shapes = {"norm1": (1, d), "wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "norm2": (1, d),
                  "w1": (f, d), "w2": (d, f)}
        for n, s in shapes.items():
            setattr(self, n, nn.Parameter(torch.zeros(s)))

    def w(self, n):
        return BF16Weight.apply(getattr(self, n), self.prefix + n)

    def forward(self, h):
        b, t, d = h.shape
        x = rms(h) * self.w("norm1")
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)
        q, k, v = (split(x @ self.w(n).T) for n in ("wq", "wk", "wv"))
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        s = s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v).reshape(b, t, d)
        h = h + o @ self.w("wo").T
        x = rms(h) * self.w("norm2")
        return h + F.gelu(x @ self.w("w1").T, approximate="tanh") @ self.w("w2").T


class Model(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(m["vocab"], m["d"]))
        self.blocks = nn.ModuleList([Block(m, i) for i in range(m["layers"])])
        self.head = nn.Parameter(torch.zeros(m["vocab"], m["d"]))

    def forward(self, tokens, targets):
        h = BF16Weight.apply(self.embed, "embed")[tokens]
        for blk in self.blocks:
            h = blk(h)
        logits = rms(h) @ BF16Weight.apply(self.head, "head").T
        logp = torch.log_softmax(logits, -1)
        return -torch.mean(torch.gather(logp, -1, targets[..., None]))


def build(job_cfg, mesh):
    model = Model(job_cfg["model"])
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_force_sum_reduction_for_comms(True)   # gloo: SUM, then / 8 after the reduction
            mod.set_gradient_divide_factor(8.0)
    a = job_cfg["adam"]
    opt = torch.optim.Adam(model.parameters(), lr=a["lr"], betas=tuple(a["betas"]), eps=a["eps"],
                           weight_decay=a["weight_decay"])
    return model, opt


def step(model, opt, tokens, targets, rank, capture=None):
    """One optimizer step: the rank's two 1/8 slices as two backward passes (sync on the second)."""
    opt.zero_grad(set_to_none=True)
    per = tokens.shape[0] // 8
    for j, sl in enumerate((2 * rank, 2 * rank + 1)):
        model.set_requires_gradient_sync(j == 1)
        if capture is not None:
            CAPTURE.clear()
            CAPTURE.update({n: None for n, _ in model.named_parameters()})
        rows = slice(sl * per, (sl + 1) * per)
        model(tokens[rows], targets[rows]).backward()
        if capture is not None:
            capture.update({f"g{sl}/{n}": g.numpy().copy() for n, g in CAPTURE.items()})
            CAPTURE.clear()
    opt.step()


def full(model):
    return {n: p.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()}


def main():
    workdir = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == 4
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world)
    with open(os.path.join(workdir, "job.json")) as f:
        cfg = json.load(f)
    data = np.load(os.path.join(workdir, "batches.npz"))
    batch = {i: (torch.from_numpy(data[f"tokens{i}"].astype(np.int64)), torch.from_numpy(data[f"targets{i}"]
                                                                                         .astype(np.int64)))
             for i in range(1, 5)}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for job in cfg["jobs"]:
        model, opt = build(cfg, mesh)
        if job["mode"] == "resume":
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=job["ckpt"])
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            assert opt.param_groups[0]["lr"] == cfg["adam"]["lr"]
        else:
            init = np.load(os.path.join(workdir, "init.npz"))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    local = p.to_local()
                    rows = local.shape[0]
                    start = rank * math.ceil(p.shape[0] / world)      # FSDP2: dim-0 chunks of ceil(rows / 4)
                    local.copy_(torch.from_numpy(init[n][start:start + rows]))
            for i in (1, 2, 3):
                step(model, opt, *batch[i], rank)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=job["ckpt"])
        p3 = full(model)
        grads = {}
        step(model, opt, *batch[4], rank, capture=grads)
        np.savez(os.path.join(workdir, f"{job['out']}_grads_rank{rank}.npz"), **grads)
        p4 = full(model)
        state = {n: opt.state[p] for n, p in model.named_parameters()}
        m4 = {n: s["exp_avg"].full_tensor().numpy().copy() for n, s in state.items()}
        v4 = {n: s["exp_avg_sq"].full_tensor().numpy().copy() for n, s in state.items()}
        if rank == 0:
            out = {f"p3/{n}": a for n, a in p3.items()} | {f"p4/{n}": a for n, a in p4.items()}
            out |= {f"m4/{n}": a for n, a in m4.items()} | {f"v4/{n}": a for n, a in v4.items()}
            np.savez(os.path.join(workdir, f"{job['out']}_params.npz"), **out)
        dist.barrier()
    dist.destroy_process_group()
    # skip the interpreter's teardown: gloo's threads can abort it ("terminate called without an active
    # exception", seen once in CI) after the rank's work is written, failing a rank that succeeded
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
