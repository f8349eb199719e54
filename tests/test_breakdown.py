"""benchmarks/breakdown.py: a profile's kernels attributed by their HLO op to issue 55's categories (FP8 / bf16 GEMMs,
attention, quantize, norms and elementwise, optimizer, collectives total / exposed, idle, other, unattributed), on a
synthetic GPU-like trace with its HLO (exact ms), on a real CPU trace of a jitted function (XLA:CPU writes
``hlo_op`` / ``hlo_module`` per thunk), and the table and PNG."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import breakdown as bd  # noqa: E402

# a GPU-shaped program: an all-gather, an amax fusion, a jaxquant FFI cast, an FP8 cast fusion, a cuBLAS FP8 GEMM,
# a Triton bf16 GEMM fusion, cuDNN attention, a scoped Adam fusion, a norm fusion, another custom call, a while loop
HLO = r"""HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[64,64]{1,0})->bf16[64,64]{1,0}}

%region_max (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %maximum.1 = f32[] maximum(%a.1, %b.1)
}

%amax_computation (param_0: bf16[64,64]) -> f32[] {
  %param_0 = bf16[64,64]{1,0} parameter(0)
  %convert.1 = f32[64,64]{1,0} convert(%param_0)
  %abs.1 = f32[64,64]{1,0} abs(%convert.1), metadata={op_name="jit(step)/abs"}
  %constant.1 = f32[] constant(0)
  ROOT %reduce.1 = f32[] reduce(%abs.1, %constant.1), dimensions={0,1}, to_apply=%region_max
}

%cast_computation (param_0.1: bf16[64,64], param_1.1: f32[]) -> f8e4m3fn[64,64] {
  %param_0.1 = bf16[64,64]{1,0} parameter(0)
  %convert.2 = f32[64,64]{1,0} convert(%param_0.1)
  %param_1.1 = f32[] parameter(1)
  %broadcast.1 = f32[64,64]{1,0} broadcast(%param_1.1), dimensions={}
  %multiply.1 = f32[64,64]{1,0} multiply(%convert.2, %broadcast.1)
  ROOT %convert.3 = f8e4m3fn[64,64]{1,0} convert(%multiply.1), metadata={op_name="jit(step)/convert_element_type"}
}

