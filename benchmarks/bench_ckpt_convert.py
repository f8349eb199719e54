"""Benchmark: streaming checkpoint conversion throughput (GB/s) and peak RSS.

Writes a synthetic DCP checkpoint of ``--size-gb`` (bf16 tensors of ``--tensor-mb`` split into
``--chunks`` row chunks each), then times, each in a fresh subprocess via the CLI:
DCP -> DCP (--transpose-linear on every key), DCP -> Orbax and Orbax -> DCP. Peak RSS is the child's
ru_maxrss (includes the interpreter + jax import baseline, printed separately).

    python benchmarks/bench_ckpt_convert.py --size-gb 2
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _env():
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("JAXQUANT_REFERENCE_ONLY", "1")
    return e


# Runs a module/code in the child and prints the child's VmHWM (peak RSS of its own address space; unlike
# ru_maxrss it does not include the parent's pages counted between fork and exec).
_WRAP = """
import atexit, runpy, sys
def _hwm():
    with open("/proc/self/status") as f:
        kb = next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))
    sys.stderr.write(f"\\nVMHWM_KB={kb}\\n")
atexit.register(_hwm)
mode, target, *rest = sys.argv[1:]
sys.argv = [target, *rest]
runpy.run_module(target, run_name="__main__") if mode == "-m" else exec(target)
"""


def _run(args):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _WRAP, *args], env=_env(), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{p.stderr[-3000:]}")
    kb = int(p.stderr.rsplit("VMHWM_KB=", 1)[1].split()[0])
    return dt, kb / 1024  # MiB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--tensor-mb", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--skip-orbax", action="store_true")
    args = ap.parse_args()
    import ml_dtypes
    from jaxquant import checkpoint as ck

    work = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.workdir)
    try:
        cols = 4096
        rows = max(args.chunks, args.tensor_mb * 2 ** 20 // (2 * cols) // args.chunks * args.chunks)
        n_tensors = max(1, int(round(args.size_gb * 1e9 / (rows * cols * 2))))
        rng = np.random.default_rng(0)
        tree, step = {}, rows // args.chunks
        for t in range(n_tensors):
            blocks = [((r, 0), rng.integers(0, 2 ** 16, (step, cols), dtype=np.uint16).view(ml_dtypes.bfloat16))
                      for r in range(0, rows, step)]
            tree[f"layers.{t}.weight"] = ck.LocalShards((rows, cols), ml_dtypes.bfloat16, blocks)
        src = os.path.join(work, "src")
        t0 = time.perf_counter()
        ck.save_dcp(src, tree)
        del tree, blocks
        save_s = time.perf_counter() - t0
        nbytes = n_tensors * rows * cols * 2
        chunk_mb = step * cols * 2 / 2 ** 20
        print(f"checkpoint: {nbytes / 1e9:.2f} GB, {n_tensors} bf16 tensors [{rows}, {cols}], "
              f"{args.chunks} chunks each (largest chunk {chunk_mb:.0f} MiB); "
              f"save_dcp {nbytes / 1e9 / save_s:.2f} GB/s")
        base_s, base_rss = _run(["-c", "import jaxquant.checkpoint, orbax.checkpoint"])
        print(f"baseline (python + jax + orbax import): {base_rss:.0f} MiB RSS, {base_s:.1f} s")
        cli = ["-m", "jaxquant", "ckpt", "convert", "--no-progress"]
        cases = [("DCP -> DCP", cli + [src, os.path.join(work, "d2"), "--to", "dcp"]),
                 ("DCP -> DCP (transpose all)", cli + [src, os.path.join(work, "d2"), "--to", "dcp",
                                                       "--transpose-linear", "*"])]
        if not args.skip_orbax:
            cases += [("DCP -> Orbax", cli + [src, os.path.join(work, "o"), "--to", "orbax"]),
                      ("Orbax -> DCP", cli + [os.path.join(work, "o"), os.path.join(work, "d3"), "--to", "dcp"])]
        for name, argv in cases:
            dt, rss = _run(argv)
            print(f"{name:<28} {nbytes / 1e9 / dt:6.2f} GB/s ({dt:6.1f} s incl. ~{base_s:.1f} s startup)  "
                  f"peak RSS {rss:7.0f} MiB")
            shutil.rmtree(os.path.join(work, "d2"), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
