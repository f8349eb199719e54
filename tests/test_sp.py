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
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jaxquant as jq
import jaxquant.tp.sp
import jaxquant.zero.distributed
from jaxquant.tp import collective_gemm as cg, sp
from jaxquant.primitives import gemm

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 (simulated) CPU devices: "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8")

B, S, H, F = 2, 32, 32, 64
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = dict(preferred_element_type=jnp.float32)


def _mesh(tp, devices="cpu"):
    return Mesh(np.array(jax.devices(devices)[:tp]), ("tp",))


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (B, S, H), jnp.float32) * 3.0
    gamma = 1.0 + 0.1 * jax.random.normal(k[1], (H,), jnp.float32)
    beta = 0.1 * jax.random.normal(k[2], (H,), jnp.float32)
    w1 = jax.random.normal(k[3], (F, H), jnp.float32) / np.sqrt(H)     # [out, in]
    w2 = jax.random.normal(k[4], (H, F), jnp.float32) / np.sqrt(F)
    return x, gamma, beta, w1, w2


def _fp8_weight(w):
    return q_fp8(w, dtype=E4M3, columnwise=True, compute_dtype=jnp.bfloat16)


# ----------------------------------------------------------------------------------------------
# Single-device reference: whole-tensor scaling, one GEMM per product, no collectives
# ----------------------------------------------------------------------------------------------


def _q(v, dtype):
    """(bytes, scale_inv) of the whole tensor v (current scaling, no compute-dtype rounding)."""
    t = q_fp8(v.reshape(-1, v.shape[-1]), dtype=dtype)
    return t.data.reshape(v.shape), t.scale_inv


def _ref_mm(a, b, a_dims, b_dims):
    """a·b contracting a_dims with b_dims; operands are (values, per-tensor factor or None)."""
    (ad, asc), (bd, bsc) = a, b
    out = lax.dot_general(ad, bd, ((a_dims, b_dims), ((), ())), **F32)
    factors = [f for f in (asc, bsc) if f is not None]
    return out * (factors[0] * factors[1] if len(factors) == 2 else factors[0]) if factors else out


def _ref_operands(recipe, act, w, act_dtype=E4M3):
    """(activation operand, weight operand [out, in]): FP8 bytes and scale; NVFP4 bf16 value(q)*s8 of
    the whole tensor and the global factor amax/2688 (docs/numerics.md §2.8); else bf16."""
    if recipe == "fp8":
        wq = w if isinstance(w, jq.Float8Tensor) else _fp8_weight(w)
        return _q(act, act_dtype), (wq.data, jnp.reshape(wq.scale_inv, ()))
    if isinstance(w, tuple):   # an operand decoded by the caller
        wop = w
    elif isinstance(w, jq.NVFP4Tensor):
        wop = (gemm.nvfp4_operand(w.data, w.scale_inv), jnp.reshape(w.amax, ()) / np.float32(2688))
    else:
        wop = (w.astype(jnp.bfloat16), None)
    return (act.astype(jnp.bfloat16), None), wop


def _ref_grad_operand(recipe, g):
    return _q(g, E5M2) if recipe == "fp8" else (g.astype(jnp.bfloat16), None)


def ref_column(recipe, x, gamma, beta, w, g):
    """(out, (dx, dgamma, dbeta, dw)) of layernorm -> dense on one device (w [out, in])."""
    ln = lambda x_, g_, b_: sp._layernorm_f32(x_, g_, b_, 1e-5)
    a, wop = _ref_operands(recipe, ln(x, gamma, beta).astype(jnp.bfloat16), w)
    out = _ref_mm(a, wop, (2,), (1,)).astype(x.dtype)
    gq = _ref_grad_operand(recipe, g)
    dy = _ref_mm(gq, wop, (2,), (0,))
    dw = _ref_mm(gq, a, (0, 1), (0, 1))
    return out, (*jax.vjp(ln, x, gamma, beta)[1](dy), dw)


