"""make_train_step on 2+ GPUs: gradients travel in grad_comm_dtype in the *compiled* HLO (XLA:GPU keeps
bf16 collectives, unlike XLA:CPU), the FP8 step's GEMMs are FP8 GEMMs, and every strategy
trains the same as on one rank's reference math (covered bitwise on the CPU by test_train_strategies.py;
here: equal across strategies)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from support import hlo

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu" or len(jax.devices()) < 2, reason="needs 2+ GPUs")]

D = 256


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"up": jax.random.normal(k1, (4 * D, D), jnp.float32) / 16, "norm": jnp.ones((D,), jnp.float32),
            "down": jax.random.normal(k2, (D, 4 * D), jnp.float32) / 32}


def _loss(w, b):
    h = jax.nn.gelu(jq.dense(b["x"] * w["norm"], w["up"], out_dtype=jnp.bfloat16))
    return jnp.mean((jq.dense(h, w["down"], out_dtype=jnp.float32) - b["y"]) ** 2)


def _batch(n):
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (n, D), jnp.bfloat16), "y": jax.random.normal(ky, (n, D), jnp.float32)}


def _mesh():
    return Mesh(np.array(jax.devices()), ("fsdp",))


def _collective_dtypes(hlo: str, op: str) -> set:
    """Element types of every ``op`` (e.g. reduce-scatter, also its async -start form) in compiled HLO."""
    kinds = set()
    for line in hlo.splitlines():
        if re.search(rf"\b{op}(-start)?\(", line):
            kinds |= set(re.findall(r"\b(bf16|f32)\[", line.split("=", 1)[1].split(op)[0]))
    return kinds


@pytest.mark.parametrize("strategy,op", [("optim_grads_params", "reduce-scatter"), ("no_shard", "all-reduce")])
def test_grad_comm_dtype_in_compiled_hlo(strategy, op):
    n = 16 * len(jax.devices())
    for comm, want in ((jnp.bfloat16, "bf16"), (None, "f32")):
        step = jq.make_train_step(_loss, optax.sgd(0.1), mesh=_mesh(), strategy=strategy, microbatches=2,
                                  policy=jq.MixedPrecisionPolicy(compute_weights="nvfp4", grad_comm_dtype=comm))
        hlo = step.lower(step.init(_params()), _batch(n)).compile().as_text()
        assert want in _collective_dtypes(hlo, op), (comm, _collective_dtypes(hlo, op))
        if comm is None:
            assert "bf16" not in _collective_dtypes(hlo, op)


def test_fp8_train_step_gemms_are_fp8():
    """Every GEMM of the FP8 step (2 layers x forward, dgrad, wgrad) takes FP8 operands. At these small
    shapes XLA may pick a Triton FP8 GEMM over cuBLASLt; tests/test_dense_gpu.py asserts cuBLASLt's
    ``__cublas$lt$matmul$f8`` at 4096^3."""
    n = 16 * len(jax.devices())
    step = jq.make_train_step(_loss, optax.sgd(0.1), mesh=_mesh(),
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))
    gemms = hlo.gemms(step.lower(step.init(_params()), _batch(n)).compile().as_text())
    # cuBLASLt's FP8 target names its operand types (the call site's operands print untyped)
    fp8 = [g for g in gemms if g[0].endswith("$f8") or any(t.startswith("f8") for t in g[1])]
    assert len(fp8) >= 6 and len(fp8) == len(gemms), gemms


def test_strategies_agree_on_gpu():
    """The four strategies are modes of one step: those that reduce gradients with the same collective (all-reduce:
    no_shard, optim; reduce-scatter: optim_grads, optim_grads_params) agree bitwise; across the two, NCCL's fp32
    summation orders differ, so after 2 SGD steps within bf16 rounding of dW (2^-8 of the largest update)."""
    n = 16 * len(jax.devices())
    out, init = {}, _params()
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        step = jq.make_train_step(_loss, optax.sgd(0.1), mesh=_mesh(), strategy=strategy,
                                  policy=jq.MixedPrecisionPolicy(compute_weights="nvfp4"))
        state = step.init(init)
        for _ in range(2):
            state, m = step(state, _batch(n))
        out[strategy] = jax.tree.map(np.asarray, step.params(state))
    for a, b in (("optim", "no_shard"), ("optim_grads", "optim_grads_params")):
        for name in out[a]:
            np.testing.assert_array_equal(out[a][name], out[b][name], err_msg=f"{a} vs {b}: {name}")
    for name in out["no_shard"]:
        update = float(np.max(np.abs(out["optim_grads_params"][name] - np.asarray(init[name]))))
        np.testing.assert_allclose(out["no_shard"][name], out["optim_grads_params"][name], rtol=0,
                                   atol=2 ** -8 * update, err_msg=name)
