"""One process of tests/test_layerwise_multihost.py:
``python multihost_worker.py PROCESS_ID PORT OUT.npz RECIPE [DEVICES_PER_PROCESS]``.
Joins a 2-process JAX cluster on 127.0.0.1 (DEVICES_PER_PROCESS CPU devices each, default 4; 1 is how cluster
launchers start one process per GPU; gloo collectives), trains the stacked test model of test_layerwise.py for
3 steps on the mesh of every process's devices and saves the losses and the full params, and
the training state as one DCP checkpoint (``ckpt`` beside ``out``, every process writing its own shards)."""

import os
import sys

process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
per_process = int(sys.argv[5]) if len(sys.argv) > 5 else 4
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per_process}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxquant as jq  # noqa: E402
from support import transformer as model  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 2 * per_process
assert len(jax.local_devices()) == per_process
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
step = jq.make_train_step(model.loss_scan, optax.sgd(model.LR), mesh=mesh, quantize_mask=model.MASK,
                          policy=jq.MixedPrecisionPolicy(compute_weights=sys.argv[4]))
# host arrays, the same on every process: no array of another process is ever needed here
state = step.init(jax.tree.map(np.asarray, model.init_params()))
losses = []
for _ in range(model.STEPS):
    state, metrics = step(state, jax.tree.map(np.asarray, model.make_batch()))
    losses.append(float(metrics["loss"]))
params = step.params(state)
assert all(a.is_fully_replicated for a in jax.tree.leaves(params))
flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
np.savez(out, losses=np.asarray(losses), **flat)
# the training state, each process writing the shards it holds (one DCP checkpoint, process 0 finalises)
from jaxquant import checkpoint as ck  # noqa: E402

hyper = dict(lr=model.LR, momentum=0.0, weight_decay=0.0)
ck.save_dcp(os.path.join(os.path.dirname(out), "ckpt"), step.state_dict(state, hyperparams=hyper), save_id="multihost")
