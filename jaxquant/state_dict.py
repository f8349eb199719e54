"""The layer-wise step's training state as PyTorch names it: ``state_dict`` / ``load_state_dict``.

``state_dict(step, state)`` gives what ``torch.distributed.checkpoint.state_dict.get_state_dict(model,
optimizer)`` gives for the same model: ``{"model": {name: fp32 tensor}, "optim": {"state": {name:
{"exp_avg", "exp_avg_sq", "step"}}, "param_groups": [{..., "params": [names]}]}}`` for optax ``adam`` /
``adamw`` (``momentum_buffer`` for ``sgd`` with momentum; plain ``sgd``: no per-parameter state). Names
join the params pytree path with dots (``{"blocks": {"w1": ...}}`` -> ``blocks.w1``); a stacked leaf
``[L, out, in]`` becomes ``L`` tensors named with the layer index after the first path element
(``blocks.0.w1`` ... ``blocks.{L-1}.w1``), as a PyTorch model holds them. Every tensor is a global
``jax.Array`` sharded as the master is (rows over ``fsdp``; nothing gathered to one host), so
``jaxquant.checkpoint.save_dcp`` writes each device's shard and ``load_dcp`` with
:func:`state_dict_target` reads it back onto any mesh. Torch keeps ``step`` per parameter as a 0-d
float32 tensor, ``betas`` as a tuple and the ``params`` list as one value; so does this.
"""

from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxquant.checkpoint.tree import _part

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _parts(path) -> tuple:
    return tuple(_part(k) for k in path)     # the key parts save_dcp joins with dots


def _names(rule_parts, rule) -> list:
    """The PyTorch names of one leaf: one, or one per layer of a stacked leaf (``ParamRule(stacked=True)``, or
    a 3-D leaf without rules), the layer index after the first part: ``blocks.0.w1``, ``blocks.0.norm``."""
    if not rule.stacked:
        return [".".join(rule_parts)]
    head, rest = rule_parts[0], rule_parts[1:]
    return [".".join((head, str(i)) + rest) for i in range(rule.shape[0])]


def _optax_parts(opt_state):
    """(Adam state or None, trace state or None, injected hyperparams or None) of an optax state; other
    states that hold per-parameter tensors get an error naming them."""
    import optax

    found = {"adam": None, "trace": None, "hyper": None}

    def walk(s):
        if isinstance(s, optax.ScaleByAdamState):
            found["adam"] = s
        elif isinstance(s, optax.TraceState):
            found["trace"] = s
        elif hasattr(s, "hyperparams") and hasattr(s, "inner_state"):   # optax.inject_hyperparams
            found["hyper"] = {k: float(v) for k, v in s.hyperparams.items()}
            walk(s.inner_state)
        elif isinstance(s, (tuple, list)) and not hasattr(s, "_fields"):
            for x in s:
                walk(x)
        elif isinstance(s, (optax.EmptyState, optax.ScaleByScheduleState)) or s is None:
            pass
        elif hasattr(s, "inner_state"):          # masked / conditioned wrappers around empty states
            walk(s.inner_state)
        else:
            raise ValueError(f"optimizer: its state {type(s).__name__} has no PyTorch counterpart here; "
                             f"state_dict maps optax adam / adamw (exp_avg, exp_avg_sq, step) and sgd "
                             f"(momentum_buffer)")

    walk(opt_state)
    if found["adam"] is not None and found["trace"] is not None:
        raise ValueError("optimizer: both an Adam and a momentum trace state; state_dict maps one of them")
    return found["adam"], found["trace"], found["hyper"]


def _param_group(kind, hyper, hyperparams, names):
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
        raise ValueError(f"hyperparams: PyTorch's param_groups need {missing}; optax does not keep them in its "
                         f"state unless the optimizer is built with optax.inject_hyperparams, so pass "
                         f"hyperparams=dict({', '.join(k + '=...' for k in need)})")
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


def _layers(a, n, spec, mesh):
    """[a[0], ..., a[n-1]] of a stacked leaf, each sharded as the stack's rows are (no gather)."""
    return _split_fn(n, NamedSharding(mesh, P(*tuple(spec)[1:])))(a)


