"""Host memory of ``save_dcp`` on a training state: the peak stays within 2x the largest tensor shard plus a small
allowance, and nothing stays behind on the host once it returns.

Measured in a fresh process (``_MEASURE``): resident set size before the save, its high-water mark during it (reset
through /proc/self/clear_refs just before), and after it (the tree still alive), plus tracemalloc's peak of Python
and numpy allocations. CPU: the layer-wise step's ``state_dict`` with one 64 MiB leaf on 8 devices (8 MiB shards),
saved as it is and with the leaf transposed (one transposed copy per chunk). GPU (one device; ``bash
scripts/gpu_suite.sh tests/test_state_dict_memory.py``): 64 MiB arrays on the device, which ``np.asarray``
copies to the host; before the writer converted each chunk through a fresh array and collected it, those copies
piled up during the save (+257 MiB for 4 arrays on an H100) and stayed cached on the caller's arrays after it.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402

MiB = 2 ** 20
ALLOWANCE = 16 * MiB      # interpreter noise, pickles, zip headers, file buffers
needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc (VmHWM reset)")

# argv: MODE ("train_state" | "gpu_arrays") DIR. Prints one JSON line: per save, bytes before / peak / after.
_MEASURE = r"""
import gc, json, os, sys, tracemalloc
import numpy as np
import jax, jax.numpy as jnp
from jaxquant import checkpoint as ck

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

def measure(path, tree, **kw):
    gc.collect()
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                         # VmHWM := VmRSS
    tracemalloc.start()
    ck.save_dcp(path, tree, **kw)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    peak = status("VmHWM")
    gc.collect()
    return {"before": before, "peak": peak, "after": status("VmRSS"), "traced": traced}

mode, out = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
result = {}
if mode == "train_state":
    import optax
    from jax.sharding import Mesh
    import jaxquant as jq
    params = {"big": rng.standard_normal((8192, 2048), np.float32),                  # 64 MiB, 8 MiB per device
              "blocks": {"w": rng.standard_normal((4, 256, 256), np.float32)}, "bias": np.zeros(256, np.float32)}
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    step = jq.make_train_step(lambda w, b: jnp.sum(b["x"]), optax.adam(1e-3), mesh=mesh,
                              policy=jq.MixedPrecisionPolicy(compute_weights="bf16"))
    state = step.init(params)
    del params
    sd = step.state_dict(state, hyperparams=dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0))
    jax.block_until_ready(sd["model"])
    shard = max(s.data.nbytes for a in jax.tree.leaves(sd) if isinstance(a, jax.Array) for s in a.addressable_shards)
    result["plain"] = measure(os.path.join(out, "plain"), sd)
    result["transposed"] = measure(os.path.join(out, "transposed"), sd,
                                   transpose=["model.big", "optim.state.big.exp_*"])
else:
    arrays = {f"w{i}": jax.device_put(rng.standard_normal((4096, 4096), np.float32)) for i in range(4)}  # 64 MiB
    jax.block_until_ready(arrays)
    shard = max(a.nbytes for a in arrays.values())
    result["plain"] = measure(os.path.join(out, "plain"), arrays)
result["largest_shard"] = shard
result["backend"] = jax.default_backend()
print(json.dumps(result))
"""


def _measure(mode, tmp_path, **env):
    r = subprocess.run([sys.executable, "-c", _MEASURE, mode, str(tmp_path)], env=common.env(**env),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(res, what):
    shard = res["largest_shard"]
    for name, m in res.items():
        if not isinstance(m, dict):
            continue
        growth, kept = m["peak"] - m["before"], m["after"] - m["before"]
        print(f"\n{what} {name}: peak +{growth / MiB:.1f} MiB, after +{kept / MiB:.1f} MiB, tracemalloc peak "
              f"{m['traced'] / MiB:.1f} MiB; largest shard {shard / MiB:.0f} MiB")
        assert growth <= 2 * shard + ALLOWANCE, (name, growth / MiB, shard / MiB)
        assert m["traced"] <= 2 * shard + ALLOWANCE, (name, m["traced"] / MiB)
        # no host copy of the tree left behind (the allocator may keep a freed chunk's pages)
        assert kept <= shard + ALLOWANCE, (name, kept / MiB)


@needs_proc
@pytest.mark.slow        # a fresh process: ~4 s on 2 cores
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_save_dcp_of_a_training_state_peaks_within_two_shards(tmp_path):
    _check(_measure("train_state", tmp_path), "CPU, 8 devices, training state")


@needs_proc
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")
def test_save_dcp_of_gpu_arrays_keeps_no_host_copy(tmp_path):
    res = _measure("gpu_arrays", tmp_path, XLA_FLAGS="")
    assert res["backend"] == "gpu"
    _check(res, "GPU, 1 device, 4 x 64 MiB arrays")
