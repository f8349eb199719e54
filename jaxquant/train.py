"""Mixed-precision data-parallel training steps with quantized weights: ``MixedPrecisionPolicy``,
``make_train_step`` and ``raise_if_nonfinite``.

The fp32 main (master) parameters live in two flat buffers laid out by :class:`~jaxquant.FlatLayout`:
``"matrices"`` (every 2-D leaf: these become the compute weights of the policy, bf16 arrays,
``Float8Tensor`` or ``NVFP4Tensor``) and ``"others"`` (every other leaf, used as is in the main-params
dtype). The optimizer (any optax ``GradientTransformation``) sees ``{"matrices": flat, "others": flat}``.

One step, with ``S`` data-parallel ranks on ``fsdp_axis`` and ``k`` microbatches:

1. compute weights: ``optim_grads_params`` gathers them from the master shards (``quantize_master_weights``:
   quantized bytes only; bf16: a bf16 all-gather); ``optim`` / ``optim_grads`` keep the gathered weights
   of the previous update in the state (gathered right after it); ``no_shard`` quantizes / casts its
   replicated master locally;
2. per rank (``shard_map``), the local batch is cut into ``k`` microbatches; the gradient of each
   microbatch's loss comes in the compute dtype (bf16; quantized weights get the straight-through
   gradient, see ``jaxquant.dense``) and is accumulated in ``main_grads_dtype``; the sum is scaled by
   ``1/(S*k)`` (so the update uses the gradient of the full-batch mean loss), converted to
   ``grad_comm_dtype`` and all-reduced (``no_shard``, ``optim``) or reduce-scattered (``optim_grads``,
   ``optim_grads_params``), then converted back to ``main_grads_dtype``;
3. the optimizer updates the master shards (replicated for ``no_shard``); with ``report_nan`` each rank
   counts the non-finite elements per parameter in its shard of the reduced gradient (one pass over
   1/S of it; a NaN or inf in any rank's gradient reaches the sum), the flags travel in the loss's
   all-reduce, and a step with a non-finite gradient leaves master and optimizer state unchanged.

FSDP x TP (``tp_axis`` of size T > 1): ``param_specs`` (a pytree like ``params``) says, per 2-D leaf, how
it is split over ``tp_axis``: ``"col"`` (column-parallel: ``out`` of ``[out, in]`` split, each TP rank holds
``[out/T, in]``), ``"row"`` (row-parallel: ``in`` split, ``[out, in/T]``) or None (replicated over TP, the
default for every leaf; non-2-D leaves must be None). The "matrices" master is a TP-aware ``FlatLayout``
(``tp_dims`` 0 / 1 / None), ``[T, num_shards * shard_size]`` sharded ``P(tp_axis, fsdp_axis)`` (replicated
leaves repeated in every TP row); "others" stay ``P(fsdp_axis)``. Step 1 gathers over ``fsdp_axis`` only
(``quantize_master_weights(..., tp_axis=)``, amaxes over the whole weight; bf16: an all-gather over
``fsdp_axis`` of each TP rank's row); ``no_shard`` quantizes through the same call. Step 2's ``shard_map``
runs over both axes and ``loss_fn`` receives the TP-local block of each split weight (``[out/T, in]`` or
``[out, in/T]``, as a bf16 array / ``Float8Tensor`` / ``NVFP4Tensor`` of that shape) and whole replicated
ones; the batch is the FSDP rank's, the same on every TP rank. ``loss_fn`` does the TP collectives itself,
Megatron style: mark the input of a column-parallel ``dense`` as varying over ``tp_axis``
(``jax.lax.pcast(x, tp_axis, to="varying")``; its transpose all-reduces the input gradient over TP) and
``psum`` the output of a row-parallel ``dense`` over ``tp_axis``, so that the loss it returns is the same on
every TP rank (or use the ``jq.sp_*`` layers); with FP8 weights pass ``amax_axes=tp_axis`` to ``dense`` so
that TP-split activations and gradients are scaled by the whole tensor's amax. Gradients of split weights
stay TP-local and are reduced over ``fsdp_axis`` only; replicated leaves enter ``loss_fn`` TP-invariant, so
JAX's transpose of their implicit broadcast psums their gradient over ``tp_axis`` (the whole gradient on every TP rank).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxquant import formats, ops
from jaxquant.dense import pcast_varying, straight_through
from jaxquant.distributed import layout_group_table, quantize_master_weights, weight_partition_specs
from jaxquant.layerwise import LayerwiseTrainStep, default_compiler_options
from jaxquant.layout import FlatLayout
from jaxquant.quantize import quantize_fp8, quantize_nvfp4
from jaxquant.tensors import NVFP4Tensor

from jaxquant.policy import (COMPUTE_DTYPE, STRATEGIES, MixedPrecisionPolicy, StepCalls, TrainState,  # noqa: F401
                             _explain_tp_errors, _leaf_name, apply_update, raise_if_nonfinite,
                             value_and_grad_over_microbatches)

# ----------------------------------------------------------------------------------------------
# Static plan and state
# ----------------------------------------------------------------------------------------------


TP_SPECS = {"col": 0, "row": 1, None: None}     # param_specs leaf -> FlatLayout tp_dims entry


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one parameter tree: hashable, so it rides in the state as metadata."""

    treedef: Any
    names: tuple                 # key path of every leaf
    shapes: tuple
    matrix_leaves: tuple         # leaf indices of the "matrices" group, in layout order
    other_leaves: tuple
    matrices: FlatLayout         # TP-aware (tp_dims) with FSDP x TP
    others: FlatLayout
    matrices_local: FlatLayout   # one TP rank's row of ``matrices``: TP-local shapes, same offsets

    @property
    def tp(self) -> bool:
        return self.matrices.tp_dims is not None

    def tp_dim(self, p: int):
        return self.matrices.tp_dims[p] if self.tp else None


