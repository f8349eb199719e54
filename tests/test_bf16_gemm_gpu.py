"""The scaled bf16 GEMM custom call (``ops.bf16_gemm``, csrc/cuda_gemm.cu: NVFP4's GEMMs on Hopper) on a GPU: the
bytes of ``(dot_general(a, b, preferred_element_type=f32) * factor).astype(bf16)`` as XLA compiles it today
(``gemm.scaled_gemm`` with ``BF16_GEMM_IMPL="xla"``, compiled as the training step compiles it: cuBLAS, no Triton
GEMM), over NVFP4 weights decoded next to the GEMM as ``jq.dense`` decodes them (``gemm.nvfp4_operand``, the global
decode factor from the amax): TN ([out, in] weights, their columnwise copy) and NN (the rowwise bytes read transposed,
[in, out] kernels), at the training step's shapes (4096 tokens, N and K from Llama-3-8B's layers), small and
odd-multiple-of-16 shapes, edge values; ``jq.dense`` and the layer-wise NVFP4 step give the same bytes either way.

Skipped unless the default backend is a GPU and the CUDA extension was built with cuBLASLt (build.py prints which).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from jaxquant.primitives import _ffi, gemm, ops
from support.custom_gemm import both, compiled, same_bytes as _same_bytes, wrapped_gives_xlas_bytes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend"),
              pytest.mark.skipif(not _ffi.has_target("cuda", "jq_bf16_gemm"),
                                 reason="the CUDA extension was built without cuBLASLt (build.py --cuda on says why)")]

XLA_GEMM = "__cublas$"                                   # XLA's cuBLAS GEMM custom calls (legacy or Lt)
_compiled = functools.partial(compiled, "BF16_GEMM_IMPL")
_both = functools.partial(both, "BF16_GEMM_IMPL")




def _weight(rows, cols, edge):
    """An NVFP4 weight ``[rows, cols]`` (columnwise copy too) of random values; ``edge``: a zero 16x16 tile (scale 0),
    a tile of tiny values next to a large one and an outlier that sets the amax."""
    w = jax.random.normal(jax.random.key(rows * 31 + cols), (rows, cols), jnp.float32) * 0.02
    if edge:
        w = w.at[:16, :16].set(0.0).at[16:32, :16].multiply(1e-6).at[16, 0].set(3.0).at[-1, -1].set(-7.5)
    return jq.quantize_nvfp4(w, columnwise=True)


def _activation(m, k, edge, seed=0):
    """bf16 ``[m, k]`` activations; ``edge``: a zero row, a column of -0.0 and a few large values."""
    x = jax.random.normal(jax.random.key(seed + m * 7 + k), (m, k), jnp.float32)
    if edge:
        x = x.at[0, :].set(0.0).at[:, 1].set(-0.0).at[2, 3].set(3.0e4).at[-1, -2].set(-1.5e4)
    return x.astype(jnp.bfloat16)


def _nvfp4_gemm(layout):
    """The GEMM dense.py runs on an NVFP4 weight, the decode next to it: "tn" reads ``W [N, K]`` (forward; dgrad on
    the columnwise copy, or on an [in, out] kernel), "nn" reads ``W [K, N]`` contracted on its major axis (dgrad on the
    rowwise bytes; forward of an [in, out] kernel)."""
    def fn(x, data, scale_inv, amax):
        w = gemm.nvfp4_operand(data, scale_inv)
        return gemm.scaled_gemm(x, None, w, gemm.nvfp4_global_decode(amax), dims=gemm.TN if layout == "tn" else gemm.NN,
                                out_dtype=jnp.bfloat16)
    return fn


def _check(m, k, n, layout, edge=False):
    q = _weight(n, k, edge) if layout == "tn" else _weight(k, n, edge)
    x = _activation(m, k, edge)
    args = (x, q.data, q.scale_inv, q.amax)
    got_xla, got_custom, hlo_xla, hlo_custom = _both(_nvfp4_gemm(layout), *args)
    assert XLA_GEMM in hlo_xla and "jq_bf16_gemm" not in hlo_xla
    assert '"jq_bf16_gemm"' in hlo_custom and XLA_GEMM not in hlo_custom
    _same_bytes(got_xla, got_custom, f"{layout} M, K, N = {m}, {k}, {n}")


# The training step's GEMMs: M = 4096 tokens (2 x 2048), N and K the sizes of Llama-3-8B's layers (1024: a kv
# projection; 4096: hidden; 6144: fused qkv; 14336: FFN; 28672: fused gate/up), every pair.
SIZES = (1024, 4096, 6144, 14336, 28672)
TRAINING = [(4096, k, n) for n in SIZES for k in SIZES]


@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("m,k,n", TRAINING, ids=[f"{m}x{k}x{n}" for m, k, n in TRAINING])
def test_training_shapes_give_xlas_bytes(m, k, n, layout):
    _check(m, k, n, layout)


# M off the 16-grid and small; N, K odd multiples of 16 (48 = 3 x 16, 80, 208, 1008, 2032 = 127 x 16)
SMALL = [(8, 64, 16), (200, 128, 48), (77, 80, 208), (1000, 1008, 2032), (4096, 2032, 1008), (16, 4096, 1024),
         (512, 14336, 4096)]


@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge_values"])
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("m,k,n", SMALL, ids=[f"{m}x{k}x{n}" for m, k, n in SMALL])
def test_small_and_odd_shapes_and_edge_values_give_xlas_bytes(m, k, n, layout, edge):
    _check(m, k, n, layout, edge)


@pytest.mark.parametrize("factor", [1.0, 2.0 ** -20, 3.0e4], ids=["one", "tiny", "large"])
def test_plain_bf16_operands_and_other_factors(factor):
    """The op itself on bf16 operands that are not NVFP4 values (full bf16 significands), factors off the NVFP4
    range, both layouts, against XLA's dot times the factor."""
    ka, kb = jax.random.split(jax.random.key(11))
    a = jax.random.normal(ka, (384, 1024), jnp.bfloat16)
    b = jax.random.normal(kb, (512, 1024), jnp.bfloat16)
    f = jnp.float32(factor)
    for layout, bb, dims in (("nk", b, gemm.TN), ("kn", b.T, gemm.NN)):
        xla = _compiled("xla", lambda a, b, f: gemm.scaled_gemm(a, None, b, f, dims=dims, out_dtype=jnp.bfloat16),
                        a, bb, f)
        custom = jax.jit(lambda a, b, f: ops.bf16_gemm(a, b, f, b_layout=layout, impl="custom_call"))
        _same_bytes(xla(a, bb, f), custom(a, bb, f), f"{layout} factor {factor}")


