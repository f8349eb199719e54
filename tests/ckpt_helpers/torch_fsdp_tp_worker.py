"""One rank of a 4-process (gloo, CPU) FSDP2 x TP job over a mesh (dp=2, tp=2): dcp.save or dcp.load.

Usage: python torch_fsdp_tp_worker.py JOBS_JSON
JOBS_JSON: [{"mode": "save" | "load", "ckpt": CKPT, "spec": SPEC_JSON, "out": RESULT_DIR}, ...], run in order (a
barrier after each) in one process group: starting torch in 4 processes takes most of a job's time.
env: RANK, WORLD_SIZE (4), MASTER_PORT.

SPEC_JSON: {"step": int, "tensors": [{"name", "key", "shape", "dtype", "style", "file"}]}; "key" is the
checkpoint key, "file" holds the full tensor's raw bytes. Each 2-D entry is the (frozen) weight of its own
nn.Linear, placed by "style":
  "col"  ColwiseParallel on "tp", then fully_shard on "dp"  -> (_StridedShard(0, tp), Shard(0))
  "row"  RowwiseParallel on "tp", then fully_shard on "dp"  -> (Shard(0), Shard(1))
  "rep"  no TP plan (replicated over tp), fully_shard on "dp" -> Shard(0) on the dp mesh
  "plain" an ordinary tensor in the state dict (every rank holds all of it; e.g. scalars)
Quantized components are plain uint8 / fp8 / fp32 tensors placed like a weight whose TP dim is theirs
(docs/checkpoint.md, "FSDP x TP"). The state dict is keyed by "key", so it names the DCP entries.
load: every rank checks each local shard's bytes against the slice of the full tensor it should hold and
writes RESULT_DIR/rank<r>.json with each name's placements, global offsets and local shapes.
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

TP_STYLES = {"col": ColwiseParallel, "row": RowwiseParallel}


def full_tensor(spec, base):
    raw = np.fromfile(os.path.join(base, spec["file"]), np.uint8)
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=getattr(torch, spec["dtype"])).reshape(spec["shape"])


def build_state(specs, mesh, base, fill):
    """The FSDP2 x TP model's state dict re-keyed by each spec's checkpoint key, plus the plain tensors."""
    model, names, state = nn.Module(), {}, {}
    model.layers = nn.ModuleDict()
    for i, s in enumerate(specs):
        w = full_tensor(s, base) if fill else torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"]))
        if s["style"] == "plain":
            state[s["key"]] = w
            continue
        out_f, in_f = s["shape"]
        lin = nn.Linear(in_f, out_f, bias=False)
        lin.weight = nn.Parameter(w, requires_grad=False)
        model.layers[f"m{i}"] = lin
        names[f"layers.m{i}.weight"] = s
    plan = {n.rsplit(".", 1)[0]: TP_STYLES[s["style"]]() for n, s in names.items() if s["style"] in TP_STYLES}
    # src_data_rank=None: every rank holds the same full weights; no scatter (gloo cannot scatter fp8)
    parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
    for n in names:
        fully_shard(model.get_submodule(n.rsplit(".", 1)[0]), mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for n, t in model.state_dict().items():
        state[names[n]["key"]] = t
    return state


def check_local(rank, s, t, base):
    """Assert ``t``'s local part equals the matching slice of the full tensor; return where it lies."""
    full = full_tensor(s, base)
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local, placements = t.to_local(), [repr(p) for p in t.placements]
    else:
        shape, offset, local, placements = tuple(full.shape), (0,) * full.dim(), t, ["plain"]
    want = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()
    got = local.contiguous()
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (s["key"], got.dtype, got.shape,
                                                                               want.shape)
    same = got.reshape(-1).view(torch.uint8).numpy().tobytes() == want.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert same, f"rank {rank}: {s['key']} local shard at {list(offset)} differs"
    return {"placements": placements, "offset": list(offset), "shape": list(shape)}


def run_job(rank, mesh, mode, ckpt, spec_path, result_dir):
    base = os.path.dirname(spec_path)
    with open(spec_path) as f:
        spec = json.load(f)
    state = build_state(spec["tensors"], mesh, base, fill=(mode == "save"))
    result = {"rank": rank, "checked": {}}
    if mode == "save":
        state["step"] = torch.tensor(spec["step"], dtype=torch.int64)
        dcp.save(state, checkpoint_id=ckpt)
    else:
        state["step"] = torch.tensor(0, dtype=torch.int64)
        dcp.load(state, checkpoint_id=ckpt)
        assert int(state["step"]) == spec["step"], f"step {int(state['step'])} != {spec['step']}"
        for s in spec["tensors"]:
            result["checked"][s["name"]] = check_local(rank, s, state[s["key"]], base)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main():
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for job in jobs:
        run_job(rank, mesh, job["mode"], job["ckpt"], job["spec"], job["out"])
        dist.barrier()
    dist.destroy_process_group()
    # skip the interpreter's teardown: gloo's threads can abort it ("terminate called without an active
    # exception", seen once in CI) after the rank's work is written, failing a rank that succeeded
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
