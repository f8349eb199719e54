"""Sequence-parallel layers (jaxquant.tp.sp) on 8 simulated CPU devices.

Each layer's forward and gradients are compared with a single-device computation of the same
quantized math (whole-tensor current scaling, one GEMM); overlap="fused" (its kernels' plain-JAX schedule
here) is compared with "off"; microbatches interleaved forward-before-backward must give the gradients of
one-at-a-time.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bytes_equal, q_fp8, q_nvfp4
from support.meshes import tp_mesh
from support.sp_layers import (CASES, E4M3, E5M2, FUSED_OPERANDS, FUSED_TILINGS, B, F, H, S, assert_close,
                               check_fp8_fused_matches_off, check_layers_match_single_device, column_vjp, fp8_weight,
                               fused_programs, fused_tiling, layer_args, layer_inputs, quantized, ref_mlp_dx, row_vjp,
                               runner)
from jax.sharding import Mesh, PartitionSpec as P

import jaxquant as jq
import jaxquant.tp.sp
import jaxquant.zero.distributed
from jaxquant.tp import collective_gemm as cg, sp
from jaxquant.primitives import gemm

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 (simulated) CPU devices: "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8")

# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _on_cpu(request):
    """The single-device references run on the CPU too (GPU runs: tests/test_sp_gpu.py)."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.mark.slow
def test_local_quantization_with_shared_amax_equals_whole_tensor():
    """Each rank quantizes its sequence chunk once after the max-reduction: the bytes and the one
    scale_inv are those of quantizing the whole tensor, on every rank."""
    x = layer_inputs()[0].astype(jnp.bfloat16)
    ctx = sp._context(tp_mesh(4), "tp", "off", "auto")
    q = jax.jit(lambda v: sp._operand(ctx, "fp8", v, P(None, "tp", None), E4M3))(x)
    data, scale_inv = quantized(x, E4M3)
    assert_bytes_equal(q.data, data, "gathered FP8 bytes")
    assert_bytes_equal(q.scale_inv, scale_inv, "scale_inv")
    per_rank = [np.asarray(s.data) for s in q.scale_inv.addressable_shards]
    assert len(per_rank) == 4 and all(r == per_rank[0] for r in per_rank)


# bf16 at every tp; FP8 (its amax shared over tp, the transposed data) at the smallest and the largest
LAYER_CASES = [(tp, r, k) for r, k in CASES for tp in (2, 4, 8) if r == "bf16" or tp != 4]


@pytest.mark.parametrize("tp,recipe,kind", LAYER_CASES, ids=[f"{r}-{k}-{tp}" for tp, r, k in LAYER_CASES])
@pytest.mark.slow
def test_layers_match_single_device(tp, recipe, kind):
    col_args, row_args = layer_args(tp, recipe, kind)
    results = runner(tp, "off", recipe)(col_args, row_args)
    check_layers_match_single_device(results, col_args, row_args, recipe)


@pytest.mark.parametrize("kind", ["float", "nvfp4"])
@pytest.mark.slow
def test_other_weight_types(kind):
    """A float weight under the FP8 recipe is quantized inside (shared amax over tp) with its
    gradient passed straight through; an NVFP4 weight is read as bf16 value(q)*s8 with the global factor
    on the GEMM output, its gradient going to a straight_through master."""
    recipe = "fp8" if kind == "float" else "bf16"
    col_args, row_args = layer_args(3, recipe, kind)
    check_layers_match_single_device(runner(2, "off", recipe)(col_args, row_args), col_args, row_args, recipe)


