"""The plain (no jaxquant) baselines of benchmarks/bench_e2e.py, bench_flax.py and bench_convergence.py are fair: on 8
simulated devices, each one's Adam moments are sharded like their parameters after init and stay so after a step
(a bare ``jax.jit(opt.init)(params)`` returns them whole on one device, which these checks catch after init)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pytest.importorskip("flax")
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_convergence  # noqa: E402
import bench_e2e  # noqa: E402
import bench_flax  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) != 8:
        pytest.skip("needs 8 (simulated) devices")
    return Mesh(np.array(jax.devices()), ("fsdp",))


def _moments_of(params, opt_state):
    """[(name, moment, its parameter)] for every optimizer-state leaf whose key path ends with a parameter's key path
    (Adam's mu and nu hold the parameters' tree), the longest such parameter path when several end it."""
    by_path = {tuple(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        ends = [p for p in by_path if len(p) <= len(path) and tuple(path[len(path) - len(p):]) == p]
        if ends:
            p = max(ends, key=len)
            out.append((jax.tree_util.keystr(tuple(path)), leaf, by_path[p]))
    return out


def assert_moments_sharded_like_params(params, opt_state, where):
    moments = _moments_of(params, opt_state)
    n_params = len(jax.tree.leaves(params))
    # Adam: a mu and a nu per parameter, nothing else in the state shaped like the parameter tree
    assert len(moments) == 2 * n_params, (where, len(moments), n_params)
    for name, m, p in moments:
        assert m.shape == p.shape, (where, name, m.shape, p.shape)
        assert m.sharding.is_equivalent_to(p.sharding, m.ndim), (where, name, m.sharding, p.sharding)
    # the check means something only where parameters are split: the kernels (and embeddings) are, over fsdp
    split = [name for name, m, p in moments if not p.sharding.is_fully_replicated]
    assert len(split) >= len(moments) // 2, (where, split)
    others = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
              if jax.tree_util.keystr(tuple(path)) not in {name for name, _, _ in moments}]
    assert all(leaf.sharding.is_fully_replicated for leaf in others), where      # the step counts


def _check(step, state, batch, where):
    params, opt_state = state
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    assert_moments_sharded_like_params(params, opt_state, f"{where} after init")
    state, loss = step(state, batch)
    assert np.isfinite(float(loss)), where
    params, opt_state = state
    for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings)):
        assert p.sharding.is_equivalent_to(s, p.ndim), where
    assert_moments_sharded_like_params(params, opt_state, f"{where} after a step")


def _e2e_batch(a, mesh):
    shape = (a.batch * mesh.size, a.seq, a.hidden)
    kx, ky = jax.random.split(jax.random.key(0))
    return jax.device_put({"x": jax.random.normal(kx, shape, jnp.bfloat16),
                           "y": jax.random.normal(ky, shape, jnp.float32)}, NamedSharding(mesh, P("fsdp")))


@pytest.mark.parametrize("scan", [False, True], ids=["plain-loop", "plain-scan"])
def test_bench_e2e_plain_keeps_adam_sharded(mesh, scan):
    a = bench_e2e.parse_args(["--tiny", "--layers", "1"])
    a.seq, a.batch = 16, 1          # the shapes that matter here are the parameters' (one layer's are every layer's)
    step, state = bench_e2e._make_plain(a, mesh, scan)
    _check(step, state, _e2e_batch(a, mesh), f"bench_e2e plain scan={scan}")


def test_bench_flax_plain_keeps_adam_sharded(mesh):
    a = bench_flax.parse_args(["--tiny"])
    a.seq, a.batch, a.layers = 16, 1, 1
    step, state = bench_flax.make_flax_plain(a, mesh, scan=False)
    _check(step, state, _e2e_batch(a, mesh), "bench_flax flax-plain")


@pytest.mark.parametrize("model", ["einsum", "dense-general"])
def test_bench_flax_style_models_plain_keeps_adam_sharded(mesh, model):
    """bench_flax --model einsum / dense-general (tests/flax_styles.py's models at their CPU size)."""
    a = bench_flax.parse_args(["--tiny", "--model", model, "--layers", "1", "--batch", "1"])
    step, state = bench_flax.make_style_plain(a, mesh)
    _check(step, state, bench_flax.style_batch(a, mesh), f"bench_flax --model {model} flax-plain")


def test_bench_convergence_plain_keeps_adam_sharded(mesh):
    from jaxquant.cli import llama as L

    a = argparse.Namespace(seed=0, steps=4, lr=1e-3)
    cfg = L.LlamaConfig(vocab=256, seq=16, dim=64, heads=4, ffn=128, layers=1)
    evaluator = bench_convergence.Evaluator(cfg, a.seed, [], mesh)
    train, state = bench_convergence.plain_train(a, cfg, mesh, bench_convergence.optimizer(a), evaluator)
    tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq + 1), 0, cfg.vocab, jnp.int32)
    _check(train, state, {"tokens": jax.device_put(tokens, NamedSharding(mesh, P("fsdp")))}, "bench_convergence")
