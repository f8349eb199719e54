"""Multi-host layer-wise FSDP: 2 JAX processes x 4 CPU devices (jax.distributed on 127.0.0.1, gloo CPU
collectives) train the stacked model of test_layerwise.py to the same parameters as 1 process x 8 devices, and
2 processes x 1 device (one process per GPU, as cluster launchers start them) as 1 process x 2 devices;
each process feeds host arrays and reads back replicated params (no non-addressable array on the host); the
training state they save together (each process its own shards) loads on 1 process x 8 devices, and PyTorch
(``torch.distributed.checkpoint.load``, one process, plain tensors) reads the same bits from it."""

import importlib.util
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from ckpt_helpers import common
from codegen import XLA_DEFAULT_CODEGEN
from support.transformer import assert_close_to, init_params, loss_scan, train, trained_scan

pytestmark = [pytest.mark.slow, pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")]


def _step(cw):
    import optax
    from jax.sharding import Mesh

    import jaxquant as jq
    from support.transformer import LR, MASK

    return jq.make_train_step(loss_scan, optax.sgd(LR), mesh=Mesh(np.array(jax.devices()), ("fsdp",)),
                              quantize_mask=MASK, policy=jq.MixedPrecisionPolicy(compute_weights=cw))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# each recipe's gathers cross the process boundary in one of the two layouts (4 devices a process: mixed in- and
# cross-process collectives; 1 a process: every collective cross-process), pairwise
@pytest.mark.parametrize("cw,per_process", [("fp8", 4), ("nvfp4", 1)])
@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, cw, per_process):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = common.REPO + os.pathsep + env.get("PYTHONPATH", "")   # this checkout's jaxquant
    procs = [subprocess.Popen([sys.executable, worker, str(i), str(port), str(tmp_path / f"p{i}.npz"), cw,
                               str(per_process)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    got = [np.load(tmp_path / f"p{i}.npz") for i in range(2)]
    # 1 process x 8 devices is test_layerwise's trained_scan (computed once per worker); both at XLA's default level,
    # as the workers compile (their environment drops XLA_FLAGS)
    ref_params, ref_losses, _, _ = (trained_scan(cw) if per_process == 4
                                    else train(loss_scan, init_params(), devices=2 * per_process, cw=cw,
                                               compiler_options=XLA_DEFAULT_CODEGEN))
    flat_ref = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(ref_params)[0]}
    for g in got:
        np.testing.assert_allclose(g["losses"], ref_losses, rtol=1e-6)
        params = {k: g[k] for k in flat_ref}
        assert_close_to(params, flat_ref, {k: np.asarray(v) for k, v in zip(flat_ref, jax.tree.leaves(init_params()))},
                        1e-3)
    # the checkpoint the two processes wrote together loads on this single process's 8 devices (resharded from
    # 2 x 1 devices)
    from jaxquant import checkpoint as ck
    step = _step(cw)
    like = step.init(init_params())
    state = step.load_state_dict(ck.load_dcp(str(tmp_path / "ckpt"), step.state_dict_target(like)), like=like)
    loaded = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(
        step.params(state))[0]}
    for k in flat_ref:
        np.testing.assert_array_equal(loaded[k], got[0][k], err_msg=k)
    # one checkpoint: each process wrote its own file; PyTorch reads it as 1 process x 8 devices does
    ckpt = str(tmp_path / "ckpt")
    assert sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    if importlib.util.find_spec("torch") is None and os.environ.get("JAXQUANT_REQUIRE_TORCH") != "1":
        return      # (the JAX part above passed; common.TORCH_SKIP_REASON says how to get torch for the rest)
    import torch
    import torch.distributed.checkpoint as dcp

    from support.transformer import LR

    jax_sd = step.state_dict(state, hyperparams=dict(lr=LR, momentum=0.0, weight_decay=0.0))
    want = {n: np.asarray(a) for n, a in jax_sd["model"].items()}
    torch_sd = {"model": {n: torch.zeros(a.shape, dtype=torch.float32) for n, a in want.items()},
                "optim": {"param_groups": [{"lr": 0.0, "momentum": -1.0, "params": []}]}}
    dcp.load(torch_sd, checkpoint_id=ckpt, no_dist=True)
    for n, a in want.items():
        assert common.same_bytes(torch_sd["model"][n].numpy(), a), n
    group = torch_sd["optim"]["param_groups"][0]
    assert group["lr"] == LR and group["momentum"] == 0.0 and sorted(group["params"]) == sorted(want)