def ref_row(recipe, x, w, g):
    a, wop = _ref_operands(recipe, x, w)
    out = _ref_mm(a, wop, (2,), (1,)).astype(x.dtype)
    gq = _ref_grad_operand(recipe, g)
    return out, (_ref_mm(gq, wop, (2,), (0,)).astype(x.dtype), _ref_mm(gq, a, (0, 1), (0, 1)))


def ref_mlp_dx(x, g, gamma, beta, w1, w2):
    h_pre = ref_column("fp8", x, gamma, beta, w1, jnp.zeros((B, S, F), jnp.float32))[0]
    h, gelu_vjp = jax.vjp(jax.nn.gelu, h_pre)
    dh = ref_row("fp8", h, w2, g)[1][0]
    return ref_column("fp8", x, gamma, beta, w1, gelu_vjp(dh)[0])[1][0]


# ----------------------------------------------------------------------------------------------
# Runners: forward and vjp of a layer in one jitted program
# ----------------------------------------------------------------------------------------------


def _grad_target(w):
    """(what to differentiate, how the layer receives it): a quantized weight's straight-through
    gradient is read on a master attached with jq.straight_through (as for jq.dense)."""
    if isinstance(w, (jq.Float8Tensor, jq.NVFP4Tensor)):
        return jnp.zeros(w.shape, jnp.float32), lambda m: jq.straight_through(w, m)
    return w, lambda v: v


def _column_vjp(mesh, overlap, recipe, x, gamma, beta, w, g):
    w_arg, as_weight = _grad_target(w)
    f = lambda x, gamma, beta, w_arg: jq.sp_layernorm_dense(x, gamma, beta, as_weight(w_arg), mesh=mesh,
                                                            overlap=overlap, recipe=recipe)
    out, vjp = jax.vjp(f, x, gamma, beta, w_arg)
    return out, vjp(g)


def _row_vjp(mesh, overlap, recipe, x, w, g):
    w_arg, as_weight = _grad_target(w)
    f = lambda x, w_arg: jq.sp_dense_reduce_scatter(x, as_weight(w_arg), mesh=mesh, overlap=overlap, recipe=recipe)
    out, vjp = jax.vjp(f, x, w_arg)
    return out, vjp(g)


@functools.lru_cache(maxsize=None)
def _runner(tp, overlap, recipe, devices="cpu"):
    """One jitted program: (out, grads) of the column layer and of the row layer."""
    mesh = _mesh(tp, devices)

    def run(col_args, row_args):
        return _column_vjp(mesh, overlap, recipe, *col_args), _row_vjp(mesh, overlap, recipe, *row_args)
    return jax.jit(run)


def _layer_args(seed, recipe, kind):
    """((x, gamma, beta, w1, g) of the column layer, (x, w2, g) of the row layer)."""
    x, gamma, beta, w1, w2 = _inputs(seed)
    w1, w2 = _weights(recipe, w1, w2, kind)
    k = jax.random.split(jax.random.key(100 + seed), 3)
    g_col = jax.random.normal(k[0], (B, S, F), jnp.float32)
    x_row = jax.random.normal(k[1], (B, S, F), jnp.float32)
    g_row = jax.random.normal(k[2], (B, S, H), jnp.float32)
    return (x, gamma, beta, w1, g_col), (x_row, w2, g_row)


def _assert_close(actual, expected, what, rtol=2e-5):
    a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    atol = rtol * max(float(np.max(np.abs(e))), 1e-30)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=what)


def _weights(recipe, w1, w2, kind):
    if kind == "float8tensor":
        return _fp8_weight(w1), _fp8_weight(w2)
    if kind == "nvfp4":
        return q_nvfp4(w1, compute_dtype=jnp.bfloat16), q_nvfp4(w2, compute_dtype=jnp.bfloat16)
    return w1, w2


