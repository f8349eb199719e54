"""benchmarks/bench_torch.py, bench_e2e's model in PyTorch (FSDP2, torchao float8): on the CPU (gloo, one rank, no
torch.compile) its first loss from bench_e2e's parameters and batch equals the JAX plain step's, it trains, and
bench_e2e runs it as a config whose row carries the other configs' fields; without torchao, torch-fp8 says so in one
line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_e2e  # noqa: E402
import bench_torch  # noqa: E402

ROW_FIELDS = ("config", "step_ms", "tokens_per_s", "tflops_per_gpu", "compile_s", "peak_gib", "loss", "devices",
              "device", "losses")


def _has_torchao_float8() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def test_torch_twin_first_loss_equals_the_jax_plain_models():
    """The same parameters (bench_e2e's init_params, numpy) and batch in both: the PyTorch model's first loss (bf16
    compute through FSDP2's mixed precision) equals JAX's plain forward's (bf16 matmuls) to bf16 rounding."""
    a = bench_e2e.parse_args(["--tiny", "--layers", "1"])
    a.remat = None
    params = bench_e2e.init_params(a, stacked=False)
    kx, ky = jax.random.split(jax.random.key(7))
    shape = (a.batch, a.seq, a.hidden)
    x, y = jax.random.normal(kx, shape, jnp.bfloat16), jax.random.normal(ky, shape, jnp.float32)
    matmul = lambda h, w: h @ w.astype(jnp.bfloat16).T            # the plain step's
    jax_loss = float(bench_e2e.mse(bench_e2e.forward(a, params, x, matmul, scan=False, plain=True), y))

    t = bench_torch.parse_args(["--tiny", "--layers", "1", "--steps", "1"])
    row = bench_torch.run_in_process(t, "torch-bf16", init=jax.tree.map(np.asarray, params),
                                     batch={"x": np.asarray(x, np.float32), "y": np.asarray(y)})
    first, *rest = row["losses"]
    # GEMM outputs rounded to bf16 on both sides, accumulated in other orders: measured 7.4e-6 relative on this
    # machine (torch 2.13, jax 0.10.2); the mean over the batch averages the roundings out
    assert first == pytest.approx(jax_loss, rel=1e-4), (first, jax_loss)
    assert rest[-1] < first, row["losses"]                     # Adam at 1e-4 lowers the loss on the one batch
    assert set(ROW_FIELDS) <= set(row) and row["devices"] == 1 and row["device"] == "cpu", row


def test_torch_fp8_without_torchao_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)           # import torchao raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    message = bench_torch.missing_requirement("torch-fp8")
    assert message and "\n" not in message and "torchao" in message and bench_torch.TORCHAO in message, message
    assert bench_torch.missing_requirement("torch-bf16") is None


@pytest.mark.slow
@pytest.mark.extended
def test_bench_e2e_runs_the_torch_configs(tmp_path):
    """bench_e2e --configs plain-loop,torch-bf16,torch-fp8 on the CPU: the torch rows sit in the table with the JAX
    rows' fields and a ratio to plain; torch-fp8 runs torchao's emulated float8 where torchao is installed, else fails
    in one line naming it while the others run."""
    out = tmp_path / "e2e.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--tiny", "--layers", "1",
                           "--steps", "1", "--flags", "default", "--configs", "plain-loop,torch-bf16,torch-fp8",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    results = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    for config in ("plain-loop", "torch-bf16"):
        r = results[config]
        assert "error" not in r and set(ROW_FIELDS) <= set(r), r
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0 and math.isfinite(r["loss"]), r
    assert "| default | torch-bf16 |" in proc.stdout, proc.stdout
    # the same model and loss at bench_e2e's init distribution: both start near 1 + the output's variance
    assert results["torch-bf16"]["losses"][0] == pytest.approx(results["plain-loop"]["losses"][0], rel=0.2)
    fp8 = results["torch-fp8"]
    if _has_torchao_float8():
        assert proc.returncode == 0 and "error" not in fp8, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "torch-fp8:" in proc.stdout and "x torch-bf16" in proc.stdout
    else:
        assert proc.returncode == 1 and fp8["error"].count("\n") == 0 and "torchao" in fp8["error"], fp8
