"""Mixed-precision data-parallel training: ``make_train_step`` (one step for every ZeRO strategy),
``MixedPrecisionPolicy``, ``TrainState`` and ``raise_if_nonfinite``.

The fp32 (main) parameters stay a pytree like ``params``, each leaf sharded on its own
(``jaxquant.training.layerwise``). The four strategies (Megatron-FSDP's names for ZeRO 0-3) are modes of that one step;
they differ only in what is split over ``fsdp_axis`` (``jaxquant.training.policy.STRATEGY_SHARDING``):

=====================  ==========================  ==================================  ===========================
strategy               master + optimizer state    gradients                           compute weights
=====================  ==========================  ==================================  ===========================
``no_shard``           replicated                  all-reduced once a step             cast once a step
``optim``              sharded                     all-reduced once a step             gathered once a step
``optim_grads``        sharded                     reduce-scattered per microbatch     gathered once a step
``optim_grads_params`` sharded (default)           reduce-scattered per microbatch     gathered where each layer
                                                                                       uses them (FSDP)
=====================  ==========================  ==================================  ===========================

Every mode quantizes the same leaves (``quantize_mask``; stacked ``[L, out, in]`` leaves layer by layer, each
with its own scales), takes the same ``param_specs`` / ``tp_axis`` / ``replicate_axis`` and ``compiler_options``,
and has ``state_dict`` / ``load_state_dict``. "Gathered once a step" means before the first microbatch: the
compute weights are whole on every rank for the step (ZeRO-2's memory), and the quantized bytes are what
travels. With gradients reduced once a step, each rank accumulates its unreduced gradient over the full rows
of every leaf (ZeRO-1's memory) and the sum over ranks happens once, in ``grad_comm_dtype``.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jaxquant.training.layerwise import LayerwiseTrainStep, default_compiler_options
from jaxquant.training.policy import STRATEGIES, MixedPrecisionPolicy


_DEFAULT = object()


def make_train_step(loss_fn, optimizer, *, mesh, policy: Optional[MixedPrecisionPolicy] = None,
                    strategy: str = "optim_grads_params", microbatches: int = 1, report_nan: bool = False,
                    param_specs=None, fsdp_axis: str = "fsdp", tp_axis: Optional[str] = None,
                    replicate_axis: Optional[str] = None, quantize_mask=None, compiler_options=_DEFAULT,
                    reshard_after_forward: bool = True, rules=None, has_aux: bool = False,
                    weighted_loss: bool = False, quantize_once: bool | None = None):
    """A jitted data-parallel training step with quantized compute weights.

    Args:
      loss_fn: ``loss_fn(weights, batch[, rng=key][, extra=tree]) -> loss``, run per rank: ``weights`` is a pytree
        like ``params`` whose quantized leaves are ``jq.ShardedWeight`` (one layer's weight, or a stack to
        ``jax.lax.scan`` over) that ``jq.dense`` reads, and whose other leaves are arrays (bf16 for masked
        matrices, else the main dtype); ``batch`` is the rank's microbatch; ``rng`` / ``extra`` only when the
        step is called with them. ``loss`` is a scalar, ``(loss, aux)`` with ``has_aux``, and with
        ``weighted_loss`` ``(sum of the per-token losses, sum of their weights)`` in place of the scalar.
      optimizer: an optax ``GradientTransformation``.
      mesh: a ``jax.sharding.Mesh`` with ``fsdp_axis``; other axes of size > 1 must be ``tp_axis`` or
        ``replicate_axis``.
      policy: a ``MixedPrecisionPolicy`` (default: fp32 master and gradients, bf16 compute weights).
      strategy: ``"no_shard"``, ``"optim"``, ``"optim_grads"`` or ``"optim_grads_params"`` (default: layer-wise
        FSDP); what each shards is in this module's docstring.
      microbatches: gradient-accumulation steps per call (the rank's batch is cut into this many).
      report_nan: count non-finite gradients per parameter (``metrics["nonfinite"]``) and skip such updates.
      param_specs: with ``tp_axis``, a pytree like ``params`` of ``"col"`` / ``"row"`` / None (or 0 / 1 / None):
        how each weight splits over the TP axis; ``loss_fn`` does the TP collectives itself.
      fsdp_axis: the data-parallel mesh axis the state is sharded over.
      tp_axis: the tensor-parallel mesh axis, or None.
      replicate_axis: HSDP: parameters replicated over this axis, the batch split over it and ``fsdp_axis``.
      quantize_mask: optax's mask convention (a pytree of bools like ``params``, a prefix of it whose bool covers a
        subtree, or a callable ``params -> pytree``): leaves masked False stay unquantized arrays.
      compiler_options: XLA options of the step's executable (default: on GPU, cuBLAS GEMMs instead of Triton
        fusions; None: XLA's defaults).
      reshard_after_forward: PyTorch FSDP2's switch, ``optim_grads_params`` only: True (default) keeps no
        gathered weight past its layer's forward and gathers it again for the backward; False keeps it until
        its backward (one gather per layer and step instead of two).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (a pytree of float arrays, e.g. accuracy, MoE losses)
        comes back as ``metrics["aux"]``, averaged over microbatches and data-parallel ranks like the loss.
      weighted_loss: ``loss_fn`` returns ``(loss_sum, weight_sum)`` (e.g. the masked token losses' sum and the
        count of valid tokens): the step's loss is the global sum over the global weight, over every rank and
        microbatch (MaxText's normalisation for padded batches), and the gradient is that loss's.
      quantize_once: ``optim_grads_params``: True: every layer's rows are quantized once a step, before the first
        microbatch, their amaxes max-reduced in one packed all-reduce, so that a layer only gathers bytes (no
        cast before its gather; holds the quantized shards of the whole model, 1/4 of the fp32 master's size for
        FP8). False: quantized where each layer reads its weight (under remat, again in the recomputed forward),
        from the amax the optimizer's update computed. None (default): NVFP4 weights once a step
        (their cast also takes a statistics pass for the tile amaxes, so casting them twice a step under remat cost
        more than holding the packed shards, about 0.56 bytes a parameter of the shard), FP8 weights and NVFP4
        weights of one shard (which make their bf16 operand in one pass where read) where they are read
        (docs/performance.md times both). Same bytes either way.
      rules: a list of ``jq.ParamRule`` (path regex -> quantized or not, recipe, TP split, stacked layer axis;
        first match wins, an unmatched leaf is an error), instead of ``quantize_mask`` / ``param_specs``. None
        with a ``loss_fn`` from ``jq.flax_loss``: that loss's ``default_rules()`` (every contraction's weight
        quantized, the output head in bf16).

    Returns:
      A step object: ``init(params) -> TrainState``, ``step(state, batch) -> (state, metrics)`` (``state`` is
      donated; ``metrics["loss"]`` the mean loss), ``params(state)``, ``describe(state)`` (the per-leaf plan),
      ``state_dict`` / ``state_dict_target`` /
      ``load_state_dict`` (PyTorch's names), ``master_shardings(params)`` and ``lower(state, batch)``.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"optimizer: must be an optax GradientTransformation (init/update), got "
                        f"{type(optimizer).__name__}")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh: must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    policy = MixedPrecisionPolicy() if policy is None else policy
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"policy: must be a jaxquant.MixedPrecisionPolicy, got {type(policy).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, (int, np.integer)) or microbatches < 1:
        raise ValueError(f"microbatches: must be a positive int, got {microbatches!r}")
    if fsdp_axis not in mesh.axis_names:
        raise ValueError(f"fsdp_axis: {fsdp_axis!r} is not an axis of the mesh (axes {mesh.axis_names})")
    if tp_axis is not None and tp_axis not in mesh.axis_names:
        raise ValueError(f"tp_axis: {tp_axis!r} is not an axis of the mesh (axes {mesh.axis_names})")
    if tp_axis is not None and tp_axis == fsdp_axis:
        raise ValueError(f"tp_axis: must differ from fsdp_axis ({fsdp_axis!r})")
    if rules is not None and (quantize_mask is not None or param_specs is not None):
        raise ValueError("rules: give either rules or quantize_mask / param_specs, not both")
    if param_specs is not None and tp_axis is None:
        raise ValueError("param_specs: given without tp_axis; name the tensor-parallel mesh axis as tp_axis")
    if replicate_axis is not None and (replicate_axis not in mesh.axis_names
                                       or replicate_axis in (fsdp_axis, tp_axis)):
        raise ValueError(f"replicate_axis: {replicate_axis!r} must be a mesh axis other than the fsdp and tp axes "
                         f"(axes {mesh.axis_names})")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward: must be a bool, got {type(reshard_after_forward).__name__}")
    if quantize_once is not None and not isinstance(quantize_once, bool):
        raise TypeError(f"quantize_once: must be a bool or None, got {type(quantize_once).__name__}")
    if strategy != "optim_grads_params" and not reshard_after_forward:
        raise ValueError(f"reshard_after_forward: False needs strategy='optim_grads_params' (the other strategies "
                         f"gather every compute weight once a step and keep it), got {strategy!r}")
    for axis in mesh.axis_names:
        if axis not in (fsdp_axis, tp_axis, replicate_axis) and mesh.shape[axis] != 1:
            raise ValueError(f"mesh: axis {axis!r} has size {mesh.shape[axis]}; only {fsdp_axis!r} (data parallel),"
                             f" the tp_axis and the replicate_axis may be larger than 1")
    if rules is None and quantize_mask is None and param_specs is None and callable(getattr(loss_fn, "default_rules",
                                                                                        None)):
        rules = loss_fn.default_rules()   # a flax loss (jq.flax_loss): its own plan of what to quantize
    if compiler_options is _DEFAULT:
        compiler_options = default_compiler_options(mesh)
    return LayerwiseTrainStep(loss_fn, optimizer, mesh, policy, int(microbatches), bool(report_nan), fsdp_axis,
                              tp_axis, param_specs, replicate_axis, quantize_mask, compiler_options,
                              reshard_after_forward, strategy, rules, bool(has_aux), bool(weighted_loss),
                              quantize_once)
