"""Flax models unchanged: an NNX or linen model trains under ``jq.make_train_step`` with bf16 / FP8 / NVFP4 weights.

The model's code is not edited. Its trainable parameters become the step's ``params`` (a plain nested dict with
flax's names, ``layers.0.mlp.up.kernel``), and while the loss runs the kernels the rules quantize reach flax's
layers as quantized kernels (``jq.ShardedWeight``, ``[in, out]`` as flax stores them, declared with
``ParamRule(kernel="in_out")``). An interception of flax's dot_general / einsum / promote_dtype, in force only
inside :func:`flax_intercept` (which :func:`flax_loss` enters around the loss), sends every matmul whose kernel
operand is such a weight to ``jq.dense`` (per-use quantize + all-gather + GEMM, its own backward) and leaves
every other call as it was::

    params = jq.flax_params(model)                     # NNX module, or linen variables {"params": ...}
    loss_fn = jq.flax_loss(model, loss)                # loss(model | variables, batch[, rng=][, extra=])
    step = jq.make_train_step(loss_fn, optax.adam(1e-3), mesh=mesh, rules=jq.flax_rules(stacked=r"layers\\..*"))
    state = step.init(params)
    state, metrics = step(state, batch)
    model = jq.flax_merge(model, step.params(state))   # the same model with the trained parameters

What runs quantized: the kernel operand of ``jax.lax.dot_general`` (``nnx.Linear``, ``nnx.LinearGeneral``,
linen ``nn.Dense`` / ``nn.DenseGeneral``) and of ``jnp.einsum`` (``nnx.Einsum``, ``nn.Einsum``) when it is one
layer's 2-D kernel, contracted on its ``in`` axis with one axis of the activation, with no batch axis on the
kernel: ``[in, out]`` kernels (``kernel="in_out"``; flax's layout) and ``[out, in]`` ones (the default, e.g. an
einsum ``"btd,fd->btf"``). ``promote_dtype`` sees such a kernel as its compute dtype (bf16): the activation is
cast as flax would cast it for a bf16 kernel (or to the module's ``dtype``), and the GEMM's output has that dtype
(``preferred_element_type`` if given). ``precision`` is not used (``jq.dense`` accumulates in fp32).

What does not: a kernel with more than one ``in`` or ``out`` axis (``nn.DenseGeneral(features=(heads, head_dim))``,
an einsum ``"btd,dnh->btnh"``) cannot be a ``ShardedWeight`` (the step quantizes ``[in, out]`` matrices only):
keep it unquantized with ``flax_rules(keep=...)`` and flax runs it as usual on the gathered array. A quantized
kernel read by anything other than those two ops (``x @ kernel``, ``jnp.take`` of a quantized embedding, a tied
``Embed.attend``, a contraction on the wrong axis, a stack of layers outside its scan) raises
:class:`FlaxKernelError` naming the parameter, its module and the operation.

Parameters and state: trainable leaves are the floating ``nnx.Param`` variables (NNX) or the floating leaves of
the ``params`` collection (linen; metadata boxes such as ``nn.Partitioned`` are stripped for training and put back
by :func:`flax_merge`). Everything else (rng keys and counts, integer counters, other collections) stays out of
the step and reaches the model as it was when :func:`flax_loss` was built; what the model writes to it during the
loss is dropped: per-step randomness comes from the step's ``rng=``, which ``loss`` receives and hands to the model
(linen: ``module.apply(variables, ..., rngs={"dropout": rng})``; NNX: its rng streams re-seeded from it).
"""

from __future__ import annotations

import contextlib
import re
import string
import sys
import threading
import types
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.training.fsdp import ShardedWeight
from jaxquant.training.rules import ParamRule, dotted_path

__all__ = ["FlaxKernelError", "flax_intercept", "flax_loss", "flax_merge", "flax_params", "flax_rules"]

class FlaxKernelError(ValueError):
    """A quantized kernel (``jq.ShardedWeight``) met an operation that ``jq.dense`` cannot run."""


