"""The sequence-parallel layers' test harness: inputs, the single-device reference of their quantized math
(whole-tensor current scaling, one GEMM per product), jitted forward-and-vjp runners on a tp mesh, the checks
that hold a sharded run to the reference, and the collective GEMM kernels' programs (tests/test_sp.py on CPU,
tests/test_sp_gpu.py on GPUs)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jaxquant as jq
from conftest import q_fp8, q_nvfp4
from jaxquant.primitives import gemm
from jaxquant.tp import collective_gemm as cg, sp
from support.meshes import tp_mesh


B, S, H, F = 2, 32, 32, 64
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = dict(preferred_element_type=jnp.float32)


def layer_inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (B, S, H), jnp.float32) * 3.0
    gamma = 1.0 + 0.1 * jax.random.normal(k[1], (H,), jnp.float32)
    beta = 0.1 * jax.random.normal(k[2], (H,), jnp.float32)
    w1 = jax.random.normal(k[3], (F, H), jnp.float32) / np.sqrt(H)     # [out, in]
    w2 = jax.random.normal(k[4], (H, F), jnp.float32) / np.sqrt(F)
    return x, gamma, beta, w1, w2


def fp8_weight(w):
    return q_fp8(w, dtype=E4M3, columnwise=True, compute_dtype=jnp.bfloat16)


# ----------------------------------------------------------------------------------------------
# Single-device reference: whole-tensor scaling, one GEMM per product, no collectives
# ----------------------------------------------------------------------------------------------


def quantized(v, dtype):
    """(bytes, scale_inv) of the whole tensor v (current scaling, no compute-dtype rounding)."""
    t = q_fp8(v.reshape(-1, v.shape[-1]), dtype=dtype)
    return t.data.reshape(v.shape), t.scale_inv


def ref_mm(a, b, a_dims, b_dims):
    """a·b contracting a_dims with b_dims; operands are (values, per-tensor factor or None)."""
    (ad, asc), (bd, bsc) = a, b
    out = lax.dot_general(ad, bd, ((a_dims, b_dims), ((), ())), **F32)
    factors = [f for f in (asc, bsc) if f is not None]
    return out * (factors[0] * factors[1] if len(factors) == 2 else factors[0]) if factors else out


def ref_operands(recipe, act, w, act_dtype=E4M3):
    """(activation operand, weight operand [out, in]): FP8 bytes and scale; NVFP4 bf16 value(q)*s8 of
    the whole tensor and the global factor amax/2688 (docs/numerics.md §2.8); else bf16."""
    if recipe == "fp8":
        wq = w if isinstance(w, jq.Float8Tensor) else fp8_weight(w)
        return quantized(act, act_dtype), (wq.data, jnp.reshape(wq.scale_inv, ()))
    if isinstance(w, tuple):   # an operand decoded by the caller
        wop = w
    elif isinstance(w, jq.NVFP4Tensor):
        wop = (gemm.nvfp4_operand(w.data, w.scale_inv), jnp.reshape(w.amax, ()) / np.float32(2688))
    else:
        wop = (w.astype(jnp.bfloat16), None)
    return (act.astype(jnp.bfloat16), None), wop


def ref_grad_operand(recipe, g):
    return quantized(g, E5M2) if recipe == "fp8" else (g.astype(jnp.bfloat16), None)


def ref_column(recipe, x, gamma, beta, w, g):
    """(out, (dx, dgamma, dbeta, dw)) of layernorm -> dense on one device (w [out, in])."""
    ln = lambda x_, g_, b_: sp._layernorm_f32(x_, g_, b_, 1e-5)
    a, wop = ref_operands(recipe, ln(x, gamma, beta).astype(jnp.bfloat16), w)
    out = ref_mm(a, wop, (2,), (1,)).astype(x.dtype)
    gq = ref_grad_operand(recipe, g)
    dy = ref_mm(gq, wop, (2,), (0,))
    dw = ref_mm(gq, a, (0, 1), (0, 1))
    return out, (*jax.vjp(ln, x, gamma, beta)[1](dy), dw)


def ref_row(recipe, x, w, g):
    a, wop = ref_operands(recipe, x, w)
    out = ref_mm(a, wop, (2,), (1,)).astype(x.dtype)
    gq = ref_grad_operand(recipe, g)
    return out, (ref_mm(gq, wop, (2,), (0,)).astype(x.dtype), ref_mm(gq, a, (0, 1), (0, 1)))


def ref_mlp_dx(x, g, gamma, beta, w1, w2):
    h_pre = ref_column("fp8", x, gamma, beta, w1, jnp.zeros((B, S, F), jnp.float32))[0]
    h, gelu_vjp = jax.vjp(jax.nn.gelu, h_pre)
    dh = ref_row("fp8", h, w2, g)[1][0]
    return ref_column("fp8", x, gamma, beta, w1, gelu_vjp(dh)[0])[1][0]


# ----------------------------------------------------------------------------------------------
# Runners: forward and vjp of a layer in one jitted program
# ----------------------------------------------------------------------------------------------


def grad_target(w):
    """(what to differentiate, how the layer receives it): a quantized weight's straight-through
    gradient is read on a master attached with jq.straight_through (as for jq.dense)."""
    if isinstance(w, (jq.Float8Tensor, jq.NVFP4Tensor)):
        return jnp.zeros(w.shape, jnp.float32), lambda m: jq.straight_through(w, m)
    return w, lambda v: v


def column_vjp(mesh, overlap, recipe, x, gamma, beta, w, g):
    w_arg, as_weight = grad_target(w)
    f = lambda x, gamma, beta, w_arg: jq.sp_layernorm_dense(x, gamma, beta, as_weight(w_arg), mesh=mesh,
                                                            overlap=overlap, recipe=recipe)
    out, vjp = jax.vjp(f, x, gamma, beta, w_arg)
    return out, vjp(g)


def row_vjp(mesh, overlap, recipe, x, w, g):
    w_arg, as_weight = grad_target(w)
    f = lambda x, w_arg: jq.sp_dense_reduce_scatter(x, as_weight(w_arg), mesh=mesh, overlap=overlap, recipe=recipe)
    out, vjp = jax.vjp(f, x, w_arg)
    return out, vjp(g)


@functools.lru_cache(maxsize=None)
def runner(tp, overlap, recipe, devices="cpu"):
    """One jitted program: (out, grads) of the column layer and of the row layer."""
    mesh = tp_mesh(tp, devices)

    def run(col_args, row_args):
        return column_vjp(mesh, overlap, recipe, *col_args), row_vjp(mesh, overlap, recipe, *row_args)
    return jax.jit(run)


def layer_args(seed, recipe, kind):
    """((x, gamma, beta, w1, g) of the column layer, (x, w2, g) of the row layer)."""
    x, gamma, beta, w1, w2 = layer_inputs(seed)
    w1, w2 = layer_weights(recipe, w1, w2, kind)
    k = jax.random.split(jax.random.key(100 + seed), 3)
    g_col = jax.random.normal(k[0], (B, S, F), jnp.float32)
    x_row = jax.random.normal(k[1], (B, S, F), jnp.float32)
    g_row = jax.random.normal(k[2], (B, S, H), jnp.float32)
    return (x, gamma, beta, w1, g_col), (x_row, w2, g_row)


def assert_close(actual, expected, what, rtol=2e-5):
    a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    atol = rtol * max(float(np.max(np.abs(e))), 1e-30)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=what)


def layer_weights(recipe, w1, w2, kind):
    if kind == "float8tensor":
        return fp8_weight(w1), fp8_weight(w2)
    if kind == "nvfp4":
        return q_nvfp4(w1, compute_dtype=jnp.bfloat16), q_nvfp4(w2, compute_dtype=jnp.bfloat16)
    return w1, w2


CASES = [("bf16", "float"), ("fp8", "float8tensor")]


def check_layers_match_single_device(results, col_args, row_args, recipe, rtol=2e-5, same_k_rtol=1e-6):
    """``same_k_rtol`` bounds the outputs whose K-reduction each rank runs whole (column out, row dx):
    near-bitwise on XLA:CPU; on GPU cuBLAS may pick another kernel (and FP8 accumulation) per shape."""
    (out, grads), (row_out, row_grads) = results
    ref_out, ref_grads = ref_column(recipe, *col_args)
    # all-gather -> GEMM: the same K-reduction per element, though XLA:CPU's dot may order it
    # differently for another N split
    assert_close(out, ref_out, "column out", same_k_rtol)
    for name, a, e in zip(("dx", "dgamma", "dbeta", "dw"), grads, ref_grads):
        assert_close(a, e, "column " + name, rtol)
    ref_out, ref_grads = ref_row(recipe, *row_args)
    assert_close(row_out, ref_out, "row out", rtol)   # partial sums over tp: another summation order
    assert_close(row_grads[0], ref_grads[0], "row dx", same_k_rtol)   # all-gather of dY -> GEMM
    assert_close(row_grads[1], ref_grads[1], "row dw", rtol)


def check_fp8_fused_matches_off(names, got, want, exact):
    """overlap="fused" under FP8 against "off": its products leave the kernels unscaled in bf16 and are
    scaled after (a second rounding), which moves some values across an FP8 rounding boundary, so the two
    differ by a few % in relative norm and are equally far from the bf16 recipe's result ``exact`` (a wrong
    scale or a misplaced chunk would be far off both)."""
    rel = lambda a, e: float(np.linalg.norm(a - e) / np.linalg.norm(e))
    for name, a, e, x in zip(names, got, want, exact):
        assert rel(a, e) <= 0.05, (name, rel(a, e))
        assert rel(a, x) <= 1.05 * rel(e, x) + 1e-3, (name, rel(a, x), rel(e, x))


def fused_programs(tp, contract, configs=None):
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
# tilings the kernels' tests run, per kernel (TileConfig fields; a kernel left out uses its own choice):
# the kernels' own (the reduce-scatter's spreads its stores over the next tile), TileConfig()'s (64x64
# epilogue pieces stored at once), and the reduce-scatter handing off tile by tile (opt-in)
FUSED_TILINGS = {"chosen": {}, "default": {"gather": {}, "scatter": {}},
                 "tile-handoff": {"scatter": dict(epi=None, stages=3, spread=4, handoff="tile")}}


def fused_tiling(name):
    """FUSED_TILINGS[name] as fused_programs' configs."""
    return {kernel: cg.TileConfig(**fields) for kernel, fields in FUSED_TILINGS[name].items()}
