"""Sharding rules of the single-tensor quantizers on 2 real GPUs (tp=2 and fsdp=2 meshes).

The same checks as tests/test_sharding.py on the CUDA custom calls: bytes equal the unsharded
result, compiled HLO has no all-gather and one max all-reduce over the axes that shard the input,
outputs sharded like the input (columnwise transposed). Skipped unless the default backend is a GPU
with at least 2 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
from support.hlo import collectives
from support.sharding import check_quantizer_sharded, tiled_input, two_axis_mesh

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu" or len(jax.devices()) < 2,
                                 reason="needs a GPU backend with 2+ GPUs")]

MESHES = {"tp2": ((1, 2), ("fsdp", "tp")), "fsdp2": ((2, 1), ("fsdp", "tp"))}
SPECS = [P("tp", None), P(None, "tp"), P(("tp", "fsdp"), None), P("fsdp", "tp"), P("fsdp", None)]


def _two_gpu_mesh(name):
    shape, names = MESHES[name]
    return two_axis_mesh(shape, names)


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_quantizer_sharded_on_gpus(mesh_name, spec, recipe):
    # [1024, 768]: 512 rows / 384 columns per GPU, aligned to the 128x4 scale layout (K/16 = 48)
    check_quantizer_sharded(recipe, _two_gpu_mesh(mesh_name), spec, tiled_input(1024, 768, seed=7))


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_check_finite_sharded_on_gpus(recipe):
    quant = jq.quantize_nvfp4 if recipe == "nvfp4" else jq.quantize_fp8
    mesh = _two_gpu_mesh("tp2")
    x = tiled_input(256, 256, seed=8)
    x[0, 0], x[255, 255] = np.nan, np.inf
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
    compiled = jax.jit(lambda v: quant(v, check_finite=True)).lower(xs).compile()
    (_, count), (_, count_ref) = compiled(xs), quant(jnp.asarray(x), check_finite=True)
    assert int(count) == int(count_ref) == 2
    assert not [k for k in collectives(compiled.as_text()) if k[0] != "all-reduce"]
