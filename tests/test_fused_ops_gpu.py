"""GPU-only checks of the fused stages: custom calls captured into XLA command buffers (CUDA graphs)
give the same bytes as the uncaptured run. (Custom call == reference on the GPU is
tests/test_fused_ops.py, which runs unchanged there.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_bytes_equal, assert_bytes_equal_nan_aware, requires_gpu

ROOT = Path(__file__).resolve().parent.parent

# Runs the jitted quantizers once, saves every output's bytes to argv[1] (.npz), and prints, as
# JSON, which of the jaxquant custom calls the compiled program places inside command buffers.
_SCRIPT = r"""
import glob, json, os, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxquant as jq
from jaxquant.zero.layout import FlatLayout

x = jax.random.normal(jax.random.key(3), (512, 768), jnp.float32) * 3
def nvfp4(v): return jq.quantize_nvfp4(v, impl="custom_call")
def nvfp4_t(v): return jq.quantize_nvfp4(v, columnwise=True, impl="custom_call")
def fp8(v): return jq.quantize_fp8(v, impl="custom_call")
def fp8_t(v): return jq.quantize_fp8(v, columnwise=True, impl="custom_call")
# The master-weight step (grouped stats, scale, cast, split and the columnwise transposes) on a
# one-GPU mesh; odd offsets (align 3) and a weight off the 16-grid in K.
mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
layout = FlatLayout([(256, 512), (96, 80), (512, 256), (48, 1040)], 1, align=3)
rng = np.random.default_rng(0)
flat = jax.device_put(layout.flatten([rng.standard_normal(s).astype(np.float32) * 4 for s in layout.shapes]),
                      NamedSharding(mesh, P("fsdp")))
def step(v, recipe):
    return jq.quantize_master_weights(v, layout, mesh=mesh, recipe=recipe, columnwise=True,
                                      manual_post_all_gather_processing=False, check_finite=True, impl="custom_call")
def step_nvfp4_t(v): return step(v, "nvfp4")
def step_fp8_t(v): return step(v, "fp8")
dump = sys.argv[2]
arrays, captured = {}, {}
for name, fn, arg in (("nvfp4", nvfp4, x), ("nvfp4_t", nvfp4_t, x), ("fp8", fp8, x), ("fp8_t", fp8_t, x),
                      ("step_nvfp4_t", step_nvfp4_t, flat), ("step_fp8_t", step_fp8_t, flat)):
    compiled = jax.jit(fn).lower(arg).compile()
    n_calls = len(re.findall(r'custom_call_target="jq_', compiled.as_text()))
    # XLA forms command buffers on the thunk sequence (JAX 0.11): the dump after the thunk passes
    # lists a kCommandBuffer thunk with the captured thunks indented under it.
    # (with command buffers off XLA may skip the thunk passes and write no such dump: nothing captured)
    seqs = glob.glob(os.path.join(dump, f"*jit_{fn.__name__}.thunk_sequence_after_thunk_passes.txt"))
    inside, in_cb = (0 if seqs else None), False
    for line in open(seqs[0]) if seqs else ():
        if not line.startswith(" "):
            in_cb = "kCommandBuffer" in line
        elif in_cb and "kCustomCall" in line:
            inside += 1
    captured[name] = [n_calls, inside]
    out = jax.tree_util.tree_leaves(compiled(arg))
    for i, leaf in enumerate(out):
        arrays[f"{name}_{i}"] = np.atleast_1d(np.asarray(leaf)).view(np.uint8)