def _tp_dims(param_specs, treedef, names, shapes):
    """One FlatLayout tp_dims entry per leaf from ``param_specs`` (a pytree like params)."""
    try:
        specs = treedef.flatten_up_to(param_specs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"param_specs: must be a pytree with the structure of params ({e})") from None
    dims = []
    for name, shape, spec in zip(names, shapes, specs):
        if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
            spec = {0: "col", 1: "row"}.get(int(spec), spec)
        if not isinstance(spec, (str, type(None))) or spec not in TP_SPECS:
            raise ValueError(f"param_specs{name}: must be 'col', 'row' or None, got {spec!r}")
        if spec is not None and len(shape) != 2:
            raise ValueError(f"param_specs{name}: only 2-D [out, in] weights can be split over TP, got shape {shape}")
        dims.append(TP_SPECS[spec])
    return dims


def _make_plan(params, num_shards: int, compute_weights: str, tp_size: int = 1, param_specs=None) -> _Plan:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not leaves_with_path:
        raise ValueError("params: the parameter tree has no leaves")
    dims = [None] * len(leaves_with_path)
    if param_specs is not None:
        dims = _tp_dims(param_specs, treedef, [_leaf_name(p) for p, _ in leaves_with_path],
                        [tuple(np.shape(a)) for _, a in leaves_with_path])
    names, shapes, mats, others = [], [], [], []
    for i, (path, leaf) in enumerate(leaves_with_path):
        name = _leaf_name(path)
        if not hasattr(leaf, "shape") or not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(f"params{name}: every leaf must be a floating array, got {type(leaf).__name__}")
        shape = tuple(int(d) for d in np.shape(leaf))
        names.append(name)
        shapes.append(shape)
        if len(shape) == 2:
            d = dims[i] if tp_size > 1 else None
            if d is not None and shape[d] % tp_size:
                raise ValueError(f"param_specs{name}: dimension {d} of shape {shape} is not divisible by the "
                                 f"tp axis size {tp_size}")
            local = shape if d is None else tuple(n // tp_size if a == d else n for a, n in enumerate(shape))
            if compute_weights == "nvfp4" and (local[0] % formats.TILE or local[1] % formats.TILE):
                raise ValueError(f"params{name}: NVFP4 compute weights need 2-D parameters whose (TP-local) "
                                 f"dimensions are multiples of 16, got shape {local}")
            mats.append(i)
        else:
            others.append(i)
    layout = lambda idx, **tp: FlatLayout([shapes[i] for i in idx], num_shards, names=[names[i] for i in idx], **tp)
    tp = {}
    if tp_size > 1:
        tp = dict(tp_size=tp_size, tp_dims=[dims[i] for i in mats])
    matrices = layout(mats, **tp)
    local = FlatLayout.from_param_offsets(matrices.local_shapes, matrices.param_offsets, num_shards,
                                          matrices.shard_size, names=matrices.names)
    return _Plan(treedef, tuple(names), tuple(shapes), tuple(mats), tuple(others), matrices, layout(others), local)


# ----------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------


class TrainStep(StepCalls):
    """What :func:`make_train_step` returns: ``init``, ``__call__``, ``params``, ``lower``."""

    def __init__(self, loss_fn, optimizer, mesh, policy, strategy, microbatches, report_nan, fsdp_axis,
                 tp_axis=None, param_specs=None):
        self.loss_fn, self.optimizer, self.mesh, self.policy = loss_fn, optimizer, mesh, policy
        self.strategy, self.microbatches, self.report_nan = strategy, microbatches, report_nan
        self.fsdp_axis = fsdp_axis
        self.num_shards = int(mesh.shape[fsdp_axis])
        # TP is on when the tp axis has more than one device; a size-1 tp axis is plain FSDP
        self.tp_size = 1 if tp_axis is None else int(mesh.shape[tp_axis])
        self.tp_axis = tp_axis if self.tp_size > 1 else None
        self.param_specs = param_specs
        self._steps = {}          # plan -> jitted step (per instance, no module state)

    # -- shardings ---------------------------------------------------------------------------

    @property
    def _sharded(self) -> bool:
        return self.strategy != "no_shard"

    @property
    def _axes(self) -> tuple:
        """The mesh axes the gradient shard_map is manual over and the loss statistics are reduced over."""
        return (self.fsdp_axis,) if self.tp_axis is None else (self.fsdp_axis, self.tp_axis)

    def _spec(self, group, plan):
        """PartitionSpec of a group's flat master (and gradient): ``[total]`` over FSDP, or the FSDP x TP
        ``[tp, total]`` of the matrices."""
        fsdp = self.fsdp_axis if self._sharded else None
        return P(self.tp_axis, fsdp) if group == "matrices" and plan.tp else P(fsdp)

    def _master_sharding(self, plan):
        return {g: NamedSharding(self.mesh, self._spec(g, plan)) for g in ("matrices", "others")}

    def _replicated(self):
        return NamedSharding(self.mesh, P())

    def _like_master(self, tree, plan):
        """Shardings for ``tree`` (e.g. the optimizer state): leaves shaped like a group's flat master are
        sharded like it, everything else replicated."""
        by_shape = {(plan.others.total_size,): self._master_sharding(plan)["others"],
                    self._flat_shape(plan): self._master_sharding(plan)["matrices"]}
        return jax.tree.map(lambda a: by_shape.get(tuple(a.shape), self._replicated()), tree)

    @staticmethod
    def _flat_shape(plan):
        m = plan.matrices
        return (m.tp_size, m.total_size) if plan.tp else (m.total_size,)

    def _weight_specs(self, plan):
        """in_specs of the compute weights (TP-local shapes) in the gradient shard_map."""
        cw = self.policy.compute_weights
        if not plan.tp:
            return P()
        if cw != "bf16":
            return weight_partition_specs(plan.matrices, cw, True, self.tp_axis)
        return [P() if d is None else P(*((self.tp_axis, None) if d == 0 else (None, self.tp_axis)))
                for d in plan.matrices.tp_dims]

    # -- compute weights ---------------------------------------------------------------------

    def _gather_weights(self, master_mat, plan):
        """The compute weights of the "matrices" group (list in layout order): replicated, or with TP
        global arrays sharded over the tp axis along each weight's TP dim."""
        cw, layout = self.policy.compute_weights, plan.matrices
        if layout.num_params == 0:
            return []
        if plan.tp:
            return self._gather_tp_weights(master_mat, plan)
        if not self._sharded:
            leaves = layout.unflatten(master_mat)
            if cw == "bf16":
                return [formats.to_compute_dtype(w, COMPUTE_DTYPE) for w in leaves]
            fn = quantize_fp8 if cw == "fp8" else quantize_nvfp4
            return [fn(w, columnwise=True, compute_dtype=COMPUTE_DTYPE) for w in leaves]
        if cw == "bf16":   # a bf16 all-gather of the master shards
            gather = jax.shard_map(
                lambda s: jax.lax.all_gather(formats.to_compute_dtype(s, COMPUTE_DTYPE), self.fsdp_axis,
                                             tiled=True, to="invarying"),
                mesh=self.mesh, in_specs=P(self.fsdp_axis), out_specs=P())
            return layout.unflatten(gather(master_mat))
        # split=True, not split=False: on 2 x H100 split=False made the strategies disagree on the GPU
        # (likely other GEMM fusions; bytes equal) and the step was no faster (docs/decisions.md,
        # "`split=False` exists; `split=True` stays the default")
        return quantize_master_weights(master_mat, layout, mesh=self.mesh, axis=self.fsdp_axis, recipe=cw,
                                       compute_dtype=COMPUTE_DTYPE, columnwise=True,
                                       manual_post_all_gather_processing=False)

    def _gather_tp_weights(self, master_mat, plan):
        """FSDP x TP: gathered over ``fsdp_axis`` only. ``no_shard`` masters are replicated over FSDP: the
        quantized path reads them through the same call (its input resharding is a local slice)."""
        cw, layout = self.policy.compute_weights, plan.matrices
        if cw != "bf16":
            return quantize_master_weights(master_mat, layout, mesh=self.mesh, axis=self.fsdp_axis,
                                           tp_axis=self.tp_axis, recipe=cw, compute_dtype=COMPUTE_DTYPE,
                                           columnwise=True, manual_post_all_gather_processing=False)

        def gather(block):   # this TP rank's row: [1, shard_size] (or [1, total_size] with no_shard)
            row = formats.to_compute_dtype(block.reshape(-1), COMPUTE_DTYPE)
            if self._sharded:
                row = jax.lax.all_gather(row, self.fsdp_axis, tiled=True, to="invarying")
            return plan.matrices_local.unflatten(row)

        # replicated weights come from TP-varying rows holding equal values, which check_vma cannot know
        fn = jax.shard_map(gather, mesh=self.mesh, in_specs=self._spec("matrices", plan),
                           out_specs=self._weight_specs(plan), check_vma=False)
        return fn(master_mat)

    def _local_weights(self, weights, plan):
        """What the gradient shard_map takes: NVFP4 tensors carry their TP-local shape."""
        if not plan.tp:
            return weights
        return [dataclasses.replace(w, shape=tuple(s)) if isinstance(w, NVFP4Tensor) else w
                for w, s in zip(weights, plan.matrices.local_shapes)]

    def _others(self, master_oth, plan):
        flat = jax.lax.with_sharding_constraint(master_oth, self._replicated())
        return plan.others.unflatten(flat)

    # -- gradients (per rank) ----------------------------------------------------------------

    def _grad_body(self, plan, weights, others, batch):
        """Inside shard_map: (mean loss, matrix grad flat, other grad flat[, non-finite flags])."""
        axes, pol, k, S = (self.fsdp_axis,), self.policy, self.microbatches, self.num_shards
        quantized = pol.compute_weights != "bf16"
        # mesh axes each differentiated leaf varies over: TP-split weights also over the tp axis
        vary = {"m": [axes + (() if plan.tp_dim(p) is None else (self.tp_axis,))
                      for p in range(plan.matrices.num_params)],
                "o": [axes] * plan.others.num_params}
        diff = {"m": [jnp.zeros(s, COMPUTE_DTYPE) for s in plan.matrices.local_shapes] if quantized else list(weights),
                "o": list(others)}
        # bf16 weights of TP-split leaves arrive varying over tp already (their in_specs)
        cast = vary if quantized else {"m": [axes] * len(vary["m"]), "o": vary["o"]}
        diff = jax.tree.map(pcast_varying, diff, cast, is_leaf=lambda a: isinstance(a, tuple))

        def loss_of(d, mb):
            mats = [straight_through(q, s) for q, s in zip(weights, d["m"])] if quantized else d["m"]
            leaves = [None] * len(plan.names)
            for i, w in zip(plan.matrix_leaves, mats):
                leaves[i] = w
            for i, w in zip(plan.other_leaves, d["o"]):
                leaves[i] = w
            loss = self.loss_fn(jax.tree_util.tree_unflatten(plan.treedef, leaves), mb)
            if jnp.shape(loss) != ():
                raise ValueError(f"loss_fn: must return a scalar loss, got shape {jnp.shape(loss)}")
            return loss.astype(jnp.float32)

        grad_fn = _explain_tp_errors(jax.value_and_grad(loss_of), self.tp_axis if plan.tp else None)
        to_main = lambda g: jax.tree.map(lambda a: formats.to_compute_dtype(a, pol.main_grads_dtype), g)
        zeros = lambda: jax.tree.map(lambda a, v: pcast_varying(jnp.zeros(a.shape, pol.main_grads_dtype), v), diff,
                                     vary, is_leaf=lambda a: isinstance(a, tuple))
        loss, grads = value_and_grad_over_microbatches(grad_fn, diff, batch, k, to_main, zeros,
                                                       loss0=lambda: pcast_varying(jnp.float32(0), axes))
        out, flags = [], []   # flags: with report_nan, one per parameter
        scale = np.float32(1.0 / (S * k)).astype(pol.main_grads_dtype)
        # x * scale in the main dtype, rounded once (the product of a bf16 and the scale is exact in fp32)
        scaled = lambda x: formats.to_compute_dtype(x.astype(jnp.float32) * np.float32(scale), pol.main_grads_dtype)
        # what the optimizer reads, element by element: scaled, in the comm dtype, back in the main dtype
        as_sent = lambda g: formats.to_compute_dtype(scaled(formats.to_compute_dtype(g, pol.main_grads_dtype)),
                                                     pol.comm_dtype)
        for group, layout in (("m", plan.matrices_local), ("o", plan.others)):
            if layout.total_size == 0:
                out.append(jnp.zeros((0,), pol.main_grads_dtype))
                if self.report_nan:
                    flags.append(jnp.zeros((layout.num_params,), jnp.float32))
                continue
            flat = formats.to_compute_dtype(scaled(layout.flatten(grads[group], pol.main_grads_dtype)), pol.comm_dtype)
            if self.strategy in ("no_shard", "optim"):
                flat = jax.lax.psum(flat, axes)
            else:
                flat = jax.lax.psum_scatter(flat, axes, tiled=True)
            flat = formats.to_compute_dtype(flat, pol.main_grads_dtype)
            if self.report_nan and S == 1:
                # no reduction: one XLA reduction per gradient leaf, in its own shape. A count over the flat
                # buffer made XLA write the flat gradient it had fused into the update; one custom call over
                # all leaves, grouped or flattened leaves all measured slower on one H200 (docs/decisions.md,
                # "`report_nan` checks the reduced gradient")
                flags.append(jnp.stack([jnp.any(~jnp.isfinite(as_sent(g))) for g in grads[group]])
                             .astype(jnp.float32))
            elif self.report_nan:
                flags.append(self._nonfinite_flags(flat, layout))
            out.append(flat.reshape(1, -1) if group == "m" and plan.tp else flat)   # TP: this rank's row
        # the loss and, with report_nan, one non-finite flag per parameter share one small all-reduce; with
        # TP the loss is the same on every TP rank (loss_fn's contract) and TP rank 0's copy is the one summed
        if plan.tp:
            loss = jnp.where(jax.lax.axis_index(self.tp_axis) == 0, loss, jnp.float32(0))
        stats = jax.lax.psum(jnp.concatenate([jnp.reshape(loss, (1,))] + flags), self._axes)
        out.insert(0, stats[0] / S)
        if self.report_nan:
            out.append(stats[1:] > 0)       # per parameter, in the order matrices then others
        return tuple(out)

    def _nonfinite_flags(self, flat, layout):
        """1.0 per parameter of ``layout`` with a non-finite element in this rank's shard of the *reduced*
        gradient (what the optimizer reads; a NaN or inf of any rank's gradient reaches the sum), else
        0.0. One pass over the shard (the grouped count op): each rank reads 1/S of the gradient."""
        r = jax.lax.axis_index(self.fsdp_axis)
        if flat.shape[0] != layout.shard_size:   # all-reduced: each rank checks its own shard's range
            flat = jax.lax.dynamic_slice_in_dim(flat, r * layout.shard_size, layout.shard_size)
        _, counts = ops.fp8_group_amax(flat, r, table=layout_group_table(layout, False), num_shards=layout.num_shards,
                                       return_nonfinite=True)
        return (counts > 0).astype(jnp.float32)

    def _grads(self, plan, weights, others, batch):
        scattered = self.strategy in ("optim_grads", "optim_grads_params")
        fsdp = self.fsdp_axis if scattered else None
        mat_spec = P(self.tp_axis, fsdp) if plan.tp else P(fsdp)
        out_specs = (P(), mat_spec, P(fsdp)) + ((P(),) if self.report_nan else ())
        fn = jax.shard_map(functools.partial(self._grad_body, plan), mesh=self.mesh,
                           in_specs=(self._weight_specs(plan), P(), P(self.fsdp_axis)), out_specs=out_specs)
        return fn(self._local_weights(weights, plan), others, batch)

    # -- one step ----------------------------------------------------------------------------

    def _step_fn(self, plan, state: TrainState, batch):
        master = state.master
        if self.strategy in ("optim", "optim_grads"):
            weights = state.weights
        else:
            weights = self._gather_weights(master["matrices"], plan)
        loss, g_mat, g_oth, *flags = self._grads(plan, weights, self._others(master["others"], plan), batch)
        grads = {"matrices": g_mat, "others": g_oth}
        if self._sharded:
            grads = jax.lax.with_sharding_constraint(grads, self._master_sharding(plan))
        new_master, opt_state, ok = apply_update(self.optimizer, grads, state, self._master_sharding(plan),
                                                 lambda o: self._like_master(o, plan),
                                                 flags[0] if self.report_nan else None)
        metrics = {"loss": loss}
        if self.report_nan:
            per_leaf = [None] * len(plan.names)
            for i, flag in zip(plan.matrix_leaves + plan.other_leaves, flags[0]):
                per_leaf[i] = flag
            metrics["nonfinite"] = jax.tree_util.tree_unflatten(plan.treedef, per_leaf)
            metrics["update_skipped"] = jnp.logical_not(ok)
        new_weights = (self._gather_weights(new_master["matrices"], plan)
                       if self.strategy in ("optim", "optim_grads") else None)
        return TrainState(new_master, opt_state, new_weights, state.step + 1, plan), metrics

    def _compiled(self, plan):
        if plan not in self._steps:
            self._steps[plan] = jax.jit(functools.partial(self._step_fn, plan), donate_argnums=0)
        return self._steps[plan]

    # -- public ------------------------------------------------------------------------------

    def init(self, params) -> TrainState:
        """State from ``params`` (a pytree of full arrays): flat main params, optimizer state, weights."""
        plan = _make_plan(params, self.num_shards, self.policy.compute_weights, self.tp_size, self.param_specs)
        leaves = jax.tree_util.tree_leaves(params)
        dtype = self.policy.main_params_dtype

        def build(leaves):
            master = {"matrices": plan.matrices.flatten([leaves[i] for i in plan.matrix_leaves], dtype),
                      "others": plan.others.flatten([leaves[i] for i in plan.other_leaves], dtype)}
            master = jax.lax.with_sharding_constraint(master, self._master_sharding(plan))
            opt_state = self.optimizer.init(master)
            opt_state = jax.lax.with_sharding_constraint(opt_state, self._like_master(opt_state, plan))
            weights = (self._gather_weights(master["matrices"], plan)
                       if self.strategy in ("optim", "optim_grads") else None)
            return TrainState(master, opt_state, weights, jnp.int32(0), plan)

        return jax.jit(build)(leaves)

    def params(self, state: TrainState):
        """The full main params as a pytree like the one given to ``init`` (replicated arrays)."""
        if not isinstance(state, TrainState):
            raise TypeError(f"state: must be the TrainState from step.init, got {type(state).__name__}")
        plan = state.plan

        def unpack(master):
            leaves = [None] * len(plan.names)
            for group, idx in (("matrices", plan.matrix_leaves), ("others", plan.other_leaves)):
                flat = jax.lax.with_sharding_constraint(master[group], self._replicated())
                for i, a in zip(idx, getattr(plan, group).unflatten(flat)):
                    leaves[i] = a
            return jax.tree_util.tree_unflatten(plan.treedef, leaves)

        return jax.jit(unpack)(state.master)

    # -- checkpoints: only the layer-wise step has a PyTorch-style state dict ------------------------

    def _no_state_dict(self, what):
        raise NotImplementedError(
            f"{what}: strategy {self.strategy!r} keeps the parameters and the optimizer state as flat buffers "
            f"that have no per-parameter PyTorch names, so it has no state dict; use the default strategy "
            f"'optim_grads_params' (layer-wise FSDP), whose step has state_dict / state_dict_target / "
            f"load_state_dict, or save step.params(state) (the full parameters, no optimizer state) with "
            f"jaxquant.checkpoint.save_dcp")

    def state_dict(self, state: TrainState, *, hyperparams=None) -> dict:
        """Not for this strategy (raises ``NotImplementedError`` naming it and the alternatives)."""
        self._no_state_dict("state_dict")

    def state_dict_target(self, like: TrainState) -> dict:
        """Not for this strategy (raises ``NotImplementedError``)."""
        self._no_state_dict("state_dict_target")

    def load_state_dict(self, state_dict: dict, *, like: TrainState, step_count=None) -> TrainState:
        """Not for this strategy (raises ``NotImplementedError``)."""
        self._no_state_dict("load_state_dict")

    def _check_call(self, state, batch):
        if not isinstance(state, TrainState):
            raise TypeError(f"state: must be the TrainState from step.init, got {type(state).__name__}")
        leaves = jax.tree_util.tree_leaves(batch)
        if not leaves:
            raise ValueError("batch: has no arrays")
        n = self.num_shards * self.microbatches
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if np.ndim(leaf) < 1 or np.shape(leaf)[0] % n:
                raise ValueError(f"batch{_leaf_name(path)}: the leading (batch) axis must be a multiple of "
                                 f"{self.fsdp_axis} size x microbatches = {self.num_shards} x {self.microbatches} "
                                 f"= {n}, got shape {tuple(np.shape(leaf))}")


_DEFAULT = object()


def make_train_step(loss_fn, optimizer, *, mesh, policy: Optional[MixedPrecisionPolicy] = None,
                    strategy: str = "optim_grads_params", microbatches: int = 1, report_nan: bool = False,
                    param_specs=None, fsdp_axis: str = "fsdp", tp_axis: Optional[str] = None,
                    replicate_axis: Optional[str] = None, quantize_mask=None, compiler_options=_DEFAULT,
                    reshard_after_forward: bool = True):
    """A jitted data-parallel training step.

    ``loss_fn(weights, batch) -> scalar``: ``weights`` is a pytree like ``params``; ``batch`` is the rank's
    microbatch. ``optimizer``: an optax ``GradientTransformation``. ``mesh`` must have ``fsdp_axis``;
    ``tp_axis`` (optional) is the tensor-parallel axis and ``param_specs`` (a pytree like ``params``, leaves
    ``"col"`` / ``"row"`` / None, or 0 / 1 / None) splits weights over it; ``loss_fn`` does the TP
    collectives itself (module docstring).

    ``strategy="optim_grads_params"`` (default) is layer-wise FSDP (``jaxquant.layerwise``): quantized
    leaves reach ``loss_fn`` as ``jq.ShardedWeight`` (one layer's weight, or a stack to ``jax.lax.scan``
    over) that ``jq.dense`` gathers where it is used. ``quantize_mask`` (optax's mask convention: a pytree
    of bools like ``params`` or a callable ``params -> pytree``) keeps leaves masked False unquantized:
    they arrive as bf16 arrays (matrices) or main-dtype arrays. ``replicate_axis`` adds HSDP.
    ``reshard_after_forward`` (PyTorch FSDP2's name): True (default) keeps no gathered weight past its layer's
    forward and gathers it again for the backward; False keeps each layer's gathered weight until its
    backward (one gather per layer and step instead of two; memory of the whole gathered model).
    ``compiler_options``: XLA options of the step's executable (default: on GPU, cuBLAS GEMMs instead of
    Triton fusions; None: XLA's defaults).

    The other strategies (``no_shard``, ``optim``, ``optim_grads``) keep whole-model compute weights
    (this module's docstring); their ``loss_fn`` receives every 2-D leaf as a compute weight.
    Mesh axes other than these must have size 1.
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
    if param_specs is not None and tp_axis is None:
        raise ValueError("param_specs: given without tp_axis; name the tensor-parallel mesh axis as tp_axis")
    if replicate_axis is not None and (replicate_axis not in mesh.axis_names
                                       or replicate_axis in (fsdp_axis, tp_axis)):
        raise ValueError(f"replicate_axis: {replicate_axis!r} must be a mesh axis other than the fsdp and tp axes "
                         f"(axes {mesh.axis_names})")
    if strategy != "optim_grads_params" and (replicate_axis is not None or quantize_mask is not None):
        raise ValueError(f"replicate_axis / quantize_mask: only with strategy='optim_grads_params', got {strategy!r}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward: must be a bool, got {type(reshard_after_forward).__name__}")
    if strategy != "optim_grads_params" and not reshard_after_forward:
        raise ValueError(f"reshard_after_forward: False needs strategy='optim_grads_params' (the flat strategies "
                         f"gather the whole model once per step), got {strategy!r}")
    for axis in mesh.axis_names:
        if axis not in (fsdp_axis, tp_axis, replicate_axis) and mesh.shape[axis] != 1:
            raise ValueError(f"mesh: axis {axis!r} has size {mesh.shape[axis]}; only {fsdp_axis!r} (data parallel),"
                             f" the tp_axis and the replicate_axis may be larger than 1")
    if compiler_options is _DEFAULT:
        compiler_options = default_compiler_options(mesh)
    if strategy == "optim_grads_params":
        return LayerwiseTrainStep(loss_fn, optimizer, mesh, policy, int(microbatches), bool(report_nan), fsdp_axis,
                                  tp_axis, param_specs, replicate_axis, quantize_mask, compiler_options,
                                  reshard_after_forward)
    return TrainStep(loss_fn, optimizer, mesh, policy, strategy, int(microbatches), bool(report_nan), fsdp_axis,
                     tp_axis, param_specs)
