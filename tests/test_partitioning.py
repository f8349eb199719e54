"""jaxquant.primitives.partitioning internals: decoding an undecoded sharding into mesh-axis names
axis by axis, same names as the former search over every axis order and assignment."""

from __future__ import annotations

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxquant.primitives import partitioning

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices: run with "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py sets it)")


class Undecoded:
    """A sharding as the partitioner hands it over: not a NamedSharding, only its placement."""

    def __init__(self, named: NamedSharding):
        self._named = named

    def shard_shape(self, shape):
        return self._named.shard_shape(shape)

    def devices_indices_map(self, shape):
        return self._named.devices_indices_map(shape)


def brute_force_as_named(sharding, mesh, shape):
    """The former ``_as_named`` search (every order of the mesh axes x every assignment of axes to
    dimensions, first match wins); None where nothing matches."""
    shape = tuple(shape)
    if tuple(sharding.shard_shape(shape)) == shape:
        return NamedSharding(mesh, P())
    want = sharding.devices_indices_map(shape)
    names = tuple(mesh.axis_names)
    for order in itertools.permutations(names):
        for dims in itertools.product(range(len(shape) + 1), repeat=len(order)):
            spec = [tuple(a for a, d in zip(order, dims) if d == i) for i in range(len(shape))]
            candidate = NamedSharding(mesh, P(*(e if e else None for e in spec)))
            if candidate.devices_indices_map(shape) == want:
                return candidate
    return None


def _mesh(sizes, names, devices=None):
    devices = np.asarray(jax.devices()[:8] if devices is None else devices)
    return Mesh(devices.reshape(sizes), names)


def _every_spec(mesh, ndim):
    """Every PartitionSpec splitting ``ndim`` dimensions over whole axes of ``mesh`` (each axis used at
    most once, in any order within a dimension)."""
    names = tuple(mesh.axis_names)
    specs = set()
    for order in itertools.permutations(names):
        for dims in itertools.product(range(ndim + 1), repeat=len(order)):
            specs.add(tuple(tuple(a for a, d in zip(order, dims) if d == i) for i in range(ndim)))
    return [P(*(e if e else None for e in spec)) for spec in sorted(specs)]


SMALL_MESHES = [
    ((2, 4), ("x", "y")),
    ((4, 2), ("y", "x")),
    ((2, 2, 2), ("a", "b", "c")),
    ((2, 1, 4), ("a", "one", "b")),
    ((1, 8), ("one", "fsdp")),
    ((2, 1, 2, 2), ("a", "one", "b", "c")),
]


# every small mesh at rank 2 and 3, except rank 3 on the 4-axis mesh, where the brute-force reference takes minutes
CASES = [(sizes, names, shape) for sizes, names in SMALL_MESHES for shape in ((16, 32), (8, 16, 24))
         if len(shape) + len(names) <= 6]


@pytest.mark.parametrize("sizes,names,shape", CASES, ids=[f"{s}-rank{len(sh)}" for s, _, sh in CASES])
def test_as_named_matches_a_brute_force_search(sizes, names, shape):
    mesh = _mesh(sizes, names)
    for spec in _every_spec(mesh, len(shape)):
        given = Undecoded(NamedSharding(mesh, spec))
        got = partitioning._as_named(given, mesh, shape)
        want = brute_force_as_named(given, mesh, shape)
        assert want is not None
        assert got.spec == want.spec, f"{spec}: {got.spec} != brute force {want.spec}"
        assert got.devices_indices_map(shape) == given.devices_indices_map(shape)


# Devices in an order no split over whole axes of a 2 x 2 x 2 (or 2 x 4, 8) mesh gives: the first
# half is the devices of even bit parity.
PARITY = [0, 3, 5, 6, 1, 2, 4, 7]


def _unmatched(mesh):
    """Placements that are not splits over whole axes of ``mesh``: a split over a sub-axis (the major
    half of an axis of size 4), and splits over a mesh with the devices in another order."""
    out = []
    sizes, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    if 4 in sizes:
        k = sizes.index(4)
        sub = _mesh(sizes[:k] + (2, 2) + sizes[k + 1:], names[:k] + ("major", "minor") + names[k + 1:],
                    mesh.devices.flat)
        out.append(Undecoded(NamedSharding(sub, P("major"))))
    shuffled = _mesh(sizes, names, np.asarray(mesh.devices.flat)[PARITY])
    big = tuple(a for a, n in zip(names, sizes) if n > 1)
    out += [Undecoded(NamedSharding(shuffled, P(big[0]))), Undecoded(NamedSharding(shuffled, P(big)))]
    return out


@pytest.mark.parametrize("sizes,names", SMALL_MESHES, ids=[str(s) for s, _ in SMALL_MESHES])
def test_unmatched_sharding_is_an_error_like_before(sizes, names):
    mesh, shape = _mesh(sizes, names), (16, 32)
    for given in _unmatched(mesh):
        assert brute_force_as_named(given, mesh, shape) is None
        with pytest.raises(ValueError, match="is not a split over whole axes of the mesh"):
            partitioning._as_named(given, mesh, shape)


TEN_AXES = ((2, 1, 1, 2, 1, 1, 1, 2, 1, 1), tuple(f"a{i}" for i in range(10)))


