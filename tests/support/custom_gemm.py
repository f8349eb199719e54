"""What the tests of jaxquant's GEMM custom calls (``jq_fp8_gemm``, ``jq_bf16_gemm``) share: a CUDA registration
pretended on the CPU (to lower a program for CUDA and read which GEMM it calls), the programs compiled with each value
of a GEMM switch (``gemm.FP8_GEMM_IMPL`` / ``gemm.BF16_GEMM_IMPL``) on a GPU, and the bitwise comparison."""

import jax
import numpy as np

from jaxquant.primitives import _ffi, gemm
from support.bitwise import bits

# what layerwise.default_compiler_options sets on a GPU: the GEMMs compiled as the training step compiles them
STEP_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def pretend_cuda_target(monkeypatch, target: str, switch: str):
    """As if the CUDA extension had been built with cuBLASLt: ``target`` registered for CUDA (a program lowered for
    CUDA then holds the custom call; the CPU branch of the same program runs the reference), and ``gemm.<switch>``
    set to ``"cublaslt"``."""
    monkeypatch.setattr(_ffi, "_REGISTERED", dict(_ffi._REGISTERED, cuda=frozenset({target})))
    if "cuda" not in _ffi._MODULES:
        monkeypatch.setattr(_ffi, "_MODULES", dict(_ffi._MODULES, cuda=object()))
    monkeypatch.setattr(gemm, switch, "cublaslt")
    jax.clear_caches()


def switch_changes_no_byte(monkeypatch, switch: str, fn, *args):
    """``fn``'s results with ``gemm.<switch>`` as it is and with it "xla", traced afresh, equal bit for bit (on the CPU
    both run the reference where the custom call would run on CUDA)."""
    jax.clear_caches()
    on = jax.jit(fn)(*args)
    monkeypatch.setattr(gemm, switch, "xla")
    jax.clear_caches()
    off = jax.jit(fn)(*args)
    for u, v in zip(on, off):
        np.testing.assert_array_equal(bits(u), bits(v))


def lowered(fn, *args, platforms=("cuda",)):
    """The StableHLO text of ``fn`` lowered for ``platforms``, traced afresh."""
    jax.clear_caches()
    return jax.jit(fn).trace(*args).lower(lowering_platforms=platforms).as_text()


def compiled(switch: str, impl: str, fn, *args):
    """``fn`` jitted and compiled with ``gemm.<switch> = impl`` (traced afresh: the switch is read at trace time)."""
    saved = getattr(gemm, switch)
    setattr(gemm, switch, impl)
    try:
        jax.clear_caches()
        return jax.jit(fn).lower(*args).compile(STEP_OPTIONS)
    finally:
        setattr(gemm, switch, saved)


def both(switch: str, fn, *args):
    """(XLA's results, the custom call's results, XLA's compiled HLO, the custom call's) of ``fn``."""
    xla = compiled(switch, "xla", fn, *args)
    custom = compiled(switch, "cublaslt", fn, *args)
    return xla(*args), custom(*args), xla.as_text(), custom.as_text()


def same_bytes(x, y, what=""):
    """``x`` (XLA's) and ``y`` (the custom call's) equal bit for bit; otherwise how many elements differ, by how many
    ulp at most, and the first."""
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (what, x.dtype, y.dtype, x.shape, y.shape)
    bx, by = bits(x), bits(y)
    diff = np.flatnonzero(bx != by)
    if diff.size:
        first = np.unravel_index(diff[0], x.shape)
        ulps = np.abs(bx.astype(np.int64) - by.astype(np.int64)).reshape(-1)[diff]
        raise AssertionError(f"{what}: {diff.size} of {x.size} elements differ (at most {ulps.max()} ulp), first at "
                             f"{first}: {x[first]} (XLA) vs {y[first]} (custom call)")


def wrapped_gives_xlas_bytes(switch: str, target: str, product, a, b):
    """``product(x, b)``, the GEMM of one item ``x`` of ``a [batch, M, K]``, wrapped as the step wraps it (shard_map
    over a 1-device mesh, every axis manual; scan; remat) and under vmap (the op's batching rule, item by item): the
    custom call ``target`` is in both programs compiled with ``gemm.<switch>`` "cublaslt", with XLA's bytes."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))

    def scanned(a, b):
        body = jax.checkpoint(lambda c, x: (c, product(x, b)))
        return jax.lax.scan(body, 0, a)[1]

    sm = jax.shard_map(scanned, mesh=mesh, in_specs=(P(None, "fsdp"), P()), out_specs=P(None, "fsdp"))
    x, y, _, hlo = both(switch, sm, a, b)
    assert target in hlo
    same_bytes(x, y, "shard_map/scan/remat")
    x, y, _, hlo = both(switch, jax.vmap(lambda x: product(x, b)), a)
    assert target in hlo
    same_bytes(x, y, "vmap")
