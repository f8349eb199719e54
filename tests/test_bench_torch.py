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


@pytest.mark.extended   # a benchmark smoke (docs/development.md: the README command's time budget)
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
    assert len(row["step_ms_each"]) == 1 and row["step_ms_each"][0] == pytest.approx(row["step_ms"])
    assert row["minor_faults_per_step"] >= 0


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


def test_fp8_all_gather_where_fsdp_shards_as_torchtitan():
    """By default (auto) FSDP2 gathers the float8 weights in float8, their scales precomputed after each step, only
    over more than one rank (torchtitan's rule); on / off force it; the rowwise recipe cannot (one scale per row)."""
    a = bench_torch.parse_args(["--tiny"])
    assert (a.fp8_recipe, a.fp8_all_gather) == ("tensorwise", "auto"), vars(a)
    assert not bench_torch.fp8_all_gather(a, 1) and bench_torch.fp8_all_gather(a, 2)
    assert bench_torch.fp8_all_gather(bench_torch.parse_args(["--fp8-all-gather", "on"]), 1)
    assert not bench_torch.fp8_all_gather(bench_torch.parse_args(["--fp8-all-gather", "off"]), 8)
    rowwise_gathered = bench_torch.parse_args(["--fp8-recipe", "rowwise", "--fp8-all-gather", "on"])
    message = bench_torch.check_args(rowwise_gathered, ["torch-fp8"])
    assert message and "\n" not in message and "tensorwise" in message, message
    assert bench_torch.check_args(bench_torch.parse_args(["--fp8-recipe", "rowwise"]), ["torch-fp8"]) is None
    assert bench_torch.check_args(rowwise_gathered, ["torch-bf16"]) is None


@pytest.mark.skipif(not _has_torchao_float8(), reason="torchao is not installed")
@pytest.mark.parametrize("recipe,world,gathered", [("tensorwise", 1, False), ("tensorwise", 2, True),
                                                   ("rowwise", 2, False)])
def test_float8_config_per_recipe_and_world(recipe, world, gathered):
    from torchao.float8.config import ScalingGranularity

    a = bench_torch.parse_args(["--tiny", "--fp8-recipe", recipe])
    config = bench_torch.float8_config(a, world, emulate=True)
    assert config.enable_fsdp_float8_all_gather is gathered and config.emulate
    expected = ScalingGranularity.TENSORWISE if recipe == "tensorwise" else ScalingGranularity.AXISWISE
    assert config.cast_config_weight.scaling_granularity is expected


def _trace():
    """A made-up torch.profiler trace of one step (µs): the main thread (tid 1) launches an FSDP hook's eager float8
    cast, the compiled forward's float8 GEMM, amax, norm and attention, the loss, the optimizer and an all-reduce;
    the autograd thread (tid 2) the compiled backward's bf16 GEMM; a memcpy too."""
    ev = []

    def scope(name, ts, dur, tid=1, cat="user_annotation", ext=None):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 9, "tid": tid, "ts": ts, "dur": dur,
                   "args": {} if ext is None else {"External id": ext}})

    def kernel(name, launch_ts, ts, dur, corr, ext=None, tid=1, cat="kernel", api="cuda_runtime"):
        ev.append({"ph": "X", "cat": api, "name": "cudaLaunchKernel", "pid": 9, "tid": tid, "ts": launch_ts,
                   "dur": 1, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                   "args": {"correlation": corr, **({} if ext is None else {"External id": ext})}})

    scope("FSDP::pre_forward (blocks.0)", 0, 100)
    scope("_ToFloat8ConstrFunc", 10, 40, cat="cpu_op")
    scope("aten::mul", 15, 5, cat="cpu_op", ext=1)
    kernel("vectorized_elementwise_kernel<MulFunctor>", 16, 1000, 100, corr=1, ext=1)
    scope("CompiledFunction", 200, 200, cat="cpu_op")
    scope("aten::_scaled_mm", 210, 10, cat="cpu_op", ext=2)
    kernel("nvjet_sm90_qqtst_128x256_128x6_2x1_v_bz_coopA_TNT", 215, 1100, 400, corr=2, ext=2)
    kernel("triton_red_fused_abs_max_0", 230, 1500, 50, corr=3, api="cuda_driver")
    kernel("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", 240, 1550, 50, corr=4, api="cuda_driver")
    scope("aten::_scaled_dot_product_flash_attention", 250, 10, cat="cpu_op", ext=5)
    kernel("pytorch_flash::flash_fwd_kernel", 255, 1600, 200, corr=5, ext=5)
    scope("bench_torch::loss", 450, 20)
    kernel("triton_per_fused_mean_pow_sub_0", 455, 1800, 20, corr=6, api="cuda_driver")
    scope("CompiledFunctionBackward", 500, 200, tid=2, cat="cpu_op")
    scope("aten::mm", 510, 10, tid=2, cat="cpu_op", ext=7)
    kernel("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_NNT", 515, 1900, 300, corr=7, ext=7, tid=2)
    kernel("Memcpy DtoD (Device -> Device)", 600, 2200, 30, corr=8, tid=2, cat="gpu_memcpy")
    scope("Optimizer.step#AdamW.step", 800, 100)
    kernel("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 810, 2300, 200, corr=9)
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 950, 2600, 40, corr=10)
    return ev


