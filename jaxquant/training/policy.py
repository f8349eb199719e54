"""What the training step is built from: the mixed-precision policy, what each strategy shards, the train
state, the non-finite report and small helpers (``jaxquant.training.layerwise`` builds the step)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxquant.primitives import formats


class Sharded(NamedTuple):
    """What a data-parallel strategy splits over the FSDP axis (one training step runs them all)."""

    optimizer: bool   # the fp32 master and the optimizer state (ZeRO-1)
    grads: bool       # + gradients: reduce-scattered each microbatch, shard-sized accumulators (ZeRO-2)
    params: bool      # + compute weights: quantized and gathered where each layer uses them (ZeRO-3)


# Megatron-FSDP's names for ZeRO 0-3
STRATEGY_SHARDING = {"no_shard": Sharded(False, False, False), "optim": Sharded(True, False, False),
                     "optim_grads": Sharded(True, True, False), "optim_grads_params": Sharded(True, True, True)}
STRATEGIES = tuple(STRATEGY_SHARDING)
MASTER_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
COMPUTE_DTYPE = formats.COMPUTE_DTYPE


# ----------------------------------------------------------------------------------------------
# Policy
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of a training step (Megatron-FSDP's mixed-precision controls).

    Args:
      main_params_dtype: master weights and optimizer inputs, float32 (default) or bfloat16.
      main_grads_dtype: gradient accumulation over microbatches and the optimizer's gradient (float32 default).
      grad_comm_dtype: the dtype gradients travel in (None: ``main_grads_dtype``).
      compute_weights: what layers read for quantized leaves: ``"bf16"`` (default), ``"fp8"`` or ``"nvfp4"``.
    """

    main_params_dtype: Any = jnp.float32
    main_grads_dtype: Any = jnp.float32
    grad_comm_dtype: Any = None
    compute_weights: str = "bf16"

    def __post_init__(self):
        for name, allowed in (("main_params_dtype", MASTER_DTYPES), ("main_grads_dtype", GRAD_DTYPES),
                              ("grad_comm_dtype", GRAD_DTYPES)):
            value = getattr(self, name)
            if value is None and name == "grad_comm_dtype":
                continue
            try:
                dt = jnp.dtype(value)
            except TypeError:
                raise TypeError(f"{name}: must be a dtype, got {value!r}") from None
            if dt not in allowed:
                raise ValueError(f"{name}: must be one of {[str(a) for a in allowed]}, got {dt}")
            object.__setattr__(self, name, dt)
        if self.compute_weights not in formats.RECIPES:
            raise ValueError(f"compute_weights: must be one of {formats.RECIPES}, got {self.compute_weights!r}")

    @property
    def comm_dtype(self):
        return self.main_grads_dtype if self.grad_comm_dtype is None else self.grad_comm_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """The training state of ``make_train_step``: ``master``, the main params (a pytree like ``params``, each
    leaf sharded over ``fsdp_axis`` except with ``no_shard``); ``opt_state``, the optimizer's state (sharded
    like ``master``); ``step``, int32 steps taken (replicated); ``plan``, the static per-leaf rules;
    ``weight_amax``, a list with one entry per leaf: the amax of each layer of an FP8 or NVFP4 compute weight's
    master (but those ``quantize_once`` quantizes), after bf16 rounding (replicated), which the step that
    wrote the master computed after its update (precomputed scales: the next step's casts reduce no amax over ranks,
    and FP8's make no amax pass of their own), None for the other leaves. ``make_train_step``'s
    ``init``, its steps and ``load_state_dict`` fill it; a state whose ``master`` is replaced by hand needs
    ``step.refresh_amax(state)``."""

    master: Any
    opt_state: Any
    step: jax.Array
    plan: Any = dataclasses.field(metadata=dict(static=True))
    weight_amax: Any = None