@pytest.mark.slow
def test_interleaved_microbatches_match_one_at_a_time():
    """Two FP8 layers (sp_mlp) with one quantizer configuration; forward passes of three microbatches
    of very different magnitude (so their scales differ) run before any backward pass."""
    mesh = tp_mesh(4)
    _, gamma, beta, w1, w2 = layer_inputs(5)
    w1q, w2q = fp8_weight(w1), fp8_weight(w2)
    x_spike = layer_inputs(21)[0].at[0, 3, 5].set(1e3)                          # outlier row
    x_flat = jax.random.uniform(jax.random.key(22), (B, S, H), jnp.float32, -1.0, 1.0)
    xs = [layer_inputs(20)[0], x_spike, x_flat]
    gs = [jax.random.normal(jax.random.key(30 + i), (B, S, H), jnp.float32) * s
          for i, s in enumerate((1.0, 1e-4, 50.0))]
    # weight gradients land on straight-through masters (zeros placeholders of the weights' shapes)
    m1, m2 = jnp.zeros(w1.shape, jnp.float32), jnp.zeros(w2.shape, jnp.float32)

    def mlp(x, gamma, beta, m1, m2):
        return jq.sp_mlp(x, gamma, beta, jq.straight_through(w1q, m1), jq.straight_through(w2q, m2),
                         mesh=mesh, overlap="off")

    def one(x, g):
        out, vjp = jax.vjp(mlp, x, gamma, beta, m1, m2)
        return out, vjp(g)

    @jax.jit
    def interleaved(xs, gs):
        pending = [jax.vjp(mlp, x, gamma, beta, m1, m2) for x in xs]     # all forwards first
        grads = [pending[i][1](gs[i]) for i in (2, 0, 1)]                # backwards out of order
        return [p[0] for p in pending], [grads[1], grads[2], grads[0]]

    outs, grads = interleaved(xs, gs)
    one_j = jax.jit(one)
    for i, (x, g) in enumerate(zip(xs, gs)):
        out_i, grads_i = one_j(x, g)
        assert_bytes_equal(outs[i], out_i, f"microbatch {i} out")
        for a, e in zip(jax.tree.leaves(grads[i]), jax.tree.leaves(grads_i)):
            assert_bytes_equal(a, e, f"microbatch {i} gradient")
    # the microbatches really had different activation scales, and the result is the quantized math
    ln_bf16 = lambda x: sp._layernorm_f32(x, gamma, beta, 1e-5).astype(jnp.bfloat16)
    assert len({float(quantized(ln_bf16(x), E4M3)[1]) for x in xs}) == 3
    for i in range(3):
        assert_close(grads[i][0], ref_mlp_dx(xs[i], gs[i], gamma, beta, w1q, w2q), f"microbatch {i} dx vs reference")


def test_bad_input_errors():
    mesh = tp_mesh(4)
    x, gamma, beta, w1, w2 = layer_inputs()
    with pytest.raises(ValueError, match="overlap: must be one of"):
        jq.sp_layernorm_dense(x, gamma, beta, w1, mesh=mesh, overlap="fast")
    with pytest.raises(ValueError, match="tp_axis: 'model' is not an axis"):
        jq.sp_layernorm_dense(x, gamma, beta, w1, mesh=mesh, tp_axis="model")
    with pytest.raises(ValueError, match=r"x: the sequence length .* multiple of the 'tp' axis size 4"):
        jq.sp_layernorm_dense(x[:, :30], gamma, beta, w1, mesh=mesh)
    with pytest.raises(ValueError, match=r"w: must be \[out, in\] with in = 32"):
        jq.sp_layernorm_dense(x, gamma, beta, w2, mesh=mesh)
    with pytest.raises(ValueError, match=r"gamma: must have shape \(32,\)"):
        jq.sp_layernorm_dense(x, gamma[:8], beta, w1, mesh=mesh)
    # the recipe errors of jq.dense (gemm.resolve_recipe): the argument, the allowed values, what was given
    with pytest.raises(ValueError, match=r"^recipe: 'fp8' does not match w, an NVFP4Tensor \(use None or 'nvfp4'\)$"):
        jq.sp_dense_reduce_scatter(jnp.ones((B, S, F)), q_nvfp4(w2), mesh=mesh, recipe="fp8")
    with pytest.raises(ValueError, match=r"^recipe: 'bf16' does not match w, a Float8Tensor \(use None or 'fp8'\)$"):
        jq.sp_dense_reduce_scatter(jnp.ones((B, S, F)), fp8_weight(w2), mesh=mesh, recipe="bf16")
    with pytest.raises(ValueError, match=r"^recipe: 'nvfp4' does not match w, a float array "
                                         r"\(use None, 'bf16' or 'fp8'\)$"):
        jq.sp_dense_reduce_scatter(jnp.ones((B, S, F)), w2, mesh=mesh, recipe="nvfp4")
    with pytest.raises(ValueError, match=r"^recipe: must be None, 'bf16', 'fp8' or 'nvfp4', got 'fp4'$"):
        jq.sp_layernorm_dense(x, gamma, beta, w1, mesh=mesh, recipe="fp4")
    with pytest.raises(ValueError, match="mesh: the sp layers need a mesh with Auto axis types"):
        jq.sp_layernorm_dense(x, gamma, beta, w1, mesh=jax.make_mesh(
            (4,), ("tp",), devices=jax.devices("cpu")[:4], axis_types=(jax.sharding.AxisType.Explicit,)))
    with pytest.raises(TypeError, match="w: a Float8Tensor weight must be float8_e4m3fn"):
        jq.sp_dense_reduce_scatter(jnp.ones((B, S, F)), q_fp8(w2, dtype=E5M2), mesh=mesh)
    bad_scales = jq.NVFP4Tensor(data=q_nvfp4(w1).data, scale_inv=jnp.zeros((256, 4), jnp.uint8),
                                amax=q_nvfp4(w1).amax)            # tp=2's TP-local layout on a tp=4 mesh
    with pytest.raises(ValueError, match=r"w: NVFP4 scales of shape \(256, 4\) match neither"):
        jq.sp_layernorm_dense(x, gamma, beta, bad_scales, mesh=mesh)
    with pytest.raises(TypeError, match="x: must be a floating-point array"):
        jq.sp_dense_reduce_scatter(jnp.ones((B, S, F), jnp.int32), w2, mesh=mesh)


