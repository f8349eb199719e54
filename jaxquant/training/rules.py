"""Which parameters are quantized, split over TP and stacked: rules on parameter paths, or the simple forms.

``ParamRule`` (qwix's ``QtRule`` / MaxText's logical axis rules in spirit): a regular expression on a leaf's
dotted path (``"blocks.w1"``, ``"layers.0.attention.wq"``; dict keys, sequence indices and attribute names
joined by dots) and what to do with the leaves it matches. The first rule that matches a leaf decides; a leaf
no rule matches is an error, so nothing is guessed.

The simple forms stay: ``quantize_mask`` (optax's mask convention: a pytree of bools like ``params``, or a
*prefix* of it whose bool covers a whole subtree, or a callable returning either) and ``param_specs`` (a
pytree or prefix of ``"col"`` / ``"row"`` / None). Without rules, every 2-D leaf is a quantizable
``[out, in]`` weight and every 3-D leaf a stacked ``[L, out, in]`` one.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple, Optional, Union

import jax
import numpy as np

from jaxquant.zero.layout import TP_SPLITS
from jaxquant.primitives import formats


KERNEL_LAYOUTS = ("out_in", "in_out")


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """How the parameters whose dotted path fully matches ``pattern`` are trained.

    Args:
      pattern: a regular expression, matched with ``re.fullmatch`` against the leaf's dotted path.
      quantize: False (default: an unquantized array, gathered whole when ``loss_fn`` starts), True (a
        ``jq.ShardedWeight`` in the policy's ``compute_weights``) or a recipe name, ``"bf16"``, ``"fp8"`` or
        ``"nvfp4"`` (this leaf's compute weights, whatever the policy says).
      tp: None (replicated over the TP axis), ``"col"`` (``out`` split) or ``"row"`` (``in`` split).
      stacked: axis 0 is a layer axis (the leaf is a stack of ``L`` layers to ``jax.lax.scan`` over): each
        layer is quantized with its own scales and saved under its own name (``blocks.0.norm`` ...); the layer
        axis is never split over FSDP.
      kernel: ``"out_in"`` (default, PyTorch's ``[out, in]``: ``jq.dense`` computes ``x @ W.T``) or ``"in_out"``
        (flax's kernels: ``x @ K``, the master kept as it is, split over FSDP along ``in``).
      keep_dtype: an unquantized leaf reaches ``loss_fn`` in the main-params dtype even where it is a matrix
        (default False: unquantized matrices get bf16 copies). The flax adapter sets it: a model reads its
        unquantized parameters in the dtype it declared.
      why: what the plan says about this rule's leaves (``step.describe``); default: the rule itself.
    """

    pattern: str
    quantize: Union[bool, str] = False
    tp: Optional[str] = None
    stacked: bool = False
    kernel: str = "out_in"
    keep_dtype: bool = False
    why: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"ParamRule.pattern: not a regular expression: {self.pattern!r} ({e})") from None
        if not isinstance(self.quantize, bool) and self.quantize not in formats.RECIPES:
            raise ValueError(f"ParamRule({self.pattern!r}).quantize: must be True, False or one of {formats.RECIPES}, "
                             f"got {self.quantize!r}")
        if self.tp is not None and self.tp not in TP_SPLITS:
            raise ValueError(f"ParamRule({self.pattern!r}).tp: must be 'col', 'row' or None, got {self.tp!r}")
        if self.kernel not in KERNEL_LAYOUTS:
            raise ValueError(f"ParamRule({self.pattern!r}).kernel: must be one of {KERNEL_LAYOUTS}, got "
                             f"{self.kernel!r}")
        if not isinstance(self.stacked, bool):
            raise ValueError(f"ParamRule({self.pattern!r}).stacked: must be a bool, got {self.stacked!r}")


class LeafDecision(NamedTuple):
    """What the rules (or the simple forms) decided for one leaf."""

    recipe: Optional[str]      # compute weights of a quantized leaf, None: an array
    tp: Optional[str]          # "col" / "row" / None
    stacked: bool              # axis 0 is a layer axis
    transposed: bool = False   # stored [in, out]
    keep_dtype: bool = False   # an unquantized matrix reaches loss_fn in the main dtype, not as a bf16 copy
    why: str = ""              # what decided it, for the plan's description


def dotted_path(path) -> str:
    """``blocks.w1`` for the key path ``['blocks']['w1']`` (what rules match, and the checkpoint's names)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def broadcast_prefix(tree, params, what: str) -> list:
    """One entry per leaf of ``params`` from ``tree``: a pytree like ``params`` or a prefix of it (an entry at
    a subtree's place covers every leaf below it, as ``optax.masked`` reads masks), or a callable
    ``params -> such a tree``. None entries stay None (a pytree node to JAX, so they must be leaves here)."""
    tree = tree(params) if callable(tree) else tree
    leaf = lambda x: x is None or isinstance(x, (bool, str, int, np.bool_, np.integer))
    try:
        full = jax.tree_util.tree_map(lambda v, sub: jax.tree_util.tree_map(lambda _: v, sub), tree, params,
                                      is_leaf=leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what}: must be a pytree like params, or a prefix of it, or a callable params -> such a "
                         f"pytree ({e})") from None
    return jax.tree_util.tree_leaves(full, is_leaf=leaf)


def decide(params, *, rules=None, quantize_mask=None, param_specs=None, compute_weights: str) -> list:
    """A ``LeafDecision`` per leaf of ``params`` (in ``tree_flatten`` order), or a ``ValueError`` naming the leaf."""
    leaves_with_path = jax.tree_util.tree_flatten_with_path(params)[0]
    if rules is not None:
        if quantize_mask is not None or param_specs is not None:
            raise ValueError("rules: give either rules or quantize_mask / param_specs, not both")
        rules = list(rules)
        for r in rules:
            if not isinstance(r, ParamRule):
                raise TypeError(f"rules: must be jaxquant.ParamRule objects, got {type(r).__name__}")
        return [_by_rules(dotted_path(p), np.shape(a), rules, compute_weights) for p, a in leaves_with_path]
    n = len(leaves_with_path)
    masks = [None] * n if quantize_mask is None else broadcast_prefix(quantize_mask, params, "quantize_mask")
    splits = [None] * n if param_specs is None else broadcast_prefix(param_specs, params, "param_specs")
    out = []
    for (path, leaf), mask, split in zip(leaves_with_path, masks, splits):
        name, shape = jax.tree_util.keystr(path), np.shape(leaf)
        if mask is not None and not isinstance(mask, (bool, np.bool_)):
            raise ValueError(f"quantize_mask{name}: leaves must be True or False, got {mask!r}")
        if isinstance(split, (int, np.integer)) and not isinstance(split, (bool, np.bool_)):
            split = {0: "col", 1: "row"}.get(int(split), split)
        if split is not None and (not isinstance(split, str) or split not in TP_SPLITS):
            raise ValueError(f"param_specs{name}: must be 'col', 'row' or None, got {split!r}")
        matrix = len(shape) in (2, 3)
        quantized = matrix if mask is None else bool(mask)
        if quantized and not matrix:
            raise ValueError(f"quantize_mask{name}: only 2-D [out, in] or stacked 3-D [L, out, in] leaves can be "
                             f"quantized, got shape {tuple(shape)}")
        if split is not None and not matrix:
            raise ValueError(f"param_specs{name}: only [out, in] (or stacked [L, out, in]) weights can be split "
                             f"over TP, got shape {tuple(shape)}")
        why = ("quantize_mask" if mask is not None else
               "default: 2-D [out, in] / stacked 3-D leaves quantized" if quantized else "default: not a matrix")
        out.append(LeafDecision(compute_weights if quantized else None, split, len(shape) == 3, why=why))
    return out


def _by_rules(name: str, shape, rules, compute_weights: str) -> LeafDecision:
    for r in rules:
        if re.fullmatch(r.pattern, name):
            break
    else:
        raise ValueError(f"rules: no rule matches the parameter {name} (shape {tuple(shape)}); add one, e.g. "
                         f"ParamRule(r'.*', quantize=False) last for everything else")
    where = f"rules: ParamRule({r.pattern!r}) matches {name} of shape {tuple(shape)}"
    layer = tuple(shape[1:]) if r.stacked else tuple(shape)
    if r.stacked and len(shape) < 1:
        raise ValueError(f"{where}: stacked=True needs a layer axis (axis 0)")
    recipe = None if r.quantize is False else (compute_weights if r.quantize is True else r.quantize)
    if recipe is not None and len(layer) != 2:
        hint = ("; if axis 0 is a layer axis (a stack of layers run under scan), declare stacked=True; if it is a "
                "multi-axis kernel (einsum / DenseGeneral [heads, embed, head_dim]), quantize it through the flax "
                "adapter, which views it as the 2-D matrix of its contraction (jq.flax_loss(model, loss, "
                "batch=example)), or keep it unquantized (quantize=False)") if len(layer) > 2 and not r.stacked else ""
        raise ValueError(f"{where}: only [out, in] weights (per layer) can be quantized, got a layer of shape "
                         f"{layer}{hint}")
    if r.tp is not None and len(layer) != 2:
        raise ValueError(f"{where}: only [out, in] weights (per layer) can be split over TP, got {layer}")
    if r.kernel == "in_out" and len(layer) != 2:
        raise ValueError(f"{where}: kernel='in_out' needs [in, out] kernels (per layer), got {layer}")
    why = r.why or f"ParamRule({r.pattern!r}" + (f", quantize={r.quantize!r}" if r.quantize is not False else "") + ")"
    return LeafDecision(recipe, r.tp, r.stacked, r.kernel == "in_out", r.keep_dtype, why)