# ----------------------------------------------------------------------------------------------
# The kernel as flax's modules see it
# ----------------------------------------------------------------------------------------------


def _module_of(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else "<root>"


class KernelRef:
    """What a flax module reads as its kernel during the loss: a quantized weight and its parameter path. Not a
    pytree (linen checks a parameter's leaves against the shape its module declares): a ``KernelBox`` carries
    it through ``jax`` and flax's transforms. Anything but the intercepted matmuls is a :class:`FlaxKernelError`."""

    __slots__ = ("weight", "path")

    def __init__(self, weight: ShardedWeight, path: str):
        self.weight, self.path = weight, path

    @property
    def shape(self) -> tuple:
        return tuple(self.weight.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def dtype(self):
        return jnp.dtype(self.weight.dtype)

    @property
    def transposed(self) -> bool:
        return bool(self.weight.spec.transposed)

    @property
    def layout(self) -> str:
        return "[in, out]" if self.transposed else "[out, in]"

    def describe(self) -> str:
        what = (f"a stack of {self.shape[0]} quantized {self.layout} kernels" if self.ndim > 2 else
                f"a quantized {self.layout} kernel")
        return (f"{self.path} (module {_module_of(self.path)}; {what} of shape {self.shape}, "
                f"recipe {self.weight.spec.recipe})")

    def misuse(self, op: str, hint: Optional[str] = None) -> FlaxKernelError:
        """The error for this kernel meeting ``op``; ``hint`` None: what runs and how to keep it unquantized."""
        if hint is None:
            hint = ("flax_loss runs a quantized kernel only as the kernel of jax.lax.dot_general / jnp.einsum "
                    "(nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nn.Dense, nn.DenseGeneral, nn.Einsum); keep this "
                    "parameter unquantized in the rules (flax_rules(keep=...)) if the model reads it otherwise")
        return FlaxKernelError(f"{self.describe()}: {op}." + (f" {hint[0].upper()}{hint[1:]}" if hint else ""))

    # every way of turning it into an array (jnp.asarray, x @ w, jnp.take, ...) ends here: a property, so that the
    # probes (jit's abstractification, jnp's arraylike checks: getattr / hasattr of __jax_array__) raise it too
    @property
    def __jax_array__(self):
        raise self.misuse("read as an array (jnp.asarray / jnp.matmul / jnp.take / an arithmetic op ...)")

    def __array__(self, *args, **kwargs):
        raise self.misuse("converted to a numpy array")

    def _op(name):
        def op(self, *args, **kwargs):
            raise self.misuse(f"used with {name}")
        op.__name__ = name
        return op

    __matmul__ = __rmatmul__ = _op("the @ operator")
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __neg__ = _op("arithmetic")
    astype = _op(".astype()")
    reshape = _op(".reshape()")
    del _op

    @property
    def T(self):
        raise self.misuse("transposed (.T; e.g. a tied nnx.Embed.attend / nn.Embed.attend)")

    def __getitem__(self, index):
        if index is Ellipsis:
            return self
        raise self.misuse(f"indexed with {index!r}")

    def __repr__(self):
        return f"KernelRef({self.describe()})"


class _KernelBoxBase:
    """The value of a quantized kernel's ``nnx.Param`` / linen ``params`` entry during the loss: a pytree whose
    leaves are the ``ShardedWeight``'s arrays (so ``nnx.scan`` / ``nn.scan`` / ``jax.lax.scan`` hand each layer
    its own), which unboxes (linen's ``meta.unbox``: it is a ``flax.core.meta.AxisMetadata``) or indexes with
    ``[...]`` (NNX's ``Variable.__getitem__``) to the :class:`KernelRef` flax reads."""

    def __init__(self, weight: ShardedWeight, path: str):
        self.weight, self.path = weight, path

    def tree_flatten(self):
        return (self.weight,), self.path

    @classmethod
    def tree_unflatten(cls, path, children):
        return cls(children[0], path)

    def ref(self) -> KernelRef:
        return KernelRef(self.weight, self.path)

    # flax.core.meta.AxisMetadata
    def unbox(self):
        return self.ref()

    def replace_boxed(self, val):
        return type(self)(val.weight if isinstance(val, KernelRef) else val, self.path)

    def add_axis(self, index, params):
        return self

    def remove_axis(self, index, params):
        return self

    # nnx.Variable.__getitem__ / .value readers
    def __getitem__(self, index):
        return self.ref()[index]

    @property
    def shape(self):
        return tuple(self.weight.shape)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(self.weight.dtype)

    @property
    def __jax_array__(self):
        return self.ref().__jax_array__

    def __repr__(self):
        return f"KernelBox({self.ref().describe()})"


_BOX = []   # the box class, made on first use (subclassing flax's AxisMetadata: importing flax costs ~0.15 s)


def _box_class():
    if not _BOX:
        from flax.core.meta import AxisMetadata

        _BOX.append(jax.tree_util.register_pytree_node_class(type("KernelBox", (_KernelBoxBase, AxisMetadata), {
            "__module__": __name__, "__doc__": _KernelBoxBase.__doc__})))
    return _BOX[0]


def _as_ref(x) -> Optional[KernelRef]:
    if isinstance(x, KernelRef):
        return x
    if isinstance(x, _KernelBoxBase):
        return x.ref()
    if isinstance(x, ShardedWeight):
        return KernelRef(x, "<a ShardedWeight>")
    return None


# ----------------------------------------------------------------------------------------------
# Interception (qwix's technique: the function objects' code is swapped, so every alias of them, e.g. the
# ``dot_general`` nnx.Linear stored at construction, is intercepted; restored when the last user leaves)
# ----------------------------------------------------------------------------------------------

# name -> (module, attribute)
_TARGETS = {
    "dot_general": ("jax.lax", "dot_general"),
    "einsum": ("jax.numpy", "einsum"),
    "nnx_promote_dtype": ("flax.nnx.nn.dtypes", "promote_dtype"),
    "linen_promote_dtype": ("flax.linen.dtypes", "promote_dtype"),
}

# The replacement code objects: no free variables (a function's code can only be swapped for code with the same
# free variables), and they run with the intercepted function's globals, so they find this module by name.


def _tramp_dot_general(*args, **kwargs):
    import sys
    return sys.modules["jaxquant.training.flax_adapter"]._dispatch("dot_general", args, kwargs)


def _tramp_einsum(*args, **kwargs):
    import sys
    return sys.modules["jaxquant.training.flax_adapter"]._dispatch("einsum", args, kwargs)


def _tramp_nnx_promote_dtype(*args, **kwargs):
    import sys
    return sys.modules["jaxquant.training.flax_adapter"]._dispatch("nnx_promote_dtype", args, kwargs)


def _tramp_linen_promote_dtype(*args, **kwargs):
    import sys
    return sys.modules["jaxquant.training.flax_adapter"]._dispatch("linen_promote_dtype", args, kwargs)


_TRAMPOLINES = {"dot_general": _tramp_dot_general, "einsum": _tramp_einsum,
                "nnx_promote_dtype": _tramp_nnx_promote_dtype, "linen_promote_dtype": _tramp_linen_promote_dtype}


class _Target(types.SimpleNamespace):
    """One intercepted function: the function object (whose ``__code__`` is swapped), its original code and a
    copy of it with that code (what every call without a quantized kernel runs)."""


_LOCK = threading.RLock()
_STATE = {"depth": 0, "targets": {}}   # targets: name -> _Target, resolved once (kept: a stale call still works)


def _resolve_targets() -> dict:
    import importlib

    targets = _STATE["targets"]
    for name, (module, attr) in _TARGETS.items():
        if name in targets:
            continue
        try:
            fn = getattr(importlib.import_module(module), attr)
        except ImportError:           # flax (or a part of it) missing: nothing of it to intercept
            continue
        if not isinstance(fn, types.FunctionType) or fn.__code__.co_freevars:
            raise RuntimeError(f"jaxquant flax adapter: cannot intercept {module}.{attr} ({type(fn).__name__}); "
                               f"this jax/flax version is not supported")
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        targets[name] = _Target(fn=fn, code=fn.__code__, original=copy)
    return targets


def _dispatch(name, args, kwargs):
    original = _STATE["targets"][name].original
    if not _has_kernel(args, kwargs):
        return original(*args, **kwargs)
    return _HANDLERS[name](original, *args, **kwargs)


def _has_kernel(args, kwargs) -> bool:
    def any_ref(xs):
        for x in xs:
            if _as_ref(x) is not None:
                return True
            if isinstance(x, (tuple, list)) and any(_as_ref(y) is not None for y in x):
                return True
        return False
    return any_ref(args) or any_ref(kwargs.values())


@contextlib.contextmanager
def flax_intercept():
    """Within this context, flax's ``dot_general`` / ``einsum`` / ``promote_dtype`` (every alias of them) send calls
    whose kernel operand is a quantized kernel to ``jq.dense``; every other call runs the original function.
    Re-entrant and thread-safe; leaving the outermost context restores the original functions (no trace left).
    :func:`flax_loss` enters it around the loss; use it directly for a loss of your own that reads
    ``jq.ShardedWeight`` kernels through flax modules."""
    with _LOCK:
        targets = _resolve_targets()
        if _STATE["depth"] == 0:
            for name, t in targets.items():
                t.fn.__code__ = _TRAMPOLINES[name].__code__
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0:
                for t in targets.values():
                    t.fn.__code__ = t.code


def intercepted_functions() -> dict:
    """``{"module.attr": (function, original code)}`` of what :func:`flax_intercept` swaps (for checks)."""
    with _LOCK:
        targets = _resolve_targets()
    return {".".join(_TARGETS[n]): (t.fn, t.code) for n, t in targets.items()}


# ----------------------------------------------------------------------------------------------
# Handlers
# ----------------------------------------------------------------------------------------------


def _dense(x, ref: KernelRef, x_axis: int, k_axis: int, out_dtype, op: str):
    """``jq.dense`` of ``x`` contracted on ``x_axis`` with the kernel's ``k_axis``: ``[x's other axes..., out]``."""
    from jaxquant.training.dense import dense

    if ref.ndim != 2:
        if ref.ndim == 3:
            raise ref.misuse(f"{op}: a stacked kernel is used as one layer's kernel",
                             "declare stacked only for the parameters of layers run under nnx.scan / nn.scan (each "
                             "iteration gets one layer), and keep multi-axis kernels (DenseGeneral [embed, heads, "
                             "head_dim], Einsum) unquantized in the rules")
        raise ref.misuse(f"{op}: not a matrix", None)
    in_axis = 0 if ref.transposed else 1
    if k_axis != in_axis:
        stored, rule = ("[out, in]", "kernel='out_in'") if ref.transposed else ("[in, out]", "kernel='in_out'")
        raise ref.misuse(f"{op} contracts kernel axis {k_axis}, but a {ref.layout} kernel's 'in' axis is {in_axis}",
                         f"the model reads this kernel as {stored}: declare {rule} in its ParamRule "
                         f"(flax_rules(kernel=...) or a rule of its own before them)")
    if x_axis != x.ndim - 1:
        x = jnp.moveaxis(x, x_axis, -1)
    try:
        return dense(x, ref.weight, out_dtype=out_dtype)
    except (ValueError, TypeError) as e:
        raise ref.misuse(f"{op}: jq.dense refused the activation of shape {tuple(x.shape)}, dtype {x.dtype} ({e})",
                         "") from None


def _dot_general(original, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    lref, rref = _as_ref(lhs), _as_ref(rhs)
    (lc, rc), (lb, rb) = dimension_numbers
    op = f"jax.lax.dot_general with dimension_numbers={((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))}"
    if lref is not None and rref is not None:
        raise lref.misuse(f"{op} of two quantized kernels (the other: {rref.path})")
    if kwargs.get("out_sharding") is not None:
        ref = rref or lref
        raise ref.misuse(f"{op} with out_sharding={kwargs['out_sharding']!r} (inside the step's shard_map each "
                         f"rank computes its own block; out_sharding is not supported)")
    unknown = set(kwargs) - {"out_sharding"}
    if unknown:
        raise (rref or lref).misuse(f"{op} with the arguments {sorted(unknown)}")
    if rref is not None:
        x, ref, xc, kc, xb, kb, kernel_first = lhs, rref, lc, rc, lb, rb, False
    else:
        x, ref, xc, kc, xb, kb, kernel_first = rhs, lref, rc, lc, rb, lb, True
    if kb or xb:
        raise ref.misuse(f"{op}: batch dimensions on a quantized kernel")
    if len(kc) != 1:
        raise ref.misuse(f"{op} contracts {len(kc)} kernel axes {tuple(kc)}; jq.dense contracts one",
                         "a kernel with several 'in' axes cannot be quantized: keep it unquantized in the rules "
                         "(flax_rules(keep=...))")
    x = jnp.asarray(x)
    y = _dense(x, ref, int(xc[0]) % x.ndim, int(kc[0]) % ref.ndim, preferred_element_type, op)
    # dot_general's output: [lhs free axes..., rhs free axes...]
    return jnp.moveaxis(y, -1, 0) if kernel_first else y


def _einsum(original, subscripts, *operands, out=None, optimize="auto", precision=None, preferred_element_type=None,
            _dot_general=None, out_sharding=None):
    refs = [_as_ref(o) for o in operands]
    ref = next(r for r in refs if r is not None)
    op = f"jnp.einsum({subscripts!r})"
    if not isinstance(subscripts, str):
        raise ref.misuse(f"jnp.einsum with non-string subscripts {subscripts!r}")
    if len(operands) != 2 or all(r is not None for r in refs):
        raise ref.misuse(f"{op} with {len(operands)} operands, {sum(r is not None for r in refs)} of them quantized "
                         f"kernels (jq.dense runs an activation times one kernel)")
    if out is not None or out_sharding is not None:
        raise ref.misuse(f"{op} with out= / out_sharding=")
    eq = subscripts.replace(" ", "")
    if "->" not in eq:
        raise ref.misuse(f"{op}: implicit output (no '->')")
    ins, out_labels = eq.split("->")
    terms = ins.split(",")
    k_pos = 0 if refs[0] is not None else 1
    x = jnp.asarray(operands[1 - k_pos])
    x_term, k_term = terms[1 - k_pos], terms[k_pos]
    if "..." in k_term:
        raise ref.misuse(f"{op}: an ellipsis on the kernel")
    if "..." in x_term:
        fresh = [c for c in string.ascii_letters if c not in eq]
        n = x.ndim - (len(x_term) - 3)
        if n < 0 or n > len(fresh):
            raise ref.misuse(f"{op}: the activation of rank {x.ndim} does not fit {x_term!r}")
        ell = "".join(fresh[:n])
        x_term, out_labels = x_term.replace("...", ell), out_labels.replace("...", ell)
    if len(x_term) != x.ndim or len(set(x_term)) != len(x_term) or len(set(out_labels)) != len(out_labels):
        raise ref.misuse(f"{op}: subscripts that do not fit an activation of shape {tuple(x.shape)}")
    if ref.ndim != 2:
        return _dense(x, ref, 0, 0, preferred_element_type, op)   # raises: a stack, or not a matrix
    if len(k_term) != 2:
        raise ref.misuse(f"{op}: the kernel's subscripts {k_term!r} do not fit its shape {ref.shape}")
    contracted = [c for c in k_term if c in x_term and c not in out_labels]
    k_free = [c for c in k_term if c not in x_term and c in out_labels]
    k_summed = [c for c in k_term if c not in x_term and c not in out_labels]
    shared = [c for c in k_term if c in x_term and c in out_labels]
    x_summed = [c for c in x_term if c not in k_term and c not in out_labels]
    if shared or x_summed or k_summed or len(contracted) != 1 or len(k_free) != 1:
        raise ref.misuse(f"{op}: the kernel {k_term!r} must have one axis contracted with the activation and one "
                         f"output axis (got contracted {contracted}, output {k_free}, summed {k_summed}, batch "
                         f"{shared}; activation axes summed alone {x_summed})",
                         "a kernel with several 'in' or 'out' axes cannot be quantized: keep it unquantized in the "
                         "rules (flax_rules(keep=...))")
    c = contracted[0]
    y = _dense(x, ref, x_term.index(c), k_term.index(c), preferred_element_type, op)
    y_labels = [l for l in x_term if l != c] + k_free
    if sorted(y_labels) != sorted(out_labels):
        raise ref.misuse(f"{op}: output {out_labels!r} is not a permutation of {''.join(y_labels)!r}")
    return jnp.transpose(y, [y_labels.index(l) for l in out_labels])


def _promote(original, args, dtype, inexact, pack):
    """flax's promote_dtype with each quantized kernel standing in as a scalar of its compute dtype (bf16): the
    other arguments are cast as flax casts them next to a bf16 kernel; the kernel is returned as it is."""
    refs = {i: a for i, a in enumerate(args) if _as_ref(a) is not None}
    stand_in = [jnp.zeros((), _as_ref(a).dtype) if i in refs else a for i, a in enumerate(args)]
    out = original(*pack(stand_in), dtype=dtype, inexact=inexact)
    return type(out)(refs.get(i, o) for i, o in enumerate(out))


def _nnx_promote(original, args, /, *, dtype=None, inexact=True):
    return _promote(original, tuple(args), dtype, inexact, lambda a: (tuple(a),))


def _linen_promote(original, *args, dtype=None, inexact=True):
    return _promote(original, args, dtype, inexact, lambda a: tuple(a))


_HANDLERS = {"dot_general": _dot_general, "einsum": _einsum, "nnx_promote_dtype": _nnx_promote,
             "linen_promote_dtype": _linen_promote}


# ----------------------------------------------------------------------------------------------
# Models: trainable parameters, the rest, the loss, merging back
# ----------------------------------------------------------------------------------------------


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(jnp.dtype(x.dtype), jnp.floating)


def _is_nnx(model) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def _check_model(model, what="model"):
    if _is_nnx(model):
        return "nnx"
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(model, linen.Module):
        raise TypeError(f"{what}: a linen Module holds no parameters; pass its variables (model.init(...), a dict "
                        f"with a 'params' collection) and call model.apply(variables, ...) inside the loss")
    if hasattr(model, "keys") and "params" in model:
        return "linen"
    raise TypeError(f"{what}: must be a flax nnx.Module or a linen variables dict with a 'params' collection, got "
                    f"{type(model).__name__}")


def _trainable(path, variable) -> bool:
    from flax import nnx

    return isinstance(variable, nnx.Param) and _is_float(variable)


class _Split:
    """A model taken apart: the trainable parameters (a plain nested dict) and how to rebuild the model around
    other values for them."""

    def __init__(self, model):
        self.kind = _check_model(model)
        if self.kind == "nnx":
            from flax import nnx

            self.graphdef, pstate, self.rest = nnx.split(model, _trainable, ...)
            self.flat = list(nnx.to_flat_state(pstate))            # [(path tuple, Variable)]
            self.params = nnx.to_pure_dict(pstate)
        else:
            from flax.core import meta
            from flax.traverse_util import flatten_dict

            flat = flatten_dict(_unfreeze(model), keep_empty_nodes=True)
            self.boxed = {k: v for k, v in flat.items() if isinstance(v, meta.AxisMetadata)}
            values = {k: meta.unbox(v) for k, v in flat.items()}
            self.train_keys = [k for k, v in values.items() if k[0] == "params" and _is_float(v)]
            self.rest = {k: v for k, v in flat.items() if k not in set(self.train_keys)}
            from flax.traverse_util import unflatten_dict

            self.params = unflatten_dict({k[1:]: values[k] for k in self.train_keys})
        leaves = jax.tree_util.tree_flatten_with_path(self.params)[0]
        self.names = [dotted_path(p) for p, _ in leaves]
        self.dtypes = {dotted_path(p): jnp.dtype(v.dtype) for p, v in leaves}

    def build(self, leaves_by_path: dict):
        """The model (NNX) or variables (linen) with ``leaves_by_path[dotted name]`` as the trainable values."""
        if self.kind == "nnx":
            from flax import nnx

            pstate = nnx.from_flat_state([(p, v.replace(leaves_by_path[".".join(map(str, p))]))
                                          for p, v in self.flat])
            # copy: the rest's variables are fresh ones at every call (never written to, never of another trace)
            return nnx.merge(self.graphdef, pstate, self.rest, copy=True)
        from flax.traverse_util import unflatten_dict

        flat = dict(self.rest)
        for k in self.train_keys:
            flat[k] = leaves_by_path[".".join(map(str, k[1:]))]
        return unflatten_dict(flat)


def _unfreeze(variables):
    from flax.core import unfreeze

    return unfreeze(variables)


def flax_params(model):
    """The trainable parameters of ``model`` (an ``nnx.Module``, or a linen variables dict) as the plain nested
    dict ``make_train_step``'s ``init`` takes: floating ``nnx.Param`` values (NNX; list indices as int keys,
    ``layers.0.attn.q.kernel``) or the floating leaves of the ``params`` collection (linen, metadata boxes
    stripped). Rng keys, counters and every other variable stay out (see :func:`flax_loss`)."""
    return _Split(model).params


def flax_loss(model, loss: Callable) -> Callable:
    """``loss_fn(weights, batch, **kw)`` for ``jq.make_train_step`` from a loss written on the flax model.

    Args:
      model: the ``nnx.Module`` or linen variables dict whose :func:`flax_params` the step trains. Its other state
        (rng keys and counts, integer variables, other collections) is captured now and handed to the model as it
        is at every call; what the model writes to it during the loss is dropped.
      loss: ``loss(model, batch, **kw)`` (NNX: the model rebuilt around the step's weights) or
        ``loss(variables, batch, **kw)`` (linen: call ``module.apply(variables, ...)`` in it), returning what the
        step's ``loss_fn`` returns (a scalar; ``(loss, aux)`` with ``has_aux``; ...). ``kw``: the step's ``rng=`` /
        ``extra=``.

    Returns:
      ``loss_fn(weights, batch, **kw)``: rebuilds the model with each quantized leaf (a ``jq.ShardedWeight``) as its
      kernel and each other leaf (an array) as it is, and runs ``loss`` inside :func:`flax_intercept`.
    """
    if not callable(loss):
        raise TypeError(f"loss: must be callable, got {type(loss).__name__}")
    split = _Split(model)

    def loss_fn(weights, batch, **kwargs):
        leaves = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, ShardedWeight))[0]
        by_path = {}
        for path, leaf in leaves:
            name = dotted_path(path)
            if isinstance(leaf, ShardedWeight):
                by_path[name] = _box_class()(leaf, name)
            elif name in split.dtypes and hasattr(leaf, "dtype") and leaf.dtype != split.dtypes[name]:
                by_path[name] = leaf.astype(split.dtypes[name])   # e.g. a bf16-gathered embedding, fp32 in the model
            else:
                by_path[name] = leaf
        if set(by_path) != set(split.names):
            raise ValueError(f"flax_loss: the step's weights must be like jq.flax_params(model) of the model given to "
                             f"flax_loss; missing {sorted(set(split.names) - set(by_path))[:4]}, unknown "
                             f"{sorted(set(by_path) - set(split.names))[:4]}")
        with flax_intercept():
            return loss(split.build(by_path), batch, **kwargs)

    loss_fn.__name__ = getattr(loss, "__name__", "flax_loss")
    return loss_fn


def flax_merge(model, params):
    """``model`` with ``params`` (e.g. ``step.params(state)``, a dict like :func:`flax_params`) as its trainable
    parameters, each cast to the dtype it had in ``model``: a new ``nnx.Module`` (NNX; ``model`` is left as it
    is) or a new variables dict (linen, metadata boxes put back). Everything else is ``model``'s."""
    split = _Split(model)
    old = dict(zip(split.names, jax.tree.leaves(split.params)))
    new = {dotted_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    if set(new) != set(old):
        raise ValueError(f"params: must be like flax_params(model); missing {sorted(set(old) - set(new))[:4]}, "
                         f"unknown {sorted(set(new) - set(old))[:4]}")
    for name, v in new.items():
        if tuple(np.shape(v)) != tuple(np.shape(old[name])):
            raise ValueError(f"params: {name} has shape {tuple(np.shape(v))}, the model's {tuple(np.shape(old[name]))}")
    cast = {name: jnp.asarray(v, old[name].dtype) for name, v in new.items()}
    if split.kind == "nnx":
        return split.build(cast)
    out = {}
    for k in split.train_keys:
        name = ".".join(map(str, k[1:]))
        out[name] = split.boxed[k].replace_boxed(cast[name]) if k in split.boxed else cast[name]
    from flax.core import FrozenDict, freeze

    return freeze(split.build(out)) if isinstance(model, FrozenDict) else split.build(out)


# ----------------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------------


def flax_rules(quantize: str = r"(.*\.)?kernel", *, stacked: Optional[str] = None, keep: Optional[str] = None,
               recipes: Optional[dict] = None, kernel: str = "in_out") -> list:
    """``jq.ParamRule`` s for a flax model's parameter names (:func:`flax_params`' dotted paths).

    Args:
      quantize: regex (full match) of the kernels to quantize (default: every ``kernel``); each is one layer's
        ``[in, out]`` matrix (``kernel="in_out"``), or a stack of them under ``stacked``.
      stacked: regex of the leaves that are stacks of layers (the parameters of ``nnx.scan`` / ``nn.scan`` layers,
        e.g. ``r"layers\\..*"``): axis 0 is the layer axis (quantized and saved per layer, never split over FSDP).
      keep: regex of leaves kept unquantized although ``quantize`` matches them: multi-axis kernels
        (``DenseGeneral(features=(heads, head_dim))``), a kernel read otherwise than by a matmul.
      recipes: ``{regex: "bf16" | "fp8" | "nvfp4"}``: quantized kernels with their own recipe (e.g. keep the
        head in bf16 under NVFP4), before ``quantize``.
      kernel: the layout of the quantized kernels, ``"in_out"`` (flax's) or ``"out_in"``.

    Returns:
      The rules, first match wins: ``keep``, ``recipes``, ``quantize``, then everything else unquantized (arrays:
      embeddings, norm scales, biases), each with ``stacked=True`` where ``stacked`` matches.
    """
    for name, pattern in (("quantize", quantize), ("stacked", stacked), ("keep", keep)):
        if pattern is not None:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"flax_rules: {name} is not a regular expression: {pattern!r} ({e})") from None
    rules = []

    def add(pattern, **kw):
        if stacked is not None:
            rules.append(ParamRule(f"(?=(?:{stacked})$)(?:{pattern})", stacked=True, **kw))
        rules.append(ParamRule(pattern, **kw))

    if keep is not None:
        add(keep)
    for pattern, recipe in (recipes or {}).items():
        add(pattern, quantize=recipe, kernel=kernel)
    add(quantize, quantize=True, kernel=kernel)
    add(r".*")
    return rules
