"""One rank of a 4-process (gloo, CPU) FSDP2 x TP job: dcp.save or dcp.load a jaxquant test model.

Usage: python torch_dist_worker.py {save,load} CKPT SPEC_JSON RESULT_DIR
env: RANK, WORLD_SIZE (4), MASTER_PORT. The model holds one nn.Linear per spec entry, TP-parallelized
(ColwiseParallel for style "col", RowwiseParallel for "row") on mesh dim "tp", then fully_shard on "dp"
(mesh (dp=2, tp=2)). Weights (any dtype, loaded as raw bytes from SPEC_JSON's .bin files) are frozen.
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def full_tensor(spec, base):
    raw = np.fromfile(os.path.join(base, spec["file"]), np.uint8)
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=getattr(torch, spec["dtype"])).reshape(spec["shape"])


def build(specs, mesh, base, fill):
    model = nn.Module()
    model.layers = nn.ModuleDict()
    for s in specs:
        out_f, in_f = s["shape"]
        lin = nn.Linear(in_f, out_f, bias=False)
        w = full_tensor(s, base) if fill else torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"]))
        lin.weight = nn.Parameter(w, requires_grad=False)
        model.layers[s["name"]] = lin
    plan = {f"layers.{s['name']}": ColwiseParallel() if s["style"] == "col" else RowwiseParallel() for s in specs}
    # src_data_rank=None: every rank holds the same full weights; no scatter (gloo cannot scatter fp8)
    parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
    for s in specs:
        fully_shard(model.layers[s["name"]], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def main():
    mode, ckpt, spec_path, result_dir = sys.argv[1:5]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world)
    base = os.path.dirname(spec_path)
    with open(spec_path) as f:
        spec = json.load(f)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(spec["tensors"], mesh, base, fill=(mode == "save"))
    sd = dict(model.state_dict())
    result = {"rank": rank, "checked": {}}
    if mode == "save":
        sd["step"] = torch.tensor(spec["step"], dtype=torch.int64)
        dcp.save(sd, checkpoint_id=ckpt)
    else:
        sd["step"] = torch.tensor(0, dtype=torch.int64)
        dcp.load(sd, checkpoint_id=ckpt)
        assert int(sd["step"]) == spec["step"], f"step {int(sd['step'])} != {spec['step']}"
        for s in spec["tensors"]:
            t = sd[f"layers.{s['name']}.weight"]
            assert isinstance(t, DTensor), type(t)
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            full = full_tensor(s, base)
            want = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()
            got = t.to_local().contiguous()
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (got.dtype, got.shape, want.shape)
            same = got.view(torch.uint8).numpy().tobytes() == want.view(torch.uint8).numpy().tobytes()
            assert same, f"rank {rank}: {s['name']} local shard differs"
            result["checked"][s["name"]] = {"placements": [repr(p) for p in t.placements], "offset": list(offset),
                                            "shape": list(shape)}
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