def test_ten_axis_mesh_unmatched_errors_quickly():
    """10 mesh axes (a MaxText-sized mesh; 8 devices, so 7 axes of size 1): the former search went
    through 10! orders x 3^10 assignments before its error."""
    mesh = _mesh(*TEN_AXES)
    shape = (16, 32)
    shuffled = _mesh(*TEN_AXES, devices=np.asarray(jax.devices()[:8])[PARITY])
    unmatched = [Undecoded(NamedSharding(shuffled, P("a0", "a3"))),
                 Undecoded(NamedSharding(shuffled, P(("a0", "a3", "a7")))),
                 Undecoded(NamedSharding(shuffled, P("a7", ("a3", "a0"))))]
    for given in unmatched:
        start = time.perf_counter()
        with pytest.raises(ValueError, match="is not a split over whole axes of the mesh"):
            partitioning._as_named(given, mesh, shape)
        assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("spec,want", [
    # size-1 axes land on dimension 0, in mesh order (where the former search put them first)
    (P("a0", "a3"), P(("a0", "a1", "a2", "a4", "a5", "a6", "a8", "a9"), "a3")),
    (P(None, ("a7", "a0")), P(("a1", "a2", "a4", "a5", "a6", "a8", "a9"), ("a7", "a0"))),
    (P(("a7", "a0"), "a3"), P(("a1", "a2", "a4", "a5", "a6", "a7", "a0", "a8", "a9"), "a3")),
])
def test_ten_axis_mesh_matched_quickly(spec, want):
    mesh, shape = _mesh(*TEN_AXES), (16, 32)
    given = Undecoded(NamedSharding(mesh, spec))
    start = time.perf_counter()
    got = partitioning._as_named(given, mesh, shape)
    assert time.perf_counter() - start < 1.0
    assert got.spec == want
    assert got.devices_indices_map(shape) == given.devices_indices_map(shape)


def test_as_named_passes_named_and_replicated_through():
    mesh = _mesh(*TEN_AXES)
    named = NamedSharding(mesh, P("a3"))
    assert partitioning._as_named(named, mesh, (16, 32)) is named
    assert partitioning._as_named(Undecoded(NamedSharding(mesh, P())), mesh, (16, 32)).spec == P()


# ----------------------------------------------------------------------------------------------
# custom_partitioning / custom_vmap objects: built once per op and static configuration
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def built(monkeypatch):
    """Lists of the custom_partitioning / custom_vmap objects partitioning builds, caches emptied."""
    made = {"cp": [], "vmap": []}

    def counting(kind, cls):
        def make(*args, **kwargs):
            obj = cls(*args, **kwargs)
            made[kind].append(obj)
            return obj
        return make

    monkeypatch.setattr(partitioning, "custom_partitioning", counting("cp", partitioning.custom_partitioning))
    monkeypatch.setattr(partitioning, "custom_vmap", counting("vmap", partitioning.custom_vmap))
    partitioning._batched.cache_clear()
    partitioning._partitioned.cache_clear()
    yield made
    partitioning._batched.cache_clear()
    partitioning._partitioned.cache_clear()


def test_same_static_config_reuses_the_partitioning_objects(built):
    from jaxquant.primitives import ops
    mesh = _mesh((2, 4), ("tp", "fsdp"))
    x = jax.device_put(np.ones((64, 128), np.float32), NamedSharding(mesh, P("tp", "fsdp")))
    stats = lambda v: ops.nvfp4_stats(v, compute_dtype=None, impl="reference")
    first = jax.make_jaxpr(stats)(x)
    second = jax.make_jaxpr(stats)(x)   # a second trace of the same call
    assert len(built["cp"]) == 1 and len(built["vmap"]) == 1
    assert str(first) == str(second)
    # the compiled, sharded call runs on the cached objects and keeps its result
    out = jax.jit(stats)(x)
    ref = ops.nvfp4_stats(np.ones((64, 128), np.float32), compute_dtype=None, impl="reference")
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(built["cp"]) == 1 and len(built["vmap"]) == 1

    jax.make_jaxpr(lambda v: ops.nvfp4_stats(v, compute_dtype=None, impl="reference"))(x[:32])  # new shape
    assert len(built["cp"]) == 2 and len(built["vmap"]) == 1
    jax.make_jaxpr(lambda v: ops.nvfp4_stats(v, compute_dtype=jnp.bfloat16, impl="reference"))(x)  # new kwargs
    assert len(built["cp"]) == 3 and len(built["vmap"]) == 2
    jax.make_jaxpr(stats)(x)
    assert len(built["cp"]) == 3 and len(built["vmap"]) == 2


def test_static_key_tells_types_apart_and_refuses_unhashable():
    key = partitioning._static_key
    assert key({"a": 1, "b": "x"}) == key({"b": "x", "a": 1})
    assert key({"eps": 0}) != key({"eps": 0.0}) and key({"flag": True}) != key({"flag": 1})
    assert key({"shape": (1, 2)}) != key({"shape": (1.0, 2)})
    assert key({"xs": [1, 2]}) is None


def test_unhashable_static_config_runs_uncached(built):
    """A keyword argument that cannot key the cache: the objects are built per call."""
    from jaxquant.primitives import ops
    x = np.ones((64, 128), np.float32)
    calls = []
    original = partitioning._static_key
    try:
        partitioning._static_key = lambda kwargs: calls.append(kwargs) or None
        jax.make_jaxpr(lambda v: ops.nvfp4_stats(v, compute_dtype=None, impl="reference"))(x)
        jax.make_jaxpr(lambda v: ops.nvfp4_stats(v, compute_dtype=None, impl="reference"))(x)
    finally:
        partitioning._static_key = original
    assert len(calls) == 2 and len(built["cp"]) == 2 and len(built["vmap"]) == 2
