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


# the loop in the README command, the rest of the benchmarks' baselines in the extended tier (docs/development.md:
# the README command's time budget); run them with -m extended before changing a benchmark's baseline
@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.extended)],
                         ids=["plain-loop", "plain-scan"])
def test_bench_e2e_plain_keeps_adam_sharded(mesh, scan):
    a = bench_e2e.parse_args(["--tiny", "--layers", "1"])
    a.seq, a.batch = 16, 1          # the shapes that matter here are the parameters' (one layer's are every layer's)
    step, state = bench_e2e._make_plain(a, mesh, scan)
    _check(step, state, _e2e_batch(a, mesh), f"bench_e2e plain scan={scan}")


@pytest.mark.extended
def test_bench_flax_plain_keeps_adam_sharded(mesh):
    a = bench_flax.parse_args(["--tiny"])
    a.seq, a.batch, a.layers = 16, 1, 1
    step, state = bench_flax.make_flax_plain(a, mesh, scan=False)
    _check(step, state, _e2e_batch(a, mesh), "bench_flax flax-plain")


@pytest.mark.parametrize("model", ["einsum", pytest.param("dense-general", marks=pytest.mark.extended)])
def test_bench_flax_style_models_plain_keeps_adam_sharded(mesh, model):
    """bench_flax --model einsum / dense-general (tests/flax_styles.py's models at their CPU size)."""
    a = bench_flax.parse_args(["--tiny", "--model", model, "--layers", "1", "--batch", "1"])
    step, state = bench_flax.make_style_plain(a, mesh)
    _check(step, state, bench_flax.style_batch(a, mesh), f"bench_flax --model {model} flax-plain")


@pytest.mark.extended
def test_bench_convergence_plain_keeps_adam_sharded(mesh):
    from jaxquant.cli import llama as L

    a = argparse.Namespace(seed=0, steps=4, lr=1e-3)
    cfg = L.LlamaConfig(vocab=256, seq=16, dim=64, heads=4, ffn=128, layers=1)
    evaluator = bench_convergence.Evaluator(cfg, a.seed, [], mesh)
    train, state = bench_convergence.plain_train(a, cfg, mesh, bench_convergence.optimizer(a), evaluator)
    tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq + 1), 0, cfg.vocab, jnp.int32)
    _check(train, state, {"tokens": jax.device_put(tokens, NamedSharding(mesh, P("fsdp")))}, "bench_convergence")


def _flax_fp8_parts(state):
    """(params, fp8 meta, Adam state) of a bench_flax flax-fp8 state: linen's flax TrainState (every variable collection
    in ``params``) or NNX's ``((params, meta), opt_state)``."""
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

    if hasattr(state, "apply_gradients"):
        return state.params["params"], state.params[OVERWRITE_WITH_GRADIENT], state.opt_state
    (params, meta), opt_state = state
    return params, meta, opt_state


def _meta_leaves(meta, name):
    """The fp8 meta leaves whose path names ``name`` (one per FP8 op), as numpy arrays."""
    leaves = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(meta)[0]
              if name in jax.tree_util.keystr(tuple(path))]
    assert leaves, name
    return leaves


@pytest.mark.slow
@pytest.mark.extended   # a benchmark smoke (docs/development.md: the README command's time budget)
@pytest.mark.parametrize("model", ["dense-general", "llama", "einsum"])
def test_bench_flax_fp8_peer_is_fair_and_tracks_plain(mesh, model):
    """bench_flax's flax-fp8 (flax.linen.fp8_ops' Fp8DirectDotGeneralOp / Fp8Einsum; linen through dot_general_cls, NNX
    through nnx.bridge): Adam's moments sharded like the parameters, the fp8 meta variables replicated; its first loss
    within FP8's error of flax-plain's from the same parameters and batch; each step overwrites the meta variables
    with their gradient (the amax histories take the operands' amax, the scales follow from them), and it trains."""
    style = model != "llama"
    a = bench_flax.parse_args(["--tiny", "--model", model] + ["--layers", "1", "--batch", "1"] * style)
    batch = bench_flax.style_batch(a, mesh) if style else _e2e_batch(a, mesh)
    plain_step, plain_state = (bench_flax.make_style_plain(a, mesh) if style
                               else bench_flax.make_flax_plain(a, mesh, scan=False))
    _, plain_loss = plain_step(plain_state, batch)
    step, state = bench_flax.make_style_flax_fp8(a, mesh, "flax-fp8")
    params, meta, opt_state = _flax_fp8_parts(state)
    assert_moments_sharded_like_params(params, opt_state, f"{model} flax-fp8 after init")
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(meta)), model
    # initial meta: scales 1, histories 0 (so the first step quantizes with scale 1: delayed scaling has no amax yet)
    assert all(np.all(s == 1) for s in _meta_leaves(meta, "input_scale")), model
    state, first = step(state, batch)
    # FP8 operands (e4m3 at scale 1 in this first step) against bf16: well within 2% of the loss here
    assert float(first) == pytest.approx(float(plain_loss), rel=2e-2), (model, float(first), float(plain_loss))
    _, meta, _ = _flax_fp8_parts(state)
    for name in ("input_amax_history", "kernel_amax_history", "output_grad_amax_history"):
        assert all(h[0] > 0 and np.all(h[1:] == 0) for h in _meta_leaves(meta, name)), (model, name)
    state, second = step(state, batch)
    params, meta, opt_state = _flax_fp8_parts(state)
    assert all(np.all(s != 1) for s in _meta_leaves(meta, "kernel_scale")), model    # amax / e4m3's max, not 1
    # the history rolls one place left and takes the new amax first: the first step's amax is now the last entry
    assert all(h[0] > 0 and h[-1] > 0 for h in _meta_leaves(meta, "input_amax_history")), model
    assert float(second) < float(first), (model, float(first), float(second))
    assert_moments_sharded_like_params(params, opt_state, f"{model} flax-fp8 after two steps")
