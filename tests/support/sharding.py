"""The check that a single-tensor quantizer runs sharded under ``jax.jit`` as docs/sharding.md states, on any
mesh (8 simulated CPU devices, 2 GPUs), and the inputs and meshes it runs on."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxquant as jq
from conftest import assert_bytes_equal
from support.hlo import collectives




def shards_of(mesh, spec) -> int:
    """How many blocks ``spec`` splits an array into on ``mesh``."""
    axes = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


def norm(spec, ndim: int, mesh=None) -> tuple:
    """PartitionSpec entries as tuples of axis names padded to ``ndim``; axes of size 1 (which
    split nothing, and XLA drops) left out when ``mesh`` is given."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out = []
    for e in entries:
        axes = () if e is None else (e if isinstance(e, tuple) else (e,))
        out.append(tuple(a for a in axes if mesh is None or mesh.shape[a] > 1))
    return tuple(out)


def transposed(spec) -> P:
    """The spec of the transpose of a 2-D array sharded by ``spec``."""
    entries = list(spec) + [None] * (2 - len(spec))
    return P(entries[1], entries[0])


QUANTIZERS = {
    "nvfp4": jax.jit(lambda v: jq.quantize_nvfp4(v, columnwise=True)),
    "fp8": jax.jit(lambda v: jq.quantize_fp8(v, columnwise=True)),
}


def check_quantizer_sharded(recipe: str, mesh, spec, x: np.ndarray) -> None:
    """Bytes equal to unsharded, no all-gather, one max all-reduce over the input's axes, output
    shardings as docs/sharding.md states (scale layouts aligned: x's shape chosen so)."""
    q = QUANTIZERS[recipe]
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    compiled = q.lower(xs).compile()
    out, ref = compiled(xs), q(x)
    for name in ("data", "scale_inv", "amax", "data_t") + (("scale_inv_t",) if recipe == "nvfp4" else ()):
        assert_bytes_equal(getattr(out, name), getattr(ref, name), f"{recipe} {spec} {name}")
    kinds = collectives(compiled.as_text())
    assert not [k for k in kinds if k[0] != "all-reduce"], f"{spec}: unexpected collectives {kinds}"
    n = shards_of(mesh, spec)
    if n > 1:
        assert len(kinds) == 1 and kinds[0][2] == n, f"{spec}: want one all-reduce over {n} devices, got {kinds}"
    same, swapped = norm(spec, 2, mesh), norm(transposed(spec), 2, mesh)
    assert norm(out.data.sharding.spec, 2, mesh) == same
    assert norm(out.data_t.sharding.spec, 2, mesh) == swapped
    assert norm(out.amax.sharding.spec, out.amax.ndim, mesh) == ((),) * out.amax.ndim
    if recipe == "nvfp4":
        assert norm(out.scale_inv.sharding.spec, 2, mesh) == same
        assert norm(out.scale_inv_t.sharding.spec, 2, mesh) == swapped


def two_axis_mesh(shape, names, explicit=False):
    """``jax.make_mesh`` of two axes, both Explicit or both Auto."""
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit if explicit else AxisType.Auto,) * 2)


def tiled_input(rows, cols, seed=0):
    """fp32 ``[rows, cols]`` normal values with a magnitude per 16x16 tile from 1e-3 to 1e3."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 3, size=(rows // 16, cols // 16))
    return (rng.standard_normal((rows, cols)) * np.kron(scale, np.ones((16, 16)))).astype(np.float32)


def one_shard_spec(**fields):
    """The ``fsdp.WeightSpec`` of a weight of one shard (nothing gathered, no amax reduction), its gradient reduced in
    bf16 at scale 1; ``fields`` (``recipe`` among them) replace any field."""
    from jaxquant.training import fsdp

    grad = fsdp.GradReduce(scale=1.0, main_dtype=np.dtype(np.float32), comm_dtype=np.dtype(jnp.bfloat16))
    return fsdp.WeightSpec(**({"gather_axis": None, "num_shards": 1, "amax_axes": (), "grad": grad} | fields))