%triton_gemm_computation (param_0.2: bf16[64,64], param_1.2: bf16[64,64]) -> bf16[64,64] {
  %param_0.2 = bf16[64,64]{1,0} parameter(0)
  %param_1.2 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,64]{1,0} dot(%param_0.2, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%adam_computation (param_0.3: f32[64,64], param_1.3: f32[64,64]) -> f32[64,64] {
  %param_0.3 = f32[64,64]{1,0} parameter(0)
  %param_1.3 = f32[64,64]{1,0} parameter(1)
  %multiply.2 = f32[64,64]{1,0} multiply(%param_0.3, %param_1.3), metadata={op_name="jit(step)/optimizer/mul"}
  ROOT %add.1 = f32[64,64]{1,0} add(%param_0.3, %multiply.2), metadata={op_name="jit(step)/add"}
}

%norm_computation (param_0.4: bf16[64,64]) -> bf16[64,64] {
  %param_0.4 = bf16[64,64]{1,0} parameter(0)
  %convert.4 = f32[64,64]{1,0} convert(%param_0.4)
  %rsqrt.1 = f32[64,64]{1,0} rsqrt(%convert.4), metadata={op_name="jit(step)/rsqrt"}
  ROOT %convert.5 = bf16[64,64]{1,0} convert(%rsqrt.1)
}

%cond (p.1: s32[]) -> pred[] {
  %p.1 = s32[] parameter(0)
  %c.1 = s32[] constant(4)
  ROOT %lt.1 = pred[] compare(%p.1, %c.1), direction=LT
}

%body (p.2: s32[]) -> s32[] {
  %p.2 = s32[] parameter(0)
  %c.2 = s32[] constant(1)
  ROOT %add.2 = s32[] add(%p.2, %c.2)
}

ENTRY %main.1 (x: bf16[64,64], w_shard: bf16[32,64], m: f32[64,64], g: f32[64,64], i: s32[]) -> bf16[64,64] {
  %x = bf16[64,64]{1,0} parameter(0), metadata={op_name="x"}
  %w_shard = bf16[32,64]{1,0} parameter(1)
  %m = f32[64,64]{1,0} parameter(2)
  %g = f32[64,64]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %all-gather-start = (bf16[32,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%w_shard), channel_id=1, replica_groups={{0,1}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = bf16[64,64]{1,0} all-gather-done(%all-gather-start)
  %amax_fusion = f32[] fusion(%x), kind=kInput, calls=%amax_computation
  %jq_cast = (f8e4m3fn[64,64]{1,0}, f32[]) custom-call(%x, %amax_fusion), custom_call_target="jq_fp8_cast", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/ffi_call"}
  %gte.0 = f8e4m3fn[64,64]{1,0} get-tuple-element(%jq_cast), index=0
  %cast_fusion = f8e4m3fn[64,64]{1,0} fusion(%all-gather-done, %amax_fusion), kind=kLoop, calls=%cast_computation
  %cublas-gemm.1 = (bf16[64,64]{1,0}, s8[4194304]{0}) custom-call(%gte.0, %cast_fusion, %amax_fusion, %amax_fusion), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1}}
  %gemm_fusion = bf16[64,64]{1,0} fusion(%x, %all-gather-done), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %fmha = (bf16[1,2,64,32]{3,2,1,0}, u8[0]{0}) custom-call(%x, %x, %x), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/dot_product_attention_fwd"}
  %loop_adam_fusion = f32[64,64]{1,0} fusion(%m, %g), kind=kLoop, calls=%adam_computation, metadata={op_name="jit(step)/add"}
  %norm_fusion = bf16[64,64]{1,0} fusion(%x), kind=kLoop, calls=%norm_computation
  %other-cc = bf16[64,64]{1,0} custom-call(%x), custom_call_target="xla_python_gpu_callback"
  %while.1 = s32[] while(%i), condition=%cond, body=%body
  ROOT %out = bf16[64,64]{1,0} add(%gemm_fusion, %norm_fusion)
}
"""  # noqa: E501


def _write_trace(tmp_path, events):
    path = tmp_path / "plugins" / "profile" / "run"
    path.mkdir(parents=True)
    with gzip.open(path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_synthetic_trace_covers_every_category(tmp_path):
    def kernel(name, ts, dur, op=None, module="jit_step", pid=1, tid=7):
        args = {} if op is None else {"hlo_op": op, "hlo_module": module}
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Ops"}},
              kernel("ncclDevKernel_AllGather_RING_LL", 0, 1000, "all-gather-start"),   # 0.4 ms under the GEMM
              kernel("gemm_fusion", 600, 1000, "gemm_fusion"),                          # bf16 (Triton) GEMM
              kernel("input_reduce_fusion", 1600, 200, "amax_fusion"),                  # amax: quantize
              kernel("jq_fp8_cast_kernel", 1800, 300, "jq_cast"),                       # jq_ FFI: quantize
              kernel("loop_convert_fusion", 2100, 100, "cast_fusion"),                  # f8 output: quantize
              kernel("sm90_xmma_gemm_e4m3bf16", 2200, 800, "cublas-gemm.1"),            # FP8 GEMM
              kernel("cudnn_generated_fort_native_sdpa", 3000, 600, "fmha"),            # attention
              kernel("loop_add_fusion", 3600, 400, "loop_adam_fusion"),                 # optimizer scope
              kernel("norm_fusion", 4000, 100),                     # no hlo_op: by its kernel name, a fusion
              kernel("callback_kernel", 4100, 50, "other-cc"),                          # other custom call
              kernel("MemcpyDtoH", 4150, 50, "while.1"),                                # the loop's: other
              kernel("mystery_kernel", 5000, 100),                                      # unattributed
              kernel("gemm_fusion", 5100, 100, "gemm_fusion", module="jit_other"),      # another program
              kernel("ncclDevKernel_AllReduce_Sum_f32", 5300, 200),                     # exposed, by name
              kernel("gemm_fusion", 0, 9000, "gemm_fusion", tid=9),                     # derived view: left out
              kernel("gemm_fusion", 0, 9000, "gemm_fusion", pid=2)]                     # GPU 1: left out
    _write_trace(tmp_path, events)
    got = bd.breakdown(str(tmp_path), HLO, steps=2)
    expect = {"bf16_gemm": 0.5, "fp8_gemm": 0.4, "attention": 0.3, "quantize": 0.3, "optimizer": 0.2,
              "norm_elementwise": 0.05, "other": 0.05, "unattributed": 0.1, "collective_total": 0.6,
              "collective_exposed": 0.4, "idle": 0.45}     # idle: 4.2-5.0 and 5.2-5.3 ms over 2 steps
    assert set(expect) == set(bd.CATEGORIES)
    for c, ms in expect.items():
        assert got[c] == pytest.approx(ms, abs=1e-12), c
    detail = got["detail"]
    assert detail["span_ms"] == pytest.approx(2.75)
    assert detail["attributed_by"] == {"hlo_op": 9, "kernel_name": 1, "container": 1, "nccl_name": 1, "none": 2}
    assert detail["hlo_module"] == "jit_step" and detail["modules"] == {"jit_step": 10, "jit_other": 1}
    assert detail["top"]["quantize"] == [("jq_cast", 0.15), ("amax_fusion", 0.1), ("cast_fusion", 0.05)]
    # the same reading as bench_e2e.exposed_collectives (one copy of the interval logic)
    import bench_e2e
    old = bench_e2e.exposed_collectives(str(tmp_path), steps=2)
    assert old["collective_ms"] == pytest.approx(got["collective_total"])
    assert old["exposed_collective_ms"] == pytest.approx(got["collective_exposed"])
    assert old["idle_ms"] == pytest.approx(got["idle"])


def test_hlo_parser_reads_what_classification_needs():
    hlo = bd.Hlo(HLO)
    assert hlo.module == "jit_step"
    cc = hlo.instrs["cublas-gemm.1"]
    assert (cc.opcode, cc.target, cc.out_dtypes) == ("custom-call", "__cublas$lt$matmul$f8", ("bf16", "s8"))
    assert cc.operands == ("gte.0", "cast_fusion", "amax_fusion", "amax_fusion")
    assert hlo.dtypes(cc.operands[:2]) == ("f8e4m3fn", "f8e4m3fn")
    assert hlo.instrs["amax_fusion"].calls == ("amax_computation",)
    assert [i.opcode for i in hlo.body(hlo.instrs["amax_fusion"])][-1] == "maximum"    # the reducer, nested
    assert hlo.instrs["while.1"].calls == ("cond", "body")
    assert hlo.instrs["fmha"].op_name == "jit(step)/dot_product_attention_fwd"


def test_jaxquants_own_gemm_is_an_fp8_gemm_and_its_casts_quantize():
    line = ('  %jq_gemm = (bf16[64,64]{1,0}, s8[33554432]{0}) custom-call(%gte.0, %cast_fusion, %amax_fusion, '
            '%amax_fusion), custom_call_target="jq_fp8_gemm", api_version=API_VERSION_TYPED_FFI')
    hlo = bd.Hlo(HLO.replace("  %gemm_fusion =", line + "\n  %gemm_fusion ="))
    assert hlo.classify(hlo.instrs["jq_gemm"], "sm90_xmma_gemm_e4m3bf16") == "fp8_gemm"
    assert hlo.classify(hlo.instrs["jq_cast"]) == "quantize"


def test_jaxquants_scaled_bf16_gemm_is_a_bf16_gemm():
    """NVFP4's GEMM on Hopper (``jq_bf16_gemm``) reads bf16 operands: a bf16 GEMM, not a quantize op."""
    line = ('  %jq_gemm = (bf16[64,64]{1,0}, u8[33554432]{0}) custom-call(%x, %all-gather-done, %amax_fusion), '
            'custom_call_target="jq_bf16_gemm", api_version=API_VERSION_TYPED_FFI')
    hlo = bd.Hlo(HLO.replace("  %gemm_fusion =", line + "\n  %gemm_fusion ="))
    assert hlo.classify(hlo.instrs["jq_gemm"], "sm90_xmma_gemm_bf16bf16_bf16f32") == "bf16_gemm"



def test_an_update_that_also_takes_the_weights_amax_is_the_optimizers():
    line = ('  %update_amax = f32[] fusion(%m), kind=kInput, calls=%amax_computation, '
            'metadata={op_name="jit(step)/optimizer/max"}')
    hlo = bd.Hlo(HLO.replace("  %gemm_fusion =", line + "\n  %gemm_fusion ="))
    assert hlo.classify(hlo.instrs["update_amax"]) == "optimizer"
    assert hlo.classify(hlo.instrs["amax_fusion"]) == "quantize"          # the same reduction outside the update


def test_cpu_trace_is_attributed_by_hlo_op(tmp_path):
    """A real trace: XLA:CPU's thunk events carry ``hlo_op`` / ``hlo_module``; a dot, jaxquant's FP8 quantization,
    elementwise work and a scoped Adam update land in their categories, every event attributed by its op."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxquant as jq

    opt = bd.scoped_optimizer(optax.adam(1e-3))

    def f(w, state, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) * 2.0 + 1.0))(w)
        updates, state = opt.update(g, state, w)
        return optax.apply_updates(w, updates), state, jq.quantize_fp8((x @ w).astype(jnp.bfloat16)), loss

    w = jax.random.normal(jax.random.key(0), (128, 128), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (128, 128), jnp.float32)
    state = opt.init(w)
    step = jax.jit(f)
    jax.block_until_ready(step(w, state, x))
    hlo = step.lower(w, state, x).compile().as_text()
    assert "jq_fp8" in hlo
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(2):
            out = step(w, state, x)
        jax.block_until_ready(out)
    events = bd.load_trace(str(tmp_path))
    if not bd.cpu_events(events):
        pytest.skip("this jax's CPU trace has no events with args.hlo_op (no per-op events to attribute)")
    got = bd.breakdown(str(tmp_path), hlo, steps=2)
    how = got["detail"]["attributed_by"]
    assert how.get("hlo_op", 0) > 0 and how.get("none", 0) == 0 and how.get("kernel_name", 0) == 0, how
    for c in ("bf16_gemm", "quantize", "norm_elementwise", "optimizer"):
        assert got[c] > 0, (c, got)
    for c in ("fp8_gemm", "attention", "collective_total", "collective_exposed", "unattributed"):
        assert got[c] == 0, (c, got)
    parsed = bd.Hlo(hlo)
    # what each category holds is what the HLO says it is
    assert any(parsed.instrs[n].target and parsed.instrs[n].target.startswith("jq_")
               for n, _ in got["detail"]["top"]["quantize"])
    assert all(any(i.opcode == "dot" for i in [parsed.instrs[n]] + parsed.body(parsed.instrs[n]))
               for n, _ in got["detail"]["top"]["bf16_gemm"])
    # the scope changes names only: the same update as optax's
    plain = optax.adam(1e-3)
    g = jnp.ones_like(w)
    assert jnp.array_equal(opt.update(g, state, w)[0], plain.update(g, plain.init(w), w)[0])


def test_table_and_plot(tmp_path):
    row = dict.fromkeys(bd.CATEGORIES, 1.0) | {"detail": {"span_ms": 9.0}, "compile_s": 2.5}
    text = bd.table([("plain-loop", row), ("jq-fp8-loop", row | {"fp8_gemm": 0.25}), ("failed", None)])
    lines = text.splitlines()
    assert lines[0] == "| ms per step | plain-loop | jq-fp8-loop |"
    assert "| fp8_gemm | 1.00 | 0.25 |" in lines and "| compile s | 2.5 | 2.5 |" in lines
    assert len(lines) == 2 + len(bd.CATEGORIES) + 2
    png = bd.plot([("plain-loop", row), ("jq-fp8-loop", row)], str(tmp_path / "b.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_collective_counts_the_synchronous_and_the_started_ones():
    hlo = "\n".join([
        "  %ag = f8e4m3fn[64,32]{1,0} all-gather(%p), channel_id=1, dimensions={0}",
        "  %rs = (bf16[64,32]{1,0}, bf16[32,32]{1,0}) reduce-scatter-start(%g), channel_id=2",
        "  %rsd = bf16[32,32]{1,0} reduce-scatter-done(%rs)",
        "  %ar = f32[] all-reduce(%l), channel_id=3, to_apply=%add",
        "  %cp = (f32[8]{0}, f32[8]{0}) collective-permute-start(%x), channel_id=4",
    ])
    assert bd.collective_counts(hlo) == {"sync": 2, "async": 2}
    assert bd.collective_counts(HLO) == {"sync": 0, "async": 1}     # the synthetic program's one all-gather