CASES = [("bf16", "float"), ("fp8", "float8tensor")]


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
    x = _inputs()[0].astype(jnp.bfloat16)
    ctx = sp._context(_mesh(4), "tp", "off", "auto")
    q = jax.jit(lambda v: sp._operand(ctx, "fp8", v, P(None, "tp", None), E4M3))(x)
    data, scale_inv = _q(x, E4M3)
    assert_bytes_equal(q.data, data, "gathered FP8 bytes")
    assert_bytes_equal(q.scale_inv, scale_inv, "scale_inv")
    per_rank = [np.asarray(s.data) for s in q.scale_inv.addressable_shards]
    assert len(per_rank) == 4 and all(r == per_rank[0] for r in per_rank)


def check_layers_match_single_device(results, col_args, row_args, recipe, rtol=2e-5, same_k_rtol=1e-6):
    """``same_k_rtol`` bounds the outputs whose K-reduction each rank runs whole (column out, row dx):
    near-bitwise on XLA:CPU; on GPU cuBLAS may pick another kernel (and FP8 accumulation) per shape."""
    (out, grads), (row_out, row_grads) = results
    ref_out, ref_grads = ref_column(recipe, *col_args)
    # all-gather -> GEMM: the same K-reduction per element, though XLA:CPU's dot may order it
    # differently for another N split
    _assert_close(out, ref_out, "column out", same_k_rtol)
    for name, a, e in zip(("dx", "dgamma", "dbeta", "dw"), grads, ref_grads):
        _assert_close(a, e, "column " + name, rtol)
    ref_out, ref_grads = ref_row(recipe, *row_args)
    _assert_close(row_out, ref_out, "row out", rtol)   # partial sums over tp: another summation order
    _assert_close(row_grads[0], ref_grads[0], "row dx", same_k_rtol)   # all-gather of dY -> GEMM
    _assert_close(row_grads[1], ref_grads[1], "row dw", rtol)


# bf16 at every tp; FP8 (its amax shared over tp, the transposed data) at the smallest and the largest
LAYER_CASES = [(tp, r, k) for r, k in CASES for tp in (2, 4, 8) if r == "bf16" or tp != 4]


@pytest.mark.parametrize("tp,recipe,kind", LAYER_CASES, ids=[f"{r}-{k}-{tp}" for tp, r, k in LAYER_CASES])
@pytest.mark.slow
def test_layers_match_single_device(tp, recipe, kind):
    col_args, row_args = _layer_args(tp, recipe, kind)
    results = _runner(tp, "off", recipe)(col_args, row_args)
    check_layers_match_single_device(results, col_args, row_args, recipe)


@pytest.mark.parametrize("kind", ["float", "nvfp4"])
@pytest.mark.slow
def test_other_weight_types(kind):
    """A float weight under the FP8 recipe is quantized inside (shared amax over tp) with its
    gradient passed straight through; an NVFP4 weight is read as bf16 value(q)*s8 with the global factor
    on the GEMM output, its gradient going to a straight_through master."""
    recipe = "fp8" if kind == "float" else "bf16"
    col_args, row_args = _layer_args(3, recipe, kind)
    check_layers_match_single_device(_runner(2, "off", recipe)(col_args, row_args), col_args, row_args, recipe)


@pytest.mark.slow
def test_interleaved_microbatches_match_one_at_a_time():
    """Two FP8 layers (sp_mlp) with one quantizer configuration; forward passes of three microbatches
    of very different magnitude (so their scales differ) run before any backward pass."""
    mesh = _mesh(4)
    _, gamma, beta, w1, w2 = _inputs(5)
    w1q, w2q = _fp8_weight(w1), _fp8_weight(w2)
    x_spike = _inputs(21)[0].at[0, 3, 5].set(1e3)                          # outlier row
    x_flat = jax.random.uniform(jax.random.key(22), (B, S, H), jnp.float32, -1.0, 1.0)
    xs = [_inputs(20)[0], x_spike, x_flat]
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
    assert len({float(_q(ln_bf16(x), E4M3)[1]) for x in xs}) == 3
    for i in range(3):
        _assert_close(grads[i][0], ref_mlp_dx(xs[i], gs[i], gamma, beta, w1q, w2q), f"microbatch {i} dx vs reference")


