"""benchmarks/bench_e2e.py's reading of a Perfetto trace (also used by bench_sp.py): collective kernel time
on GPU 0, the part of it no other kernel overlaps (exposed), GEMM / other kernel sums and idle time per
step, and where the idle time sits."""

import gzip
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import bench_e2e  # noqa: E402


def test_exposed_collectives_reads_a_trace(tmp_path):
    kernel = lambda pid, name, ts, dur: {"ph": "X", "pid": pid, "name": name, "ts": ts, "dur": dur}
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
              kernel(1, "ncclDevKernel_SendRecv", 0, 1000),          # 1 ms, 0.4 ms under the GEMM
              kernel(1, "sm90_xmma_gemm_bf16", 600, 1000),
              kernel(1, "loop_add_fusion", 3000, 500),
              kernel(1, "ncclDevKernel_AllGather", 4000, 200),      # exposed
              kernel(1, "collective_gather_gemm_mosaic_gpu_kernel", 5000, 300),   # overlap="fused"
              kernel(1, "stream_executor::gpu::MultiGpuBarrierWithNccl", 4900, 100),   # names NCCL, as on GPUs
              kernel(2, "ncclDevKernel_SendRecv", 0, 9000)]         # another GPU: ignored
    path = tmp_path / "plugins" / "profile" / "run"
    path.mkdir(parents=True)
    with gzip.open(path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = bench_e2e.exposed_collectives(str(tmp_path), steps=2)
    assert abs(got["collective_ms"] - 0.6) < 1e-9                  # (1.0 + 0.2) ms over 2 steps
    assert abs(got["exposed_collective_ms"] - 0.4) < 1e-9          # (0.6 + 0.2) ms over 2 steps
    assert abs(got["gemm_kernel_ms"] - 0.5) < 1e-9 and abs(got["other_kernel_ms"] - 0.25) < 1e-9
    assert got["top_other_kernels"] == [("loop_add_fusion", 0.25)]
    # per collective kernel, the part no computation overlaps, largest first
    assert got["top_exposed_collectives"] == [("ncclDevKernel_SendRecv", 0.3), ("ncclDevKernel_AllGather", 0.1)]
    assert abs(got["collective_gemm_kernel_ms"] - 0.15) < 1e-9
    assert abs(got["barrier_kernel_ms"] - 0.05) < 1e-9
    assert abs(got["busy_ms"] - (1.6 + 0.5 + 0.2 + 0.4) / 2) < 1e-9
    # idle between GPU 0's kernels: 1.6-3.0, 3.5-4.0, 4.2-4.9 ms (2.6 ms over 2 steps), largest first
    assert abs(got["idle_ms"] - 1.3) < 1e-9
    assert got["largest_gaps"][:2] == [(1.4, "sm90_xmma_gemm_bf16", "loop_add_fusion"),
                                       (0.7, "ncclDevKernel_AllGather",
                                        "stream_executor::gpu::MultiGpuBarrierWithNccl")]
    # every kernel of GPU 0 by name, longest first: (name, ms a step, launches a step); 6 launches in 2 steps
    assert got["kernels"][:2] == [("ncclDevKernel_SendRecv", 0.5, 0.5), ("sm90_xmma_gemm_bf16", 0.5, 0.5)]
    assert len(got["kernels"]) == 6 and got["kernels_per_step"] == 3
    # the progress line names what the scheduler left synchronous, when the compiled program's counts are there
    r = {"step_ms": 10.0, "tflops_per_gpu": 1.0, "peak_gib": 1.0, "compile_s": 1.0,
         "trace": got | {"collective_counts": {"sync": 3, "async": 19}}}
    assert "collectives left synchronous / asynchronous 3 / 19" in bench_e2e.describe(r)


def test_process_rule_compares_each_process_count_with_the_first():
    """bench_e2e --processes 1,2: per config and flag set, the 2-process run's step time and losses against
    the 1-process run's (the deep-models issue's rule: within 3%, the same losses)."""
    rows = [{"config": "jq-fp8", "flags": "default", "processes": 1, "step_ms": 40.0, "losses": [2.0, 1.0]},
            {"config": "jq-fp8", "flags": "default", "processes": 2, "step_ms": 41.0, "losses": [2.0, 1.001]},
            {"config": "plain-scan", "flags": "default", "processes": 1, "step_ms": 50.0, "losses": [2.0]}]
    assert list(bench_e2e.process_rule(rows)) == [
        "jq-fp8 (default): 2 processes x 1 device 41.0 ms vs 1 process 40.0 ms (1.025x); losses over 2 steps "
        "differ by at most 1.00e-03 (relative)"]


@pytest.mark.extended
def test_bench_e2e_two_processes_train_like_one(tmp_path):
    """bench_e2e --processes 1,2 --devices 2 on the CPU: the step as 2 jax.distributed processes of one device
    each (as cluster launchers start one process per GPU) gives the losses of 1 process x 2 devices: the first
    step's bit for bit, the later ones within 1e-3 (gloo's CPU collectives sum in another order, and not the same
    order from run to run under load; FP8 turns a flipped E4M3 rounding into up to 2.2e-4 relative at step 3)."""
    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--tiny", "--configs", "jq-fp8", "--flags", "default", "--steps", "1",
                           "--processes", "1,2", "--devices", "2", "--json", str(out)]) == 0
    one, two = json.loads(out.read_text())["results"]
    assert (one["processes"], one["devices"], two["processes"], two["devices"]) == (1, 2, 2, 2)
    assert len(one["losses"]) == 3 and two["losses"][0] == one["losses"][0]
    assert np.allclose(two["losses"], one["losses"], rtol=1e-3, atol=0), (two["losses"], one["losses"])