np.savez(sys.argv[1], **arrays)
print("CAPTURED " + json.dumps(captured))
"""


def _run(flags: str, out: Path) -> dict:
    dump = out.with_suffix(".dump")
    flags = f"{flags} --xla_dump_to={dump}"
    # the pytest process already holds most of the GPU's memory: the child allocates as it goes
    env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(out), str(dump)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CAPTURED ")][-1]
    return json.loads(line[len("CAPTURED "):])


@pytest.mark.gpu
@requires_gpu
def test_command_buffer_capture_gives_identical_bytes(tmp_path):
    """With FUSION,CUSTOM_CALL command buffers (minimum graph size 1) every jq_ custom call of the
    quantizers and of the master-weight step (grouped stages, split and the grouped transposes, which
    take their output pointers from kernel parameters) is captured (the handlers declare
    kCmdBufferCompatible), and every output byte equals the run with command buffers off."""
    captured = _run("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
                    tmp_path / "graph.npz")
    plain = _run("--xla_gpu_enable_command_buffer=", tmp_path / "plain.npz")
    # [jq_ custom calls in the compiled module, custom-call thunks inside command buffers]
    # two launches per quantizer; the step's 5 (NVFP4: tile amax, scale, cast, split, columnwise) and
    # 4 (FP8: amax, cast, transpose, split)
    want = {"nvfp4": 2, "nvfp4_t": 2, "fp8": 2, "fp8_t": 2, "step_nvfp4_t": 5, "step_fp8_t": 4}
    assert captured == {k: [n, n] for k, n in want.items()}, f"custom calls inside command buffers: {captured}"
    assert all(inside in (0, None) for _, inside in plain.values()), f"command buffers off, yet captured: {plain}"
    a, b = np.load(tmp_path / "graph.npz"), np.load(tmp_path / "plain.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) >= 30
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _large_fp8_input(dtype):
    """[5001, 7001] values (an odd count: a scalar tail after the 16-byte vectors; large enough that
    every thread of the resident grid runs full rounds of in-flight loads) with non-finite values
    and values that round to inf in bf16 spread over the vector body and the tail."""
    import jax.numpy as jnp

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((5001, 7001)) * 3).astype(np.float32)
    flat = x.reshape(-1)
    n = flat.size
    specials = np.array([np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.39e38, 1e-40, -0.0], np.float32)
    for k, at in enumerate((1, 12_345, n // 3 + 5, n // 2, n - 9_000_000, n - 70_001, n - 3, n - 1)):
        flat[at] = specials[k]
    return jnp.asarray(x).astype(dtype)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("compute", ["none", "bf16"])
def test_fp8_stats_and_cast_large_custom_equals_reference(dtype_name, compute):
    """At a size where the FP8 statistics kernel runs its unpredicated multi-load rounds and the
    suspect-vector path (inf/NaN/overflowing values) inside them, and the rowwise cast its warp
    spans: amax, count and the FP8 bytes equal the reference; then the same without specials."""
    import jax
    import jax.numpy as jnp
    from jaxquant.primitives import ops

    cdt = None if compute == "none" else jnp.bfloat16
    stats = jax.jit(ops.fp8_stats, static_argnames=("compute_dtype", "impl"))
    cast = jax.jit(ops.fp8_quantize, static_argnames=("compute_dtype", "impl"))
    x = _large_fp8_input(jnp.dtype(dtype_name))
    finite = jnp.where(jnp.isfinite(x) & (jnp.abs(x) < 1e38), x, jnp.zeros_like(x))
    for name, v in (("specials", x), ("finite", finite)):
        ref = stats(v, compute_dtype=cdt, impl="reference")
        cus = stats(v, compute_dtype=cdt, impl="custom_call")
        assert_bytes_equal(cus[0], ref[0], f"{name} amax")
        assert_bytes_equal(cus[1], ref[1], f"{name} count")
        amax = jnp.float32(5.0)
        ref_q = cast(v, amax, compute_dtype=cdt, impl="reference")
        cus_q = cast(v, amax, compute_dtype=cdt, impl="custom_call")
        for i, (a, b) in enumerate(zip(jax.tree_util.tree_leaves(cus_q), jax.tree_util.tree_leaves(ref_q))):
            assert_bytes_equal_nan_aware(a, b, f"{name} fp8_quantize output {i}")


@pytest.mark.gpu
@requires_gpu
def test_nvfp4_quantize_e2m1_every_fp32_in_decision_range():
    """Every fp32 value with 0.125 <= |x| < 8 (all E2M1 rounding decisions, both signs) through the
    CUDA quantize with an encode multiplier of exactly 1 (tile amax 6, global amax 2688, as in
    test_nvfp4_quantize_e2m1_rounding_sweep): the packed codes equal the reference's."""
    import jax.numpy as jnp
    from jaxquant.primitives import ops

    mags = np.arange(0x3E000000, 0x41000000, dtype=np.uint32)  # [2^-3, 2^3)
    x = np.concatenate([mags, mags | np.uint32(0x80000000)]).view(np.float32).reshape(-1, 4096)
    rows, cols = x.shape
    tiles = jnp.full((rows // 16, cols // 16), 6.0, jnp.float32)
    amax = jnp.asarray([2688.0], jnp.float32)
    xj = jnp.asarray(x)
    ref = ops.nvfp4_quantize(xj, tiles, amax, compute_dtype=None, impl="reference")
    cus = ops.nvfp4_quantize(xj, tiles, amax, compute_dtype=None, impl="custom_call")
    assert_bytes_equal(cus[0], ref[0], "data")
    assert_bytes_equal(cus[1], ref[1], "scale_inv")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("rows,cols", [(70_048, 1040), (140_000, 16)], ids=["70048x1040", "140000x16"])
def test_nvfp4_bf16_grid_stride_custom_equals_reference(rows, cols):
    """bf16 input with more 64-row block items than the GPU holds at once, so every block of the
    NVFP4 stats kernel walks several items (rows not a multiple of 64; K = 1040 not a multiple of the
    512-column block span, 1,095 items x 3 column blocks; K = 16, 2,188 items in one column block,
    small enough for the sanitizer): stats, and the quantize's rowwise and columnwise bytes (one
    item per block) from them, equal the reference."""
    import jax.numpy as jnp
    from jaxquant.primitives import ops

    rng = np.random.default_rng(5)
    tile_scale = np.exp2(rng.integers(-8, 8, (rows // 16, 1, cols // 16, 1))).astype(np.float32)
    x = (rng.standard_normal((rows // 16, 16, cols // 16, 16), np.float32) * tile_scale).reshape(rows, cols)
    x[rows - 1, cols - 16:] = -0.0                 # a signed-zero row segment in the last item
    v = jnp.asarray(x).astype(jnp.bfloat16)
    ref_stats = ops.nvfp4_stats(v, impl="reference")
    cus_stats = ops.nvfp4_stats(v, impl="custom_call")
    for field, a, b in zip(("tile_amax", "amax", "count"), cus_stats, ref_stats):
        assert_bytes_equal(a, b, field)
    tiles, amax, _ = ref_stats
    ref = ops.nvfp4_quantize(v, tiles, amax, columnwise=True, impl="reference")
    cus = ops.nvfp4_quantize(v, tiles, amax, columnwise=True, impl="custom_call")
    for field, a, b in zip(("data", "scale_inv", "data_t", "scale_inv_t"), cus, ref):
        assert_bytes_equal(a, b, field)
    rows_only = ops.nvfp4_quantize(v, tiles, amax, impl="custom_call")
    assert_bytes_equal(rows_only[0], ref[0], "data (rowwise only)")
    assert_bytes_equal(rows_only[1], ref[1], "scale_inv (rowwise only)")
