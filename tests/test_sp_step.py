"""Sequence parallelism inside the layer-wise training step (jq.sp_column_dense / jq.sp_row_dense in the
demo's transformer on a (fsdp 2, tp 2) mesh): it trains to the parameters of the same step without sequence
parallelism (which all-reduces the row-parallel partial sums), and its compiled program moves activations
with tp all-gathers and bf16 reduce-scatters instead of all-reduces."""

import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from jaxquant.cli import demo, tpsp

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
CFG = tpsp.ModelConfig(layers=2, seq=32)


def _step(recipe, sequence_parallel, cfg=CFG, overlap="off"):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
    return jq.make_train_step(tpsp.loss_fn(cfg, "tp", 2, sequence_parallel=sequence_parallel, overlap=overlap),
                              optax.adam(1e-3), mesh=mesh, tp_axis="tp", param_specs=tpsp.param_specs(cfg),
                              quantize_mask=tpsp.quantize_mask(cfg),
                              policy=jq.MixedPrecisionPolicy(compute_weights=recipe))


def _train(recipe, sequence_parallel, steps=3, cfg=CFG, overlap="off"):
    """(step, params after the first step, losses of ``steps`` steps)."""
    step = _step(recipe, sequence_parallel, cfg, overlap)
    state = step.init(tpsp.init_params(jax.random.key(0), cfg))
    data = demo.SyntheticData(cfg, batch=4)
    losses, first = [], None
    for _ in range(steps):
        state, metrics = step(state, data.next())
        losses.append(float(metrics["loss"] if isinstance(metrics, dict) else metrics))
        first = step.params(state) if first is None else first
    return step, first, losses


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])   # fp8 first: the case the README command runs (tests/conftest.py)
@pytest.mark.slow
def test_sequence_parallel_step_equals_tensor_parallel_step(recipe):
    """Same model, batch and optimizer, with and without sequence parallelism: the losses of 3 steps agree
    to the bf16 rounding of the activations (SP reduces bf16 partial sums, the other path fp32), and after
    the first Adam step, whose update is lr x sign(g), the parameters are equal except where the rounding
    flips the sign of a near-zero gradient (a 2 x lr difference; FP8 flips more: a bf16 ulp changes an E4M3
    rounding about 1 time in 32). A wrong gradient would flip about half of them."""
    lr = 1e-3
    _, p_sp, l_sp = _train(recipe, True)
    _, p_tp, l_tp = _train(recipe, False)
    np.testing.assert_allclose(l_sp, l_tp, rtol=2e-3)
    assert l_sp[-1] < l_sp[0]
    diffs = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel()
                            for a, b in zip(jax.tree.leaves(p_sp), jax.tree.leaves(p_tp))])
    assert diffs.max() <= 2 * lr * (1 + 1e-3), diffs.max()
    equal = np.mean(diffs < 1e-6)
    assert equal > (0.99 if recipe == "bf16" else 0.95), equal     # measured fp8: 0.97-0.99 per leaf


@pytest.mark.slow
def test_sequence_parallel_moves_bf16_activations_with_gathers_and_reduce_scatters():
    """From the lowered step: the tp collectives of the block activations are all-gathers and bf16
    reduce-scatters (the wire dtype of the row-parallel partial sums); no bf16/fp32 activation all-reduce."""
    step = _step("fp8", True)
    state = step.init(tpsp.init_params(jax.random.key(0), CFG))
    text = step.lower(state, demo.SyntheticData(CFG, batch=4).next()).as_text()
    # block activations [b, S or S/tp, d] (weight gradients are 2-D, norm-scale ones [1, 1, d])
    three_d = lambda types: [t for t in types if re.fullmatch(rf"tensor<\d+x({CFG.seq}|{CFG.seq // 2})x\d+x\w+>", t)]
    scattered = re.findall(r'"stablehlo\.reduce_scatter".*?\}\) : \(([^)]*)\) ->', text, flags=re.S)
    act = three_d(scattered)
    assert act and all(t.endswith("xbf16>") for t in act), scattered
    gathered = re.findall(r'"stablehlo\.all_gather"\(%\S+\) .*?: \(([^)]*)\) ->', text)
    assert three_d(gathered), gathered
    reduced = re.findall(r'"stablehlo\.all_reduce".*?\}\) : \(([^)]*)\) ->', text, flags=re.S)
    assert not three_d(reduced), reduced


# the fused kernels' tiles: 256 rows of each rank's chunk (2 sequences x 256 / tp 2), every rank's output
# features a multiple of 128 (d_model / tp = 128)
FUSED_CFG = tpsp.ModelConfig(d_model=256, heads=4, d_ff=512, layers=1, seq=256)


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
@pytest.mark.slow
def test_fused_sequence_parallel_step_equals_off_step(recipe):
    """make_train_step with the per-rank layers' overlap="fused" (the collective GEMMs' plain-JAX schedule
    here; ShardedWeights gathered over fsdp, FP8 ones quantized, before the kernels) trains as
    overlap="off": the losses of 3 steps agree to bf16 rounding and the first Adam step moves the
    parameters alike (sign flips of near-zero gradients aside, more with FP8 as in the test above; a wrong
    gradient would flip about half of them)."""
    lr = 1e-3
    step, p_fused, l_fused = _train(recipe, True, cfg=FUSED_CFG, overlap="fused")
    _, p_off, l_off = _train(recipe, True, cfg=FUSED_CFG, overlap="off")
    # on GPUs the collective GEMM kernels run (Mosaic GPU custom calls); elsewhere their schedule, whose
    # running sums travel by collective_permute ("off" has none of its own)
    state = step.init(tpsp.init_params(jax.random.key(0), FUSED_CFG))
    text = step.lower(state, demo.SyntheticData(FUSED_CFG, batch=4).next()).as_text()
    assert ("mosaic_gpu" if jax.devices()[0].platform == "gpu" else "stablehlo.collective_permute") in text
    np.testing.assert_allclose(l_fused, l_off, rtol=2e-3)
    assert l_fused[-1] < l_fused[0]
    diffs = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel()
                            for a, b in zip(jax.tree.leaves(p_fused), jax.tree.leaves(p_off))])
    assert diffs.max() <= 2 * lr * (1 + 1e-3), diffs.max()
    assert np.mean(diffs < 1e-6) > (0.98 if recipe == "bf16" else 0.9), np.mean(diffs < 1e-6)


