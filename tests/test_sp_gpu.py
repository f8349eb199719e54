"""jaxquant.tp.sp on the GPUs of one host (tp = every GPU): each layer (overlap="off") against the
single-GPU computation of the same quantized math for every weight type ([out, in] bf16 array,
Float8Tensor, float weight quantized inside under "fp8", NVFP4Tensor; quantized weights' gradients on
straight-through masters); overlap="fused"'s kernels against their plain-JAX schedule, and sp_mlp with
"fused" against "off". Skipped unless the default backend is a GPU with
at least 2 devices (tests/test_sp.py covers tp in {2, 4, 8} on simulated CPU devices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bytes_equal

from support.sp_layers import (CASES, FUSED_OPERANDS, FUSED_TILINGS, check_fp8_fused_matches_off,
                               check_layers_match_single_device, fused_programs, fused_tiling, layer_args, runner)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu" or len(jax.devices()) < 2,
                                 reason="needs 2 or more GPUs")]


@pytest.mark.parametrize("recipe,kind", CASES + [("fp8", "float"), ("bf16", "nvfp4")])
def test_layers_on_gpus_match_single_gpu(recipe, kind):
    """overlap="off" (NCCL + cuBLAS) against one GPU; "fused": test_fused_*."""
    tp = len(jax.devices())
    col_args, row_args = layer_args(tp, recipe, kind)
    results = runner(tp, "off", recipe, devices="gpu")(col_args, row_args)
    # cuBLAS picks other kernels (and FP8 accumulation) for the sharded shapes: compare closely,
    # not bitwise; a misplaced chunk or a wrong scale is off by far more than this
    check_layers_match_single_device(results, col_args, row_args, recipe, rtol=1e-2, same_k_rtol=1e-2)


def _fused_operands(seed, tp, rows, k, n_cols, contract, a_dtype, b_dtype, scale=1):
    """Random operands of fused_programs' kernels for call ``seed``: ((a, b) of the all-gather GEMM,
    (a2, b2) of the GEMM reduce-scatter), A scaled by ``scale``, B as ``contract`` lays it out."""
    keys = jax.random.split(jax.random.key(seed), 4)
    as_b = (lambda b: b.astype(b_dtype)) if contract == 0 else (lambda b: jnp.asarray(b.T).astype(b_dtype))
    a = (jax.random.normal(keys[0], (tp * rows, k)) * scale).astype(a_dtype)
    b = as_b(jax.random.normal(keys[1], (k, tp * n_cols)) / np.sqrt(k))
    a2 = (jax.random.normal(keys[2], (tp * rows, tp * k)) * scale).astype(a_dtype)
    b2 = as_b(jax.random.normal(keys[3], (tp * k, n_cols)) / np.sqrt(tp * k))
    return (a, b), (a2, b2)


@pytest.mark.parametrize("tiling", list(FUSED_TILINGS))
@pytest.mark.parametrize("operands", list(FUSED_OPERANDS))
def test_fused_kernels_match_their_schedule(operands, tiling):
    """overlap="fused"'s kernels against their plain-JAX schedule (collective_gemm, impl="reference"), on
    every GPU, called repeatedly with new values (a stale semaphore count or a slot read before its
    transfer landed would show as a wrong chunk): the gathered operand is the same bytes, the GEMM
    results agree to the GEMMs' own rounding; bf16 with B as [K, N] and as [N, K] (a weight read as
    stored), and FP8 (E4M3, and E5M2 x E4M3 as a dgrad multiplies) with B K-major; with the kernels'
    own tilings (the reduce-scatter's stores spread over the next tile), with TileConfig()'s, and with
    the reduce-scatter handing off tile by tile (``handoff="tile"``)."""
    a_dtype, b_dtype, contract = FUSED_OPERANDS[operands]
    tp = len(jax.devices())
    # more output tiles per ring step (144) than a GPU has CTAs, so that the reduce-scatter's CTAs store
    # (and hand off) a tile during their next one, not only after their last; TileConfig() at a small shape
    rows, k, n_cols = (256, 512, 256) if tiling == "default" else (1024, 512, 4608)
    gather, scatter = fused_programs(tp, contract, fused_tiling(tiling))
    for i in range(4):
        (a, b), (a2, b2) = _fused_operands(i, tp, rows, k, n_cols, contract, a_dtype, b_dtype, scale=i + 1)
        (out, full), (out_ref, full_ref) = gather["kernel"](a, b), gather["reference"](a, b)
        assert_bytes_equal(full, full_ref, f"gathered operand, call {i}")
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32),
                                   rtol=2e-2, atol=2e-2 * (i + 1), err_msg=f"all-gather GEMM, call {i}")
        got, want = scatter["kernel"](a2, b2), scatter["reference"](a2, b2)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=3e-2, atol=3e-2 * (i + 1), err_msg=f"GEMM reduce-scatter, call {i}")


@pytest.mark.skipif(len(jax.devices()) < 3, reason="at tp 2 a call hands off one ring step: nothing to overtake")
@pytest.mark.parametrize("contract", [0, 1])
def test_fused_kernels_hand_off_each_ring_step_whole(contract):
    """At tp >= 3 a rank hands its left neighbour several ring steps per call, and at a small shape most
    CTAs have no output tile and run ahead of the few that store: each hand-off must wait for every
    CTA's stores of that step, not for a count that CTAs of later steps also add to (that read a chunk
    before it landed about once in 60 calls on 4 x H100). Both kernels, 120 calls, each within the GEMMs'
    rounding of its plain-JAX schedule."""
    tp = len(jax.devices())
    gather, scatter = fused_programs(tp, contract, fused_tiling("default"))
    bad = []
    for i in range(120):
        (a, b), (a2, b2) = _fused_operands(1000 + i, tp, 256, 512, 256, contract, jnp.bfloat16, jnp.bfloat16)
        cases = (("all-gather GEMM", gather, (a, b), 2e-2), ("GEMM reduce-scatter", scatter, (a2, b2), 3e-2))
        for name, programs, args, tol in cases:
            got, want = programs["kernel"](*args), programs["reference"](*args)
            if name == "all-gather GEMM":   # (product, gathered operand)
                got, want = got[0], want[0]
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            if not np.all(np.abs(got - want) <= tol * (1 + np.abs(want))):   # NaN fails too
                bad.append(f"{name}, call {i}")
    assert not bad, f"{len(bad)} wrong calls: {bad[:6]}"


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize("fsdp", [1, pytest.param(2, marks=pytest.mark.skipif(
    len(jax.devices()) < 4, reason="a (fsdp 2, tp 2) mesh needs 4 GPUs"))])
def test_fused_mlp_matches_off(fsdp, recipe):
    """sp_mlp forward and gradients, overlap="fused" (kernels) against "off" (NCCL + cuBLAS); with
    fsdp = 2 on a 2-D mesh (the kernels address their tp neighbour within the rank's own fsdp row).
    bf16: within 3% of the largest element. FP8: a few % apart in relative norm (a bf16 rounding more
    moves some values across FP8 rounding boundaries) and as far as "off" from the bf16 result."""
    import jaxquant as jq
    from jax.sharding import Mesh
    tp = len(jax.devices()) // fsdp
    mesh = Mesh(np.array(jax.devices()[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))
    bsz, seq, hidden, ffn = 2, 256 * tp, 256, 256 * tp
    k = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(k[0], (bsz, seq, hidden), jnp.bfloat16)
    w1 = (jax.random.normal(k[1], (ffn, hidden), jnp.float32) / np.sqrt(hidden)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[2], (hidden, ffn), jnp.float32) / np.sqrt(ffn)).astype(jnp.bfloat16)
    g = jax.random.normal(k[3], (bsz, seq, hidden), jnp.bfloat16)
    gamma, beta = jnp.ones((hidden,), jnp.float32), jnp.zeros((hidden,), jnp.float32)

    def run(overlap, recipe):
        f = lambda x, w1, w2: jq.sp_mlp(x, gamma, beta, w1, w2, mesh=mesh, overlap=overlap, recipe=recipe)
        out, vjp = jax.vjp(f, x, w1, w2)
        return jax.tree.leaves((out, vjp(g)))

    leaves = lambda overlap, recipe: [np.asarray(v, np.float32) for v in jax.jit(lambda: run(overlap, recipe))()]
    names, got, want = ("out", "dx", "dw1", "dw2"), leaves("fused", recipe), leaves("off", recipe)
    if recipe == "fp8":
        check_fp8_fused_matches_off(names, got, want, leaves("off", "bf16"))
        return
    for name, a, e in zip(names, got, want):
        assert float(np.max(np.abs(a - e))) <= 3e-2 * float(np.max(np.abs(e))), name
