"""With ``jaxquant.primitives._ffi.LATENCY_HINTS`` (``JAXQUANT_LATENCY_HINTS=1``) every jaxquant custom call tells
XLA's latency-hiding scheduler its estimated time (the frontend attribute ``latency_metadata``, nanoseconds): the
memory-bound ops the bytes they move at HBM bandwidth, the GEMMs their FLOPs at a GEMM rate. Without it XLA takes a
custom call for a few microseconds and plans the collectives that should run under jaxquant's GEMMs as if nothing
could hide them."""

import os
import re

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
@pytest.mark.skipif(os.environ.get("JAXQUANT_LATENCY_HINTS") == "1", reason="JAXQUANT_LATENCY_HINTS=1 turns them on")
def test_no_hint_by_default():
    x = jnp.ones((64, 128), jnp.float32)
    text = jax.jit(lambda v: ops.amax(v, impl="custom_call")).lower(x).as_text()
    assert "jq_amax" in text and "latency_metadata" not in text


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
