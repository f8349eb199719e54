"""quantize_master_weights on real GPUs (2 or more): bit-exact against single-tensor quantization.

Skipped unless the default backend is a GPU with at least 2 devices (the CPU suite covers
S in {1, 2, 3, 4, 8} on simulated devices in tests/test_distributed.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxquant as jq
from jaxquant.layout import FlatLayout
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


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_master_weights_on_gpus_equal_single_tensor(name, recipe):
    layout = LAYOUTS[name]()
    rng = np.random.default_rng(len(name))
    ws = _weights(rng, layout.shapes)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    flat = jax.device_put(layout.flatten(ws), NamedSharding(mesh, P("fsdp")))
    out, report = jq.quantize_master_weights(flat, layout, mesh=mesh, recipe=recipe, columnwise=True,
                                             manual_post_all_gather_processing=False, check_finite=True)
    assert not bool(report.any())
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