@pytest.mark.parametrize("kind,spellings", [("nvfp4", (None, "nvfp4", "bf16")), ("float8tensor", (None, "fp8")),
                                            ("float", (None, "bf16"))])
@pytest.mark.fast_cases("float-spellings2")  # the other cases: slow
def test_recipe_spellings_agree_bitwise(kind, spellings):
    """One vocabulary with jq.dense: None follows the weight's type; an NVFP4Tensor takes "nvfp4" (its
    former spelling "bf16" still works). Every spelling gives the same outputs and gradients, bitwise."""
    col_args, row_args = layer_args(5, "bf16", kind)
    runs = [runner(2, "off", r)(col_args, row_args) for r in spellings]
    for r, res in zip(spellings[1:], runs[1:]):
        for a, e in zip(jax.tree.leaves(res), jax.tree.leaves(runs[0])):
            assert_bytes_equal(a, e, f"recipe={r!r} vs None ({kind})")


def test_every_layer_refuses_an_overlap_it_does_not_have_in_one_line():
    """An overlap other than "off" and "fused" is refused by every layer with one line naming the choices."""
    mesh = tp_mesh(4)
    x, gamma, beta, w1, w2 = layer_inputs()
    message = r"^overlap: must be one of \('off', 'fused'\), got 'ring'$"
    calls = (lambda: jq.sp_layernorm_dense(x, gamma, beta, w1, mesh=mesh, overlap="ring"),
             lambda: jq.sp_dense_reduce_scatter(jnp.ones((B, S, F)), w2, mesh=mesh, overlap="ring"),
             lambda: jq.sp_mlp(x, gamma, beta, w1, w2, mesh=mesh, overlap="ring"))
    for call in calls:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
    assert sp.OVERLAPS == ("off", "fused")


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_off_moves_data_with_one_collective_per_product(x_dtype):
    """The lowered forward+backward of sp_mlp with overlap="off": no collective-permutes; one all-gather
    per all-gather GEMM (column forward: E4M3; row backward: E5M2 dY for its dgrad and wgrad) plus one
    for the column layer's wgrad (E4M3), and one reduce-scatter per GEMM reduce-scatter (row forward,
    column backward). What travels, read from the HLO: FP8 bytes each paired with its scale_inv
    (all-gathered beside them), and partial sums in x's dtype (bf16 for bf16 activations, never widened
    to fp32)."""
    mesh = tp_mesh(4)
    _, gamma, beta, w1, w2 = layer_inputs()
    x = jnp.zeros((B, S, H), x_dtype)
    st = jq.straight_through     # masters: every wgrad runs

    def loss(x, m1, m2):
        return jnp.sum(jq.sp_mlp(x, gamma, beta, st(fp8_weight(w1), m1), st(fp8_weight(w2), m2), mesh=mesh,
                                 overlap="off"))
    # the loss value too: the row layer's forward reduce-scatter is not dead code
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, w1, w2).as_text()
    counts = {op: text.count(f"stablehlo.{op}") for op in ("collective_permute", "all_gather", "reduce_scatter")}
    wire = {jnp.bfloat16: "xbf16>", jnp.float32: "xf32>"}[x_dtype]
    gathered = [line.rsplit("-> ", 1)[-1] for line in text.splitlines() if "stablehlo.all_gather" in line]
    fp8 = [t for t in gathered if "xf8E" in t]
    scales = [t for t in gathered if t.strip() == "tensor<4xf32>"]     # one scale_inv from each of 4 ranks
    assert counts["collective_permute"] == 0 and counts["reduce_scatter"] == 2, counts
    assert len(gathered) == 6 and len(scales) == 3, gathered
    assert sorted(t.split("xf8")[1] for t in fp8) == ["E4M3FN>", "E4M3FN>", "E5M2>"], gathered
    # the op's type follows its reduction region: }) : (tensor<...>) -> tensor<...>
    scattered = re.findall(r'"stablehlo\.reduce_scatter".*?\}\) : \(([^)]*)\) ->', text, flags=re.S)
    assert len(scattered) == 2 and all(wire in t for t in scattered), scattered


def test_bench_overlap_report_reads_a_schedule():
    """benchmarks/bench_sp.py's reading of a compiled schedule: a transfer counts as overlapped when a
    GEMM (cuBLAS custom call or Triton GEMM fusion) is scheduled between its start and its done."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sp.py"
    spec = importlib.util.spec_from_file_location("bench_sp", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    schedule = """HloModule m

