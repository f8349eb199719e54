"""The layer-wise step's training state as PyTorch names it: ``state_dict`` / ``load_state_dict``.

``state_dict(step, state)`` gives what ``torch.distributed.checkpoint.state_dict.get_state_dict(model,
optimizer)`` gives for the same model: ``{"model": {name: fp32 tensor}, "optim": {"state": {name:
{"exp_avg", "exp_avg_sq", "step"}}, "param_groups": [{..., "params": [names]}]}}`` for optax ``adam`` /
``adamw`` (``momentum_buffer`` for ``sgd`` with momentum; plain ``sgd``: no per-parameter state). Names
join the params pytree path with dots (``{"blocks": {"w1": ...}}`` -> ``blocks.w1``); a stacked leaf
(``ParamRule(stacked=True)``, or a 3-D leaf without rules) becomes ``L`` tensors named with the layer index
after the first path element (``blocks.0.w1`` ... ``blocks.{L-1}.w1``), as a PyTorch model holds them.
``names=`` (a callable or a dict on those default names) renames them to a PyTorch twin's own names
(``blocks.0.w1`` -> ``layers.0.feed_forward.w1.weight``), everywhere a name occurs: ``model``,
``optim.state`` and every group's ``params``; loading reads the same names back (:class:`NameMap`). A tied
parameter takes a tuple of names, as torch lists a tensor shared by two modules.

Optimizer states. The per-parameter tensors are those of optax's Adam (``ScaleByAdamState``) or momentum
trace (``TraceState``), found anywhere in the state: inside ``optax.chain`` (e.g. after
``clip_by_global_norm``), ``inject_hyperparams``, ``optax.masked`` and ``optax.multi_transform``. Each such
state is one torch param group, holding the parameters it covers: ``multi_transform({"decay": adamw(...),
"no_decay": adam(...)}, labels)`` gives two groups (in label order), each with its own ``lr`` /
``weight_decay``. A parameter no such state covers (``optax.masked``'s masked-out leaves, a
``multi_transform`` label with ``set_to_zero()``) is in ``model`` only: no ``optim.state`` entry and in no
group, as torch has it for a parameter its optimizer does not hold (freeze it, or leave it out of the
optimizer). Without any per-parameter state (plain SGD) one group holds every parameter. One torch
optimizer is one class, so Adam and momentum states in one optax state are an error.

Every tensor is a global ``jax.Array`` sharded as the master is (rows over ``fsdp``; nothing gathered to one
host), so ``jaxquant.checkpoint.save_dcp`` writes each device's shard and ``load_dcp`` with
:func:`state_dict_target` reads it back onto any mesh. Torch keeps ``step`` per parameter as a 0-d float32
tensor, ``betas`` as a tuple and the ``params`` list as one value; so does this.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxquant.checkpoint.tree import key_part
from jaxquant.training.fsdp import pad_row_blocks, unpad_row_blocks


def _parts(path) -> tuple:
    return tuple(key_part(k) for k in path)     # the key parts save_dcp joins with dots


def _names(rule_parts, rule) -> list:
    """The default PyTorch names of one leaf: one, or one per layer of a stacked leaf (``ParamRule(stacked=True)``,
    or a 3-D leaf without rules), the layer index after the first part: ``blocks.0.w1``, ``blocks.0.norm``."""
    if not rule.stacked:
        return [".".join(rule_parts)]
    head, rest = rule_parts[0], rule_parts[1:]
    return [".".join((head, str(i)) + rest) for i in range(rule.shape[0])]


# -- names ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NameMap:
    """The checkpoint names of one model's parameters, both ways (one-to-one, checked when built).

    A tied parameter (one tensor a PyTorch twin holds under several names, e.g. ``output.weight =
    tok_embeddings.weight``) is given a tuple of names: torch's ``get_state_dict`` lists it in ``model`` under
    every name and in ``optim`` under the first (``named_parameters`` yields a shared tensor once, by the name it
    was first registered under), so the first name is the optimizer's and the rest are ``aliases``.

    Attributes:
      to_torch: default name (``blocks.0.w1``, ``embed``) -> the name in the checkpoint (a tied parameter's first).
      from_torch: the inverse, every checkpoint name (aliases included) -> default name.
      aliases: default name -> the further names of a tied parameter, written in ``model`` only.
    """

    to_torch: dict
    from_torch: dict
    aliases: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, defaults, names=None) -> "NameMap":
        """The map of ``names`` over the model's default names.

        Args:
          defaults: every default name of the model, in parameter order.
          names: None (the default names), a callable ``default name -> name``, or a dict with one entry for
            every default name (and no other); a name may be a tuple of names for a tied parameter.

        Returns:
          A :class:`NameMap`; a ``ValueError`` names missing or unknown dict keys, names that are not
          non-empty strings, and two parameters given the same name.
        """
        defaults = list(defaults)
        if names is None:
            table = {d: d for d in defaults}
        elif isinstance(names, Mapping):
            known = set(defaults)
            missing = [d for d in defaults if d not in names]
            unknown = [k for k in names if k not in known]
            if missing:
                raise ValueError(f"names: no entry for the parameters {_few(missing)}; the dict must map every "
                                 f"default name ({_few(defaults)}) to the PyTorch name")
            if unknown:
                raise ValueError(f"names: {_few(unknown)} are no parameters of this model (its default names: "
                                 f"{_few(defaults)})")
            table = {d: names[d] for d in defaults}
        elif callable(names):
            table = {d: names(d) for d in defaults}
        else:
            raise TypeError(f"names: must be None, a callable default name -> PyTorch name, or a dict, got "
                            f"{type(names).__name__}")
        every = {d: (t,) if isinstance(t, str) else tuple(t) if isinstance(t, (tuple, list)) else (t,)
                 for d, t in table.items()}
        bad = {d: t for d, t in table.items() if not every[d] or not all(isinstance(n, str) and n for n in every[d])}
        if bad:
            d, t = next(iter(bad.items()))
            raise ValueError(f"names: every parameter needs a non-empty str name, got {t!r} for {d!r}"
                             f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; a tied parameter takes a "
                             f"tuple of them")
        inverse = {}
        for d, ts in every.items():
            for t in ts:
                if t in inverse:      # loading could not tell the two apart
                    raise ValueError(f"names: {inverse[t]!r} and {d!r} both map to {t!r}; the mapping must be "
                                     f"one-to-one")
                inverse[t] = d
        return cls({d: ts[0] for d, ts in every.items()}, inverse,
                   {d: ts[1:] for d, ts in every.items() if len(ts) > 1})


def _few(xs, n=4) -> str:
    xs = list(xs)
    return repr(xs[:n])[:-1] + (f", ... ({len(xs)} in all)]" if len(xs) > n else "]")


def _default_names(like) -> list:
    """[[default names] per master leaf] of a state ``like``."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(like.master)[0]]
    return [_names(_parts(p), r) for p, r in zip(paths, like.plan.rules)]


def name_map(like, names=None) -> NameMap:
    """The names ``step.state_dict(like, names=names)`` gives each parameter, and back.

    Args:
      like: a ``TrainState`` of the model (``step.init(params)``).
      names: as :meth:`NameMap.build`.

    Returns:
      A :class:`NameMap` (``to_torch`` / ``from_torch`` dicts).
    """
    return NameMap.build([n for leaf in _default_names(like) for n in leaf], names)


def _mapped_names(like, names) -> tuple:
    """(NameMap, [[checkpoint names] per master leaf])."""
    defaults = _default_names(like)
    nm = NameMap.build([n for leaf in defaults for n in leaf], names)
    return nm, [[nm.to_torch[n] for n in leaf] for leaf in defaults]


# -- optax states --------------------------------------------------------------------------------


def _is_masked(x) -> bool:
    import optax

    return isinstance(x, optax.MaskedNode)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One optax state with per-parameter tensors: one torch param group."""

    kind: str                  # "adam" (ScaleByAdamState) or "trace" (TraceState)
    state: Any
    path: tuple                # where it lies in the optax state (``optax.tree_utils`` key path)
    label: Optional[str]       # the optax.multi_transform label(s) above it, dotted; None: none
    hyper: Optional[dict]      # the nearest optax.inject_hyperparams' values, None: none
    covered: tuple             # per master leaf: has tensors here (not an optax.MaskedNode)

    def tensors(self) -> dict:
        """{torch key: [per master leaf: array, or an optax.MaskedNode]}."""
        trees = ({"exp_avg": self.state.mu, "exp_avg_sq": self.state.nu} if self.kind == "adam"
                 else {"momentum_buffer": self.state.trace})
        return {k: jax.tree.leaves(t, is_leaf=_is_masked) for k, t in trees.items()}


_KINDS = {"adam": "ScaleByAdamState", "trace": "TraceState"}   # the optax states torch has a counterpart of


def _is_prefix(prefix: tuple, path: tuple) -> bool:
    return path[:len(prefix)] == prefix


def _optax_parts(opt_state, leaf_names) -> tuple:
    """(the :class:`_Slot` s of an optax state, in pytree order; the hyperparameters of an outer
    ``inject_hyperparams`` or None). ``leaf_names``: a name per master leaf, for errors. States that hold
    per-parameter tensors torch has no name for are an error naming them.

    Read with ``optax.tree_utils`` (states found by their class name, wherever ``chain``, ``masked``,
    ``multi_transform`` or ``inject_hyperparams`` put them): a slot's label is the ``multi_transform`` keys on its
    path (the only dicts above a state), its hyperparameters those of the nearest ``inject_hyperparams`` above it.
    """
    from optax import tree_utils as otu

    n_leaves = len(leaf_names)
    found = {kind: otu.tree_get_all_with_path(opt_state, name) for kind, name in _KINDS.items()}
    if all(found.values()):
        raise ValueError("optimizer: both an Adam and a momentum trace state; a torch optimizer is one class, "
                         "state_dict maps one of them")
    # each inject_hyperparams' values, by where its state lies (the path less its "hyperparams" field)
    hypers = [(path[:-1], {k: float(v) for k, v in values.items()})
              for path, values in otu.tree_get_all_with_path(opt_state, "hyperparams") if isinstance(values, Mapping)]
    slots = []
    for kind, states in found.items():
        for path, s in states:
            leaves = jax.tree.leaves(s.mu if kind == "adam" else s.trace, is_leaf=_is_masked)
            if len(leaves) != n_leaves:
                raise ValueError(f"optimizer: its {type(s).__name__} holds {len(leaves)} tensors for {n_leaves} "
                                 f"parameters; state_dict maps states shaped like the parameters")
            labels = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
            above = [h for at, h in hypers if _is_prefix(at, path)]
            slots.append(_Slot(kind, s, path, ".".join(labels) or None, above[-1] if above else None,
                               tuple(not _is_masked(x) for x in leaves)))
    _no_other_tensors(opt_state, slots)
    for i, name in enumerate(leaf_names):
        if sum(s.covered[i] for s in slots) > 1:      # torch keeps one state per parameter
            raise ValueError(f"optimizer: {sum(s.covered[i] for s in slots)} Adam / momentum states cover the "
                             f"parameter {name}; state_dict maps one per parameter (torch's optimizer state)")
    outer = [h for at, h in hypers if not any(isinstance(k, jax.tree_util.DictKey) for k in at)]
    return slots, outer[-1] if outer else None


def _no_other_tensors(opt_state, slots) -> None:
    """ValueError naming the state that holds a tensor outside every slot: per-parameter state torch has no name
    for (counters, hyperparameters and other scalars are not tensors of a parameter)."""
    in_slots = {id(x) for slot in slots for x in jax.tree.leaves(slot.state)}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_masked)[0]:
        if _is_masked(leaf) or not getattr(leaf, "ndim", 0) or id(leaf) in in_slots:
            continue
        raise ValueError(f"optimizer: its state {_owner(opt_state, path)} has no PyTorch counterpart here; "
                         f"state_dict maps optax adam / adamw (exp_avg, exp_avg_sq, step) and sgd "
                         f"(momentum_buffer), also under chain, masked, multi_transform and inject_hyperparams")


def _owner(tree, path) -> str:
    """The class name of the innermost state (a NamedTuple) on ``path`` (a ``jax.tree_util`` key path)."""
    owner = type(tree).__name__
    for k in path:
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            owner = type(tree).__name__
        if isinstance(k, jax.tree_util.GetAttrKey):
            tree = getattr(tree, k.name)
        elif isinstance(k, jax.tree_util.DictKey):
            tree = tree[k.key]
        elif isinstance(k, jax.tree_util.SequenceKey):
            tree = tree[k.idx]
        else:
            break
    return owner


def _group_hyperparams(hyperparams, slots) -> list:
    """(where, the ``hyperparams`` dict or None) per param group: one dict for every group, or one per
    ``optax.multi_transform`` label."""
    if hyperparams is None:
        return [("hyperparams", None)] * max(len(slots), 1)
    if not isinstance(hyperparams, Mapping):
        raise TypeError(f"hyperparams: must be a dict, got {type(hyperparams).__name__}")
    if not any(isinstance(v, Mapping) for v in hyperparams.values()):
        return [("hyperparams", hyperparams)] * max(len(slots), 1)
    labels = [s.label for s in slots if s.label is not None]
    unknown = [k for k in hyperparams if k not in labels]
    if unknown or not all(isinstance(v, Mapping) for v in hyperparams.values()):
        raise ValueError(f"hyperparams: a dict of dicts is keyed by the optax.multi_transform labels of the groups "
                         f"({labels}); {_few(unknown) if unknown else 'some values are no dicts'}")
    return [(f"hyperparams[{s.label!r}]", hyperparams.get(s.label)) for s in slots]


def _param_group(kind, hyper, hyperparams, names, where="hyperparams"):
    """Torch's param_group for Adam(W) / SGD from optax's injected hyperparameters or ``hyperparams``."""
    given = dict(hyperparams or {})
    if hyper is not None:    # optax.inject_hyperparams names
        given.setdefault("lr", hyper.get("learning_rate"))
        if kind == "adam":
            given.setdefault("betas", (hyper.get("b1", 0.9), hyper.get("b2", 0.999)))
            given.setdefault("eps", hyper.get("eps", 1e-8))
        else:
            given.setdefault("momentum", hyper.get("momentum", 0.0))
        given.setdefault("weight_decay", hyper.get("weight_decay", 0.0))
    need = ("lr", "betas", "eps", "weight_decay") if kind == "adam" else ("lr", "momentum", "weight_decay")
    missing = [k for k in need if given.get(k) is None]
    if missing:
        raise ValueError(f"{where}: PyTorch's param_groups need {missing}; optax does not keep them in its "
                         f"state unless the optimizer is built with optax.inject_hyperparams, so pass "
                         f"{where}=dict({', '.join(k + '=...' for k in need)})")
    group = {k: given[k] for k in need}
    # the rest of torch's group (torch.distributed.checkpoint loads every key its template has)
    common = {"maximize": False, "foreach": None, "differentiable": False, "fused": None}
    if kind == "adam":
        group["betas"] = tuple(float(b) for b in group["betas"])
        group |= common | {"amsgrad": False, "capturable": False,
                           "decoupled_weight_decay": bool(given.get("decoupled_weight_decay", False))}
    else:
        group |= common | {"dampening": 0.0, "nesterov": False}
    return {k: (float(v) if isinstance(v, (int, float, np.floating)) and not isinstance(v, bool) else v)
            for k, v in group.items()} | {"params": list(names)}


def _group_target(adam: bool) -> dict:
    """``load_dcp`` target of :func:`_param_group`'s dict (types of the byte entries)."""
    common = {"lr": float, "weight_decay": float, "maximize": bool, "foreach": None, "differentiable": bool,
              "fused": None, "params": list}
    if adam:
        return common | {"betas": tuple, "eps": float, "amsgrad": bool, "capturable": bool,
                         "decoupled_weight_decay": bool}
    return common | {"momentum": float, "dampening": float, "nesterov": bool}


# -- sharded split / stack -----------------------------------------------------------------------


def _layers(a, n, spec, mesh):
    """[a[0], ..., a[n-1]] of a stacked leaf, each sharded as the stack's rows are (no gather)."""
    return _split_fn(n, NamedSharding(mesh, P(*tuple(spec)[1:])))(a)


def _saved(a, rule, mesh):
    """A master leaf as the state dict holds it (``LeafRule.saved_shape``): padding rows dropped, an ``[in, out]``
    kernel transposed to PyTorch's ``[out, in]``."""
    if not (rule.pad_rows or rule.weight.transposed):
        return a
    return _to_saved_fn(rule, NamedSharding(mesh, rule.saved_spec))(a)


def _stored(a, rule, mesh):
    """The inverse of :func:`_saved`: the leaf as the master holds it, sharded as the master is."""
    if not (rule.pad_rows or rule.weight.transposed):
        return a
    return _to_stored_fn(rule, NamedSharding(mesh, rule.spec))(a)


def _swap(a, rule):
    return jnp.swapaxes(a, -1, -2) if rule.weight.transposed else a


@functools.lru_cache(maxsize=256)
def _to_saved_fn(rule, out):
    return jax.jit(lambda x: _swap(unpad_row_blocks(x, rule.weight, rule.row_blocks), rule), out_shardings=out)


@functools.lru_cache(maxsize=256)
def _to_stored_fn(rule, out):
    return jax.jit(lambda x: pad_row_blocks(_swap(x, rule), rule.weight, rule.row_blocks), out_shardings=out)


# compiled once per (layer count, sharding), not at every save / load of a training run
@functools.lru_cache(maxsize=256)
def _split_fn(n, out):
    return jax.jit(lambda x: [x[i] for i in range(n)], out_shardings=[out] * n)


@functools.lru_cache(maxsize=256)
def _stack_fn(out):
    return jax.jit(lambda *x: jnp.stack(x), out_shardings=out)


# -- public --------------------------------------------------------------------------------------


def _dotted(like) -> list:
    """A name per master leaf (``blocks.w1``), for errors about a whole leaf."""
    return [".".join(_parts(p)) for p, _ in jax.tree_util.tree_flatten_with_path(like.master)[0]]


def _check_not_donated(state) -> None:
    """A clear error for a state whose arrays a step consumed: reading a donated buffer can crash the process
    instead of raising (seen on the CPU runtime)."""
    deleted = [".".join(_parts(p)) for p, a in jax.tree_util.tree_flatten_with_path(state)[0]
               if isinstance(a, jax.Array) and a.is_deleted()]
    if deleted:
        more = f" and {len(deleted) - 1} more" if len(deleted) > 1 else ""
        raise ValueError(f"state: its arrays were donated to a training step ({deleted[0]}{more} deleted); a step "
                         "consumes the state it is given, so save the state it returned")


def state_dict(step, state, *, hyperparams=None, names=None) -> dict:
    """The training state as torch's ``get_state_dict(model, optimizer)`` names it (see the module docstring).

    Args:
      step: the layer-wise training step.
      state: its ``TrainState``.
      hyperparams: torch's ``lr``, ``betas``, ``eps``, ``weight_decay`` (SGD: ``lr``, ``momentum``,
        ``weight_decay``; ``decoupled_weight_decay=True`` for AdamW) where the optax state does not hold them
        (no ``inject_hyperparams``): one dict for every param group, or ``{label: dict}`` per
        ``optax.multi_transform`` label.
      names: None (default names), a callable default name -> PyTorch name, or a dict of them (:class:`NameMap`);
        a tuple of names for a tied parameter (written under each in ``model``, under the first in ``optim``).

    Returns:
      ``{"model": {name: array}, "optim": {"state": {name: {...}}, "param_groups": [...]}, "plan": {name: recipe}}``:
      ``plan`` records what the step trained each parameter with (``"fp8"``, ``"nvfp4"``, ``"bf16"``, ``"kept"``,
      ``"bf16 copy"``: ``step.describe``'s recipe column) as DCP byte entries, which ``jaxquant ckpt inspect``
      shows; loading reads only the keys its target names, so PyTorch and :func:`load_state_dict` skip them.
    """
    from jaxquant.training.plan_view import plan_row

    _check_not_donated(state)
    nm, leaf_names = _mapped_names(state, names)
    rules = state.plan.rules
    slots, outer_hyper = _optax_parts(state.opt_state, _dotted(state))

    def split(a, i):
        a = _saved(a, rules[i], step.mesh)
        return _layers(a, len(leaf_names[i]), rules[i].saved_spec, step.mesh) if rules[i].stacked else [a]

    model = {}
    for i, master in enumerate(jax.tree.leaves(state.master)):
        model.update(zip(leaf_names[i], split(master, i)))
    for default, extra in nm.aliases.items():     # a tied parameter: the same tensor under its other names
        model.update(dict.fromkeys(extra, model[nm.to_torch[default]]))
    optim = {}
    for slot in slots:
        for key, per_leaf in slot.tensors().items():
            for i in (i for i, c in enumerate(slot.covered) if c):
                for n, v in zip(leaf_names[i], split(per_leaf[i], i)):
                    optim.setdefault(n, {})[key] = v
        if slot.kind == "adam":    # torch's per-parameter 0-d float32 step
            count = np.float32(np.asarray(slot.state.count))
            for n in _covered_names(slot, leaf_names):
                optim[n]["step"] = np.asarray(count, np.float32)
    plan = {n: plan_row(rule)["recipe"] for rule, ns in zip(rules, leaf_names) for n in ns}
    plan.update({a: plan[nm.to_torch[d]] for d, extra in nm.aliases.items() for a in extra})
    wheres = _group_hyperparams(hyperparams, slots)
    if not slots:      # plain SGD: no per-parameter state, one group of every parameter
        return {"model": model, "optim": {"state": optim, "param_groups": [
            _param_group("sgd", outer_hyper, wheres[0][1], [n for ns in leaf_names for n in ns])]}, "plan": plan}
    groups = [_param_group(s.kind, s.hyper, hp, _covered_names(s, leaf_names), where)
              for s, (where, hp) in zip(slots, wheres)]
    return {"model": model, "optim": {"state": optim, "param_groups": groups}, "plan": plan}


def _covered_names(slot, leaf_names) -> list:
    return [n for i, ns in enumerate(leaf_names) if slot.covered[i] for n in ns]


def state_dict_target(step, like, *, names=None) -> dict:
    """``load_dcp``'s target for :func:`state_dict` of a state like ``like``.

    Args:
      step: the layer-wise training step (its mesh places the arrays).
      like: a ``TrainState`` of the model (``step.init(params)``).
      names: as for :func:`state_dict` (the names the checkpoint was written with).

    Returns:
      The state dict's layout with ``jax.ShapeDtypeStruct`` leaves in this step's shardings, so a checkpoint
      written on any mesh loads onto this one.
    """
    _, leaf_names = _mapped_names(like, names)
    rules = like.plan.rules
    slots, _ = _optax_parts(like.opt_state, _dotted(like))

    def struct(i, dtype):
        shape = rules[i].saved_shape[1:] if rules[i].stacked else rules[i].saved_shape
        spec = P(*tuple(rules[i].saved_spec)[1:]) if rules[i].stacked else rules[i].saved_spec
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(step.mesh, spec))

    model = {n: struct(i, m.dtype) for i, m in enumerate(jax.tree.leaves(like.master)) for n in leaf_names[i]}
    optim = {}
    for slot in slots:
        for key, per_leaf in slot.tensors().items():
            for i in (i for i, c in enumerate(slot.covered) if c):
                for n in leaf_names[i]:
                    optim.setdefault(n, {})[key] = struct(i, per_leaf[i].dtype)
        if slot.kind == "adam":
            for n in _covered_names(slot, leaf_names):
                optim[n]["step"] = jax.ShapeDtypeStruct((), jnp.float32)
    groups = [_group_target(s.kind == "adam") for s in slots] or [_group_target(False)]
    return {"model": model, "optim": {"state": optim, "param_groups": groups}}


