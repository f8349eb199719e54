"""ZeRO-sharded fp32 master weights + optax, with NVFP4 / FP8 model weights re-quantized every step.

The fp32 master weights of a small MLP live in one flat buffer sharded ``P("fsdp")`` (each device holds
1/S of it, and so does the optax state). Each step:

1. ``quantize_master_weights`` turns the master shards into full NVFP4 (or FP8) weights: per-shard
   partial amaxes, one max all-reduce, per-shard partial casts, one all-gather of quantized bytes;
2. the forward pass uses the dequantized weights (a straight-through estimator: the gradient with
   respect to the dequantized weight is applied to the master weight);
3. the gradients are laid into the flat layout and sharded like the masters (a reduce-scatter under
   jit), and optax updates the master shards.

Run (8 simulated CPU devices):
    JAXQUANT_REFERENCE_ONLY=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        PYTHONPATH=. python3 examples/train_loop.py --steps 50
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxquant.distributed import quantize_master_weights
from jaxquant.layout import FlatLayout


def make_problem(key, dims, batch):
    """A random teacher MLP (fixed) whose outputs the student learns to reproduce."""
    keys = jax.random.split(key, len(dims))
    teacher = [jax.random.normal(k, (dout, din), jnp.float32) / np.sqrt(din)
               for k, din, dout in zip(keys[1:], dims[:-1], dims[1:])]
    x = jax.random.normal(keys[0], (batch, dims[0]), jnp.float32)
    return x, mlp(teacher, x)


def mlp(weights, x):
    """PyTorch convention: weights are [out, in]."""
    for i, w in enumerate(weights):
        x = x @ w.T
        if i + 1 < len(weights):
            x = jax.nn.gelu(x)
    return x


def init_masters(key, dims):
    keys = jax.random.split(key, len(dims) - 1)
    return [jax.random.normal(k, (dout, din), jnp.float32) / np.sqrt(din)
            for k, din, dout in zip(keys, dims[:-1], dims[1:])]


def build(mesh, layout, optimizer, recipe, impl="auto"):
    """Returns (init_fn, step_fn); step_fn(master_flat, opt_state, x, y) -> (master, state, loss, weights)."""
    master_sharding = NamedSharding(mesh, P("fsdp"))

    @jax.jit
    def init_fn(master_flat):
        return optimizer.init(master_flat)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_fn(master_flat, opt_state, x, y):
        weights = quantize_master_weights(master_flat, layout, mesh=mesh, recipe=recipe, impl=impl)
        deq = [w.dequantize(jnp.float32) for w in weights]

        def loss_fn(ws):
            return jnp.mean((mlp(ws, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(deq)
        # straight-through: d loss / d master = d loss / d dequantized weight, laid out flat
        g = jax.lax.with_sharding_constraint(layout.flatten(grads, jnp.float32), master_sharding)
        updates, opt_state = optimizer.update(g, opt_state, master_flat)
        master_flat = optax.apply_updates(master_flat, updates)
        return master_flat, opt_state, loss, weights

    return init_fn, step_fn


def train(steps=50, num_shards=None, recipe="nvfp4", dims=(64, 128, 96, 32), batch=64, lr=3e-3,
          impl="auto", seed=0, log_every=10, verbose=True):
    """Runs the loop; returns (losses, final master flat, layout, mesh, weights of the last step)."""
    devices = jax.devices()
    num_shards = num_shards or len(devices)
    mesh = jax.sharding.Mesh(np.array(devices[:num_shards]), ("fsdp",))
    k_data, k_init = jax.random.split(jax.random.key(seed))
    x, y = make_problem(k_data, dims, batch)
    masters = init_masters(k_init, dims)
    layout = FlatLayout([m.shape for m in masters], num_shards, align=1,
                        names=[f"layer{i}" for i in range(len(masters))])
    master_flat = jax.device_put(layout.flatten(masters), NamedSharding(mesh, P("fsdp")))

    optimizer = optax.adam(lr)
    init_fn, step_fn = build(mesh, layout, optimizer, recipe, impl)
    opt_state = init_fn(master_flat)
    losses, weights = [], None
    for i in range(steps):
        master_flat, opt_state, loss, weights = step_fn(master_flat, opt_state, x, y)
        losses.append(float(loss))
        if verbose and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.6f}")
    return losses, master_flat, layout, mesh, weights


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--recipe", choices=("nvfp4", "fp8"), default="nvfp4")
    ap.add_argument("--shards", type=int, default=None, help="fsdp size (default: all devices)")
    ap.add_argument("--impl", default="auto", choices=("auto", "reference", "custom_call"))
    args = ap.parse_args()
    losses, *_ = train(args.steps, args.shards, args.recipe, impl=args.impl)
    print(f"loss: {losses[0]:.6f} -> {losses[-1]:.6f}")


if __name__ == "__main__":
    main()