ENTRY %main {
  %p = f32[4]{0} parameter(0)
  %cp-start = (f32[4]{0}, f32[4]{0}) collective-permute-start(f32[4]{0} %p), source_target_pairs={{0,1}}
  %g = f32[4,4]{1,0} custom-call(f32[4]{0} %p), custom_call_target="__cublas$lt$matmul$f8"
  %cp-done = f32[4]{0} collective-permute-done((f32[4]{0}, f32[4]{0}) %cp-start)
  %cp-start.1 = (f32[4]{0}, f32[4]{0}) collective-permute-start(f32[4]{0} %cp-done), source_target_pairs={{0,1}}
  %a = f32[4,4]{1,0} add(f32[4,4]{1,0} %g, f32[4,4]{1,0} %g)
  ROOT %cp-done.1 = f32[4]{0} collective-permute-done((f32[4]{0}, f32[4]{0}) %cp-start.1)
}
"""
    assert bench.overlap_report(schedule) == {"async_transfers": 2, "under_a_gemm": 1,
                                              "collective_dtypes": {"f32": 2}}
    triton = schedule.replace('custom-call(f32[4]{0} %p), custom_call_target="__cublas$lt$matmul$f8"',
                              'fusion(f32[4]{0} %p), kind=kCustom, calls=%gemm, '
                              'backend_config={"kind":"__triton_gemm"}')
    assert bench.overlap_report(triton)["under_a_gemm"] == 1


def test_trains_inside_a_jitted_step():
    """sp_mlp inside a loss function of a jitted optax step: float master weights under the FP8
    recipe (quantized inside, gradients straight through); the loss goes down."""
    import optax
    mesh = tp_mesh(2)
    x, gamma, beta, w1, w2 = layer_inputs(40)
    target = jnp.tanh(x[..., ::-1])
    params = dict(gamma=gamma, beta=beta, w1=w1, w2=w2)
    opt = optax.adam(3e-2)

    def loss_fn(p):
        y = jq.sp_mlp(x, p["gamma"], p["beta"], p["w1"], p["w2"], mesh=mesh, recipe="fp8")
        return jnp.mean(jnp.square(y - target))

    @jax.jit
    def step(p, state):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    state, losses = opt.init(params), []
    for _ in range(15):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def _tp_local_nvfp4_operand(w, tp, tp_dim):
    """The reference reading of a TP-local NVFP4 weight: each rank's bytes decoded with its own padded
    scales (gemm.nvfp4_operand of the rank's slice of data and scale_inv), concatenated on tp_dim."""
    data, scale = np.asarray(w.data), np.asarray(w.scale_inv)
    parts = [gemm.nvfp4_operand(d, sc) for d, sc in zip(np.split(data, tp, tp_dim), np.split(scale, tp, tp_dim))]
    return jnp.concatenate(parts, axis=tp_dim), jnp.reshape(w.amax, ()) / np.float32(2688)


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.slow
def test_weights_from_quantize_master_weights_pass_directly(recipe):
    """[out, in] weights from quantize_master_weights(tp_axis="tp") (w1 tp_dims 0: column parallel, w2
    tp_dims 1: row parallel) on an fsdp x tp mesh go into the layers as they are. NVFP4 with a TP split
    not aligned to the scale layout (local rows 32, local cols 32): each rank's padded scales are read
    with its own bytes. FP8: the per-tensor bytes equal whole-tensor quantization."""
    tp = 2
    mesh = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, tp), ("fsdp", "tp"))
    col_args, row_args = layer_args(4, "bf16", "float")
    w1, w2 = col_args[3], row_args[1]
    layout = jq.FlatLayout([w1.shape, w2.shape], 2, tp_size=tp, tp_dims=[0, 1])
    master = jax.device_put(layout.flatten([w1, w2]), jq.master_sharding(mesh, "fsdp", "tp"))
    q1, q2 = jq.quantize_master_weights(master, layout, mesh=mesh, tp_axis="tp", recipe=recipe,
                                        columnwise=True, manual_post_all_gather_processing=False)
    col_args, row_args = (*col_args[:3], q1, col_args[4]), (row_args[0], q2, row_args[2])
    run = jax.jit(lambda c, r: (column_vjp(mesh, "off", None, *c), row_vjp(mesh, "off", None, *r)))
    results = run(col_args, row_args)
    if recipe == "nvfp4":
        from jaxquant.primitives import formats
        assert tuple(q1.scale_inv.shape) != formats.nvfp4_scale_shape(*w1.shape)   # the TP-local layout
        assert tuple(q2.scale_inv.shape) != formats.nvfp4_scale_shape(*w2.shape)
        col_args = (*col_args[:3], _tp_local_nvfp4_operand(q1, tp, 0), col_args[4])
        row_args = (row_args[0], _tp_local_nvfp4_operand(q2, tp, 1), row_args[2])
    check_layers_match_single_device(results, col_args, row_args, "fp8" if recipe == "fp8" else "bf16")


