"""The layer-wise FSDP step on the GPUs there are (1+): the step's own compiler options send every GEMM of
the FP8 step to cuBLASLt (no Triton GEMM fusion, no process-wide flag), and stacked leaves under scan train
like per-layer leaves (different GEMM fusions and algorithms on GPU: within bf16 rounding, not bitwise)."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from support.transformer import MASK, init_params, loss_loop, loss_scan, make_batch, stack_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


def _train(loss, params, cw, steps=3, **kw):
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    step = jq.make_train_step(loss, optax.sgd(0.05), mesh=mesh, quantize_mask=MASK,
                              policy=jq.MixedPrecisionPolicy(compute_weights=cw), **kw)
    state, losses = step.init(params), []
    for _ in range(steps):
        state, m = step(state, make_batch())
        losses.append(float(m["loss"]))
    return step, state, losses


def test_fp8_step_gemms_are_cublaslt_without_a_global_flag():
    step, state, _ = _train(loss_scan, init_params(), "fp8", steps=1)
    hlo = step.lower(state, make_batch()).compile().as_text()
    # XLA's FP8 GEMM, or jaxquant's on cuBLASLt (gemm.FP8_GEMM_IMPL "cublaslt", which writes the bf16 GEMMs)
    assert "__cublas$lt$matmul$f8" in hlo or (jq.primitives.gemm.FP8_GEMM_IMPL == "cublaslt" and "jq_fp8_gemm" in hlo)
    assert "__triton_gemm" not in hlo and "__triton_nested_gemm" not in hlo


@pytest.mark.parametrize("cw", ["bf16", "fp8", "nvfp4"])
def test_scan_trains_like_the_loop_on_gpu(cw):
    _, s_scan, l_scan = _train(loss_scan, init_params(stacked=True), cw)
    _, s_loop, l_loop = _train(loss_loop, init_params(stacked=False), cw)
    # FP8 amplifies the bf16 rounding differences of other GEMM algorithms (a bf16 ulp flips an E4M3
    # rounding about 1 time in 32): 2 x H100 measured 2.4e-3 at step 3 of FP8, 2e-3 elsewhere
    np.testing.assert_allclose(l_scan, l_loop, rtol=5e-3 if cw == "fp8" else 2e-3)
    for a, b in zip(jax.tree.leaves(s_scan.master), jax.tree.leaves(stack_params(s_loop.master))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-3)



@pytest.mark.parametrize("cw,target", [("fp8", "jq_fp8_quantize"), ("nvfp4", "jq_nvfp4_quantize")])
def test_scan_casts_each_weight_once(cw, target):
    """Under scan the fp32 weight cast has two users, the gather and the stacked residual; XLA's GPU
    dynamic-slice fusion cloned it into the residual's write (every weight cast twice a step, ~5% of the scan step
    on one H200) until jq.dense put an optimization barrier between the cast and its users. Counted in the compiled
    scan step: one cast of each stacked weight's fp32 rows [rows / fsdp, in] (the activations' casts have other
    shapes)."""
    import re

    from support.transformer import D, F

    n = len(jax.devices())
    step, state, _ = _train(loss_scan, init_params(stacked=True), cw, steps=1)
    hlo = step.lower(state, make_batch()).compile().as_text()
    # one shard: the FP8 cast also writes the columnwise bytes the backward keeps (fsdp.keeps_columnwise); NVFP4
    # makes the GEMMs' bf16 operand in one pass (fsdp.dequantizes_once)
    target += "_t" if cw == "fp8" and n == 1 else ""
    target = "jq_nvfp4_bf16_operand" if cw == "nvfp4" and n == 1 else target
    shapes = re.findall(rf'custom_call_target="{target}", operand_layout_constraints=\{{f32\[(\d+),(\d+)\]', hlo)
    for rows, cols in ((F // n, D), (D // n, F)):   # w1, w2 of one layer
        assert shapes.count((str(rows), str(cols))) == 1, (rows, cols, shapes)


@pytest.mark.skipif(len(jax.devices()) != 1, reason="one GPU: every weight is one shard")
def test_one_gpu_fp8_scan_writes_weight_gradients_in_place_and_transposes_no_stack():
    """FP8 under scan on one GPU, gradients sent in bf16: XLA's dynamic-slice fusion runs each stacked weight's
    gradient GEMM (jq_fp8_gemm) straight into the stacked gradient, a dynamic-update-slice inside the fusion and no
    copy of dW after it (the gradient reaches it unconverted: fsdp.rounds_to_itself), and no FP8 stack is
    transposed (the backward reads the columnwise residual the cast wrote: fsdp.keeps_columnwise). Seen otherwise on
    an H200 (jax 0.11.2): a copy of every layer's dW into the stack, the whole stacked residual transposed before
    the backward loop and a strided copy of each layer's slice in it."""
    import re

    from jaxquant.primitives import _ffi, gemm
    from support.transformer import D, F, L

    if gemm.FP8_GEMM_IMPL != "cublaslt" or not _ffi.has_target("cuda", "jq_fp8_gemm"):
        pytest.skip("jaxquant's FP8 GEMM is not in use (gemm.FP8_GEMM_IMPL, or a build without cuBLASLt)")
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    policy = jq.MixedPrecisionPolicy(compute_weights="fp8", grad_comm_dtype=jax.numpy.bfloat16)
    step = jq.make_train_step(loss_scan, optax.sgd(0.05), mesh=mesh, quantize_mask=MASK, policy=policy)
    state = step.init(init_params(stacked=True))
    state, _ = step(state, make_batch())
    hlo = step.lower(state, make_batch()).compile().as_text()
    bodies = re.split(r"\n(?=\S)", hlo)   # one computation each
    fused = [b for b in bodies if b.startswith("%dynamic-slice-fusion") and 'custom_call_target="jq_fp8_gemm"' in b]
    for rows, cols in ((F, D), (D, F)):        # w1's and w2's gradient stacks [L, rows, cols]
        stack = re.compile(rf"= bf16\[{L},{rows},{cols}\]\S* dynamic-update-slice\(")
        assert any(stack.search(b) for b in fused), (rows, cols, fused)
    stack_transposes = re.findall(r"%\S*transpose\S* = f8e4m3fn\[\d+,\d+,\d+\]", hlo)
    assert not stack_transposes, stack_transposes
