"""quantize_master_weights on real GPUs (2 or more): bit-exact against single-tensor quantization.

Skipped unless the default backend is a GPU with at least 2 devices (the CPU suite covers
S in {1, 2, 3, 4, 8} on simulated devices in tests/test_distributed.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxquant as jq
from jaxquant.zero.layout import FlatLayout
from conftest import assert_bytes_equal

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu" or len(jax.devices()) < 2,
                                 reason="needs 2+ GPUs")]


def _weights(rng, shapes):
    return [(rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32) for m, k in shapes]


LAYOUTS = {
    "llama_like_align128": lambda: FlatLayout([(1024, 512), (256, 512), (256, 512), (1792, 512), (512, 1792)],
                                              len(jax.devices()), align=128),
    "odd_offsets": lambda: FlatLayout.from_param_offsets([(48, 80), (16, 16), (144, 48)], [3, 3846, 4103],
                                                         len(jax.devices())),
    "align1_odd_shards": lambda: FlatLayout([(16, 48), (32, 80), (16, 16)], len(jax.devices())),
}


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_master_weights_on_gpus_equal_single_tensor(name, recipe, split):
    """split=False: the GatheredWeights' weights, cut out inside jit, have the same bytes."""
    layout = LAYOUTS[name]()
    rng = np.random.default_rng(len(name))
    ws = _weights(rng, layout.shapes)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    flat = jax.device_put(layout.flatten(ws), NamedSharding(mesh, P("fsdp")))
    out, report = jq.quantize_master_weights(flat, layout, mesh=mesh, recipe=recipe, columnwise=True,
                                             manual_post_all_gather_processing=False, check_finite=True, split=split)
    assert not bool(report.any())
    if not split:
        out = jax.jit(lambda g: g.tensors())(out)
    single = jq.quantize_nvfp4 if recipe == "nvfp4" else jq.quantize_fp8
    for p, (q, w) in enumerate(zip(out, ws)):
        want = single(jnp.asarray(w), columnwise=True)
        for field in ("data", "scale_inv", "amax", "data_t") + (("scale_inv_t",) if recipe == "nvfp4" else ()):
            assert_bytes_equal(getattr(q, field), getattr(want, field), f"{name} param {p} {field}")


def test_check_finite_on_gpus_names_parameter_and_shard():
    layout = FlatLayout([(32, 32), (64, 16)], len(jax.devices()))
    ws = _weights(np.random.default_rng(1), layout.shapes)
    ws[1][5, 3] = np.nan
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    flat = jax.device_put(layout.flatten(ws), NamedSharding(mesh, P("fsdp")))
    _, report = jq.quantize_master_weights(flat, layout, mesh=mesh, check_finite=True)
    owner = (layout.param_offsets[1] + 5 * 16 + 3) // layout.shard_size
    counts = np.asarray(report.counts)
    assert counts[owner, 1] == 1 and counts.sum() == 1
    with pytest.raises(FloatingPointError, match=f"shard {owner}"):
        report.raise_if_nonfinite()


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_fsdp_tp_on_gpus_equal_single_tensor(recipe):
    """tp = 2 (fsdp = the other devices): aligned TP splits of both kinds and a TP-replicated weight
    equal whole-tensor quantization; one all-reduce over both axes, one all-gather over fsdp (none
    when fsdp = 1)."""
    tp = 2
    fsdp = len(jax.devices()) // tp
    mesh = Mesh(np.array(jax.devices()[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))
    shapes, tp_dims = [(512, 256), (256, 512), (96, 80)], [0, 1, None]
    layout = FlatLayout(shapes, fsdp, align=3, tp_size=tp, tp_dims=tp_dims)
    ws = _weights(np.random.default_rng(5), shapes)
    master = jax.device_put(layout.flatten(ws), jq.master_sharding(mesh, "fsdp", tp_axis="tp"))
    f = jax.jit(lambda x: jq.quantize_master_weights(x, layout, mesh=mesh, tp_axis="tp", recipe=recipe,
                                                     columnwise=True, manual_post_all_gather_processing=False))
    hlo = f.lower(master).compile().as_text()
    assert hlo.count(" all-reduce-start(") + hlo.count(" all-reduce(") == 1
    # (on 2 GPUs fsdp = 1: nothing to gather)
    assert hlo.count(" all-gather-start(") + hlo.count(" all-gather(") == (1 if fsdp > 1 else 0)
    out = f(master)
    single = jq.quantize_nvfp4 if recipe == "nvfp4" else jq.quantize_fp8
    for p, (q, w, d) in enumerate(zip(out, ws, tp_dims)):
        if d is not None:
            want_spec = P("tp", None) if d == 0 else P(None, "tp")
            assert q.data.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 2)
        want = single(jnp.asarray(w), columnwise=True)
        for field in ("data", "scale_inv", "amax", "data_t") + (("scale_inv_t",) if recipe == "nvfp4" else ()):
            assert_bytes_equal(getattr(q, field), getattr(want, field), f"tp param {p} {field}")


def test_custom_call_count_on_gpus_independent_of_parameter_count():
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    counts = []
    for n in (7, 300):
        layout = FlatLayout([(16, 32)] * n, len(jax.devices()))
        flat = jax.device_put(jnp.zeros((layout.total_size,), jnp.float32), NamedSharding(mesh, P("fsdp")))
        f = jax.jit(lambda x: jq.quantize_master_weights(x, layout, mesh=mesh, columnwise=True,
                                                         manual_post_all_gather_processing=False))
        counts.append(f.lower(flat).compile().as_text().count(" custom-call("))
    assert counts[0] == counts[1], counts