def test_fp8_gemms_take_float8_operands_and_no_fp8_bytes_are_transposed():
    """sp_mlp forward+backward with Float8Tensor weights carrying data_t ("off": one GEMM per product):
    every GEMM reads float8 on both sides; forward and dgrad GEMMs contract both operands on their
    minor axis (the weight read as data, then as data_t; without data_t the dgrad would contract the
    weight's dim 0), wgrad GEMMs the rows of both; no FP8 tensor is transposed by the program."""
    mesh = tp_mesh(2)
    x, gamma, beta, w1, w2 = layer_inputs()
    q1, q2 = fp8_weight(w1), fp8_weight(w2)

    def loss(x, m1, m2):
        y = jq.sp_mlp(x, gamma, beta, jq.straight_through(q1, m1), jq.straight_through(q2, m2), mesh=mesh,
                      overlap="off")
        return jnp.sum(y)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w1, w2).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    contracted = [line.split("contracting_dims = ")[1].split(",")[0] for line in dots]
    # forward, dgrad and wgrad of two layers (XLA may share one lowered body between equal GEMMs)
    assert len(dots) >= 5 and set(contracted) == {"[1] x [1]", "[0] x [0]"}, contracted
    for line in dots:
        operands = line.rsplit(" : (", 1)[1].split(") -> ")[0]
        assert operands.count("xf8E") == 2, line
    assert not [line for line in text.splitlines() if "stablehlo.transpose" in line and "xf8E" in line]


# ----------------------------------------------------------------------------------------------
# overlap="fused" (bf16 collective GEMM kernels on GPUs; here their plain-JAX schedule)
# ----------------------------------------------------------------------------------------------


def _fused_inputs(tp, batch):
    """bf16 sp_mlp inputs whose per-rank GEMMs fit the kernels' tiling (256-row chunks, 128-wide outputs)."""
    seq, hidden, ffn = 256 * tp // batch, 128, 128 * tp
    k = jax.random.split(jax.random.key(tp), 4)
    x = jax.random.normal(k[0], (batch, seq, hidden), jnp.bfloat16)
    w1 = jax.random.normal(k[1], (ffn, hidden), jnp.float32) / np.sqrt(hidden)
    w2 = jax.random.normal(k[2], (hidden, ffn), jnp.float32) / np.sqrt(ffn)
    return x, w1, w2, jax.random.normal(k[3], (batch, seq, hidden), jnp.bfloat16)


def _mlp_vjp(mesh, overlap, recipe, x, w1, w2, g):
    hidden = x.shape[-1]
    gamma, beta = jnp.ones((hidden,), jnp.float32), jnp.zeros((hidden,), jnp.float32)
    f = lambda x, w1, w2: jq.sp_mlp(x, gamma, beta, w1, w2, mesh=mesh, overlap=overlap, recipe=recipe)
    out, vjp = jax.vjp(f, x, w1, w2)
    return out, vjp(g)


@pytest.mark.parametrize("tp,batch,recipe", [(2, 1, "bf16"), (4, 2, "bf16"), (2, 1, "fp8"), (4, 2, "fp8")])
def test_fused_schedule_matches_off(tp, batch, recipe):
    """overlap="fused" off the GPU runs its kernels' schedule in plain JAX (collective_gemm,
    impl="reference"): the same products as "off", reduce-scattered in another order (bf16 running
    sums round the ring), so equal to bf16 rounding; batch > 1 checks the rank-major reordering.
    FP8 products leave the kernels unscaled in bf16 and are scaled after (a second rounding), which
    moves some activations and gradients across an FP8 rounding boundary: "fused" and "off" then differ
    by a few % (relative norm) and are equally far from the bf16 recipe's result (a wrong scale or a
    misplaced chunk would be far off both)."""
    mesh = tp_mesh(tp)
    args = _fused_inputs(tp, batch)
    run = jax.jit(functools.partial(_mlp_vjp, mesh), static_argnums=(0, 1))
    leaves = lambda t: [np.asarray(v, np.float32) for v in jax.tree.leaves(t)]
    got, want = leaves(run("fused", recipe, *args)), leaves(run("off", recipe, *args))
    if recipe == "bf16":
        for name, a, e in zip(("out", "dx", "dw1", "dw2"), got, want):
            assert float(np.max(np.abs(a - e))) <= 2e-2 * float(np.max(np.abs(e))), name
        return
    check_fp8_fused_matches_off(("out", "dx", "dw1", "dw2"), got, want, leaves(run("off", "bf16", *args)))