def test_bad_input_errors():
    mesh = _mesh(4)
    x, gamma, beta, w1, w2 = _inputs()
    with pytest.raises(ValueError, match="overlap: must be one of"):
        jq.sp_layernorm_dense(x, gamma, beta, w1, mesh=mesh, overlap="fast")
    with pytest.raises(ValueError, match='overlap: "xla" was removed .* use "off" or "fused"'):
        jq.sp_layernorm_dense(x, gamma, beta, w1, mesh=mesh, overlap="xla")
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
        jq.sp_dense_reduce_scatter(jnp.ones((B, S, F)), _fp8_weight(w2), mesh=mesh, recipe="bf16")
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
    col_args, row_args = _layer_args(5, "bf16", kind)
    runs = [_runner(2, "off", r)(col_args, row_args) for r in spellings]
    for r, res in zip(spellings[1:], runs[1:]):
        for a, e in zip(jax.tree.leaves(res), jax.tree.leaves(runs[0])):
            assert_bytes_equal(a, e, f"recipe={r!r} vs None ({kind})")


def test_ring_overlap_was_removed():
    """overlap="ring" (a ppermute ring, slower than "off" in every measurement) is refused by every layer
    with one line: the argument, why it went, where the figures are, and the choices left."""
    mesh = _mesh(4)
    x, gamma, beta, w1, w2 = _inputs()
    message = (r'^overlap: "ring" was removed \(it was slower than "off" in every measurement, '
               r'docs/performance\.md\); use "off" or "fused"$')
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
    mesh = _mesh(4)
    _, gamma, beta, w1, w2 = _inputs()
    x = jnp.zeros((B, S, H), x_dtype)
    st = jq.straight_through     # masters: every wgrad runs

    def loss(x, m1, m2):
        return jnp.sum(jq.sp_mlp(x, gamma, beta, st(_fp8_weight(w1), m1), st(_fp8_weight(w2), m2), mesh=mesh,
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
    mesh = _mesh(2)
    x, gamma, beta, w1, w2 = _inputs(40)
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
    col_args, row_args = _layer_args(4, "bf16", "float")
    w1, w2 = col_args[3], row_args[1]
    layout = jq.FlatLayout([w1.shape, w2.shape], 2, tp_size=tp, tp_dims=[0, 1])
    master = jax.device_put(layout.flatten([w1, w2]), jq.master_sharding(mesh, "fsdp", "tp"))
    q1, q2 = jq.quantize_master_weights(master, layout, mesh=mesh, tp_axis="tp", recipe=recipe,
                                        columnwise=True, manual_post_all_gather_processing=False)
    col_args, row_args = (*col_args[:3], q1, col_args[4]), (row_args[0], q2, row_args[2])
    run = jax.jit(lambda c, r: (_column_vjp(mesh, "off", None, *c), _row_vjp(mesh, "off", None, *r)))
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
    mesh = _mesh(2)
    x, gamma, beta, w1, w2 = _inputs()
    q1, q2 = _fp8_weight(w1), _fp8_weight(w2)

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


def check_fp8_fused_matches_off(names, got, want, exact):
    """overlap="fused" under FP8 against "off": its products leave the kernels unscaled in bf16 and are
    scaled after (a second rounding), which moves some values across an FP8 rounding boundary, so the two
    differ by a few % in relative norm and are equally far from the bf16 recipe's result ``exact`` (a wrong
    scale or a misplaced chunk would be far off both)."""
    rel = lambda a, e: float(np.linalg.norm(a - e) / np.linalg.norm(e))
    for name, a, e, x in zip(names, got, want, exact):
        assert rel(a, e) <= 0.05, (name, rel(a, e))
        assert rel(a, x) <= 1.05 * rel(e, x) + 1e-3, (name, rel(a, x), rel(e, x))


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
    mesh = _mesh(tp)
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
    mesh = _mesh(2)
    args = _fused_inputs(2, 1)
    text = {m: jax.jit(functools.partial(_mlp_vjp, mesh, m, "bf16")).lower(*args).as_text() for m in ("off", "fused")}
    gathers = {m: len(re.findall(r"stablehlo\.all_gather", t)) for m, t in text.items()}
    assert gathers == {"off": 3, "fused": 2}


def test_fused_refuses_what_its_kernels_cannot_run():
    mesh = _mesh(2)
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


def _fused_programs(tp, contract, configs=None):
    """Jitted (kernel, schedule) pairs of collective_gemm's two collective GEMMs over the first ``tp``
    devices of the default backend, B given as [K, N] (contract 0) or [N, K] (contract 1), with the
    kernels' own tilings or ``configs`` ({"gather": TileConfig, "scatter": TileConfig}, either may be
    missing)."""
    configs = configs or {}
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    n_split, k_split = (P(None, "tp"), P("tp", None))[::1 if contract == 0 else -1]
    gather = {impl: smap(lambda a, b, impl=impl: cg.gather_matmul(a, b, axis="tp", n=tp, contract=contract, impl=impl,
                                                                   config=configs.get("gather")),
                         (P("tp", None), n_split), (P(None, "tp"), P()))
              for impl in ("kernel", "reference")}
    scatter = {impl: smap(lambda a, b, impl=impl: cg.matmul_reduce_scatter(a, b, axis="tp", n=tp, contract=contract,
                                                                          impl=impl,
                                                                          config=configs.get("scatter")),
                          (P(None, "tp"), k_split), P("tp", None))
               for impl in ("kernel", "reference")}
    return gather, scatter


FUSED_OPERANDS = {   # name -> (A dtype, B dtype, B's contracted axis)
    "bf16-kn": (jnp.bfloat16, jnp.bfloat16, 0),
    "bf16-nk": (jnp.bfloat16, jnp.bfloat16, 1),
    "e4m3-nk": (jnp.float8_e4m3fn, jnp.float8_e4m3fn, 1),
    "e5m2xe4m3-nk": (jnp.float8_e5m2, jnp.float8_e4m3fn, 1),
}
# JAX before 0.11 lowers no wgmma of mixed FP8 operands (the GPU machines' 0.11 does)
MIXED_FP8_LOWERS = pytest.mark.skipif(jax.__version_info__ < (0, 11),
                                      reason=f"jax {jax.__version__}'s wgmma refuses mixed FP8 operands")
# tilings the kernels' tests run, per kernel (TileConfig fields; a kernel left out uses its own choice):
# the kernels' own (the reduce-scatter's spreads its stores over the next tile), TileConfig()'s (64x64
# epilogue pieces stored at once), and the reduce-scatter handing off tile by tile (opt-in)
FUSED_TILINGS = {"chosen": {}, "default": {"gather": {}, "scatter": {}},
                 "tile-handoff": {"scatter": dict(epi=None, stages=3, spread=4, handoff="tile")}}


def fused_tiling(name):
    """FUSED_TILINGS[name] as _fused_programs' configs."""
    return {kernel: cg.TileConfig(**fields) for kernel, fields in FUSED_TILINGS[name].items()}


@pytest.mark.parametrize("tiling", list(FUSED_TILINGS))
@pytest.mark.parametrize("operands", [pytest.param(name, marks=MIXED_FP8_LOWERS) if a != b else name
                                      for name, (a, b, _) in FUSED_OPERANDS.items()])
def test_fused_kernels_lower_for_cuda(operands, tiling):
    """Both collective GEMM kernels, every operand pairing, lower to Mosaic GPU without a GPU (lowered
    for "cuda" from the CPU): a kernel Pallas cannot lower fails here instead of first on a GPU. One
    Mosaic GPU custom call per kernel; the kernels' GPU tests (tests/test_sp_gpu.py) run them."""
    a_dtype, b_dtype, contract = FUSED_OPERANDS[operands]
    tp = 4
    gather, scatter = _fused_programs(tp, contract, fused_tiling(tiling))
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
    gather, _ = _fused_programs(4, 0, {"gather": cg.TileConfig(epi=None, stages=3, spread=4, handoff="tile")})
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
    mesh = _mesh(2)
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
    mesh = _mesh(2)
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
    mesh = _mesh(2)
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
