"""The training step of ``make_train_step``: per-leaf sharded state, every ZeRO strategy one mode of it.

The fp32 (main) parameters stay a pytree like ``params``; each leaf is sharded on its own:

* quantized leaves (``quantize_mask`` True; default every 2-D ``[out, in]`` and stacked 3-D ``[L, out, in]``
  leaf) are split by rows over ``fsdp_axis`` and reach ``loss_fn`` as :class:`jaxquant.training.fsdp.ShardedWeight`:
  with ``optim_grads_params`` (layer-wise FSDP, the default) ``jq.dense`` quantizes and all-gathers one
  layer's weight where it reads it and reduce-scatters its gradient right after the weight-gradient GEMM
  (see ``jaxquant.training.fsdp``). ``jax.lax.scan`` over a stacked leaf hands the body one layer; each layer is
  quantized with its own scales;
* other leaves (masked matrices: bf16; everything else: the main-params dtype) are split by rows too and
  all-gathered as arrays when ``loss_fn`` starts (embeddings, norms, routers); their gradients are reduced
  the same way as the weights'.

The other strategies change what is split (``jaxquant.training.policy.STRATEGY_SHARDING``), not this code path:
``no_shard`` keeps master and optimizer state whole on every rank; ``optim`` / ``optim_grads`` gather every
compute weight once, before the first microbatch (``WeightSpec.per_use`` False: the layers read the
``ShardedWeight.gathered`` operands, the same bytes); ``no_shard`` / ``optim`` leave gradients unreduced
(``WeightSpec.grad_sharded`` False: full-row accumulators in the main-grads dtype) and all-reduce them once
after the microbatches, ``optim`` then keeping this rank's rows for the update.

A leaf whose rows do not split evenly (NVFP4: into multiples of 16 rows) over ``fsdp_axis`` is padded with
zero rows (``LeafRule.pad_rows``) and split; one so small that padding would more than double it stays whole on
every rank (its gradient is all-reduced).

With ``optim_grads_params``, no whole-model gathered copy and no full-size gradient buffer: per device the
state is the shards of the master and of the optimizer state and shard-sized gradient accumulators; no
layer's gathered weight is a residual of the backward (how many layers' gathers XLA keeps in flight at once
is its scheduler's choice).

Mesh axes: ``fsdp_axis`` (required), ``tp_axis`` (tensor parallel, ``param_specs`` say which leaves split
over it) and ``replicate_axis`` (HSDP: parameters and optimizer state replicated over it, the batch split
over ``(replicate_axis, fsdp_axis)``, gradients reduce-scattered over FSDP and summed over the replicate
axis). The amax of a quantized weight is max-reduced over the axes that split it (FSDP rows, TP), never over
the replicate axis (each replica holds the same master).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxquant.primitives import formats
from jaxquant.training.fsdp import (GradReduce, ShardedWeight, WeightSpec, dequantizes_once, gather_array, gather_once,
                           gathered_array, pad_row_blocks, quantize_once, unpad_row_blocks, weight_amax)
from jaxquant.primitives.formats import to_compute_dtype
from jaxquant.primitives.varying import mark_varying
from jaxquant.zero.layout import TP_SPLITS
from jaxquant.training.plan_view import format_plan, plan_row
from jaxquant.training.rules import decide, dotted_path
from jaxquant.training.policy import (STRATEGY_SHARDING, TrainState, _explain_tp_errors, _leaf_name, apply_update,
                             value_and_grad_over_microbatches)


@dataclasses.dataclass(frozen=True)
class LeafRule:
    """How one parameter is stored and what ``loss_fn`` receives for it (static)."""

    name: str
    shape: tuple
    quantized: bool              # a ShardedWeight (else an array gathered at the start of loss_fn)
    recipe: str                  # weights: the policy's compute weights; arrays: "bf16" or "keep"
    spec: Any                    # PartitionSpec of the master leaf (global array)
    weight: WeightSpec           # gather / amax / gradient rules
    tp_size: int = 1             # TP ranks the leaf is split over (1: replicated over TP)
    stacked: bool = False        # axis 0 is a layer axis (saved per layer, quantized per layer)
    pad_rows: int = 0            # zero rows appended to each row block so that the rows split over fsdp
    row_blocks: int = 1          # TP blocks along the rows axis (tp for a column-parallel [out, in] weight)
    why: str = dataclasses.field(default="", compare=False)   # what decided it (rule, mask or default)
    path: str = dataclasses.field(default="", compare=False)  # dotted path (``layers.0.mlp.up.kernel``)

    @property
    def stored_shape(self) -> tuple:
        """The master leaf's shape in the state: ``shape`` with each row block padded by ``pad_rows``."""
        if not self.pad_rows:
            return self.shape
        axis = self.weight.rows_axis(len(self.shape))
        return tuple(n + self.row_blocks * self.pad_rows if a == axis else n for a, n in enumerate(self.shape))

    @property
    def saved_shape(self) -> tuple:
        """The leaf as the state dict holds it: unpadded, and an ``[in, out]`` kernel as PyTorch's ``[out, in]``."""
        s = self.shape
        return s[:-2] + (s[-1], s[-2]) if self.weight.transposed else s

    @property
    def saved_spec(self):
        """The sharding of :attr:`saved_shape`: ``spec`` without fsdp on padded rows, swapped with the axes of a
        transposed kernel."""
        entries = list(self.spec) + [None] * (len(self.shape) - len(self.spec))
        if self.pad_rows:
            entries = [tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if a != self.weight.gather_axis)
                       for e in entries]
            entries = [None if not e else e[0] if len(e) == 1 else e for e in entries]
        if self.weight.transposed:
            entries[-2:] = entries[-2:][::-1]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    treedef: Any
    rules: tuple

    @property
    def names(self):
        return tuple(r.name for r in self.rules)

    @property
    def shapes(self):
        return tuple(r.shape for r in self.rules)