# compiled once per (layer count, sharding), not at every save / load of a training run
@functools.lru_cache(maxsize=256)
def _split_fn(n, out):
    return jax.jit(lambda x: [x[i] for i in range(n)], out_shardings=[out] * n)


@functools.lru_cache(maxsize=256)
def _stack_fn(out):
    return jax.jit(lambda *x: jnp.stack(x), out_shardings=out)


def state_dict(step, state, *, hyperparams=None) -> dict:
    """See the module docstring. ``hyperparams``: torch's ``lr``, ``betas``, ``eps``, ``weight_decay``
    (SGD: ``lr``, ``momentum``, ``weight_decay``) when the optax state does not hold them."""
    plan = state.plan
    leaves = jax.tree_util.tree_flatten_with_path(state.master)[0]
    adam, trace, hyper = _optax_parts(state.opt_state)
    per_param = {}
    if adam is not None:
        per_param = {"exp_avg": jax.tree.leaves(adam.mu), "exp_avg_sq": jax.tree.leaves(adam.nu)}
        count = np.float32(np.asarray(adam.count))
    elif trace is not None:
        per_param = {"momentum_buffer": jax.tree.leaves(trace.trace)}
    model, optim, names = {}, {}, []
    for i, ((path, master), rule) in enumerate(zip(leaves, plan.rules)):
        leaf_names = _names(_parts(path), rule)
        split = ((lambda a: _layers(a, len(leaf_names), rule.spec, step.mesh)) if rule.stacked
                 else (lambda a: [a]))
        for name, value in zip(leaf_names, split(master)):
            model[name] = value
            names.append(name)
        tensors = {k: split(v[i]) for k, v in per_param.items()}
        for j, name in enumerate(leaf_names):
            entry = {k: v[j] for k, v in tensors.items()}
            if adam is not None:
                entry["step"] = np.asarray(count, np.float32)
            if entry:
                optim[name] = entry
    kind = "adam" if adam is not None else "sgd"
    return {"model": model, "optim": {"state": optim, "param_groups": [_param_group(kind, hyper, hyperparams,
                                                                                     names)]}}


def state_dict_target(step, like) -> dict:
    """``load_dcp``'s target for :func:`state_dict` of a state like ``like``: ``jax.ShapeDtypeStruct``
    leaves with this step's shardings, so a checkpoint written on any mesh loads onto this one."""
    plan = like.plan
    leaves = jax.tree_util.tree_flatten_with_path(like.master)[0]
    adam, trace, _ = _optax_parts(like.opt_state)
    model, optim = {}, {}
    for (path, master), rule in zip(leaves, plan.rules):
        leaf_names = _names(_parts(path), rule)
        stacked = rule.stacked
        shape = rule.shape[1:] if stacked else rule.shape
        spec = P(*tuple(rule.spec)[1:]) if stacked else rule.spec
        struct = jax.ShapeDtypeStruct(shape, master.dtype, sharding=NamedSharding(step.mesh, spec))
        for name in leaf_names:
            model[name] = struct
            entry = {}
            if adam is not None:
                entry = {k: struct for k in _ADAM_KEYS} | {"step": jax.ShapeDtypeStruct((), jnp.float32)}
            elif trace is not None:
                entry = {"momentum_buffer": struct}
            if entry:
                optim[name] = entry
    return {"model": model, "optim": {"state": optim, "param_groups": [_group_target(adam is not None)]}}