def _bench_sp():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_sp.py")
    spec = importlib.util.spec_from_file_location("bench_sp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_rule_measures_against_the_synchronous_step():
    """The 70% rule of both benchmarks: what an overlapped step saves against the same program with every
    collective synchronous, as a share of that program's collective kernel time."""
    trace = lambda coll: {"collective_ms": coll, "exposed_collective_ms": coll}
    sync = {"step_ms": 10.0, "trace": trace(2.0)}
    cells = {"sync": sync, "off": {"step_ms": 8.5, "trace": trace(1.0)},      # saves 1.5 = 75%: meets
             "fused": {"step_ms": 8.9, "trace": trace(0.5)}}                  # saves 55%, and > 1.03 x off
    text = _bench_sp().overlap_target(cells)
    assert "off: saves 1.500 ms = 75% of sync's collectives (meets" in text
    assert "fused: saves 1.100 ms = 55% of sync's collectives (MISSES" in text
    # bench_e2e: per config, the default-flag step against its "sync" run; a "-spfused" step also against
    # the sync run of its "-sp" form (the same step with the tp collectives left to XLA)
    rows = [{"config": "jq", "flags": "sync", "step_ms": 50.0, "trace": trace(10.0)},
            {"config": "jq", "flags": "default", "step_ms": 42.0, "trace": trace(12.0)},
            {"config": "plain", "flags": "default", "step_ms": 60.0, "trace": trace(12.0)},   # no sync run
            {"config": "jq-sp", "flags": "sync", "step_ms": 40.0, "trace": trace(8.0)},
            {"config": "jq-spfused", "flags": "default", "step_ms": 35.0, "trace": trace(3.0)}]
    lines = list(bench_e2e.overlap_rule(rows))
    assert lines == ["jq (default) vs jq (sync): saves 8.00 ms of 10.00 ms sync collectives (80%; meets the 70% rule)",
                     "jq-spfused (default) vs jq-sp (sync): saves 5.00 ms of 8.00 ms sync collectives (62%; MISSES "
                     "the 70% rule)"]


def test_clock_summary_keeps_the_window_and_skips_what_it_cannot_read():
    """nvidia-smi's samples (``ClockSampler.QUERY``) summarized over a time.time() window: samples outside
    it, headers and "[N/A]" fields are left out; the power-cap share counts the samples whose clock-event
    reasons name the software power cap (0x4) or the hardware power brake (0x80); no sample in the
    window gives None."""
    from datetime import datetime
    stamp = lambda s: datetime(2026, 11, 27, 8, 0, s).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    t = lambda s: datetime(2026, 11, 27, 8, 0, s).timestamp()
    text = "\n".join(["timestamp, index, clocks.current.sm [MHz], power.draw.instant [W], temperature.gpu, "
                      "clocks_event_reasons.active",
                      f"{stamp(1)}, 0, 1980, 300.0, 40, 0x0000000000000000",          # before the window
                      f"{stamp(2)}, 0, 1755, 690.5, 61, 0x0000000000000004",
                      f"{stamp(2)}, 1, 1665, 700.0, 63, 0x0000000000000080",
                      f"{stamp(3)}, 0, [N/A], 650.0, 62, 0x0000000000000004",
                      f"{stamp(4)}, 1, 1830, 600.0, 60, 0x0000000000000000",
                      f"{stamp(9)}, 0, 1980, 100.0, 45, 0x0000000000000001"])         # after it
    got = bench_e2e.clock_summary(text, t(2), t(5))
    assert got == {"sm_mhz_mean": 1750, "sm_mhz_min": 1665.0, "power_w_mean": 663.5, "power_w_max": 700.0,
                   "temp_c_max": 63.0, "power_capped": 0.67, "samples": 3}
    no_reasons = "\n".join(",".join(line.split(",")[:5]) for line in text.splitlines())
    assert bench_e2e.clock_summary(no_reasons, t(2), t(5))["power_capped"] is None
    assert bench_e2e.clock_summary(text, t(5), t(8)) is None
    assert bench_e2e.joules_per_step(got, 20.0) == 13.27 and bench_e2e.joules_per_step(None, 20.0) is None
    assert bench_e2e.ClockSampler(on=False).__enter__().between(0, 1e12) is None


def test_pipelined_timing_reports_the_dispatch_and_frees_outputs_unless_kept():
    """bench_sp._time: timed one call at a time it gives (median ms, None); pipelined, (mean ms, the host's
    mean ms to dispatch a call), both with each call's outputs freed once the next is dispatched and
    with every output kept (``keep_outputs``)."""
    import jax
    import jax.numpy as jnp
    timer = _bench_sp()._time
    live = []
    # arrays of this shape that earlier tests of the same process keep alive (module-scoped fixtures, caches)
    others = sum(1 for a in jax.live_arrays() if a.shape == (64, 64))

    def fn(x):
        out = x + 1
        live.append(sum(1 for a in jax.live_arrays() if a.shape == (64, 64)) - others)
        return out

    x = jnp.zeros((64, 64))
    ms, dispatch = timer(fn, (x,), iters=4, warmup=1)
    assert ms > 0 and dispatch is None
    for keep in (False, True):
        live.clear()
        ms, dispatch = timer(fn, (x,), iters=4, warmup=1, pipelined=True, keep_outputs=keep)
        assert 0 < dispatch <= ms
        # counted as a call ends: x, the call's own result and the previous call's (still bound), or with
        # kept outputs every earlier call's too
        assert max(live) == (5 if keep else 3), live


@pytest.mark.extended
def test_bench_sp_runs_one_process_per_device():
    """bench_sp --processes 2 on simulated CPU devices: each mode runs as 2 jax.distributed processes
    (2 devices each, tp 4 over both), and process 0 reports its rows."""
    results = _bench_sp().main(["--cpu-smoke", "--processes", "2", "--modes", "off", "--recipes", "bf16",
                                "--pipelined", "--iters", "1", "--warmup", "1"])
    assert [(r["mode"], r["tp"], r["processes"]) for r in results] == [("off", 4, 2)]
    assert results[0]["step_ms"] > 0 and results[0]["dispatch_ms"] > 0


@pytest.mark.extended
def test_bench_sp_stacks_layers_unrolled_or_under_scan():
    """bench_sp --layers K: K layers back to back with a residual add, unrolled (K call sites) or under
    lax.scan (one); the CPU smoke runs sp_mlp so stacked, "off" and "fused" (its plain-JAX schedule on
    the CPU), and reports the stacking with each row."""
    import jax
    import jax.numpy as jnp
    bench_sp = _bench_sp()
    layer = lambda h: 2.0 * h
    x = jnp.ones((4,))
    assert float(bench_sp._stack(layer, x, 1, False)[0]) == 2.0
    for scan in (False, True):
        assert float(bench_sp._stack(layer, x, 3, scan)[0]) == 27.0   # x + 2x, three times
        eqns = [e.primitive.name for e in jax.make_jaxpr(lambda v: bench_sp._stack(layer, v, 3, scan))(x).eqns]
        assert ("scan" in eqns) == scan and eqns.count("mul") == (0 if scan else 3), eqns
    results = bench_sp.main(["--cpu-smoke", "--modes", "off,fused", "--recipes", "bf16", "--layers", "2", "--scan",
                             "--iters", "1", "--warmup", "1"])
    assert [(r["mode"], r["layers"], r["scan"]) for r in results] == [("off", 2, True), ("fused", 2, True)]
    assert all(r["step_ms"] > 0 for r in results)
