"""Every jaxquant custom call tells XLA's latency-hiding scheduler its estimated time (the frontend attribute
``latency_metadata``, nanoseconds; ``jaxquant.primitives._ffi.LATENCY_HINTS``, on unless ``JAXQUANT_LATENCY_HINTS=0``):
the memory-bound ops the bytes they move at HBM bandwidth, the GEMMs their FLOPs at a GEMM rate. Without it XLA takes
a custom call for a few microseconds and plans the collectives that should run under jaxquant's GEMMs as if nothing
could hide them (tests/test_schedule_gpu.py)."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant.primitives import _ffi, ops
from jaxquant.primitives.ops import single


def hints(text: str, target: str) -> list[int]:
    """The ``latency_metadata`` of each custom call of ``target`` in lowered (StableHLO) or compiled (HLO) text."""
    calls = re.findall(rf"custom_call(?:_target=\"|\s*@){target}\b.*", text)
    return [int(m) for c in calls for m in re.findall(r'latency_metadata\s*=\s*"(\d+)"', c)]


needs_cpu_extension = pytest.mark.skipif("cpu" not in _ffi.built_platforms(), reason="needs the compiled CPU extension")


@pytest.fixture
def hints_on(monkeypatch):
    monkeypatch.setattr(_ffi, "LATENCY_HINTS", True)


@needs_cpu_extension
def test_a_memory_bound_call_carries_its_bytes_at_hbm_bandwidth_into_the_compiled_program(hints_on):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((512, 1024)), jnp.float32)
    step = jax.jit(lambda v: ops.amax(v, impl="custom_call"))
    out = jax.eval_shape(lambda v: ops.amax(v, impl="custom_call"), x)
    want = _ffi.memory_bound_ns(x, *jax.tree.leaves(out))
    assert want == int((x.size * 4 + sum(o.size * o.dtype.itemsize for o in jax.tree.leaves(out))) / 4000.0)
    assert hints(step.lower(x).as_text(), "jq_amax") == [want]
    # XLA keeps the attribute on the instruction its scheduler reads
    assert hints(step.lower(x).compile().as_text(), "jq_amax") == [want]


@needs_cpu_extension
@pytest.mark.parametrize("setting, hinted", [(None, True), ("1", True), ("0", False)])
def test_on_by_default_and_off_with_the_environment_variable(setting, hinted):
    """Read at import: a fresh process per setting (None: the variable unset)."""
    env = {k: v for k, v in os.environ.items() if k != "JAXQUANT_LATENCY_HINTS"}
    if setting is not None:
        env["JAXQUANT_LATENCY_HINTS"] = setting
    code = ("import jax, jax.numpy as jnp\n"
            "from jaxquant.primitives import ops\n"
            "x = jnp.ones((64, 128), jnp.float32)\n"
            "print(jax.jit(lambda v: ops.amax(v, impl='custom_call')).lower(x).as_text())\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "jq_amax" in out.stdout
    assert ("latency_metadata" in out.stdout) == hinted


@pytest.mark.parametrize("m, n, k, bound", [(8192, 14336, 4096, "flops"), (16, 4096, 4096, "bytes")])
def test_gemm_estimate_is_flops_at_the_gemm_rate_or_its_bytes_if_longer(m, n, k, bound):
    a = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
    b = jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn)
    out = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    ns = single.gemm_ns(a, b, out, single.FP8_GEMM_FLOPS_PER_NS)
    flops_ns = int(2 * m * n * k / single.FP8_GEMM_FLOPS_PER_NS)
    bytes_ns = _ffi.memory_bound_ns(a, b, out)
    assert ns == max(flops_ns, bytes_ns)
    assert (flops_ns > bytes_ns) == (bound == "flops")


def test_the_fp8_gemm_custom_call_carries_its_estimate(monkeypatch, hints_on):
    """Lowered as on CUDA (the target need not be registered to lower): the call of each device's rows carries
    ``gemm_ns`` of its shapes."""
    monkeypatch.setattr(_ffi, "require", lambda target: None)
    a = jnp.ones((256, 512), jnp.float8_e4m3fn)
    b = jnp.ones((1024, 512), jnp.float8_e4m3fn)
    s = jnp.float32(1.0)
    text = jax.jit(lambda x, y: ops.fp8_gemm(x, y, s, s, impl="custom_call")).lower(a, b).as_text()
    out = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    assert hints(text, "jq_fp8_gemm") == [single.gemm_ns(a, b, out, single.FP8_GEMM_FLOPS_PER_NS)]
