"""tests/flax_styles.py's two models (NNX with nnx.Einsum attention and a tied embedding; linen with nn.DenseGeneral
attention and logical axis names), plain flax without jaxquant: they have the kernels of their style, start at about
log(vocab) and learn a fixed batch under plain optax steps; dropout draws its masks from the rng it is given."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import flax_styles as fs  # noqa: E402


def _train(loss, params, batch, steps=6, lr=3e-3):
    """Losses of ``steps`` plain Adam steps on ``batch``, the first at ``params``."""
    opt = optax.adam(lr)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = opt.init(params), []
    for _ in range(steps):
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
    return losses


def _assert_learns(losses, vocab):
    assert all(math.isfinite(v) for v in losses), losses
    # at init the next token is about uniform over the vocabulary (logits of about unit spread add ~0.5)
    assert abs(losses[0] - math.log(vocab)) < 1.0, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses


def test_nnx_einsum_model_has_einsum_kernels_and_learns():
    cfg = fs.EINSUM_SMALL
    assert cfg.kv_heads == 1       # multi-query: the query heads share one kv head
    model = fs.nnx_einsum_model(cfg)
    attn = model.layers[0].attn
    assert isinstance(model.layers, list) and len(model.layers) == cfg.layers
    assert isinstance(attn.q, nnx.Einsum) and attn.q.kernel.shape == (cfg.heads, cfg.dim, cfg.head_dim)
    assert attn.k.kernel.shape == attn.v.kernel.shape == (1, cfg.dim, cfg.head_dim)
    assert attn.out.kernel.shape == (cfg.heads, cfg.head_dim, cfg.dim)
    assert not hasattr(model, "head")          # the embedding is the head
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p, b: fs.nnx_einsum_loss(nnx.merge(graphdef, p, rest), b)
    _assert_learns(_train(loss, params, fs.example_batch(cfg)), cfg.vocab)


def test_nnx_einsum_model_with_grouped_kv_heads():
    cfg = dataclasses.replace(fs.EINSUM_SMALL, kv_heads=2)
    model = fs.nnx_einsum_model(cfg)
    assert model.layers[0].attn.k.kernel.shape == (2, cfg.dim, cfg.head_dim)
    assert math.isfinite(float(fs.nnx_einsum_loss(model, fs.example_batch(cfg))))


def test_nnx_einsum_dropout_follows_its_rng():
    batch = fs.example_batch(fs.EINSUM_SMALL)
    model = fs.nnx_einsum_model(dataclasses.replace(fs.EINSUM_SMALL, dropout=0.3))
    loss = lambda seed: float(fs.nnx_einsum_loss(model, batch, rng=jax.random.key(seed)))
    assert loss(1) != loss(2)
    assert loss(1) == loss(1)          # the masks are the rng's, nothing else's
    # rate 0 (the benchmarks'): the rng changes nothing
    plain = fs.nnx_einsum_model(fs.EINSUM_SMALL)
    assert float(fs.nnx_einsum_loss(plain, batch, rng=jax.random.key(1))) == \
        float(fs.nnx_einsum_loss(plain, batch, rng=jax.random.key(2)))


def test_linen_dense_general_model_has_logical_kernels_and_learns():
    cfg = fs.DENSE_GENERAL_SMALL
    variables = fs.linen_dense_general_init(cfg)
    p = variables["params"]
    attn = p["layers_0"]["attn"]
    assert attn["query"]["kernel"].names == ("embed", "heads", "kv")
    assert attn["query"]["kernel"].value.shape == (cfg.dim, cfg.heads, cfg.head_dim)
    assert attn["key"]["kernel"].value.shape == (cfg.dim, cfg.kv_heads, cfg.head_dim)
    assert attn["out"]["kernel"].value.shape == (cfg.heads, cfg.head_dim, cfg.dim)
    assert attn["out"]["kernel"].names == ("heads", "kv", "embed")
    assert p["head"]["kernel"].value.shape == (cfg.dim, cfg.vocab) and p["head"]["kernel"].names == ("embed", "vocab")
    assert p["embed"]["embedding"].names == ("vocab", "embed")
    # every parameter is annotated
    boxed = jax.tree.leaves(p, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert boxed and all(isinstance(x, nn.LogicallyPartitioned) for x in boxed)
    assert dict(fs.LOGICAL_RULES)["batch"] == "fsdp" and {v for k, v in fs.LOGICAL_RULES if k != "batch"} == {None}
    loss = functools.partial(fs.linen_dense_general_loss, cfg=cfg)
    _assert_learns(_train(loss, nn.unbox(variables), fs.example_batch(cfg)), cfg.vocab)


def test_gpu_configs_have_the_benchmark_shapes():
    a = fs.einsum_gpu_config()
    model = nnx.eval_shape(lambda: fs.nnx_einsum_model(a))
    assert (a.layers, a.dim, a.heads, a.head_dim, a.kv_heads, a.mlp, a.vocab, a.seq) == \
        (6, 2048, 8, 256, 1, 16384, 32768, 2048) and a.dropout == 0.0
    assert model.layers[0].attn.q.kernel.shape == (8, 2048, 256) and model.embed.embedding.shape == (32768, 2048)
    b = fs.dense_general_gpu_config()
    shapes = jax.eval_shape(lambda: nn.unbox(fs.linen_dense_general_init(b)))["params"]
    assert len([k for k in shapes if k.startswith("layers_")]) == 4
    assert shapes["layers_0"]["attn"]["query"]["kernel"].shape == (4096, 32, 128)
    assert shapes["layers_0"]["attn"]["key"]["kernel"].shape == (4096, 8, 128)
    assert shapes["layers_0"]["mlp"]["gate"]["kernel"].shape == (4096, 14336)
    assert shapes["head"]["kernel"].shape == (4096, 128256)
    # matmul_params counts every matrix a token multiplies: the models' parameters less norms and an untied lookup
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    norms = lambda tree: sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
                             if "norm" in jax.tree_util.keystr(path))
    params = nnx.state(model, nnx.Param)
    assert a.matmul_params() == count(params) - norms(params)
    assert b.matmul_params() == count(shapes) - norms(shapes) - b.vocab * b.dim
    assert jnp.dtype(a.dtype) == jnp.dtype(b.dtype) == jnp.bfloat16
