"""Shared helpers of the checkpoint tests: torch multi-process jobs, subprocess env, byte comparison."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


# Why a torch test skips, and how to enable it without downloading a CUDA build on a CPU machine.
TORCH_SKIP_REASON = ("needs PyTorch (not in the 'test' extra): install a CPU build with `pip install torch==2.13.0 "
                     "--index-url https://download.pytorch.org/whl/cpu` (on jaxquant's CI and dev machines plain "
                     "`pip install torch==2.13.0` finds the local CPU wheel)")


def require_torch():
    """``torch``, or a skip saying how to install it; with JAXQUANT_REQUIRE_TORCH=1 (CI) a missing torch fails."""
    if os.environ.get("JAXQUANT_REQUIRE_TORCH") == "1":
        import torch

        return torch
    return pytest.importorskip("torch", reason=TORCH_SKIP_REASON)


def env(**extra):
    """Environment for subprocesses: the repo importable, reference kernels, 8 simulated JAX devices."""
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("JAXQUANT_REFERENCE_ONLY", "1")
    e["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    e.update(extra)
    return e


def same_bytes(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes() == \
        np.ascontiguousarray(b).reshape(-1).view(np.uint8).tobytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv, timeout, world=4):
    """Run ``world`` gloo ranks of the torch script ``argv`` (``[script, args...]``) within ``timeout`` seconds
    in all; assert every rank exited 0 (the failing rank's output tail in the message)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env(RANK=str(r), WORLD_SIZE=str(world), MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(world)]
    outs, deadline = [], time.monotonic() + timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [(i, p.returncode, o[-3000:]) for i, (p, o) in enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not bad, f"torch ranks failed: {bad[0]}"


def _layer_weight(name):
    return f"layers.{name}.weight"


def torch_jobs(jobs, timeout=240):
    """Run 4 gloo ranks of torch_fsdp_tp_worker.py once (within ``timeout`` seconds in all) for ``jobs``, in order (a
    barrier after each; starting torch in 4 processes takes most of a job's time); each job's per-rank results.

    A job: {"mode": "save" | "load", "ckpt", "tensors", "step", "workdir", "key" (optional)}; ``tensors``:
    [(name, full numpy array, style "col"|"row"|"rep"|"plain")]; each is stored under the checkpoint key
    ``key(name)`` (default ``layers.{name}.weight``); the ranks' results are keyed by name.
    """
    from jaxquant.checkpoint.dtypes import to_torch_name

    listed = []
    for job in jobs:
        workdir, key = job["workdir"], job.get("key", _layer_weight)
        os.makedirs(workdir, exist_ok=True)
        specs = []
        for name, arr, style in job["tensors"]:
            fn = f"{name}.bin"
            np.ascontiguousarray(arr).reshape(-1).view(np.uint8).tofile(os.path.join(workdir, fn))
            specs.append({"name": name, "key": key(name), "shape": list(arr.shape),
                          "dtype": to_torch_name(arr.dtype, what=name), "style": style, "file": fn})
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({"tensors": specs, "step": job["step"]}, f)
        listed.append({"mode": job["mode"], "ckpt": str(job["ckpt"]), "spec": spec_path, "out": workdir})
    jobs_path = os.path.join(jobs[0]["workdir"], "jobs.json")
    with open(jobs_path, "w") as f:
        json.dump(listed, f)
    run_ranks([os.path.join(HERE, "torch_fsdp_tp_worker.py"), jobs_path], timeout)
    results = []
    for job in listed:
        results.append([])
        for rank in range(4):
            with open(os.path.join(job["out"], f"rank{rank}.json")) as f:
                results[-1].append(json.load(f))
    return results


def setup_devices():
    """Ask for 8 CPU devices; effective if the JAX backend is not initialised yet (else tests rerun in a
    subprocess, see :func:`rerun_if_few_devices`)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


def rerun_if_few_devices(request, n=8) -> bool:
    """If this process has fewer than ``n`` JAX devices (JAX was initialised by another suite), run the
    test in a fresh pytest subprocess with 8 devices and return True (the caller then returns)."""
    import jax

    if jax.device_count() >= n:
        return False
    assert not os.environ.get("JAXQUANT_CKPT_SUBPROCESS"), "subprocess still has too few devices"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                       cwd=str(request.config.rootpath), env=env(JAXQUANT_CKPT_SUBPROCESS="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return True


def mesh22():
    """Mesh (fsdp=2, tp=2) on the first 4 devices: the JAX twin of torch's (dp=2, tp=2)."""
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