def test_torch_breakdown_attributes_kernels_by_op_name_and_launch_scope():
    b = bench_torch.torch_breakdown(_trace(), steps=1, wall_s=2e-3)
    ms = lambda us: pytest.approx(us / 1e3)
    assert set(bench_e2e.breakdown.CATEGORIES) <= set(b), b
    assert b["fp8_gemm"] == ms(400) and b["bf16_gemm"] == ms(300) and b["attention"] == ms(200)
    assert b["quantize"] == ms(100 + 50) and b["optimizer"] == ms(200)
    assert b["norm_elementwise"] == ms(50 + 20 + 30)              # the norm, the loss, the memcpy
    assert b["collective_total"] == ms(40) and b["collective_exposed"] == ms(40)   # nothing else runs beside it
    # the gaps between the merged kernels: 1820-1900, 2230-2300, 2500-2600
    assert b["idle"] == ms(80 + 70 + 100)
    # the GPU waited for the compiled backward's GEMM, the optimizer, the all-reduce
    assert b["detail"]["idle_before"] == {"compiled_bwd": ms(80), "optimizer": ms(70), "eager_other": ms(100)}
    d = b["detail"]
    assert d["span_ms"] == ms(2640 - 1000) and d["wall_ms"] == pytest.approx(2.0) and d["kernels_per_step"] == 10
    assert d["copy_ms"] == ms(30) and d["attributed_by"] == {"launch": 10, "name": 0}
    regions = d["regions"]
    assert regions["fsdp_hooks"] == {"quantize": ms(100)}
    assert regions["compiled_fwd"] == {"fp8_gemm": ms(400), "quantize": ms(50), "norm_elementwise": ms(50),
                                       "attention": ms(200)}
    assert regions["compiled_bwd"] == {"bf16_gemm": ms(300), "copy": ms(30)}
    assert regions["loss"] == {"norm_elementwise": ms(20)} and regions["optimizer"] == {"optimizer": ms(200)}
    assert regions["eager_other"] == {"collective": ms(40)}
    assert "| compiled_fwd / fp8_gemm | 0.40 |" in bench_torch.region_table([("x", b)])


@pytest.mark.extended   # a benchmark smoke (docs/development.md: README command's time budget)
def test_profile_on_the_cpu_writes_the_trace_and_a_breakdown(tmp_path):
    """--profile DIR: the trace under DIR/<flag set>/<config>/ and the row's breakdown (no GPU kernels on the CPU:
    every category 0); nothing compiled on the CPU by default."""
    t = bench_torch.parse_args(["--tiny", "--layers", "1", "--steps", "1", "--profile", str(tmp_path)])
    row = bench_torch.run_in_process(t, "torch-bf16")
    folder = tmp_path / "default" / "torch-bf16"
    assert (folder / "torch-bf16.trace.json.gz").stat().st_size > 0 and (folder / "breakdown.json").exists()
    b = row["breakdown"]
    assert all(b[c] == 0.0 for c in bench_e2e.breakdown.CATEGORIES) and b["detail"]["wall_ms"] > 0, b
    assert not row["compiled_loss"] and not row["compiled"]
    assert json.loads((folder / "breakdown.json").read_text())["detail"]["wall_ms"] == b["detail"]["wall_ms"]