def test_fused_keeps_the_gathered_activation():
    """The fused column layer keeps the gathered activation for its wgrad: one all-gather fewer than
    "off" (which gathers x again in the backward)."""
    mesh = tp_mesh(2)
    args = _fused_inputs(2, 1)
    text = {m: jax.jit(functools.partial(_mlp_vjp, mesh, m, "bf16")).lower(*args).as_text() for m in ("off", "fused")}
    gathers = {m: len(re.findall(r"stablehlo\.all_gather", t)) for m, t in text.items()}
    assert gathers == {"off": 3, "fused": 2}


def test_fused_refuses_what_its_kernels_cannot_run():
    mesh = tp_mesh(2)
    x, w1, w2, _ = _fused_inputs(2, 1)
    gamma, beta = jnp.ones((x.shape[-1],)), jnp.zeros((x.shape[-1],))
    kw = dict(mesh=mesh, overlap="fused")
    with pytest.raises(ValueError, match="x: overlap='fused' takes bf16 activations"):
        jq.sp_layernorm_dense(x.astype(jnp.float32), gamma, beta, w1, **kw)
    nv = jq.quantize_nvfp4(w1.astype(jnp.float32))
    with pytest.raises(ValueError, match="overlap: 'fused' runs bf16 and FP8 GEMMs .* and a NVFP4Tensor weight"):
        jq.sp_layernorm_dense(x, gamma, beta, nv, **kw)
    with pytest.raises(ValueError, match="w: overlap='fused' tiles the GEMM .* must be a multiple of 256"):
        jq.sp_layernorm_dense(x[:, :384], gamma, beta, w1, **kw)
    with pytest.raises(ValueError, match="impl: overlap='fused' with impl='custom_call' .* need a mesh of GPUs"):
        jq.sp_dense_reduce_scatter(jnp.ones((1, 512, 256), jnp.bfloat16), w2, impl="custom_call", **kw)


# JAX before 0.11 lowers no wgmma of mixed FP8 operands (the GPU machines' 0.11 does)
MIXED_FP8_LOWERS = pytest.mark.skipif(jax.__version_info__ < (0, 11),
                                      reason=f"jax {jax.__version__}'s wgmma refuses mixed FP8 operands")


@pytest.mark.slow   # the first case in the README's command, the rest in the extended tier (tests/conftest.py)
@pytest.mark.parametrize("tiling", list(FUSED_TILINGS))
@pytest.mark.parametrize("operands", [pytest.param(name, marks=MIXED_FP8_LOWERS) if a != b else name
                                      for name, (a, b, _) in FUSED_OPERANDS.items()])
def test_fused_kernels_lower_for_cuda(operands, tiling):
    """Both collective GEMM kernels, every operand pairing, lower to Mosaic GPU without a GPU (lowered
    for "cuda" from the CPU): a kernel Pallas cannot lower fails here instead of first on a GPU. One
    Mosaic GPU custom call per kernel; the kernels' GPU tests (tests/test_sp_gpu.py) run them."""
    a_dtype, b_dtype, contract = FUSED_OPERANDS[operands]
    tp = 4
    gather, scatter = fused_programs(tp, contract, fused_tiling(tiling))
    as_a = lambda rows, k: jax.ShapeDtypeStruct((rows, k), a_dtype)
    as_b = lambda k, n: jax.ShapeDtypeStruct((k, n) if contract == 0 else (n, k), b_dtype)
    for program, args in ((gather["kernel"], (as_a(tp * 256, 512), as_b(512, tp * 256))),
                          (scatter["kernel"], (as_a(tp * 256, tp * 512), as_b(tp * 512, 256)))):
        text = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("@mosaic_gpu_v2") == 1