def make_plan(params, *, policy, mesh, fsdp_axis, tp_axis, replicate_axis, microbatches, param_specs=None,
              quantize_mask=None, rules=None, reshard_after_forward=True, strategy="optim_grads_params") -> LayerPlan:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not leaves_with_path:
        raise ValueError("params: the parameter tree has no leaves")
    for path, leaf in leaves_with_path:
        dtype = getattr(leaf, "dtype", None) or jnp.result_type(leaf)   # a ShapeDtypeStruct too (abstract init)
        if not hasattr(leaf, "shape") or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"params{_leaf_name(path)}: every leaf must be a floating array, got {type(leaf).__name__}")
    decisions = decide(params, rules=rules, quantize_mask=quantize_mask, param_specs=param_specs,
                       compute_weights=policy.compute_weights)
    S = int(mesh.shape[fsdp_axis])
    T = 1 if tp_axis is None else int(mesh.shape[tp_axis])
    R = 1 if replicate_axis is None else int(mesh.shape[replicate_axis])
    grad = GradReduce(float(np.float32(1.0 / (R * S * microbatches))), policy.main_grads_dtype, policy.comm_dtype)
    out = []
    for (path, leaf), d in zip(leaves_with_path, decisions):
        shape = tuple(int(n) for n in np.shape(leaf))
        quantized = d.recipe is not None
        matrix = len(shape) - d.stacked == 2    # unquantized [out, in] layers get bf16 copies, others their dtype
        recipe = d.recipe if quantized else ("bf16" if matrix and not d.keep_dtype else "keep")
        tp_dim = TP_SPLITS[d.tp] if T > 1 and d.tp is not None else None
        if tp_dim is not None and d.transposed:   # [in, out]: "col" splits out, the minor axis
            tp_dim = 1 - tp_dim
        rule = _leaf_rule(_leaf_name(path), shape, quantized, recipe, tp_dim, S, T, fsdp_axis, tp_axis,
                          replicate_axis, grad, not reshard_after_forward, STRATEGY_SHARDING[strategy], d.stacked,
                          d.transposed)
        out.append(dataclasses.replace(rule, why=d.why, path=dotted_path(path)))
    return LayerPlan(treedef, tuple(out))