def test_fused_per_rank_layers_refuse_what_they_cannot_run():
    """The per-rank fused layers run bf16 and FP8 only, refuse kernels they cannot run, and name the rule."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    x = jax.numpy.ones((1, 256, 256), jax.numpy.bfloat16)
    w = jq.quantize_nvfp4(jax.numpy.ones((256, 256)))

    def f(x):
        return jq.sp_column_dense(x, w, tp_axis="tp", overlap="fused")
    run = jax.shard_map(f, mesh=mesh, in_specs=jax.sharding.PartitionSpec(None, "tp"),
                        out_specs=jax.sharding.PartitionSpec(None, None, "tp"))
    with pytest.raises(ValueError, match="overlap: 'fused' runs bf16 and FP8 GEMMs .* NVFP4Tensor"):
        jax.jit(run)(x)
    kernels = jax.shard_map(lambda x: jq.sp_column_dense(x, jax.numpy.ones((128, 256), jax.numpy.bfloat16),
                                                             tp_axis="tp", overlap="fused", impl="custom_call"),
                                mesh=mesh, in_specs=jax.sharding.PartitionSpec(None, "tp"),
                                out_specs=jax.sharding.PartitionSpec(None, None, "tp"))
    # 128 rows per rank: the CPU has no kernels; on GPUs, the kernels' tiles do not fit
    refusal = ("w: overlap='fused' tiles the GEMM in .* the rows of one rank's sequence chunk .* must be a multiple"
               if jax.devices()[0].platform == "gpu" else
               "impl: overlap='fused' with impl='custom_call' .* need a mesh of GPUs")
    with pytest.raises(ValueError, match=refusal):
        jax.jit(kernels)(x)
    f32_out = jax.shard_map(lambda x: jq.sp_row_dense(x, jax.numpy.ones((256, 128), jax.numpy.bfloat16), tp_axis="tp",
                                                      overlap="fused", out_dtype=jax.numpy.float32),
                            mesh=mesh, in_specs=jax.sharding.PartitionSpec(None, None, "tp"),
                            out_specs=jax.sharding.PartitionSpec(None, "tp"))
    with pytest.raises(ValueError, match=r"out_dtype: sp_row_dense with overlap='fused' writes x's dtype \(bfloat16\)"):
        jax.jit(f32_out)(x)
    with pytest.raises(ValueError, match="overlap: sp_row_dense takes 'off' or 'fused', got 'ring'"):
        jax.jit(jax.shard_map(lambda x: jq.sp_row_dense(x, jax.numpy.ones((256, 128), jax.numpy.bfloat16),
                                                        tp_axis="tp", overlap="ring"),
                              mesh=mesh, in_specs=jax.sharding.PartitionSpec(None, None, "tp"),
                              out_specs=jax.sharding.PartitionSpec(None, "tp")))(x)


def test_fused_per_rank_kernels_type_check_inside_shard_map(monkeypatch):
    """The per-rank fused layers with their kernels (impl="custom_call"), traced with gradients inside a
    check_vma shard_map on a (fsdp 2, tp 2) mesh (the kernels' outputs are typed as varying like their
    inputs, which the layers' custom VJP needs) and lowered for GPUs, with the device check told the CPU
    is a Hopper GPU."""
    import jax.numpy as jnp

    from jaxquant.tp import collective_gemm
    monkeypatch.setattr(collective_gemm, "device_problem", lambda device: None)
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
    x = jnp.ones((4, 512, 256), jnp.bfloat16)
    w1, w2 = jnp.ones((512, 256), jnp.bfloat16), jnp.ones((256, 512), jnp.bfloat16)

    def loss(x, w1, w2):
        for _ in range(2):   # two identical layers: their kernel calls share one traced kernel
            h = jq.sp_column_dense(x, w1, tp_axis="tp", overlap="fused", impl="custom_call")
            x = jq.sp_row_dense(jax.nn.gelu(h), w2, tp_axis="tp", overlap="fused", impl="custom_call")
        return jax.lax.psum(jnp.sum(x.astype(jnp.float32)), ("fsdp", "tp"))

    specs = (P("fsdp", "tp"), P("tp", None), P(None, "tp"))
    grads = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=specs, out_specs=specs,
                          check_vma=True)
    closed = jax.make_jaxpr(grads)(x, w1, w2)
    assert "wgmma" in str(closed)   # the kernels, not their plain-JAX schedule
    # 8 kernel calls (2 layers x forward and backward x 2 kernels), each a call of a jitted kernel; the
    # calls of one shape share one jaxpr, so the program lowered for GPUs (from the CPU) holds 4 Mosaic
    # GPU kernels, not 8 (their lowering dominated the training step's compile time)
    calls = [e for e in _eqns(closed.jaxpr) if e.primitive.name in ("jit", "pjit")
             and e.params["name"] in ("_gather_matmul_kernel", "_matmul_reduce_scatter_kernel")]
    assert len(calls) == 8
    lowered = jax.jit(grads).trace(x, w1, w2).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("@mosaic_gpu_v2") == 4


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)
