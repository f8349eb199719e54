"""Layer-wise FSDP: a master weight shard that is quantized and all-gathered where a layer reads it.

``ShardedWeight`` is what ``make_train_step`` (every strategy) hands ``loss_fn`` for a quantized parameter:
this rank's rows of the fp32 master (``shard``), a gradient sink (``grad``), static rules (``WeightSpec``) and,
for the strategies that gather once a step (``WeightSpec.per_use`` False), the gathered operands
(``gathered``; then ``jq.dense`` reads those and neither quantizes nor gathers). It is a pytree, so
``jax.lax.scan`` over a stacked ``[L, out, in]`` leaf hands the body one layer's ``ShardedWeight``. A layer
uses it in one of two ways:

* ``jq.dense(x, w)``: one ``custom_vjp`` that quantizes the shard, all-gathers the quantized bytes, runs
  the GEMM and keeps only this rank's quantized rows as residuals; the backward gathers them again (and
  builds the columnwise copy; an FP8 weight of one shard has its cast write both layouts instead,
  ``keeps_columnwise``; an NVFP4 weight of one shard makes its bf16 GEMM operand once and keeps that,
  ``dequantizes_once``) and reduce-scatters ``dW`` into ``grad`` right after the weight-gradient GEMM.
  By default no layer's gathered weight outlives the layer (PyTorch FSDP2's reshard-after-forward); with
  ``make_train_step(reshard_after_forward=False)`` (``WeightSpec.keep_gathered``) the gathered operands
  are the residual and the backward gathers nothing;
* ``w.gather()``: the gathered compute weight (bf16 array, ``Float8Tensor`` or ``NVFP4Tensor`` with its
  straight-through gradient target), for layers of one's own that take quantized tensors (the step's
  sequence-parallel layers, ``jq.sp_column_dense`` / ``jq.sp_row_dense``, go through ``jq.dense``).

Quantizing rows: per-tensor FP8 scaling needs the whole weight's amax (one scalar ``pmax`` over the
axes that split the weight); NVFP4 16x16 tiles are whole inside a shard whose row count is a multiple
of 16, so each rank derives the same tile scales it would from the whole weight (docs/numerics.md §2.2-
§2.5) and the gathered bytes equal ``quantize_fp8`` / ``quantize_nvfp4`` of the whole weight.

Gradients (``GradReduce``): ``dW`` (the fp32 GEMM output rounded to bf16, the weight gradient of a bf16 layer; a
gathered array's gradient in its own dtype) is rounded to the main-grads dtype, scaled by ``1/(data-parallel ranks
x microbatches)``, rounded to the comm dtype and reduce-scattered over the FSDP axis (a bf16 ``dW`` and a power-
of-two scale: reduce-scattered first and the reduced rows scaled, the same bits but out of the normal range,
:func:`scales_after_the_sum`); ``grad`` holds the comm dtype and ``make_train_step`` converts it to the main-grads
dtype. Axes the weight is replicated over while the activations vary (the FSDP axis of an unsharded leaf, an HSDP
replicate axis, the TP axis of a TP-replicated weight) are summed by JAX's own transpose of the broadcast
(``psum`` in the comm dtype).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import formats, ops, reference
from jaxquant.primitives.gemm import FWD_FP8, nvfp4_global_decode
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor, straight_through
from jaxquant.primitives.varying import mark_varying, vary_like

COMPUTE_DTYPE = formats.COMPUTE_DTYPE

# A stacked master's per-layer amaxes (:func:`weight_amax`) are reduced in a pass of their own
# (JAXQUANT_SEPARATE_STACKED_AMAX=0 turns it off). Left to XLA, the reduction joins the optimizer's update of the
# whole stack, and that fusion became a row-reduction kernel slower than plain JAX's update of the same bytes
# (docs/performance.md, third round), where a pass of its own reads a fraction of the bytes the update moves.
# Per-layer leaves keep the fused reduction, which cost about nothing there.
SEPARATE_STACKED_AMAX = os.environ.get("JAXQUANT_SEPARATE_STACKED_AMAX", "1") == "1"


class GradReduce(NamedTuple):
    """How a weight gradient reaches the master shard (static)."""

    scale: float                 # 1 / (data-parallel ranks x microbatches): the full-batch mean loss
    main_dtype: np.dtype         # the optimizer's gradient dtype (rounded to it before scaling)
    comm_dtype: np.dtype         # the dtype on the wire (and of ``ShardedWeight.grad``)


class WeightSpec(NamedTuple):
    """Static rules of a ``ShardedWeight``.

    ``recipe``: compute weight, ``"bf16"``, ``"fp8"`` or ``"nvfp4"``; ``gather_axis``: the FSDP mesh axis
    the rows are sharded over (None: this rank holds every row); ``num_shards``: its size;
    ``amax_axes``: the mesh axes that split the weight (the FP8/NVFP4 amax is max-reduced over them);
    ``grad``: the gradient's way back; ``vary_axes``: axes the gathered weight is marked varying over
    although replicated (the unsharded FSDP axis, the replicate axis), so its gradient is reduced here;
    ``keep_gathered``: ``jq.dense`` keeps the gathered operands for the backward instead of gathering again
    (FSDP2's ``reshard_after_forward=False``: less communication, the whole layer's weight held until its
    backward);
    ``per_use``: True, the weight is quantized and gathered where a layer reads it (ZeRO-3); False, the step
    gathers it once before the first microbatch and hands it over in ``ShardedWeight.gathered`` (ZeRO 0-2:
    the compute weights are whole on every rank for the whole step);
    ``grad_sharded``: True, each microbatch's ``dW`` is reduce-scattered in the backward (ZeRO 2-3); False,
    it stays this rank's unreduced sum over the full rows in the main-grads dtype and the step all-reduces it
    once (ZeRO 0-1: one gradient all-reduce a step, as DDP does across microbatches);
    ``transposed``: the weight is stored ``[in, out]`` (flax's kernels, ``ParamRule(kernel="in_out")``): its
    rows are ``in``, and ``jq.dense(x, w)`` computes ``x @ w`` reading the same quantized bytes (per-tensor FP8
    scaling and 16x16 NVFP4 tiles do not depend on the orientation).
    """

    recipe: str
    gather_axis: Optional[str]
    num_shards: int
    amax_axes: tuple
    grad: GradReduce
    vary_axes: tuple = ()
    keep_gathered: bool = False
    per_use: bool = True
    grad_sharded: bool = True
    transposed: bool = False
    rows_from_end: int = 2       # the FSDP-split axis counted from the end: 2 for matrices, 1 for vectors
    pad_rows: int = 0            # zero rows after the (TP-local) rows so that they split (dropped when gathered)

    @property
    def grad_dtype(self):
        """dtype of the gradient sink: what travels (comm dtype), or the unreduced main-dtype sum."""
        return self.grad.comm_dtype if self.grad_sharded else self.grad.main_dtype

    def rows_axis(self, ndim: int) -> int:
        """The axis rows are split over FSDP along in an array of ``ndim`` (a whole leaf, a stack or one layer):
        ``out`` of ``[..., out, in]``, a vector's own axis; never a stack's layer axis."""
        return max(ndim - self.rows_from_end, 0)


def pad_row_blocks(a, spec: WeightSpec, blocks: int = 1):
    """A whole leaf ``a`` with ``spec.pad_rows`` zero rows after each of its ``blocks`` row blocks (one per TP rank
    of a column-parallel weight): how the state stores a leaf whose rows do not split over FSDP (FSDP2's padding)."""
    if not spec.pad_rows:
        return a
    axis = spec.rows_axis(a.ndim)
    split = a.reshape(a.shape[:axis] + (blocks, a.shape[axis] // blocks) + a.shape[axis + 1:])
    widths = [(0, 0)] * split.ndim
    widths[axis + 1] = (0, spec.pad_rows)
    return jnp.pad(split, widths).reshape(a.shape[:axis] + (-1,) + a.shape[axis + 1:])


def unpad_row_blocks(a, spec: WeightSpec, blocks: int = 1):
    """The inverse of :func:`pad_row_blocks`."""
    if not spec.pad_rows:
        return a
    axis = spec.rows_axis(a.ndim)
    split = a.reshape(a.shape[:axis] + (blocks, a.shape[axis] // blocks) + a.shape[axis + 1:])
    kept = jax.lax.slice_in_dim(split, 0, split.shape[axis + 1] - spec.pad_rows, axis=axis + 1)
    return kept.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 1:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedWeight:
    """This rank's rows of a master weight ``[..., out, in]`` (``[..., in, out]`` when ``spec.transposed``;
    ``shard``: the rows split over ``num_shards``, padding rows included) and its gradient sink ``grad`` (zeros
    in ``spec.grad_dtype``: the shard's shape, or every row where the gradient is reduced once a step;
    differentiate with respect to it). ``shape`` is the logical (gathered, unpadded) shape, ``dtype`` the
    compute dtype the layer sees; ``gathered``: the step's once-a-step gathered operands, or None; ``local``:
    this rank's rows already quantized once a step (:func:`quantize_once`), which the layer only gathers."""

    shard: jax.Array
    grad: jax.Array
    spec: WeightSpec = dataclasses.field(metadata=dict(static=True))
    gathered: Optional[dict] = None   # the step's once-a-step gathered operands (``spec.per_use`` False)
    local: Optional[dict] = None      # the step's once-a-step quantized rows (:func:`quantize_shard`'s dict)
    amax: Optional[jax.Array] = None  # FP8, NVFP4 of one shard: the whole weight's amax (:func:`weight_amax`), or None

    @property
    def shape(self) -> tuple:
        s = tuple(self.shard.shape)
        return s[:-2] + (s[-2] * self.spec.num_shards - self.spec.pad_rows, s[-1]) if len(s) >= 2 else s

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return COMPUTE_DTYPE

    def gather(self):
        """The gathered compute weight of one layer: a bf16 array, or a ``Float8Tensor`` / ``NVFP4Tensor``
        (rowwise and columnwise) whose ``jq.dense`` weight gradient reaches ``grad``. Unlike
        ``jq.dense(x, w)``, a layer that keeps the result keeps the gathered weight for its backward."""
        check_layer(self, "w")
        if self.spec.transposed:
            raise ValueError(f"w: an [in, out] ShardedWeight of shape {self.shape} is read by jq.dense only (x @ w); "
                             f"gather() gives [out, in] weights")
        if self.spec.recipe == "bf16":
            return gather_array(self.shard, self.grad, self.spec, None if self.gathered is None else self.gathered["w"])
        operands = (self.gathered if self.gathered is not None else
                    gathered_operands(self.local, self.spec, False) if self.local is not None else
                    gather_once(self.shard, self.spec, amax=self.amax))
        q = jax.lax.stop_gradient(tensor_of(with_columnwise(operands, self.spec)))
        return straight_through(q, _grad_funnel(self.grad, self.spec, q.shape))


def check_layer(w: ShardedWeight, name: str) -> None:
    """ValueError unless ``w`` is one layer's ``[out, in]`` weight (not a stack of layers)."""
    if w.shard.ndim != 2:
        raise ValueError(f"{name}: a ShardedWeight of shape {w.shape} is a stack of layers; use one layer "
                         f"(index it, or jax.lax.scan over the stack) as a [out, in] weight")


# ----------------------------------------------------------------------------------------------
# A weight's way to the GEMMs, in the order a layer runs it: quantize this rank's rows (one amax pmax),
# gather the quantized rows, build the columnwise copy for the backward; the gradient's way back below
# ----------------------------------------------------------------------------------------------


def forward_weight(shard, gathered, local, spec: WeightSpec, amax=None):
    """(the operands ``jq.dense``'s forward GEMM reads, what its backward keeps of the weight).

    ``gathered``: the step's once-a-step gather (``spec.per_use`` False), read forward and backward as it is;
    ``local``: this rank's rows quantized once a step (:func:`quantize_once`), gathered here without a cast or an
    amax reduction; otherwise this rank's rows are quantized (:func:`quantize_rows`, with the precomputed ``amax``
    when given) and gathered. The backward
    keeps this rank's quantized rows (FSDP2's reshard after forward: it gathers again, with no second cast; an FP8
    weight of one shard casts both layouts and keeps the one the backward reads, :func:`keeps_columnwise`; an NVFP4
    weight of one shard keeps the bf16 operand its forward read, :func:`dequantizes_once`), or with
    ``spec.keep_gathered`` the gathered operands (no second gather)."""
    if gathered is not None:
        return gathered, gathered
    if local is None and dequantizes_once(spec):   # the GEMMs' bf16 operand, made once, read forward and backward
        # the barrier, as below: under scan XLA cloned the pass into the residual's stacked write otherwise
        operands = jax.lax.optimization_barrier(dequantized_operands(shard, spec, amax))
        return operands, operands
    if local is None:
        columnwise = keeps_columnwise(spec)
        # one cast for both users (the gather and the residual): under scan, XLA's GPU dynamic-slice fusion
        # otherwise clones the cast into the residual's stacked write, casting every weight twice
        local = jax.lax.optimization_barrier(quantize_rows(shard, spec, amax, columnwise=columnwise))
        if columnwise:   # each GEMM reads the layout it needs (forward_operands, backward_weight), none transposed
            read, kept = ("data_t", "data") if spec.transposed else ("data", "data_t")
            return (forward_operands({k: v for k, v in local.items() if k != kept}, spec),
                    {k: v for k, v in local.items() if k != read})
    gathered = forward_operands(local, spec)
    return gathered, (gathered if spec.keep_gathered else local)


def keeps_columnwise(spec: WeightSpec) -> bool:
    """Whether :func:`forward_weight` casts an FP8 weight with its columnwise copy, so that neither GEMM reads a
    transpose made for it: a weight quantized where it is read, not split over ranks (one shard: nothing is gathered
    between the cast and the GEMMs) and not kept gathered. The cast writes both layouts in one pass
    (``ops.fp8_quantize(columnwise=True)``: the same bytes as the transpose of the rowwise ones).

    An ``[out, in]`` weight's forward reads the rowwise bytes and the backward keeps the columnwise ones for its dgrad
    (TN), instead of transposing the residual in the backward. Under ``scan`` that transpose's operand is a slice of
    the stacked residual, and XLA (jax 0.11.2, for the row-major operand of ``jq_fp8_gemm``) transposed the whole
    stack before the backward loop and copied each layer's strided slice out of it inside the loop. An ``[in, out]``
    weight (flax's kernels) is read the other way round: its forward reads the columnwise bytes (a transpose of the
    cast's result in every forward otherwise, one kernel a weight use on an H200) and the backward keeps the rowwise
    ones. Rows split over ranks are gathered before their transpose, which stays one layer's transpose: those keep
    the rowwise bytes."""
    return spec.recipe == "fp8" and _one_shard_per_use(spec)


def _one_shard_per_use(spec: WeightSpec) -> bool:
    """A weight in one shard (one rank on its FSDP axis, or not split; no padding rows) quantized where it is read
    and not kept gathered: nothing is gathered between its cast and its GEMMs (:func:`keeps_columnwise`,
    :func:`dequantizes_once`)."""
    return spec.num_shards == 1 and not spec.pad_rows and spec.per_use and not spec.keep_gathered


def dequantizes_once(spec: WeightSpec) -> bool:
    """Whether :func:`forward_weight` makes an NVFP4 weight's bf16 GEMM operand (``value(q) * s8``) straight from its
    master rows in one pass (:func:`dequantized_operands`) and keeps it for the backward's dgrad: a weight quantized
    where it is read, not split over ranks (one shard: no bytes are gathered, so the packed bytes are needed by
    nothing but the two decodes) and not kept gathered; ``[in, out]`` weights too (the GEMMs read the same operand
    contracted on the other axis).

    Per element and step that is one read of the fp32 master and one bf16 write (6 bytes, what plain JAX's cast
    costs), where the statistics pass, the cast and one decode per GEMM (the forward's and the dgrad's: XLA does not
    fuse a decode into the cuBLAS GEMM that reads it) read and wrote about 13.5; the residual is the bf16 operand
    (2 bytes an element, as plain JAX's bf16 weight) instead of the packed bytes. The whole weight's amax comes
    from ``TrainState.weight_amax`` (:func:`weight_amax`, computed by the update that wrote the master), so no
    statistics pass runs. Same bytes: the op's reference is the statistics pass, the cast and the decode composed.

    A weight split over ranks gathers its packed bytes instead: dequantizing the rows before a bf16 gather was timed
    at the 13B shape on two H200s and gained nothing (docs/fsdp.md)."""
    return spec.recipe == "nvfp4" and _one_shard_per_use(spec)


def dequantized_operands(shard, spec: WeightSpec, amax=None) -> dict:
    """The operands of :func:`dequantizes_once`'s weight: ``operand``, the bf16 ``value(q) * s8`` of every element
    (``ops.nvfp4_bf16_operand``: the rows' own tile amaxes, the whole weight's ``amax``), ``dec`` and ``amax``;
    ``amax`` precomputed by :func:`weight_amax`, or None (a state built by hand: one statistics pass finds it)."""
    amax = statistics(shard, spec)[0] if amax is None else _given_amax(amax, spec)
    operand = _all_gather(ops.nvfp4_bf16_operand(shard, amax, compute_dtype=COMPUTE_DTYPE), spec)
    return {"operand": operand, "dec": nvfp4_global_decode(amax), "amax": amax}


def backward_weight(kept, spec: WeightSpec) -> dict:
    """The operands ``jq.dense``'s backward GEMMs read, from what :func:`forward_weight` kept: FP8 GEMMs need the
    transposed bytes (TN) of an ``[out, in]`` weight; NVFP4's bf16 GEMM reads the rowwise bytes transposed, or the
    bf16 operand :func:`dequantizes_once` kept; a transposed (``[in, out]``) weight's dgrad reads its rowwise bytes."""
    if "operand" in kept:
        return kept
    columnwise = spec.recipe == "fp8" and not spec.transposed
    if spec.keep_gathered or not spec.per_use:
        return with_columnwise(kept, spec) if columnwise else kept
    return gathered_operands(kept, spec, columnwise=columnwise)


def quantize_rows(shard, spec: WeightSpec, amax=None, columnwise: bool = False) -> dict:
    """:func:`quantize_shard` of this rank's rows with their own :func:`statistics` (one scalar ``pmax``), or with the
    whole weight's ``amax`` precomputed by :func:`weight_amax`: no reduction (otherwise a small all-reduce per layer
    use, which XLA left synchronous in the 13B NVFP4 step compiled for two GPUs), and for FP8 no amax pass. NVFP4
    still runs the statistics pass over this rank's rows for their tile amaxes; its largest is this rank's share of
    the same amax."""
    if spec.recipe == "bf16":
        return quantize_shard(shard, spec, None)
    if amax is None:
        return quantize_shard(shard, spec, statistics(shard, spec), columnwise)
    tiles = local_statistics(shard, spec)[1] if spec.recipe == "nvfp4" else None
    return quantize_shard(shard, spec, (_given_amax(amax, spec), tiles), columnwise)


def _given_amax(amax, spec: WeightSpec):
    """A precomputed amax (:func:`weight_amax`) marked varying over the amax axes, as :func:`statistics`' ``pmax``
    result is made (ops' custom-call and reference branches must agree on it)."""
    return mark_varying(amax, spec.amax_axes) if spec.amax_axes else amax


def weight_amax(master):
    """The amax of every layer of an FP8 (or :func:`dequantizes_once` NVFP4) compute weight's (global,
    unsharded-view) master leaf ``[..., rows, cols]``, after bf16 rounding (docs/numerics.md §1.1, §2.1 and "Compute
    dtype": both recipes' amax is of the bf16-rounded values): shape ``[...]``. The same value as :func:`statistics`
    of each layer (this rank's rows' amax, NVFP4's the max of its tile amaxes, max-reduced over the axes that split
    the weight: a max is a max, however grouped). Left to XLA in the step that writes the master, which fuses the
    reduction into the optimizer's update (seen in the H200 profiles of docs/performance.md: one fusion writes the
    update and reduces the amax); with :data:`SEPARATE_STACKED_AMAX` a stacked leaf's in a pass of its own."""
    fn = lambda layer: reference.fp8_stats(layer, compute_dtype=COMPUTE_DTYPE)[0]
    if SEPARATE_STACKED_AMAX and master.ndim > 2:
        master = jax.lax.optimization_barrier(master)   # the update's fusion ends here; the values are unchanged
    return _per_layer(fn, master.ndim)(master)


def statistics(shard, spec: WeightSpec):
    """(amax of the whole weight, NVFP4 tile amaxes of the shard or None): one scalar ``pmax``."""
    amax, tiles = local_statistics(shard, spec)
    return _max_over(amax, spec.amax_axes), tiles


def local_statistics(shard, spec: WeightSpec):
    """(amax of this rank's rows, NVFP4 tile amaxes of the shard or None)."""
    if spec.recipe == "fp8":
        return ops.fp8_stats(shard, compute_dtype=COMPUTE_DTYPE)[0], None
    tiles, amax, _ = ops.nvfp4_stats(shard, compute_dtype=COMPUTE_DTYPE)
    return amax, tiles


def _max_over(amax, axes):
    # varying again after the reduction: ops' custom-call and reference branches must agree on it
    return mark_varying(jax.lax.pmax(amax, axes), axes) if axes else amax


def quantize_shard(shard, spec: WeightSpec, stats, columnwise: bool = False) -> dict:
    """This rank's rows in the compute format, ready to gather (what the backward keeps instead of the
    gathered weight): bf16 ``w``; FP8 ``data``, ``scale_inv`` (with ``columnwise``, FP8 only, also ``data_t``, the
    rows' transpose, written by the same pass); NVFP4 ``data``, ``scales`` (the unpadded rows of ``scale_inv``),
    ``amax``. ``stats`` comes from :func:`statistics` (None for bf16)."""
    if spec.recipe == "bf16":
        return {"w": formats.to_compute_dtype(shard, COMPUTE_DTYPE)}
    amax, tiles = stats
    if spec.recipe == "fp8":
        data, scale_inv, data_t = ops.fp8_quantize(shard, amax, dtype=FWD_FP8, compute_dtype=COMPUTE_DTYPE,
                                                   columnwise=columnwise)
        out = {"data": data, "scale_inv": jnp.reshape(scale_inv, ()), "amax": amax}
        return out | ({"data_t": data_t} if columnwise else {})
    rows, cols = shard.shape
    data, scale_inv, _, _ = ops.nvfp4_quantize(shard, tiles, amax, compute_dtype=COMPUTE_DTYPE)
    return {"data": data, "scales": scale_inv[:rows, : cols // formats.TILE], "amax": amax}


def forward_operands(local: dict, spec: WeightSpec) -> dict:
    """The gathered operands ``jq.dense``'s forward reads: FP8 GEMMs take K-major (TN) operands, so an ``[in, out]``
    weight's forward reads its columnwise bytes."""
    return gathered_operands(local, spec, columnwise=spec.recipe == "fp8" and spec.transposed)


def gathered_operands(local: dict, spec: WeightSpec, columnwise: bool) -> dict:
    """The GEMM operands of the gathered weight, as ``jq.dense`` reads them (docs/numerics.md §1.7, §2.7),
    from :func:`quantize_shard`'s ``local``: bf16 ``w``; FP8 ``data`` [``data_t``], ``scale_inv``, ``amax`` (only
    ``data_t`` from the columnwise bytes of :func:`keeps_columnwise` without the rowwise ones);
    NVFP4 ``data``, ``scale_inv`` [``data_t``, ``scale_inv_t``], ``dec``, ``amax``."""
    if spec.recipe == "bf16":
        return {"w": _all_gather(local["w"], spec)}
    if "data" not in local:   # the columnwise bytes of one shard (keeps_columnwise): its gather moves nothing
        return {"data_t": _all_gather(local["data_t"], spec), "scale_inv": local["scale_inv"], "amax": local["amax"]}
    data = _all_gather(local["data"], spec)
    if spec.recipe == "fp8":
        out = {"data": data, "scale_inv": local["scale_inv"], "amax": local["amax"]}
    else:
        rows, cols = data.shape[0], data.shape[1] * 2
        pr, pc = formats.nvfp4_scale_shape(rows, cols)
        scales = _all_gather(local["scales"], spec)
        scale_inv = jnp.pad(scales, ((0, pr - rows), (0, pc - cols // formats.TILE)))   # §2.7 padding: zeros
        out = {"data": data, "scale_inv": scale_inv, "dec": nvfp4_global_decode(local["amax"]), "amax": local["amax"]}
    return with_columnwise(out, spec) if columnwise else out


def _all_gather(a, spec: WeightSpec):
    """Rows of every FSDP rank in order; marked varying (not invariant) so that the consumers' gradients
    arrive per rank and are reduce-scattered here, in the comm dtype."""
    if spec.gather_axis is not None:
        axis = spec.rows_axis(a.ndim)
        a = jax.lax.all_gather(a, spec.gather_axis, axis=axis, tiled=True)
        if spec.pad_rows:   # the padding rows are zeros that no layer reads
            a = jax.lax.slice_in_dim(a, 0, a.shape[axis] - spec.pad_rows, axis=axis)
    return mark_varying(a, spec.vary_axes)


def with_columnwise(operands: dict, spec: WeightSpec) -> dict:
    """Gathered operands with the columnwise copy the dgrad GEMM reads: FP8 ``data_t`` (TN layout), NVFP4
    ``data_t`` and ``scale_inv_t`` (docs/numerics.md §2.6); bf16 and operands that have it: unchanged."""
    if spec.recipe == "bf16" or "data_t" in operands:
        return operands
    data = operands["data"]
    if spec.recipe == "fp8":
        return operands | {"data_t": data.T}
    rows, cols = data.shape[0], data.shape[1] * 2
    return operands | {"data_t": ops.nvfp4_transpose(data),
                       "scale_inv_t": ops.nvfp4_scale_transpose(operands["scale_inv"], rows=rows, cols=cols)}


# The once-a-step forms (``WeightSpec.per_use`` False, ``quantize_once``) and the gathered tensor of ``gather()``


def quantize_once(shards: list, specs: list) -> list:
    """Every weight's rows quantized (:func:`quantize_shard`, each layer of a stack with its own scales), the amaxes
    of all of them max-reduced in one packed ``pmax`` per set of amax axes (not one scalar all-reduce a layer): what
    the step does once, before the first microbatch, so that a layer only gathers (``ShardedWeight.local``).
    The bytes equal :func:`statistics` + :func:`quantize_shard` per layer (a max is a max, however grouped)."""
    stats = [None if spec.recipe == "bf16" else _per_layer(lambda s, sp=spec: local_statistics(s, sp), s.ndim)(s)
             for s, spec in zip(shards, specs)]
    groups = {}
    for i, (st, spec) in enumerate(zip(stats, specs)):
        if st is not None and spec.amax_axes:
            groups.setdefault(tuple(spec.amax_axes), []).append(i)
    for axes, members in groups.items():
        packed = _max_over(jnp.concatenate([stats[i][0].reshape(-1).astype(jnp.float32) for i in members]), axes)
        at = 0
        for i in members:
            amax, tiles = stats[i]
            stats[i] = (packed[at: at + amax.size].reshape(amax.shape).astype(amax.dtype), tiles)
            at += amax.size
    # (bf16: stats None, an empty pytree that vmap passes through)
    return [_per_layer(lambda s, st, sp=spec: quantize_shard(s, sp, st), s.ndim)(s, st)
            for s, st, spec in zip(shards, stats, specs)]


def _per_layer(fn, ndim: int):
    """``fn`` of one layer's rows, mapped over the leading (stack) axes of an array of ``ndim``."""
    for _ in range(ndim - 2):
        fn = jax.vmap(fn)
    return fn


def gather_once(shard, spec: WeightSpec, columnwise: bool = False, amax=None) -> dict:
    """Quantize this rank's rows and gather them: :func:`gathered_operands` of one layer, or of every layer
    of a stack ``[..., rows, in]`` (each layer with its own scales, all gathered in one collective); ``amax``: the
    precomputed amaxes (:func:`weight_amax`, shape ``[...]``) or None."""
    fn = lambda s, a: gathered_operands(quantize_rows(s, spec, a), spec, columnwise)
    return _per_layer(fn, shard.ndim)(shard, amax)     # vmap passes amax=None through (an empty pytree)


def tensor_of(operands: dict):
    """The ``Float8Tensor`` / ``NVFP4Tensor`` of :func:`gathered_operands` with ``columnwise=True``: what
    ``quantize_fp8`` / ``quantize_nvfp4`` with ``columnwise=True`` give for the whole (TP-local) weight."""
    o = operands
    if "dec" not in o:
        return Float8Tensor(data=o["data"], scale_inv=o["scale_inv"], amax=jnp.reshape(o["amax"], ()),
                            data_t=o["data_t"])
    rows, cols = o["data"].shape[0], o["data"].shape[1] * 2
    return NVFP4Tensor(data=o["data"], scale_inv=o["scale_inv"], amax=jnp.reshape(o["amax"], (1,)), data_t=o["data_t"],
                       scale_inv_t=o["scale_inv_t"], shape=(rows, cols))


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------


def reduce_scatters(spec: WeightSpec) -> bool:
    """Whether :func:`reduce_grad` reduce-scatters the weight's gradient (sharded gradient, an FSDP axis)."""
    return spec.grad_sharded and spec.gather_axis is not None


def reduce_grad(dw, spec: WeightSpec, *, sum_vary_axes: bool = True):
    """This rank's share of ``dW`` [rows, in] (in the gradient dtype of what the layer read: bf16 for compute
    weights, the array's dtype for gathered arrays) -> its rows of the reduced gradient, comm dtype; or, when
    the gradient is not sharded (``spec.grad_sharded`` False), the scaled unreduced gradient in the main-grads
    dtype (the step sums it over the data-parallel ranks once). ``sum_vary_axes=False`` leaves the sum over
    ``spec.vary_axes`` to the caller's broadcast (:func:`vary_like`)."""
    g = spec.grad
    if spec.pad_rows:   # zero gradients for the padding rows
        widths = [(0, 0)] * dw.ndim
        widths[spec.rows_axis(dw.ndim)] = (0, spec.pad_rows)
        dw = jnp.pad(dw, widths)
    after_the_sum = scales_after_the_sum(dw, spec)
    if after_the_sum or rounds_to_itself(dw, spec):
        x = dw
    else:
        x = formats.to_compute_dtype(dw, g.main_dtype).astype(jnp.float32) * np.float32(g.scale)
        x = formats.to_compute_dtype(x, g.main_dtype)
        if spec.grad_sharded:
            x = formats.to_compute_dtype(x, g.comm_dtype)
    if not spec.grad_sharded:
        return x
    if reduce_scatters(spec):
        x = jax.lax.psum_scatter(x, spec.gather_axis, scatter_dimension=spec.rows_axis(x.ndim), tiled=True)
    if after_the_sum:    # exact: a power of two (fused by XLA into what reads the reduced rows)
        x = (x.astype(jnp.float32) * np.float32(g.scale)).astype(g.comm_dtype)
    if spec.vary_axes and sum_vary_axes:
        x = jax.lax.psum(x, spec.vary_axes)
    return x


def rounds_to_itself(dw, spec: WeightSpec) -> bool:
    """Whether :func:`reduce_grad`'s roundings and scaling leave ``dw`` as it is, bit for bit: a scale of 1, the
    result dtype (comm, or main when unsharded) ``dw``'s own, and a main dtype that holds ``dw``'s values exactly
    (its own, or fp32). Then ``dw`` goes on unconverted: under ``scan`` XLA's dynamic-slice fusion lets the
    weight-gradient GEMM (``jq_fp8_gemm``) write it straight into the stacked gradient, which the bf16 -> fp32 ->
    reduce_precision -> bf16 round trip, an identity XLA does not remove, turned into a copy of every layer's dW
    (docs/performance.md)."""
    return float(spec.grad.scale) == 1.0 and _arrives_exact(dw, spec)


def _arrives_exact(dw, spec: WeightSpec) -> bool:
    """``dw`` already in :func:`reduce_grad`'s result dtype (comm, or main when unsharded) and a main dtype that holds
    its values exactly (its own, or fp32): no rounding of the chain changes it."""
    g = spec.grad
    out = jnp.dtype(g.comm_dtype if spec.grad_sharded else g.main_dtype)
    return jnp.dtype(dw.dtype) == out and jnp.dtype(g.main_dtype) in (jnp.dtype(jnp.float32), out)


def scales_after_the_sum(dw, spec: WeightSpec) -> bool:
    """Whether :func:`reduce_grad` reduce-scatters ``dw`` as it came and scales this rank's reduced rows: a scale that
    is a power of two other than 1 (``1 / (ranks x microbatches)`` with both powers of two), ``dw`` already in the comm
    dtype and a main dtype that holds it exactly (fp32 or the comm dtype). Scaling by a power of two is exact and
    commutes with every rounding of the sum, so the rows are those of scaling each rank's ``dw`` first, bit for bit,
    but where a value leaves the dtype's normal range: a sum of at least 2**128 before its scaling (inf, where
    scaling first kept it finite) or a scaled value below 2**-126 (subnormal, rounded once instead of per addend).
    Scaling first is a pass over the whole ``dw`` of every weight and step, on two GPUs or more only (one rank's
    scale is 1); scaling the reduced rows costs nothing, as XLA fuses it into what reads them (the stacked gradient's
    update under ``scan``, the optimizer's update otherwise)."""
    scale = float(spec.grad.scale)
    return reduce_scatters(spec) and scale != 1.0 and math.frexp(scale)[0] == 0.5 and _arrives_exact(dw, spec)


def gather_array(shard, grad, spec: WeightSpec, gathered=None):
    """The gathered array: bf16 (``recipe="bf16"``) or in the shard's own dtype (any other recipe name,
    e.g. ``"keep"``); its gradient is reduced into ``grad`` as for a weight. ``gathered``: the step's
    once-a-step gather of it (``spec.per_use`` False), handed over as is."""
    return _gather_array(shard, grad, gathered, spec)


def gathered_array(shard, spec: WeightSpec):
    a = formats.to_compute_dtype(shard, COMPUTE_DTYPE) if spec.recipe == "bf16" else shard
    return _all_gather(a, spec)


def _gather_array_fwd(shard, grad, gathered, spec):
    return (gathered_array(shard, spec) if gathered is None else gathered), None


def _gather_array_bwd(spec, _, ct):
    return None, reduce_grad(ct, spec), None


_gather_array = jax.custom_vjp(lambda shard, grad, gathered, spec: _gather_array_fwd(shard, grad, gathered, spec)[0],
                               nondiff_argnums=(3,))
_gather_array.defvjp(_gather_array_fwd, _gather_array_bwd)


def _funnel_zeros(grad, spec, shape):
    """The straight-through target of a gathered weight: zeros (never built) varying as the gathered weight."""
    z = vary_like(jnp.zeros(shape, COMPUTE_DTYPE), grad)   # grad, a shard, varies over the gather axis
    return mark_varying(z, spec.vary_axes)


def _funnel_fwd(grad, spec, shape):
    return _funnel_zeros(grad, spec, shape), None


def _funnel_bwd(spec, shape, _, ct):
    return (reduce_grad(ct, spec),)


_grad_funnel = jax.custom_vjp(_funnel_zeros, nondiff_argnums=(1, 2))
_grad_funnel.defvjp(_funnel_fwd, _funnel_bwd)