def load_state_dict(step, sd, *, like, step_count=None):
    """A ``TrainState`` on ``step``'s mesh from ``sd`` (:func:`state_dict`'s layout, e.g. read by ``load_dcp``
    from a checkpoint written on any mesh size), shaped like ``like`` (``step.init(params)``).

    Every step counter of the optax state (Adam's, a schedule's, ``inject_hyperparams``') and the
    ``TrainState``'s become the checkpoint's Adam ``step``, so a learning-rate schedule resumes where it left
    off. PyTorch's SGD keeps no step count: for an SGD state pass ``step_count`` (the number of steps taken),
    else the counters restart at 0. With Adam, ``step_count`` must equal the checkpoint's."""
    from jaxquant.policy import TrainState

    plan = like.plan
    leaves = jax.tree_util.tree_flatten_with_path(like.master)[0]
    adam, trace, _ = _optax_parts(like.opt_state)
    model, optim = sd["model"], sd["optim"]["state"]

    def gather_leaf(table, key, path, rule):
        names = _names(_parts(path), rule)
        missing = [n for n in names if n not in table or (key is not None and key not in table[n])]
        if missing:
            raise KeyError(f"sd: no {key or 'tensor'} for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        parts = [table[n] if key is None else table[n][key] for n in names]
        sharding = NamedSharding(step.mesh, rule.spec)
        if rule.stacked:
            return _stack_fn(sharding)(*parts)
        # a fresh buffer even where sd's array already has this sharding: the loaded state must not share
        # buffers with a live state (e.g. sd = step.state_dict(state)) that a step then donates
        return jax.device_put(parts[0], sharding, may_alias=False)

    def like_master(key):
        out = [gather_leaf(model if key is None else optim, key, path, rule)
               for (path, _), rule in zip(leaves, plan.rules)]
        return jax.tree_util.tree_unflatten(plan.treedef, out)

    if step_count is not None and (isinstance(step_count, bool) or not isinstance(step_count, (int, np.integer))
                                   or step_count < 0):
        raise ValueError(f"step_count: must be a non-negative int (the steps taken), got {step_count!r}")
    master = jax.tree.map(lambda new, old: new.astype(old.dtype), like_master(None), like.master)
    count = 0 if step_count is None else int(step_count)
    if adam is not None:
        steps = {float(np.asarray(e["step"])) for e in optim.values()}
        if len(steps) != 1:
            raise ValueError(f"sd: Adam 'step' differs between parameters ({sorted(steps)[:4]}); one step count "
                             f"for the whole model is what optax keeps")
        count = int(steps.pop())
        if step_count is not None and int(step_count) != count:
            raise ValueError(f"step_count: {step_count} differs from the checkpoint's Adam step {count}")
        new_count = jax.device_put(jnp.asarray(count, adam.count.dtype), adam.count.sharding)   # as init placed it
        new_adam = adam._replace(count=new_count, mu=like_master("exp_avg"), nu=like_master("exp_avg_sq"))
        opt_state = _replace_state(like.opt_state, adam, new_adam, count)
    elif trace is not None:
        opt_state = _replace_state(like.opt_state, trace, trace._replace(trace=like_master("momentum_buffer")),
                                   count)
    else:
        opt_state = _replace_state(like.opt_state, None, None, count)
    return TrainState(master, opt_state, step.step_count(count), plan)


def _replace_state(tree, old, new, count=None):
    """``tree`` (an optax state) with the sub-state ``old`` replaced by ``new`` (``old`` None: none); the step
    counters of ``optax.inject_hyperparams`` and of a schedule (``ScaleByScheduleState``, e.g.
    ``optax.adamw(learning_rate=schedule)``) become ``count`` (so the schedule resumes where it left off)."""
    import optax

    if old is not None and tree is old:
        return new
    at = lambda c: jax.device_put(jnp.asarray(count, c.dtype), c.sharding)
    if isinstance(tree, optax.ScaleByScheduleState):
        return tree if count is None else tree._replace(count=at(tree.count))
    if hasattr(tree, "inner_state") and hasattr(tree, "_replace"):
        out = tree._replace(inner_state=_replace_state(tree.inner_state, old, new, count))
        if count is None:
            return out
        if hasattr(out, "count"):
            out = out._replace(count=at(out.count))
        if isinstance(getattr(out, "hyperparams_states", None), dict):   # a schedule's own counter
            out = out._replace(hyperparams_states={k: v._replace(count=at(v.count)) if hasattr(v, "count") else v
                                                   for k, v in out.hyperparams_states.items()})
        return out
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_replace_state(x, old, new, count) for x in tree)
    if isinstance(tree, list):
        return [_replace_state(x, old, new, count) for x in tree]
    return tree