_FIELDS = {"exp_avg": "mu", "exp_avg_sq": "nu", "momentum_buffer": "trace"}   # torch key -> optax field


def load_state_dict(step, sd, *, like, step_count=None, names=None):
    """A ``TrainState`` on ``step``'s mesh from ``sd`` (:func:`state_dict`'s layout, e.g. read by ``load_dcp``
    from a checkpoint written on any mesh size, by JAX or by torch).

    Every step counter of the optax state (Adam's, a schedule's, ``inject_hyperparams``') and the
    ``TrainState``'s become the checkpoint's Adam ``step``, so a learning-rate schedule resumes where it left
    off. PyTorch's SGD keeps no step count: for an SGD state pass ``step_count`` (the number of steps taken),
    else the counters restart at 0. With Adam, ``step_count`` must equal the checkpoint's. Parameters no
    Adam / momentum state covers (``optax.masked``) read nothing from ``optim``.

    Args:
      step: the layer-wise training step.
      sd: the state dict (``{"model": ..., "optim": {"state": ...}}``).
      like: a ``TrainState`` of the model (``step.init(params)``): its structure, dtypes and optimizer.
      step_count: the steps taken, for an SGD state.
      names: as for :func:`state_dict` (the names in ``sd``).

    Returns:
      The ``TrainState``; a ``KeyError`` names the tensors ``sd`` lacks (and the JAX parameter of each).
    """
    from jaxquant.training.policy import TrainState

    nm, leaf_names = _mapped_names(like, names)
    plan = like.plan
    slots, _ = _optax_parts(like.opt_state, _dotted(like))
    model, optim = sd["model"], sd["optim"]["state"]
    if step_count is not None and (isinstance(step_count, bool) or not isinstance(step_count, (int, np.integer))
                                   or step_count < 0):
        raise ValueError(f"step_count: must be a non-negative int (the steps taken), got {step_count!r}")

    def check(table, key, ns):
        missing = [n for n in ns if n not in table or (key is not None and key not in table[n])]
        if missing:
            shown = [n if nm.from_torch[n] == n else f"{n} ({nm.from_torch[n]})" for n in missing[:3]]
            strays = [n for n in table if n not in nm.from_torch]     # names no parameter maps to
            raise KeyError(f"sd: no {key or 'tensor'} for {shown}{' ...' if len(missing) > 3 else ''}"
                           + (f"; names in sd that no parameter maps to: {_few(strays)}" if strays else ""))

    def gather_leaf(table, key, i, dtype):
        ns, rule = leaf_names[i], plan.rules[i]
        check(table, key, ns)
        parts = [table[n] if key is None else table[n][key] for n in ns]
        sharding = NamedSharding(step.mesh, rule.saved_spec)
        if rule.stacked:
            return _stored(_stack_fn(sharding)(*parts).astype(dtype), rule, step.mesh)
        # a fresh buffer even where sd's array already has this sharding: the loaded state must not share
        # buffers with a live state (e.g. sd = step.state_dict(state)) that a step then donates
        return _stored(jax.device_put(parts[0], sharding, may_alias=False).astype(dtype), rule, step.mesh)

    master = jax.tree_util.tree_unflatten(plan.treedef, [gather_leaf(model, None, i, m.dtype)
                                                         for i, m in enumerate(jax.tree.leaves(like.master))])
    count = 0 if step_count is None else int(step_count)
    adam_names = [n for s in slots if s.kind == "adam" for n in _covered_names(s, leaf_names)]
    if adam_names:
        check(optim, "step", adam_names)
        steps = {float(np.asarray(optim[n]["step"])) for n in adam_names}
        if len(steps) != 1:
            raise ValueError(f"sd: Adam 'step' differs between parameters ({sorted(steps)[:4]}); one step count "
                             f"for the whole model is what optax keeps")
        count = int(steps.pop())
        if step_count is not None and int(step_count) != count:
            raise ValueError(f"step_count: {step_count} differs from the checkpoint's Adam step {count}")
    from optax import tree_utils as otu

    opt_state = like.opt_state
    for slot in slots:
        fields = {}
        for key, per_leaf in slot.tensors().items():
            # masked-out leaves keep their optax.MaskedNode: the state keeps optax's structure
            leaves = [x if _is_masked(x) else gather_leaf(optim, key, i, x.dtype) for i, x in enumerate(per_leaf)]
            treedef = jax.tree_util.tree_structure(getattr(slot.state, _FIELDS[key]), is_leaf=_is_masked)
            fields[_FIELDS[key]] = jax.tree_util.tree_unflatten(treedef, leaves)
        opt_state = otu.tree_set(opt_state, lambda path, _, at=slot.path: path == at,
                                 **{_KINDS[slot.kind]: slot.state._replace(**fields)})
    # every step counter (the ``count`` field of Adam's, a schedule's, inject_hyperparams' and its schedules'
    # states), placed as init placed it, so that a learning-rate schedule resumes where it left off
    def restart(path, leaf):
        if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "count":
            return jax.device_put(jnp.asarray(count, leaf.dtype), leaf.sharding)
        return leaf

    opt_state = jax.tree_util.tree_map_with_path(restart, opt_state, is_leaf=_is_masked)
    return step.refresh_amax(TrainState(master, opt_state, step.step_count(count), plan))