def _leaf_rule(name, shape, quantized, recipe, tp_dim, S, T, fsdp_axis, tp_axis, replicate_axis, grad,
               keep_gathered, sharded_parts, stacked, transposed=False):
    # rows: the first of a layer's [rows, cols] (a vector's only axis); a stack's layer axis is never split
    per_layer = len(shape) - int(stacked)
    rows_from_end = min(per_layer, 2)
    rows_dim = len(shape) - rows_from_end if rows_from_end else None
    local = list(shape)
    if tp_dim is not None:
        d = len(shape) - 2 + tp_dim
        if shape[d] % T:
            raise ValueError(f"param_specs{name}: dimension {d} of shape {shape} is not divisible by the tp axis "
                             f"size {T}")
        local[d] //= T
    if quantized and recipe == "nvfp4" and (local[-2] % formats.TILE or local[-1] % formats.TILE):
        raise ValueError(f"params{name}: NVFP4 compute weights need (TP-local) dimensions that are multiples of "
                         f"16, got {tuple(local[-2:])}")
    unit = formats.TILE if quantized and recipe == "nvfp4" else 1
    sharded, pad = False, 0
    if sharded_parts.optimizer and rows_dim is not None:
        # rows that do not split into S shards of whole units are padded with zero rows (FSDP2's way) where that
        # leaves each rank fewer rows than the whole leaf and at most doubles what is gathered (tiny leaves stay
        # whole); the padding never reaches the numerics (zeros change no amax or tile scale, gathers drop them,
        # their gradients are zeros)
        rows, step = local[rows_dim], S * unit
        padded = -(-rows // step) * step
        sharded = padded == rows or (padded // S < rows and padded <= 2 * rows)
        pad = padded - rows if sharded else 0
    spec = [None] * len(shape)
    if tp_dim == 0:
        spec[rows_dim] = (tp_axis, fsdp_axis) if sharded else tp_axis
    elif sharded:
        spec[rows_dim] = fsdp_axis
    if tp_dim == 1:
        spec[len(shape) - 1] = tp_axis
    amax_axes = ((fsdp_axis,) if sharded else ()) + ((tp_axis,) if tp_dim is not None else ())
    vary = (() if sharded else (fsdp_axis,)) + ((replicate_axis,) if replicate_axis is not None else ())
    weight = WeightSpec(recipe, fsdp_axis if sharded else None, S if sharded else 1, amax_axes, grad, vary,
                        keep_gathered, per_use=sharded_parts.params, grad_sharded=sharded_parts.grads,
                        transposed=transposed, rows_from_end=max(rows_from_end, 1), pad_rows=pad)
    while spec and spec[-1] is None:   # as jit returns it: P(None, 'fsdp', None) would be a second cache entry
        spec.pop()
    return LeafRule(name, shape, quantized, recipe, P(*spec), weight, T if tp_dim is not None else 1, stacked, pad,
                    T if tp_dim == 0 else 1)


def _spec_axes(spec) -> tuple:
    out = []
    for entry in spec:
        out += [entry] if isinstance(entry, str) else list(entry or ())
    return tuple(out)


class LayerwiseTrainStep:
    """``make_train_step(..., strategy="optim_grads_params")``: ``init``, ``__call__``, ``params``, ``lower``."""

    def __init__(self, loss_fn, optimizer, mesh, policy, microbatches, report_nan, fsdp_axis, tp_axis=None,
                 param_specs=None, replicate_axis=None, quantize_mask=None, compiler_options=None,
                 reshard_after_forward=True, strategy="optim_grads_params", rules=None, has_aux=False,
                 weighted_loss=False, quantize_once=None):
        self.strategy, self.rules = strategy, rules
        self.has_aux, self.weighted_loss = has_aux, weighted_loss
        self.user_mesh = mesh
        mesh = auto_mesh(mesh)
        self.loss_fn, self.optimizer, self.mesh, self.policy = loss_fn, optimizer, mesh, policy
        self.microbatches, self.report_nan, self.fsdp_axis = microbatches, report_nan, fsdp_axis
        self.tp_axis = tp_axis if tp_axis is not None and int(mesh.shape[tp_axis]) > 1 else None
        self.replicate_axis = replicate_axis
        self.param_specs, self.quantize_mask = param_specs, quantize_mask
        self.num_shards = int(mesh.shape[fsdp_axis])
        self.replicas = 1 if replicate_axis is None else int(mesh.shape[replicate_axis])
        self.compiler_options = compiler_options
        self.reshard_after_forward = reshard_after_forward
        self.quantize_once = quantize_once
        self._steps = {}

    # -- shardings ---------------------------------------------------------------------------

    @property
    def _batch_axes(self):
        return (self.fsdp_axis,) if self.replicate_axis is None else (self.replicate_axis, self.fsdp_axis)

    def _master_shardings(self, plan):
        return jax.tree_util.tree_unflatten(plan.treedef, [NamedSharding(self.mesh, r.spec) for r in plan.rules])

    def _opt_shardings(self, plan, opt_state):
        """The optimizer state's shardings: every subtree shaped like params is sharded like the master, also
        where ``optax.masked`` / ``multi_transform`` left an ``optax.MaskedNode`` for a leaf (it stays one)."""
        from optax import MaskedNode

        master = self._master_shardings(plan)
        replicated = NamedSharding(self.mesh, P())
        masked = lambda x: isinstance(x, MaskedNode)
        like_params = lambda node: (jax.tree_util.tree_structure(node, is_leaf=masked) == plan.treedef and all(
            masked(x) or np.shape(x) == r.stored_shape
            for x, r in zip(jax.tree.leaves(node, is_leaf=masked), plan.rules)))
        like_master = lambda node: jax.tree.map(lambda x, s: x if masked(x) else s, node, master, is_leaf=masked)
        return jax.tree.map(lambda node: like_master(node) if like_params(node) else replicated, opt_state,
                            is_leaf=like_params)

    # -- per rank ----------------------------------------------------------------------------

    def _body(self, plan, masters, amaxes, batch, rng, extra):
        """Inside shard_map over every mesh axis: (metrics, gradient shards[, non-finite flags]). ``amaxes``: the
        state's ``weight_amax`` (replicated)."""
        pol, k = self.policy, self.microbatches
        # ZeRO 0-2: every compute weight gathered once, before the first microbatch, held for the step
        gathered = [None if r.weight.per_use else
                    (gather_once(m, r.weight, columnwise=r.recipe == "fp8", amax=a) if r.quantized else
                     gathered_array(m, r.weight))
                    for m, a, r in zip(masters, amaxes, plan.rules)]
        # ZeRO-3 with quantize_once: every layer's rows quantized once, one packed amax reduction; layers gather
        once = [i for i, r in enumerate(plan.rules) if self._quantized_once(r)]
        local = [None] * len(masters)
        for i, q in zip(once, quantize_once([masters[i] for i in once], [plan.rules[i].weight for i in once])):
            local[i] = q
        sinks = [mark_varying(jnp.zeros(self._sink_shape(m.shape, r), r.weight.grad_dtype),
                               _spec_axes(r.spec) + self._unreduced_axes(r))
                 for m, r in zip(masters, plan.rules)]
        kwargs = {} if extra is None else {"extra": extra}
        # one key per data-parallel rank and microbatch (TP ranks of one batch share it)
        keys = None if rng is None else jax.random.split(jax.random.fold_in(rng, self._batch_index()), k)

        def loss_of(sinks, mb):
            mb, key = mb
            leaves = [ShardedWeight(m, s, r.weight, g, q, a) if r.quantized else gather_array(m, s, r.weight, g)
                      for m, s, r, g, q, a in zip(masters, sinks, plan.rules, gathered, local, amaxes)]
            kw = kwargs if key is None else kwargs | {"rng": key[0]}
            out = self.loss_fn(jax.tree_util.tree_unflatten(plan.treedef, leaves), mb, **kw)
            stats = self._loss_stats(out)
            return stats["loss"], stats

        grad_fn = _explain_tp_errors(jax.value_and_grad(loss_of, has_aux=True), self.tp_axis)
        to_main = lambda g: [to_compute_dtype(a, pol.main_grads_dtype) for a in g]
        first = jax.tree.map(lambda a: a[: a.shape[0] // k], (batch, keys))
        zero_stats = lambda: jax.tree.map(lambda a: mark_varying(jnp.zeros(a.shape, a.dtype), self._batch_axes),
                                          jax.eval_shape(loss_of, sinks, first)[1])
        def stats_and_grads(sinks, mb):
            (_, stats), grads = grad_fn(sinks, mb)
            return stats, grads

        stats, grads = value_and_grad_over_microbatches(
            stats_and_grads, sinks, (batch, keys), k, to_main,
            zeros=lambda: [s.astype(pol.main_grads_dtype) for s in sinks], loss0=zero_stats)
        grads = [self._reduce_unsharded(g, r) for g, r in zip(grads, plan.rules)]
        axes = tuple(self.mesh.axis_names)
        if self.tp_axis is not None:   # the loss is the same on every TP rank: count TP rank 0's
            stats = jax.tree.map(lambda a: jnp.where(jax.lax.axis_index(self.tp_axis) == 0, a, 0), stats)
        flags = ([jnp.any(~jnp.isfinite(g)).astype(jnp.float32) for g in grads] if self.report_nan else [])
        # every statistic and non-finite flag in one small all-reduce
        packed, unpack = ravel_pytree(stats)       # float32 throughout (_loss_stats)
        total = jax.lax.psum(mark_varying(jnp.concatenate([packed] + ([jnp.stack(flags)] if flags else [])), axes),
                             axes)
        summed = unpack(total[: packed.size])
        ranks = self.num_shards * self.replicas
        metrics = {"loss": summed["loss"] / ranks}     # the mean of the per-rank mean losses
        if self.weighted_loss:   # sum over every token / their weight: the gradient of that, not of a mean of means
            # summed: sums over ranks of per-rank means over the k microbatches; the gradients came scaled by
            # 1 / (ranks x k), so ranks / summed weight turns them into the gradient of sum / weight
            weight = jnp.where(summed["weight"] > 0, summed["weight"], 1)
            scale = jnp.float32(ranks) / weight
            grads = [(g.astype(jnp.float32) * scale).astype(g.dtype) for g in grads]
            metrics = {"loss": summed["loss"] / weight, "weight": summed["weight"] * k}
        if self.has_aux:
            metrics["aux"] = jax.tree.map(lambda a: a / ranks, summed["aux"])
        out = (metrics, grads)
        return out + ((total[packed.size:] > 0,) if self.report_nan else ())

    def _loss_stats(self, out) -> dict:
        """What ``loss_fn`` returned, as ``{"loss", ["weight"], ["aux"]}`` float32 (checked)."""
        stats = {}
        if self.has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ValueError("loss_fn: with has_aux=True must return (loss, aux)")
            out, aux = out
            stats["aux"] = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), aux)
        if self.weighted_loss:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ValueError("loss_fn: with weighted_loss=True must return (sum of the losses, sum of their "
                                 "weights), e.g. (jnp.sum(token_loss * mask), jnp.sum(mask))")
            out, weight = out
            if jnp.shape(weight) != ():
                raise ValueError(f"loss_fn: the weight sum must be a scalar, got shape {jnp.shape(weight)}")
            stats["weight"] = jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32))
        if jnp.shape(out) != ():
            raise ValueError(f"loss_fn: must return a scalar loss, got shape {jnp.shape(out)}")
        stats["loss"] = jnp.asarray(out).astype(jnp.float32)
        return stats

    def _batch_index(self):
        """This rank's index among the data-parallel ranks (the batch's shards)."""
        i = jax.lax.axis_index(self.fsdp_axis)
        return i if self.replicate_axis is None else jax.lax.axis_index(self.replicate_axis) * self.num_shards + i

    def _unreduced_axes(self, rule) -> tuple:
        """Data-parallel axes a gradient is left unreduced over until the end of the step (ZeRO 0-1)."""
        return () if rule.weight.grad_sharded else self._batch_axes

    def _sink_shape(self, shard_shape, rule) -> tuple:
        """The gradient accumulator: this rank's rows, or with unsharded gradients every (TP-local) row."""
        if rule.weight.grad_sharded or rule.weight.gather_axis is None:
            return tuple(shard_shape)
        shape = list(shard_shape)
        shape[rule.weight.rows_axis(len(shape))] *= rule.weight.num_shards
        return tuple(shape)

    def _reduce_unsharded(self, g, rule):
        """ZeRO 0-1: the step's one all-reduce of an accumulated gradient (comm dtype), then this rank's rows
        of it where the master is sharded; sharded gradients were reduce-scattered in the backward."""
        spec = rule.weight
        if spec.grad_sharded:
            return g
        g = to_compute_dtype(jax.lax.psum(to_compute_dtype(g, spec.grad.comm_dtype), self._batch_axes),
                             spec.grad.main_dtype)
        if spec.gather_axis is None:
            return g
        axis = spec.rows_axis(g.ndim)
        rows = g.shape[axis] // spec.num_shards
        return jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(spec.gather_axis) * rows, rows, axis=axis)

    def _grads(self, plan, master, amaxes, batch, rng, extra):
        out_specs = (P(), [r.spec for r in plan.rules]) + ((P(),) if self.report_nan else ())
        fn = jax.shard_map(functools.partial(self._body, plan), mesh=self.mesh,
                           in_specs=([r.spec for r in plan.rules], [P()] * len(plan.rules), P(self._batch_axes), P(),
                                     P()), out_specs=out_specs)
        return fn(jax.tree_util.tree_leaves(master), list(amaxes), batch, rng, extra)

    def _amax_leaves(self, plan) -> list:
        """Per leaf: whether its casts read a precomputed amax (``TrainState.weight_amax``): FP8 and NVFP4 compute
        weights (FP8 casts then need no amax pass, NVFP4's one-shard pass takes it as an input, and neither reduces
        an amax over ranks: ``fsdp.quantize_rows``), but those ``quantize_once`` quantizes (their amaxes are reduced
        together there)."""
        return [r.quantized and r.recipe in ("fp8", "nvfp4") and not self._quantized_once(r) for r in plan.rules]

    def _quantized_once(self, rule) -> bool:
        """Whether a leaf's rows are quantized once a step (``make_train_step``'s ``quantize_once``; None: NVFP4
        leaves, but one-shard ones whose forward makes the bf16 operand in one pass, ``fsdp.dequantizes_once``)
        rather than where a layer reads them: ZeRO-3 quantized leaves (the other strategies gather once a step
        anyway)."""
        once = self.quantize_once
        if once is None:
            once = rule.recipe == "nvfp4" and not dequantizes_once(rule.weight)
        return rule.quantized and rule.weight.per_use and once

    def _weight_amax(self, plan, master) -> list:
        """``TrainState.weight_amax`` of ``master`` (inside the step: where the update writes it)."""
        replicated = NamedSharding(self.mesh, P())
        return [jax.lax.with_sharding_constraint(weight_amax(m), replicated) if use else None
                for m, use in zip(jax.tree_util.tree_leaves(master), self._amax_leaves(plan))]

    def _step_fn(self, plan, state: TrainState, batch, rng=None, extra=None):
        master = state.master
        amaxes = state.weight_amax
        if amaxes is None:   # a state built by hand: the casts compute their own amax
            amaxes = [None] * len(plan.rules)
        metrics, grads, *flags = self._grads(plan, master, amaxes, batch, rng, extra)
        grads = jax.tree_util.tree_unflatten(plan.treedef, grads)
        new_master, opt_state, ok = apply_update(self.optimizer, grads, state, self._master_shardings(plan),
                                                 lambda o: self._opt_shardings(plan, o),
                                                 flags[0] if self.report_nan else None)
        if self.report_nan:
            metrics["nonfinite"] = jax.tree_util.tree_unflatten(plan.treedef, list(flags[0]))
            metrics["update_skipped"] = jnp.logical_not(ok)
        return TrainState(new_master, opt_state, state.step + 1, plan, self._weight_amax(plan, new_master)), metrics

    def refresh_amax(self, state: TrainState) -> TrainState:
        """``state`` with ``weight_amax`` computed from its ``master`` (after replacing the master by hand: the
        steps and ``init`` / ``load_state_dict`` keep it current themselves)."""
        amax = jax.jit(functools.partial(self._weight_amax, state.plan))(state.master)
        return dataclasses.replace(state, weight_amax=amax)

    def _compiled(self, plan):
        if plan not in self._steps:
            self._steps[plan] = jax.jit(functools.partial(self._step_fn, plan), donate_argnums=0,
                                        compiler_options=self.compiler_options)
        return self._steps[plan]

    # -- public ------------------------------------------------------------------------------

    def __call__(self, state: TrainState, batch, *, rng=None, extra=None):
        """One step.

        Args:
          state: the ``TrainState`` (donated: do not use it afterwards).
          batch: a pytree of arrays whose leading axis is split over the data-parallel ranks and microbatches.
          rng: a PRNG key for this step (e.g. dropout): ``loss_fn`` gets ``rng=`` a key folded with the
            data-parallel rank and split per microbatch (TP ranks of one batch share it). None: no ``rng``.
          extra: a pytree of inputs that are not split with the batch (the same on every rank), passed to
            ``loss_fn`` as ``extra=``. None: no ``extra``.

        Returns:
          ``(new state, metrics)``: ``metrics["loss"]`` (the mean loss; with ``weighted_loss`` the global sum
          over the global weight, and ``metrics["weight"]`` that weight), ``metrics["aux"]`` with ``has_aux``
          (the mean over ranks and microbatches), and the non-finite report with ``report_nan``.
        """
        self._check_call(state, batch)
        batch, rng, extra = self._on_step_mesh((batch, rng, extra))
        with _no_mesh_context():
            return self._compiled(state.plan)(state, batch, rng, extra)

    def _on_step_mesh(self, tree):
        """Arrays the user placed on an Explicit-axes mesh (``jax.make_mesh``'s default), moved to the step's Auto
        view of the same devices (the data stays where it is): the step's shard_map splits them itself."""
        def move(x):
            sharding = getattr(x, "sharding", None)
            if not isinstance(sharding, NamedSharding) or all(
                    t == AxisType.Auto for t in getattr(sharding.mesh, "axis_types", ())):
                return x
            return jax.device_put(x, NamedSharding(auto_mesh(sharding.mesh), sharding.spec))
        return jax.tree.map(move, tree)

    def lower(self, state: TrainState, batch, *, rng=None, extra=None):
        """``jax.stages.Lowered`` of one step (for HLO checks); does not run or donate anything."""
        self._check_call(state, batch)
        batch, rng, extra = self._on_step_mesh((batch, rng, extra))
        with _no_mesh_context():
            return self._compiled(state.plan).lower(state, batch, rng, extra)

    def plan(self, params) -> LayerPlan:
        return make_plan(params, policy=self.policy, mesh=self.mesh, fsdp_axis=self.fsdp_axis,
                         tp_axis=self.tp_axis, replicate_axis=self.replicate_axis, microbatches=self.microbatches,
                         param_specs=self.param_specs, quantize_mask=self.quantize_mask, rules=self.rules,
                         reshard_after_forward=self.reshard_after_forward, strategy=self.strategy)

    def describe(self, state: TrainState, *, file=None) -> list:
        """What the step does with each parameter, as a list of dicts and (unless ``file`` is False) a table
        printed to ``file`` (default stdout): ``path``, ``shape`` (the leaf as ``params`` holds it), ``recipe``
        (``"fp8"`` / ``"nvfp4"`` / ``"bf16"``: quantized compute weights, gathered where a layer reads them;
        ``"kept"``: an array in the main-params dtype; ``"bf16 copy"``: an unquantized matrix read as bf16),
        ``why`` (the rule, mask or default that decided it), ``sharding`` (the master's ``PartitionSpec``),
        ``padding`` (zero rows added to split it evenly) and ``stacked`` (axis 0 a layer axis). The last line is
        :func:`plan_summary`."""
        if not isinstance(state, TrainState) or not isinstance(state.plan, LayerPlan):
            raise TypeError(f"state: must be the TrainState from this step's init, got {type(state).__name__}")
        rows = [plan_row(r) for r in state.plan.rules]
        if file is not False:
            import sys

            print(format_plan(rows), file=file or sys.stdout)
        return rows

    def master_shardings(self, params):
        """``NamedSharding`` of each parameter as ``params`` holds it (a pytree like ``params``, which may hold
        ``jax.ShapeDtypeStruct``): build a large model directly sharded, ``jax.jit(init, out_shardings=...)``,
        instead of on one device. A leaf the step pads to split it is not split over fsdp here (its rows do
        not divide); ``init`` pads and splits it."""
        plan = self.plan(params)
        return jax.tree_util.tree_unflatten(plan.treedef, [NamedSharding(self.mesh, r.saved_spec) for r in plan.rules])

    def init(self, params) -> TrainState:
        """State from ``params`` (a pytree of arrays, or a function without arguments returning one, which is
        called under ``jit`` with the master's shardings as outputs: a model larger than one device): sharded main
        params and optimizer state."""
        with _no_mesh_context():
            return self._init(params)

    def _init(self, params) -> TrainState:
        build = params if callable(params) else None
        if build is not None:
            params = jax.eval_shape(build)
        plan = self.plan(params)
        dtype = self.policy.main_params_dtype
        stored = lambda p: jax.tree_util.tree_unflatten(plan.treedef, [
            pad_row_blocks(jnp.asarray(a, dtype), r.weight, r.row_blocks)
            for a, r in zip(jax.tree.leaves(p), plan.rules)])
        if build is not None:    # built inside the jit whose outputs are the shards: no whole copy anywhere
            master = jax.jit(lambda: stored(build()), out_shardings=self._master_shardings(plan))()
        else:
            master = jax.jit(stored, out_shardings=self._master_shardings(plan))(params)
        opt_shape = jax.eval_shape(self.optimizer.init, master)
        opt_state = jax.jit(self.optimizer.init, out_shardings=self._opt_shardings(plan, opt_shape))(master)
        return self.refresh_amax(TrainState(master, opt_state, self.step_count(0), plan))

    def step_count(self, n) -> jax.Array:
        """``TrainState.step`` for ``n`` steps taken: int32, replicated on the mesh as the step returns it (an
        uncommitted one would be another jit cache entry, a second compile at step 2)."""
        with _no_mesh_context():
            return jax.device_put(jnp.asarray(n, jnp.int32), NamedSharding(self.mesh, P()))

    def state_dict(self, state: TrainState, *, hyperparams=None, names=None) -> dict:
        """The training state as PyTorch's ``get_state_dict(model, optimizer)`` names it (``training.state_dict``).

        Args:
          state: a ``TrainState`` of this step.
          hyperparams: torch's param-group values (``lr``, ``betas``, ``eps``, ``weight_decay``; SGD: ``lr``,
            ``momentum``, ``weight_decay``) that the optax state does not hold: one dict, or ``{label: dict}`` per
            ``optax.multi_transform`` label.
          names: a PyTorch twin's own names: a callable or a dict from the default names (``blocks.0.w1``,
            ``embed``) to the twin's (``layers.0.feed_forward.w1.weight``); it must be one-to-one. A tied
            parameter takes a tuple of names (``("tok_embeddings.weight", "output.weight")``). None: defaults.

        Returns:
          ``{"model": ..., "optim": {"state": ..., "param_groups": [...]}}`` of sharded arrays, ready for
          ``jaxquant.checkpoint.save_dcp``.
        """
        from jaxquant.training import state_dict as sd

        with _no_mesh_context():
            return sd.state_dict(self, state, hyperparams=hyperparams, names=names)

    def state_dict_target(self, like: TrainState, *, names=None) -> dict:
        """``load_dcp``'s target for :meth:`state_dict` on this step's mesh (any saved mesh size loads).

        Args:
          like: ``self.init(params)``.
          names: the names the checkpoint was written with, as for :meth:`state_dict`.

        Returns:
          The state dict's layout with ``jax.ShapeDtypeStruct`` leaves in this step's shardings.
        """
        from jaxquant.training import state_dict as sd

        with _no_mesh_context():
            return sd.state_dict_target(self, like, names=names)

    def load_state_dict(self, state_dict: dict, *, like: TrainState, step_count=None, names=None) -> TrainState:
        """A ``TrainState`` on this step's mesh from :meth:`state_dict`'s layout (written by JAX or by torch).

        Args:
          state_dict: the state dict, e.g. ``load_dcp(path, self.state_dict_target(like, names=names))``.
          like: ``self.init(params)``.
          step_count: the steps taken, for an SGD state (PyTorch's SGD keeps no step count).
          names: the names in ``state_dict``, as for :meth:`state_dict` (the same callable or dict).

        Returns:
          The loaded ``TrainState``.
        """
        from jaxquant.training import state_dict as sd

        with _no_mesh_context():
            return sd.load_state_dict(self, state_dict, like=like, step_count=step_count, names=names)

    def params(self, state: TrainState):
        """The full main params as a pytree like the one given to ``init`` (replicated arrays)."""
        if not isinstance(state, TrainState):
            raise TypeError(f"state: must be the TrainState from step.init, got {type(state).__name__}")
        replicated = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), state.master)
        unpad = lambda m: jax.tree_util.tree_unflatten(state.plan.treedef, [
            unpad_row_blocks(a, r.weight, r.row_blocks) for a, r in zip(jax.tree.leaves(m), state.plan.rules)])
        with _no_mesh_context():
            return jax.jit(unpad, out_shardings=replicated)(state.master)

    def _check_call(self, state, batch):
        if not isinstance(state, TrainState) or not isinstance(state.plan, LayerPlan):
            raise TypeError(f"state: must be the TrainState from this step's init, got {type(state).__name__}")
        if not jax.tree_util.tree_leaves(batch):
            raise ValueError("batch: has no arrays")
        n = self.num_shards * self.replicas * self.microbatches
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if np.ndim(leaf) < 1 or np.shape(leaf)[0] % n:
                axes = " x ".join(self._batch_axes)
                raise ValueError(f"batch{_leaf_name(path)}: the leading (batch) axis must be a multiple of {axes} "
                                 f"size x microbatches = {n}, got shape {tuple(np.shape(leaf))}")


def auto_mesh(mesh):
    """``mesh`` with every axis of type Auto: the step places each array itself (its shard_map and the master's
    shardings), so a mesh from ``jax.make_mesh`` (Explicit axes by default) or one with Auto axes gives the same
    program."""
    types = getattr(mesh, "axis_types", None)
    if types is None or all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@contextlib.contextmanager
def _no_mesh_context():
    """The step traced outside a user's ``jax.set_mesh`` / ``use_mesh`` block: the step names its own mesh, and
    an Explicit context mesh would make its activations' shardings part of their types."""
    if hasattr(jax.sharding, "get_abstract_mesh") and jax.sharding.get_abstract_mesh().empty:
        yield
        return
    with jax.set_mesh(None) if hasattr(jax, "set_mesh") else contextlib.nullcontext():
        yield


def default_compiler_options(mesh) -> Optional[dict]:
    """XLA options of the step's executable: on GPU, GEMMs go to cuBLAS(Lt) instead of Triton fusions whose
    autotuning made the FP8 step compile for minutes (no process-wide flag needed)."""
    platforms = {d.platform for d in mesh.devices.flat}
    return {"xla_gpu_enable_triton_gemm": False} if platforms & {"gpu", "cuda", "rocm"} else None