def test_tile_configs_refuse_what_their_kernels_cannot_do():
    """A handoff other than "step" or "tile" is refused when the config is made; "tile" is the
    reduce-scatter kernel's (the all-gather kernel refuses it, on every impl); spread stores need whole-tile
    epilogues."""
    with pytest.raises(ValueError, match="handoff: 'step' or 'tile', got 'row'"):
        cg.TileConfig(handoff="row")
    with pytest.raises(ValueError, match="spread: .* need epi=None"):
        cg.TileConfig(spread=4)
    gather, _ = fused_programs(4, 0, {"gather": cg.TileConfig(epi=None, stages=3, spread=4, handoff="tile")})
    a, b = jnp.zeros((4 * 256, 512), jnp.bfloat16), jnp.zeros((512, 4 * 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="handoff='tile' is the reduce-scatter kernel's"):
        gather["reference"](a, b)


def test_fused_kernels_name_the_gpus_they_need():
    from types import SimpleNamespace as NS

    assert cg.device_problem(NS(platform="gpu", compute_capability="9.0", device_kind="H100")) is None
    assert "compute capability 9.x), not NVIDIA A100 (compute capability 8.0)" in cg.device_problem(
        NS(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100"))
    assert "not cpu" in cg.device_problem(jax.devices("cpu")[0])


def test_fused_kernels_refuse_tp_ranks_in_other_processes(monkeypatch):
    """The kernels store into the neighbour's memory: every rank of the TP axis must be a device of one process.
    One process per GPU (what cluster launchers start) puts them in different processes: a clear error."""
    from types import SimpleNamespace as NS

    dev = lambda i, p: NS(id=i, process_index=p)
    one_per_gpu = NS(axis_names=("fsdp", "tp"), shape={"fsdp": 2, "tp": 2},
                     devices=np.array([[dev(0, 0), dev(1, 1)], [dev(2, 2), dev(3, 3)]]))
    problem = cg.process_problem(one_per_gpu, "tp")
    assert "every rank of the TP axis 'tp' in one process (its ranks lie in processes [0, 1]" in problem
    tp_in_host = NS(axis_names=("fsdp", "tp"), shape={"fsdp": 2, "tp": 2},       # 2 hosts x 2 GPUs, TP inside one
                    devices=np.array([[dev(0, 0), dev(1, 0)], [dev(2, 1), dev(3, 1)]]))
    assert cg.process_problem(tp_in_host, "tp") is None
    assert cg.process_problem(None, "tp") is None                       # one process here
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert "a layer given no mesh cannot check in a run of 2 processes" in cg.process_problem(None, "tp")


def test_collective_gemm_benchmark_runs_its_cpu_smoke():
    """benchmarks/bench_collective_gemm.py --cpu-smoke: every case and tiling runs (the kernels' schedule on
    4 CPU devices) and agrees with XLA's all-gather / reduce-scatter programs; a tiling that does not fit
    the shape is reported, not fatal."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_collective_gemm.py")
    spec = importlib.util.spec_from_file_location("bench_collective_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--cpu-smoke", "--configs", "chosen,split-n", "--iters", "1"])
    assert [r["case"] for r in rows] == ["all-gather GEMM", "GEMM reduce-scatter"]
    for r in rows:
        assert r["fused"]["chosen"]["max_abs_diff"] <= 0.05, r
        assert "must be a multiple of 256" in r["fused"]["split-n"]["error"]


def test_fused_kernels_pick_the_first_tiling_that_fits():
    """collective_gemm.tiling: the preferred tiling where the shape fits it, the smaller one where it does
    not, and the error of the smallest (naming the argument and the rule) where none fits."""
    first, last = cg.TILINGS["gather"][0], cg.TILINGS["gather"][-1]
    assert cg.tiling("gather", "w", 2048, 4096, 4096) == first
    assert first != last and cg.tiling("gather", "w", 2048, 4096, 128) == last
    with pytest.raises(ValueError, match=r"w: .*output features of one rank \(64\) must be a multiple of 128"):
        cg.tiling("gather", "w", 2048, 4096, 64)


def test_reduce_scatter_hands_off_tile_by_tile_where_ring_steps_are_short():
    """The reduce-scatter kernel's tiling: SHORT_STEPS (hand-off tile by tile) at tp >= 3 where a ring step
    has at most SHORT_STEP_WAVES waves of output tiles (8192x4096x16384 at tp 4: 256 tiles a step), the
    step-wise TILINGS["scatter"][0] where steps are long (8192x8192x32768 at tp 4: 1024 tiles) or a call has
    one hand-off (tp 2); the gather kernel keeps its own; FP8 operands step twice as far along K."""
    short, step = cg.SHORT_STEPS, cg.TILINGS["scatter"][0]
    assert short.handoff == "tile" and step.handoff == "step"
    assert cg.tiling("scatter", "w", 2048, 4096, 4096, n=4) == short
    assert cg.tiling("scatter", "w", 2048, 8192, 8192, n=4) == step
    assert cg.tiling("scatter", "w", 2048, 4096, 4096, n=2) == step
    assert cg.tiling("gather", "w", 2048, 4096, 4096, n=4) == cg.TILINGS["gather"][0]
    fp8 = cg.tiling("scatter", "w", 2048, 4096, 4096, jnp.float8_e4m3fn, 4)
    assert fp8.handoff == "tile" and fp8.tile_k == 2 * short.tile_k
    # the bound: SHORT_STEP_WAVES waves of the grid's CTAs (256x128 tiles), and one column of tiles more
    waves = cg.SHORT_STEP_WAVES * cg._num_sms()
    assert cg.tiling("scatter", "w", 256 * 2, 4096, 128 * waves // 2, n=3) == short
    assert cg.tiling("scatter", "w", 256 * 2, 4096, 128 * (waves // 2 + 1), n=3) == step


def test_fused_schedule_reads_weights_as_stored():
    """gather_matmul / matmul_reduce_scatter take B as [K, N] (contract=0) or [N, K] (contract=1, a
    weight [out, in] read without a transpose): both give all-gather(a) @ B (the plain-JAX schedule)."""
    mesh = tp_mesh(2)
    k1, k2 = jax.random.split(jax.random.key(3))
    a = jax.random.normal(k1, (2 * 256, 128), jnp.bfloat16)
    b = jax.random.normal(k2, (128, 256), jnp.bfloat16)
    want = np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float32)
    for contract, operand in ((0, b), (1, b.T)):
        def body(x, y, c=contract):
            return cg.gather_matmul(x, y, axis="tp", n=2, contract=c, impl="reference")[0]
        got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P()), out_specs=P(),
                                    check_vma=False))(a, operand)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    with pytest.raises(ValueError, match="contract: the contracted axis of b is 0 or 1, got 2"):
        cg.gather_matmul(a, b, axis="tp", n=2, contract=2, impl="reference")


def test_fused_schedule_takes_fp8_operands_k_major():
    """FP8 operands (E4M3 / E5M2) go through the fused GEMMs with B K-major ([N, K], contract=1): the
    gathered operand keeps its bytes, the products are those of the stored values (unscaled, fp32
    accumulation, bf16 out) for both collectives; FP8 with B as [K, N], or FP8 beside bf16, is refused."""
    mesh = tp_mesh(2)
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    a = (jax.random.normal(k1, (2 * 256, 128)) * 8).astype(jnp.float8_e4m3fn)
    w = (jax.random.normal(k2, (256, 128)) * 8).astype(jnp.float8_e4m3fn)        # [N, K]
    h = (jax.random.normal(k3, (2 * 256, 2 * 128)) * 8).astype(jnp.float8_e5m2)  # K split over tp
    w2 = (jax.random.normal(k2, (256, 2 * 128)) * 8).astype(jnp.float8_e4m3fn)   # [N, K], K split
    f32 = lambda v: np.asarray(v, np.float32)
    smap = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))
    gather = smap(lambda x, y: cg.gather_matmul(x, y, axis="tp", n=2, contract=1, impl="reference"),
                  (P("tp", None), P()), (P(), P()))
    out, full = gather(a, w)
    assert full.dtype == a.dtype and np.array_equal(f32(full), f32(a))
    np.testing.assert_array_equal(f32(out), f32(jnp.asarray(f32(a) @ f32(w).T).astype(jnp.bfloat16)))
    scatter = smap(lambda x, y: cg.matmul_reduce_scatter(x, y, axis="tp", n=2, contract=1, impl="reference"),
                   (P(None, "tp"), P(None, "tp")), P("tp", None))
    want = f32(h) @ f32(w2).T
    np.testing.assert_allclose(f32(scatter(h, w2)), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"contract: FP8 operands need b as \[N, K\] \(contract=1\)"):
        cg.gather_matmul(a, w.T, axis="tp", n=2, contract=0, impl="reference")
    with pytest.raises(ValueError, match="b: a is float8_e4m3fn and b is bfloat16; both must be bf16 or both FP8"):
        cg.gather_matmul(a, w.astype(jnp.bfloat16), axis="tp", n=2, contract=1, impl="reference")
    assert cg.tiling("gather", "w", 256, 128, 256, jnp.float8_e4m3fn).tile_k == 2 * cg.TILINGS["gather"][0].tile_k


@pytest.mark.parametrize("columnwise", [False, True])
def test_fused_reads_float8_weights_with_or_without_their_transpose(columnwise):
    """A Float8Tensor weight under overlap="fused": its dgrad GEMMs read data_t where it has one, else its
    bytes transposed (exact); forward and dX agree with "off" as the FP8 recipe's fused path does (a few %
    relative norm, equally far from the bf16 recipe)."""
    mesh = tp_mesh(2)
    x, w1, w2, g = _fused_inputs(2, 1)
    gamma, beta = jnp.ones((x.shape[-1],), jnp.float32), jnp.zeros((x.shape[-1],), jnp.float32)
    q1, q2 = (jq.quantize_fp8(w, columnwise=columnwise) for w in (w1, w2))

    def run(overlap, a, b, recipe=None):
        f = lambda x: jq.sp_mlp(x, gamma, beta, a, b, mesh=mesh, overlap=overlap, recipe=recipe)
        out, vjp = jax.vjp(f, x)
        return (out, *vjp(g))

    leaves = lambda *args: [np.asarray(v, np.float32) for v in jax.jit(lambda: run(*args))()]
    check_fp8_fused_matches_off(("out", "dx"), leaves("fused", q1, q2), leaves("off", q1, q2),
                                leaves("off", w1, w2, "bf16"))