@pytest.mark.parametrize("case", ["fp32_result", "no_factor", "n_off_grid", "rank3"])
def test_products_the_gemm_does_not_take_stay_xlas(case):
    m, k, n, out = 64, 128, 64, jnp.bfloat16
    if case == "n_off_grid":
        n = 40
    ka, kb = jax.random.split(jax.random.key(3))
    a = jax.random.normal(ka, (2, m, k) if case == "rank3" else (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (n, k), jnp.bfloat16)
    f = None if case == "no_factor" else jnp.float32(0.25)
    out = None if case == "fp32_result" else out
    dims = (((2,), (1,)), ((), ())) if case == "rank3" else gemm.TN
    x, y, _, hlo = _both(lambda a, b: gemm.scaled_gemm(a, None, b, f, dims=dims, out_dtype=out), a, b)
    assert "jq_bf16_gemm" not in hlo
    _same_bytes(x, y, case)


def test_under_shard_map_scan_remat_and_vmap():
    """What the step wraps the GEMM in: shard_map over a 1-device mesh, scan, remat; and vmap (item by item)."""
    ka, kb = jax.random.split(jax.random.key(4))
    a = jax.random.normal(ka, (3, 128, 256), jnp.bfloat16)
    b = jax.random.normal(kb, (64, 256), jnp.bfloat16)
    f = jnp.float32(0.6)
    wrapped_gives_xlas_bytes("BF16_GEMM_IMPL", "jq_bf16_gemm",
                             lambda x, b: gemm.scaled_gemm(x, None, b, f, out_dtype=jnp.bfloat16), a, b)


@pytest.mark.parametrize("rows", [512, 4096])
def test_nvfp4_dense_fwd_bwd_same_bytes_with_the_custom_call(rows):
    """``jq.dense`` on an NVFP4 weight: the forward and the dgrad (on the columnwise copy) run the custom call, with
    the bytes of XLA's dot; the wgrad (no factor) stays XLA's bf16 GEMM. The weight and the output gradient are
    arguments: as constants XLA would fold the dgrad's dot on the host, which is not the GEMM the step runs."""
    kx, kg = jax.random.split(jax.random.key(6))
    q = _weight(1024, 2048, False)
    x = jax.random.normal(kx, (rows, 2048), jnp.bfloat16)
    ct = jax.random.normal(kg, (rows, 1024), jnp.bfloat16)

    def fn(x, m, q, ct):
        y, vjp = jax.vjp(lambda x, m: jq.dense(x, jq.straight_through(q, m)), x, m)
        return (y,) + vjp(ct)

    m = jnp.zeros(q.shape, jnp.bfloat16)
    got_xla, got_custom, _, hlo = _both(fn, x, m, q, ct)
    assert hlo.count('"jq_bf16_gemm"') == 2
    for name, u, v in zip(("y", "dx", "dW"), got_xla, got_custom):
        _same_bytes(u, v, name)


def _toy_loss(w, batch):
    """Two NVFP4 layers on bf16 activations (no embedding: its gradient is a scatter-add, whose atomics make the
    step's bytes vary from run to run on a GPU): each forward and dgrad is a scaled bf16 GEMM with a bf16 result."""
    h = jax.nn.gelu(jq.dense(batch["x"], w["w1"]))
    y = jq.dense(h, w["w2"]).astype(jnp.float32)
    return jnp.mean(jnp.square(y - batch["y"]))


def _train_nvfp4(impl, steps=3):
    """(compiled HLO, losses, state) of ``steps`` layer-wise NVFP4 steps of :func:`_toy_loss` with
    ``BF16_GEMM_IMPL = impl``."""
    kw1, kw2, kx, ky = jax.random.split(jax.random.key(12), 4)
    params = {"w1": jax.random.normal(kw1, (256, 128), jnp.float32) / np.sqrt(128),
              "w2": jax.random.normal(kw2, (128, 256), jnp.float32) / np.sqrt(256)}
    batch = {"x": jax.random.normal(kx, (64, 128), jnp.bfloat16), "y": jax.random.normal(ky, (64, 128), jnp.float32)}
    saved = gemm.BF16_GEMM_IMPL
    gemm.BF16_GEMM_IMPL = impl
    try:
        jax.clear_caches()
        mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
        step = jq.make_train_step(_toy_loss, optax.sgd(0.05), mesh=mesh, quantize_mask=True,
                                  policy=jq.MixedPrecisionPolicy(compute_weights="nvfp4"))
        state, losses = step.init(params), []
        hlo = step.lower(state, batch).compile().as_text()
        for _ in range(steps):
            state, m = step(state, batch)
            losses.append(np.asarray(m["loss"]))
        return hlo, losses, jax.tree.map(np.asarray, state.master)
    finally:
        gemm.BF16_GEMM_IMPL = saved


def test_layerwise_nvfp4_step_same_bytes_with_the_custom_call():
    """The layer-wise NVFP4 step (its backward reads the rowwise bytes transposed: NN) trains to the same master bytes
    with the custom call as with XLA's dot; the reported losses agree within their reduction's reordering bound."""
    hlo_xla, l_xla, m_xla = _train_nvfp4("xla")
    hlo_custom, l_custom, m_custom = _train_nvfp4("cublaslt")
    # the two forwards and w2's dgrad (w1's dx, of the batch, is not needed)
    assert "jq_bf16_gemm" not in hlo_xla and hlo_custom.count('"jq_bf16_gemm"') >= 3
    # the trained weights: the same bytes
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(m_xla), jax.tree.leaves(m_custom)):
        _same_bytes(u, v, f"master {jax.tree_util.keystr(path)}")
    # The reported loss is a mean of 64 x 128 fp32 squares that XLA reduces inside whatever fusion surrounds it, and
    # the two programs fuse it differently (with XLA's dot the factor's multiply and the bf16 cast sit next to it).
    # On one H200 (2026-11-29) the third step's loss came out 1 ulp apart (1.3759230 vs 1.3759229) in every run,
    # alone or with XLA's GEMM autotuning off, while the masters above were the same bytes. So the losses are held
    # to the bound of an fp32 sum of n non-negative terms in another order: relative (n - 1) * 2^-24.
    n = 64 * 128
    for i, (u, v) in enumerate(zip(l_xla, l_custom)):
        np.testing.assert_allclose(v, u, rtol=(n - 1) * 2.0 ** -24, atol=0, err_msg=f"loss of step {i}")