def _explain_tp_errors(fn, tp_axis):
    """``fn`` whose JAX type error for a TP-local weight applied to a TP-replicated activation names the fix."""
    if tp_axis is None:
        return fn

    def wrapped(*args):
        try:
            return fn(*args)
        except ValueError as e:
            if "manual axis types do not match" not in str(e):
                raise
            raise ValueError(f"loss_fn: a TP-split weight met an activation that is the same on every {tp_axis!r} "
                             f"rank; mark the input of a column-parallel dense as varying over {tp_axis!r} first "
                             f"(jax.lax.pcast(x, {tp_axis!r}, to='varying')) and psum row-parallel outputs over "
                             f"it ({e})") from e

    return wrapped


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def raise_if_nonfinite(metrics) -> None:
    """Raise ``FloatingPointError`` naming every parameter whose gradient was non-finite.

    Args:
      metrics: the metrics of a step built with ``make_train_step(..., report_nan=True)`` (the step skipped the
        update), or a ``NonFiniteReport`` of ``quantize_master_weights`` (non-finite master weights).

    Raises:
      FloatingPointError: naming the parameters; ValueError: metrics without a non-finite report. Reads device
      values.
    """
    if callable(getattr(metrics, "raise_if_nonfinite", None)):   # a NonFiniteReport (duck typed: no import cycle)
        return metrics.raise_if_nonfinite()
    if not isinstance(metrics, dict) or "nonfinite" not in metrics:
        raise ValueError("metrics: has no 'nonfinite' entry; build the step with make_train_step(..., report_nan=True)")
    flags = jax.tree_util.tree_flatten_with_path(jax.device_get(metrics["nonfinite"]))[0]
    bad = [_leaf_name(path) for path, flag in flags if bool(flag)]
    if bad:
        raise FloatingPointError(f"non-finite (NaN or ±inf) gradient in parameter(s) {', '.join(bad)}; "
                                 f"the update of this step was skipped")


def value_and_grad_over_microbatches(grad_fn, diff, batch, k: int, to_main, zeros, loss0):
    """(mean loss, gradients in the main dtype) of ``grad_fn(diff, microbatch)`` over ``k`` microbatches cut
    from ``batch``'s leading axis, summed in a ``lax.scan``; the loss may be a pytree (the step's statistics).
    ``zeros()`` / ``loss0()`` start the sums (called only when ``k > 1``; they carry the mesh axes the sums
    vary over)."""
    if k == 1:
        loss, grads = grad_fn(diff, batch)
        return loss, to_main(grads)
    mbs = jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), batch)

    def accumulate(carry, mb):
        loss_sum, acc = carry
        loss, grads = grad_fn(diff, mb)
        return (jax.tree.map(jnp.add, loss_sum, loss), jax.tree.map(jnp.add, acc, to_main(grads))), None

    (loss, grads), _ = jax.lax.scan(accumulate, (loss0(), zeros()), mbs)
    return jax.tree.map(lambda a: a / k, loss), grads


def apply_update(optimizer, grads, state: TrainState, master_sharding, opt_sharding, nonfinite=None):
    """(new master, new optimizer state, ok): one optax update of ``state``'s master, both outputs sharded as
    the inputs (``opt_sharding(opt_state)`` gives the optimizer state's), so the donated buffers are reused.
    With ``nonfinite`` (per-parameter flags) a step whose gradient has a NaN or inf keeps master and state."""
    master = state.master
    updates, opt_state = optimizer.update(grads, state.opt_state, master)
    new_master = jax.tree.map(lambda p, u: (p + u.astype(p.dtype)).astype(p.dtype), master, updates)
    new_master = jax.lax.with_sharding_constraint(new_master, master_sharding)
    opt_state = jax.lax.with_sharding_constraint(opt_state, opt_sharding(opt_state))
    if nonfinite is None:
        return new_master, opt_state, None
    ok = jnp.logical_not(jnp.any(nonfinite))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    return keep(new_master, master), keep(opt_state, state.opt_state), ok
