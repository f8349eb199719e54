"""Train an MLP with NVFP4 / FP8 weights cast each step from ZeRO-sharded fp32 master weights.

``jq.make_train_step`` keeps the fp32 master weights (and the optax state) sharded over the ``fsdp`` mesh
axis (layer-wise FSDP by default; ``--strategy optim`` etc. keep flat ZeRO buffers). Each layer's ``jq.dense``
casts its master shard to NVFP4 (or FP8) bytes and all-gathers only those bytes, multiplies (FP8: float8
GEMMs; NVFP4: bf16 GEMMs on the exactly dequantized blocks), and its backward reduce-scatters the
straight-through gradient; then the master shards are updated.

Run on 8 simulated CPU devices (without the XLA flag a CPU shows one device, and the mesh has one rank;
the script prints how many devices it uses):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python3 examples/train_loop.py --steps 50
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxquant as jq


def make_problem(key, dims, batch):
    """A random teacher MLP (fixed) whose outputs the student learns to reproduce."""
    keys = jax.random.split(key, len(dims))
    teacher = {f"layer{i}": jax.random.normal(k, (dout, din), jnp.float32) / np.sqrt(din)
               for i, (k, din, dout) in enumerate(zip(keys[1:], dims[:-1], dims[1:]))}
    x = jax.random.normal(keys[0], (batch, dims[0]), jnp.float32)
    return {"x": x, "y": mlp(teacher, x)}


def mlp(weights, x):
    """Weights are PyTorch-convention [out, in]: arrays, Float8Tensors or NVFP4Tensors."""
    n = len(weights)
    for i in range(n):
        x = jq.dense(x, weights[f"layer{i}"], out_dtype=jnp.float32)
        if i + 1 < n:
            x = jax.nn.gelu(x)
    return x


def loss_fn(weights, batch):
    return jnp.mean((mlp(weights, batch["x"]) - batch["y"]) ** 2)


def init_masters(key, dims):
    keys = jax.random.split(key, len(dims) - 1)
    return {f"layer{i}": jax.random.normal(k, (dout, din), jnp.float32) / np.sqrt(din)
            for i, (k, din, dout) in enumerate(zip(keys, dims[:-1], dims[1:]))}


def train(steps=50, num_shards=None, recipe="nvfp4", dims=(64, 128, 96, 32), batch=96, lr=3e-3,
          strategy="optim_grads_params", seed=0, log_every=10, verbose=True):
    """Runs the loop; returns (losses, step, final state)."""
    devices = jax.devices()
    num_shards = num_shards or len(devices)
    mesh = jax.sharding.Mesh(np.array(devices[:num_shards]), ("fsdp",))
    if verbose:
        print(f"{num_shards} of {len(devices)} {devices[0].platform} devices on the fsdp axis, {recipe} weights, "
              f"strategy {strategy}")
    k_data, k_init = jax.random.split(jax.random.key(seed))
    data = make_problem(k_data, dims, batch)
    step = jq.make_train_step(loss_fn, optax.adam(lr), mesh=mesh, strategy=strategy,
                              policy=jq.MixedPrecisionPolicy(compute_weights=recipe))
    state = step.init(init_masters(k_init, dims))
    losses = []
    for i in range(steps):
        state, metrics = step(state, data)
        losses.append(float(metrics["loss"]))
        if verbose and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.6f}")
    return losses, step, state


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--recipe", choices=("nvfp4", "fp8", "bf16"), default="nvfp4")
    ap.add_argument("--shards", type=int, default=None, help="fsdp size (default: all devices)")
    ap.add_argument("--strategy", default="optim_grads_params",
                    choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
    args = ap.parse_args()
    losses, *_ = train(args.steps, args.shards, args.recipe, strategy=args.strategy)
    print(f"loss: {losses[0]:.6f} -> {losses[-1]:.6f}")


if __name__ == "__main__":
    main()
