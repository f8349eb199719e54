"""Flax models unchanged: an NNX or linen model trains under ``jq.make_train_step`` with bf16 / FP8 / NVFP4 weights.

The model's code is not edited. Its trainable parameters become the step's ``params`` (a plain nested dict with
flax's names, ``layers.0.mlp.up.kernel``), and while the loss runs the kernels the rules quantize reach flax's
layers as quantized kernels (``jq.ShardedWeight``, ``[in, out]`` as flax stores them, declared with
``ParamRule(kernel="in_out")``). An interception through public attributes only (the module attributes
``jax.lax.dot_general`` / ``jax.numpy.einsum`` / ``jax.numpy.asarray`` replaced for a scope, as qwix does, and
the NNX layers' own ``dot_general`` / ``einsum_op``), in force only inside :func:`flax_intercept` (which
:func:`flax_loss` enters around the loss), sends every matmul whose kernel operand is such a weight to
``jq.dense`` (per-use quantize + all-gather + GEMM, its own backward) and leaves every other call as it was::

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
einsum ``"btd,fd->btf"``). flax's ``promote_dtype`` sees such a kernel (through ``jnp.asarray``) as an array of
its compute dtype (bf16): the activation is cast as flax would cast it for a bf16 kernel (or to the module's
``dtype``), and the GEMM's output has that dtype (``preferred_element_type`` if given). ``precision`` is not used
(``jq.dense`` accumulates in fp32).

A kernel with more than one ``in`` or ``out`` axis (``nn.DenseGeneral(features=(heads, head_dim))``, an einsum
``"btd,dnh->btnh"``) runs quantized as the 2-D ``[in, out]`` matrix of its contraction (:class:`KernelView`) when
``flax_loss`` is given ``batch=`` (the loss is traced once to see its axes, :func:`trace_kernels`); without it, keep
it unquantized with ``flax_rules(keep=...)`` and flax runs it as usual on the gathered array. A quantized
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
import inspect
import re
import string
import sys
import threading
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.training.fsdp import ShardedWeight
from jaxquant.training.rules import ParamRule, dotted_path

__all__ = ["FlaxKernelError", "FlaxLoss", "KernelView", "flax_intercept", "flax_loss", "flax_merge", "flax_params",
           "flax_rules"]

class FlaxKernelError(ValueError):
    """A quantized kernel (``jq.ShardedWeight``) met an operation that ``jq.dense`` cannot run."""


# ----------------------------------------------------------------------------------------------
# The kernel as flax's modules see it
# ----------------------------------------------------------------------------------------------


def _module_of(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else "<root>"


class KernelView(NamedTuple):
    """How a kernel with several contracted or free axes is quantized: as the 2-D ``[in, out]`` matrix of its
    contraction (PyTorch's ``[out, in]`` when saved), ``in`` the product of the contracted axes in ``in_axes``
    order and ``out`` of the free ones in ``out_axes`` order. ``shape`` is one layer's kernel as the model
    declares it; ``op`` the contraction the trace saw (for the plan and errors)."""

    shape: tuple
    in_axes: tuple
    out_axes: tuple
    op: str = ""

    @property
    def matrix_shape(self) -> tuple:
        return (int(np.prod([self.shape[a] for a in self.in_axes])),
                int(np.prod([self.shape[a] for a in self.out_axes])))

    @property
    def is_identity(self) -> bool:
        return len(self.shape) == 2 and self.in_axes == (0,)

    def to_matrix(self, a):
        """The model's kernel (a leading layer axis allowed) as ``[..., in, out]``."""
        lead = a.ndim - len(self.shape)
        perm = list(range(lead)) + [lead + i for i in self.in_axes + self.out_axes]
        return jnp.reshape(jnp.transpose(a, perm), a.shape[:lead] + self.matrix_shape)

    def from_matrix(self, m):
        """:meth:`to_matrix` undone."""
        lead = m.ndim - 2
        order = self.in_axes + self.out_axes
        m = jnp.reshape(m, m.shape[:lead] + tuple(self.shape[a] for a in order))
        inverse = list(range(lead)) + [lead + order.index(i) for i in range(len(self.shape))]
        return jnp.transpose(m, inverse)


class KernelRef:
    """What a flax module reads as its kernel during the loss: a quantized weight and its parameter path. Not a
    pytree (linen checks a parameter's leaves against the shape its module declares): a ``KernelBox`` carries
    it through ``jax`` and flax's transforms. Anything but the intercepted matmuls is a :class:`FlaxKernelError`."""

    __slots__ = ("weight", "path", "view")

    def __init__(self, weight: ShardedWeight, path: str, view: Optional[KernelView] = None):
        self.weight, self.path, self.view = weight, path, view

    @property
    def shape(self) -> tuple:
        if self.view is not None:   # the model's own (multi-axis) shape; a stack keeps its layer axis
            return tuple(self.weight.shape)[:-2] + tuple(self.view.shape)
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
        layout = (f"kernel quantized as its [in, out] matrix {self.view.matrix_shape}" if self.view is not None
                  else f"{self.layout} kernel")
        stacked = self.weight.ndim > 2
        what = f"a stack of {self.shape[0]} quantized {layout}s" if stacked else f"a quantized {layout}"
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


class _LayerAxisAgnostic:
    """flax's ``AxisMetadata`` hooks of a box whose leaves scans slice themselves: adding or removing a layer axis
    leaves the box as it is."""

    def add_axis(self, index, params):
        return self

    def remove_axis(self, index, params):
        return self


class _KernelBoxBase(_LayerAxisAgnostic):
    """The value of a quantized kernel's ``nnx.Param`` / linen ``params`` entry during the loss: a pytree whose
    leaves are the ``ShardedWeight``'s arrays (so ``nnx.scan`` / ``nn.scan`` / ``jax.lax.scan`` hand each layer
    its own), which unboxes (linen's ``meta.unbox``: it is a ``flax.core.meta.AxisMetadata``) or indexes with
    ``[...]`` (NNX's ``Variable.__getitem__``) to the :class:`KernelRef` flax reads."""

    def __init__(self, weight: ShardedWeight, path: str, view: Optional[KernelView] = None):
        self.weight, self.path, self.view = weight, path, view

    def tree_flatten(self):
        return (self.weight,), (self.path, self.view)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def ref(self) -> KernelRef:
        return KernelRef(self.weight, self.path, self.view)

    # flax.core.meta.AxisMetadata
    def unbox(self):
        return self.ref()

    def replace_boxed(self, val):
        return type(self)(val.weight if isinstance(val, KernelRef) else val, self.path, self.view)

    # nnx.Variable.__getitem__ / .value readers
    def __getitem__(self, index):
        return self.ref()[index]

    @property
    def shape(self):
        return self.ref().shape

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


_BOXES = {}   # box classes, made on first use (subclassing flax's AxisMetadata: importing flax costs ~0.15 s)


def _metadata_class(name, base):
    """``base`` as a pytree subclass of flax's ``AxisMetadata`` named ``name``, made once."""
    if name not in _BOXES:
        from flax.core.meta import AxisMetadata

        _BOXES[name] = jax.tree_util.register_pytree_node_class(type(name, (base, AxisMetadata), {
            "__module__": __name__, "__doc__": base.__doc__}))
    return _BOXES[name]


def _box_class():
    return _metadata_class("KernelBox", _KernelBoxBase)


def _as_ref(x) -> Optional[KernelRef]:
    if isinstance(x, KernelRef):
        return x
    if isinstance(x, _KernelBoxBase):
        return x.ref()
    if isinstance(x, ShardedWeight):
        return KernelRef(x, "<a ShardedWeight>")
    return None


# ----------------------------------------------------------------------------------------------
# Interception through public attributes only (qwix's technique): for the duration of a scope, the module
# attributes ``jax.lax.dot_general``, ``jax.numpy.einsum``, ``jax.numpy.asarray`` and
# ``jax.lax.with_sharding_constraint`` are wrappers (flax's layers look them up at call time, and flax's
# ``promote_dtype`` casts through ``jnp.asarray``); NNX modules that captured ``jax.lax.dot_general`` /
# ``jnp.einsum`` at construction (``nnx.Linear.dot_general``, ``nnx.Einsum.einsum_op``: public constructor
# arguments) get the wrappers as those attributes for the scope. No function's code is touched.
# ----------------------------------------------------------------------------------------------

# name -> (module, attribute)
_TARGETS = {
    "dot_general": ("jax.lax", "dot_general"),
    "einsum": ("jax.numpy", "einsum"),
    "asarray": ("jax.numpy", "asarray"),
    "with_sharding_constraint": ("jax.lax", "with_sharding_constraint"),
}

# what an NNX module attribute holding one of these functions (captured at construction) is routed through
_INSTANCE_TARGETS = ("dot_general", "einsum")

_LOCK = threading.RLock()
_STATE = {"depth": 0, "originals": {}}   # originals: name -> the function the module attribute held (kept)
_LOCAL = threading.local()               # .depth: this thread's nesting of flax_intercept


def _module(name):
    import importlib

    return importlib.import_module(_TARGETS[name][0])


def _make_wrapper(name):
    def wrapper(*args, **kwargs):
        return _dispatch(name, args, kwargs)

    module, attr = _TARGETS[name]
    wrapper.__name__ = wrapper.__qualname__ = attr
    wrapper.__doc__ = f"{module}.{attr}, routed by jaxquant's flax adapter (see jaxquant.flax_intercept)."
    return wrapper


_WRAPPERS = {name: _make_wrapper(name) for name in _TARGETS}
# the functions themselves, as jax defines them (what a module captured at construction holds)
_JAX_FUNCTIONS = {"dot_general": jax.lax.dot_general, "einsum": jnp.einsum}


def _originals() -> dict:
    """name -> the function the module attribute holds outside the scope (resolved once; updated when something
    else has replaced the attribute since)."""
    originals = _STATE["originals"]
    for name, (_, attr) in _TARGETS.items():
        current = getattr(_module(name), attr)
        if current is not _WRAPPERS[name]:
            originals[name] = current
        elif name not in originals:   # pragma: no cover - our wrapper left in place by someone else's restore
            raise RuntimeError(f"jaxquant flax adapter: {'.'.join(_TARGETS[name])} is jaxquant's wrapper outside "
                               f"the scope, and the original function is unknown")
    return originals


def _in_scope() -> bool:
    return getattr(_LOCAL, "depth", 0) > 0


def _dispatch(name, args, kwargs):
    original = _STATE["originals"][name]
    if name == "with_sharding_constraint":
        # the loss runs per rank (inside the step's shard_map) or abstractly (the trace): a constraint on the
        # global array's sharding has nothing to constrain there; the step places the batch and weights itself
        if _in_scope():
            return args[0] if args else kwargs["x"]
        return original(*args, **kwargs)
    log = _PROBE_LOG.get(threading.get_ident())
    if log is not None:
        return _PROBE_HANDLERS[name](log, original, *args, **kwargs)
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


def _route_modules(models, done: list):
    """Point the attributes of the NNX modules in ``models`` that hold ``jax.lax.dot_general`` / ``jnp.einsum``
    itself (captured at construction: ``nnx.Linear``'s ``dot_general``, ``nnx.Einsum``'s ``einsum_op``, a module of
    the user's that stored one) at the wrappers, appending ``(module, attribute, old value)`` to ``done``."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    originals = _STATE["originals"]
    swaps = {}
    for name in _INSTANCE_TARGETS:
        swaps[id(originals[name])] = (originals[name], _WRAPPERS[name])
        jax_fn = _JAX_FUNCTIONS.get(name)
        if jax_fn is not None:
            swaps[id(jax_fn)] = (jax_fn, _WRAPPERS[name])
    for model in models:
        if not isinstance(model, nnx.Module):
            continue
        for _, node in nnx.iter_graph(model):
            if not isinstance(node, nnx.Module):
                continue
            for attr, value in list(vars(node).items()):
                hit = swaps.get(id(value))
                if hit is not None and hit[0] is value:
                    setattr(node, attr, hit[1])
                    done.append((node, attr, value))


@contextlib.contextmanager
def flax_intercept(*models):
    """Within this context, calls of ``jax.lax.dot_general`` / ``jnp.einsum`` whose kernel operand is a quantized
    kernel go to ``jq.dense``, and flax's ``promote_dtype`` (through ``jnp.asarray``) passes such a kernel on as
    it is, casting the other operands as next to a kernel of its compute dtype (bf16); every other call runs the
    original function. ``jax.lax.with_sharding_constraint`` (and flax's logical constraints, which call it)
    returns its input in the threads inside the context: the loss runs per rank inside the step's ``shard_map``,
    where the model's activation shardings do not apply.

    How: only public attributes are replaced, for the duration of the context: the module attributes
    ``jax.lax.dot_general``, ``jax.numpy.einsum``, ``jax.numpy.asarray`` and ``jax.lax.with_sharding_constraint``
    (what flax's layers and a loss's own ``jnp.einsum(...)`` look up at call time), and, on the NNX modules of
    ``models``, each attribute that holds ``jax.lax.dot_general`` / ``jnp.einsum`` itself (``nnx.Linear``'s
    ``dot_general``, ``nnx.Einsum``'s ``einsum_op``: constructor arguments, captured at construction). No code
    object is touched. A name bound before the context (``from jax.numpy import einsum``) is not intercepted.
    Re-entrant and thread-safe; leaving the outermost context restores the module attributes, and leaving each
    context the attributes of its ``models``. :func:`flax_loss` enters it around the loss with the model it
    builds; use it directly for a loss of your own that reads ``jq.ShardedWeight`` kernels through flax modules
    (pass the NNX model)."""
    with _LOCK:
        originals = _originals() if _STATE["depth"] == 0 else _STATE["originals"]
        if _STATE["depth"] == 0:
            for name, (_, attr) in _TARGETS.items():
                setattr(_module(name), attr, _WRAPPERS[name])
        _STATE["depth"] += 1
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    routed = []
    try:
        _route_modules(models, routed)
        yield
    finally:
        for node, attr, value in reversed(routed):
            setattr(node, attr, value)
        _LOCAL.depth -= 1
        with _LOCK:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0:
                for name, (_, attr) in _TARGETS.items():
                    module = _module(name)
                    if getattr(module, attr) is _WRAPPERS[name]:   # else someone replaced it since: theirs stays
                        setattr(module, attr, originals[name])


def intercepted_attributes() -> dict:
    """``{"module.attr": (original function, wrapper)}``: the module attributes :func:`flax_intercept` replaces by
    the wrapper for its duration (for checks)."""
    with _LOCK:
        originals = _originals() if _STATE["depth"] == 0 else _STATE["originals"]
    return {".".join(_TARGETS[n]): (originals[n], _WRAPPERS[n]) for n in _TARGETS}


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


def _dense_view(x, ref: KernelRef, k_contracted, x_contracted, out_dtype, op: str):
    """``jq.dense`` of a viewed kernel: ``x``'s axes ``x_contracted`` (paired with the kernel's ``k_contracted``)
    against its ``[in, out]`` matrix; ``[x's other axes..., the kernel's free axes in view order]``."""
    from jaxquant.training.dense import dense

    view = ref.view
    if ref.weight.ndim != 2:
        raise ref.misuse(f"{op}: a stacked kernel is used as one layer's kernel",
                         "declare stacked only for the parameters of layers run under nnx.scan / nn.scan")
    if sorted(k_contracted) != sorted(view.in_axes):
        raise ref.misuse(f"{op} contracts kernel axes {tuple(k_contracted)}, but it is quantized as the matrix of "
                         f"{view.op or 'another contraction'} (contracted axes {view.in_axes})",
                         "a kernel read by two different contractions cannot be one quantized matrix: keep it "
                         "unquantized in the rules")
    x_axes = [x_contracted[list(k_contracted).index(a)] % x.ndim for a in view.in_axes]
    n = len(x_axes)
    x = jnp.moveaxis(x, x_axes, list(range(x.ndim - n, x.ndim)))
    lead = x.shape[:x.ndim - n]
    x = jnp.reshape(x, lead + (view.matrix_shape[0],))
    try:
        y = dense(x, ref.weight, out_dtype=out_dtype)
    except (ValueError, TypeError) as e:
        raise ref.misuse(f"{op}: jq.dense refused the activation of shape {tuple(x.shape)}, dtype {x.dtype} ({e})",
                         "") from None
    return jnp.reshape(y, lead + tuple(view.shape[a] for a in view.out_axes))


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
    if ref.view is not None:
        x = jnp.asarray(x)
        y = _dense_view(x, ref, [int(a) % len(ref.view.shape) for a in kc], [int(a) for a in xc],
                        preferred_element_type, op)
        # dot_general's output: [lhs free axes..., rhs free axes...], each side's in increasing axis order
        nx = x.ndim - len(xc)
        k_free = ref.view.out_axes
        y = jnp.transpose(y, list(range(nx)) + [nx + k_free.index(a) for a in sorted(k_free)])
        return jnp.moveaxis(y, list(range(nx, y.ndim)), list(range(y.ndim - nx))) if kernel_first else y
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
    if ref.view is not None:
        if len(k_term) != len(ref.view.shape) or len(set(k_term)) != len(k_term):
            raise ref.misuse(f"{op}: the kernel's subscripts {k_term!r} do not fit its shape {ref.view.shape}")
        k_contracted = [i for i, c in enumerate(k_term) if c in x_term and c not in out_labels]
        odd = ([c for c in k_term if (c in x_term) == (c in out_labels)] +
               [c for c in x_term if c not in k_term and c not in out_labels])
        if odd:
            raise ref.misuse(f"{op}: labels {odd} are batch axes of the kernel or summed alone",
                             "only a contraction of activation axes with kernel axes can run quantized: keep this "
                             "kernel unquantized in the rules")
        y = _dense_view(x, ref, k_contracted, [x_term.index(k_term[a]) for a in k_contracted],
                        preferred_element_type, op)
        y_labels = [l for l in x_term if l not in k_term] + [k_term[a] for a in ref.view.out_axes]
        return jnp.transpose(y, [y_labels.index(l) for l in out_labels])
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


def _asarray(original, a, *args, **kwargs):
    """``jnp.asarray`` of a quantized kernel is the kernel as it is. flax's ``promote_dtype`` reads the kernel's dtype
    (its compute dtype, bf16) through ``jnp.asarray(kernel)`` and ``jnp.result_type``, so the other operands are
    cast as flax casts them next to a bf16 kernel, and hands the kernel on to the contraction unchanged."""
    if _as_ref(a) is None:   # a list / tuple holding a kernel: not a kernel of a layer
        return original(a, *args, **kwargs)
    return a


_HANDLERS = {"dot_general": _dot_general, "einsum": _einsum, "asarray": _asarray}


# ----------------------------------------------------------------------------------------------
# The trace: how the loss reads each parameter (which kernels are a contraction's weight operand, on which axes)
# ----------------------------------------------------------------------------------------------

_PROBE_LOG = {}   # thread id -> the ProbeLog of the trace running in that thread


class ProbeLog:
    """What one abstract run of the loss saw. Each parameter read through its variable is registered by the
    identity of the traced array it reads as (``ids``: id -> path; ``alive`` keeps those arrays, so no id is
    reused); an intercepted dot_general / einsum with a registered operand as one side records a contraction
    (``uses[path]``: ``(layer shape, contracted axes, free axes, op)``), in the order the loss ran them."""

    def __init__(self):
        self.ids, self.alive, self.seen = {}, [], {}
        self.uses, self.order, self.reads = {}, [], []
        self.depth = 0

    def register(self, array, path):
        self.ids[id(array)] = path
        self.alive.append(array)
        self.seen.setdefault(path, set()).add(tuple(np.shape(array)))
        return array

    def path_of(self, x) -> Optional[str]:
        return self.ids.get(id(x))

    def contract(self, path, shape, contracted, free, op):
        self.uses.setdefault(path, []).append((tuple(shape), tuple(contracted), tuple(free), op))
        self.order.append(path)

    def other_contraction(self):
        """A dot_general / einsum of no parameter (attention scores, a tied head's ``x @ embedding.T``)."""
        self.order.append(None)


class _ProbeBoxBase(_LayerAxisAgnostic):
    """A candidate kernel's variable value during the trace: a pytree of its array (so scans slice it per layer)
    that unboxes / indexes to that array, registered in the log."""

    def __init__(self, array, path, log):
        self.array, self.path, self.log = array, path, log

    def tree_flatten(self):
        return (self.array,), (self.path, self.log)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def unbox(self):
        self.log.reads.append(self.path)
        return self.log.register(self.array, self.path)

    def replace_boxed(self, val):
        return type(self)(val, self.path, self.log)

    def __getitem__(self, index):
        return self.unbox()[index]

    shape = property(lambda self: tuple(self.array.shape))
    ndim = property(lambda self: self.array.ndim)
    dtype = property(lambda self: self.array.dtype)


def _probe_box_class():
    return _metadata_class("ProbeBox", _ProbeBoxBase)


@contextlib.contextmanager
def _outermost(log):
    """Calls the intercepted functions make inside one another are not the model's own."""
    log.depth += 1
    try:
        yield log.depth == 1
    finally:
        log.depth -= 1


def _probe_dot_general(log, original, lhs, rhs, dimension_numbers, *args, **kwargs):
    with _outermost(log) as outer:
        lp, rp = log.path_of(lhs), log.path_of(rhs)
        if outer and (lp is None) != (rp is None):
            (lc, rc), (lb, rb) = dimension_numbers
            path, k, kc, kb = (rp, rhs, rc, rb) if rp is not None else (lp, lhs, lc, lb)
            if not kb:
                kc = tuple(int(a) % k.ndim for a in kc)
                log.contract(path, k.shape, kc, tuple(a for a in range(k.ndim) if a not in kc),
                             f"jax.lax.dot_general(contracting={(tuple(lc), tuple(rc))})")
        elif outer:
            log.other_contraction()
        return original(lhs, rhs, dimension_numbers, *args, **kwargs)


def _probe_einsum(log, original, subscripts, *operands, **kwargs):
    with _outermost(log) as outer:
        paths = [log.path_of(o) for o in operands]
        eq = subscripts.replace(" ", "") if isinstance(subscripts, str) else ""
        if outer and "->" in eq and len(operands) == 2 and sum(p is not None for p in paths) == 1:
            ins, out_labels = eq.split("->")
            terms = ins.split(",")
            k = 0 if paths[0] is not None else 1
            kernel, k_term, x_term = operands[k], terms[k], terms[1 - k]
            if "..." not in k_term and len(k_term) == kernel.ndim and len(set(k_term)) == len(k_term):
                contracted = tuple(i for i, c in enumerate(k_term) if c in x_term and c not in out_labels)
                free = tuple(i for i, c in enumerate(k_term) if c in out_labels and c not in x_term)
                if len(contracted) + len(free) == kernel.ndim and contracted and free:
                    log.contract(paths[k], kernel.shape, contracted, free, f"jnp.einsum({eq!r})")
        elif outer:
            log.other_contraction()
        return original(subscripts, *operands, **kwargs)


def _probe_asarray(log, original, a, *args, **kwargs):
    """``jnp.asarray``; a registered parameter's array (flax's ``promote_dtype`` casts through it) is registered under
    its path too."""
    out = original(a, *args, **kwargs)
    path = log.path_of(a)
    if path is not None:
        log.register(out, path)
    return out


_PROBE_HANDLERS = {"dot_general": _probe_dot_general, "einsum": _probe_einsum, "asarray": _probe_asarray}


class KernelPlan(NamedTuple):
    """What the trace decided for a flax model's parameters: ``views`` (path -> :class:`KernelView` of each
    contraction weight), ``stacked`` (paths whose axis 0 is a layer axis), ``kept`` (path -> why it stays an
    unquantized array) and ``head`` (the last contraction of the loss: the output head)."""

    views: dict
    stacked: frozenset
    kept: dict
    head: Optional[str]


def trace_kernels(split, loss, batch) -> KernelPlan:
    """Run ``loss`` abstractly (``jax.eval_shape``: no FLOPs, no memory) on the model and ``batch`` and read off how
    each parameter is used."""
    log = ProbeLog()
    box = _probe_box_class()
    try:
        takes_rng = "rng" in inspect.signature(loss).parameters
    except (TypeError, ValueError):
        takes_rng = False

    def run(params, batch):
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        by_path = {dotted_path(p): box(v, dotted_path(p), log) if np.ndim(v) >= 2 else v for p, v in leaves}
        key = threading.get_ident()
        _PROBE_LOG[key] = log
        try:
            model = split.build(by_path)
            with flax_intercept(model):
                out = loss(model, batch, **({"rng": jax.random.key(0)} if takes_rng else {}))
        finally:
            del _PROBE_LOG[key]
        return jax.tree.map(jnp.asarray, out)

    try:
        jax.eval_shape(run, split.params, batch)
    except Exception as e:   # the user's loss on the user's batch: say where it failed, keep the cause
        raise ValueError(f"flax_loss: batch: running the loss abstractly on it (to see how each kernel is "
                         f"contracted) failed: {type(e).__name__}: {e}") from e
    shapes = split.shapes
    views, kept = {}, {}
    stacked = {n for n, seen in log.seen.items()
               if len(seen) == 1 and shapes[n][1:] == next(iter(seen)) and len(shapes[n]) >= 2}
    # a stack's other leaves (norm scales, biases) live under the same module path with the same layer count
    roots = {}
    for n in stacked:
        parts = n.split(".")
        key = (parts[0], shapes[n][0])
        roots[key] = parts if key not in roots else [a for a, b in zip(roots[key], parts) if a == b]
    for n, shape in shapes.items():
        parts = n.split(".")
        if n not in stacked and shape and (parts[0], shape[0]) in roots:
            prefix = roots[(parts[0], shape[0])]
            if parts[:len(prefix)] == prefix and len(prefix) < len(parts):
                stacked.add(n)
    for name, shape in shapes.items():
        uses = log.uses.get(name, [])
        contractions = {u[:3] for u in uses}
        if not uses:
            kept[name] = ("not the weight operand of a dot_general / einsum (an embedding lookup, a scale, a "
                          "tied head read through .T ...)" if len(shape) - (name in stacked) >= 2 else
                          "not a matrix")
        elif len(contractions) > 1:
            kept[name] = "contracted in more than one way"
        else:
            (layer, k_in, k_out), = contractions
            views[name] = KernelView(tuple(layer), tuple(k_in), tuple(k_out), uses[0][3])
    # the output head: the forward's last contraction of a parameter, when no matrix parameter is read after it
    # (a tied embedding read again for x @ embedding.T is the head then: no contraction's weight, it stays kept)
    last = next((n for n in reversed(log.order) if n is not None), None)
    head = last if last in views and log.reads and log.reads[-1] == last else None
    return KernelPlan(views, frozenset(stacked), kept, head)


# ----------------------------------------------------------------------------------------------
# Models: trainable parameters, the rest, the loss, merging back
# ----------------------------------------------------------------------------------------------


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(jnp.dtype(x.dtype), jnp.floating)


def _is_nnx(model) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def _is_constructor(model) -> bool:
    """A function that builds the model (an NNX module, or linen variables), rather than the model itself."""
    return callable(model) and not _is_nnx(model) and not hasattr(model, "keys") and not isinstance(
        model, getattr(sys.modules.get("flax.linen"), "Module", ()))


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

    @classmethod
    def abstract(cls, constructor):
        """The split of ``constructor()``'s model with abstract parameters (``jax.ShapeDtypeStruct``: nothing is
        allocated) and its other state (rng keys and counts, ...) built for real, under ``jit``, alone."""
        from flax import nnx

        split = cls(nnx.eval_shape(constructor))
        split.rest = jax.jit(lambda: cls(constructor()).rest)()
        return split

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
        self.shapes = {dotted_path(p): tuple(np.shape(v)) for p, v in leaves}
        self.model = model

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
    """The trainable parameters as the plain nested dict ``make_train_step``'s ``init`` takes.

    Args:
      model: a loss from :func:`flax_loss` (its model's parameters with every multi-axis kernel as the 2-D
        ``[in, out]`` matrix it is quantized as: what its step trains), or an ``nnx.Module`` / linen variables
        dict (the parameters as the model holds them): floating ``nnx.Param`` values (NNX; list indices as int
        keys, ``layers.0.attn.q.kernel``) or the floating leaves of the ``params`` collection (linen, metadata
        boxes stripped). Rng keys, counters and every other variable stay out (see :func:`flax_loss`).
    """
    if isinstance(model, FlaxLoss):
        return model.params()
    return _Split(model).params


class FlaxLoss:
    """``loss_fn(weights, batch, **kw)`` for ``jq.make_train_step``, made by :func:`flax_loss`; also the plan of
    what its step quantizes (:meth:`default_rules`, :meth:`rules`) and the views between the model's kernels and
    the step's matrices (:meth:`params`, :meth:`merge`)."""

    def __init__(self, model, loss: Callable, batch=None):
        self.constructor = model if _is_constructor(model) else None
        self.split = _Split.abstract(model) if self.constructor is not None else _Split(model)
        self.loss = loss
        self.kernels = None if batch is None else trace_kernels(self.split, loss, batch)
        self.__name__ = getattr(loss, "__name__", "flax_loss")
        self.rng_streams = _rng_streams(self.split)
        try:
            self.loss_takes_rng = "rng" in inspect.signature(loss).parameters or any(
                p.kind == p.VAR_KEYWORD for p in inspect.signature(loss).parameters.values())
        except (TypeError, ValueError):
            self.loss_takes_rng = True

    def _view(self, name) -> Optional[KernelView]:
        view = None if self.kernels is None else self.kernels.views.get(name)
        return None if view is None or view.is_identity else view

    def params(self):
        """The step's parameters: the model's, each multi-axis kernel as its ``[in, out]`` matrix. For a loss made
        from a model constructor, a function that builds them (``step.init`` calls it under ``jit`` with the
        master's shardings as its outputs', so no device holds the whole model)."""
        if self.constructor is not None:
            return lambda: self._as_step_params(_Split(self.constructor()).params)
        return self._as_step_params(self.split.params)

    def _map_viewed(self, params, fn):
        """``params`` with ``fn(view, leaf)`` in place of each leaf that has a (non-identity) view."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        views = [self._view(dotted_path(p)) for p, _ in flat]
        return jax.tree_util.tree_unflatten(treedef, [v if view is None else fn(view, jnp.asarray(v))
                                                      for view, (_, v) in zip(views, flat)])

    def _as_step_params(self, params):
        return self._map_viewed(params, lambda view, a: view.to_matrix(a))

    def model_params(self, params):
        """``params`` (like :meth:`params`) with each viewed kernel back in the model's own shape."""
        return self._map_viewed(params, lambda view, a: view.from_matrix(a))

    def merge(self, params):
        """The model (NNX: a new ``nnx.Module``; linen: a variables dict) with ``params`` (e.g. ``step.params(state)``)
        as its trainable parameters."""
        return flax_merge(self.split.model, self.model_params(params))

    def default_rules(self) -> list:
        """:meth:`rules` with no overrides: what ``make_train_step`` uses when given no rules."""
        return self.rules()

    def rules(self, *, keep: Optional[str] = None, recipes: Optional[dict] = None) -> list:
        """One ``jq.ParamRule`` per parameter: every contraction's weight operand quantized with the policy's
        recipe (as the ``[in, out]`` matrix of its contraction), the output head (the loss's last contraction) in
        bf16 as TransformerEngine and Megatron keep it, every other parameter an array in the dtype the model
        declared, with the reason in the plan (``step.describe(state)``).

        Args:
          keep: regex (full match) of parameters kept unquantized although they could be quantized.
          recipes: ``{regex: "bf16" | "fp8" | "nvfp4"}``: contraction weights with a recipe of their own (first
            match wins; e.g. ``{r"head\\.kernel": "fp8"}`` quantizes the head too).
        """
        for what, pattern in [("keep", keep)] + [("recipes", r) for r in (recipes or {})]:
            if pattern is not None:
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as e:
                    raise ValueError(f"rules: {what} is not a regular expression: {pattern!r} ({e})") from None
        if self.kernels is None:
            return _untraced_rules(self.split, keep, recipes)
        plan, out = self.kernels, []
        for name in self.split.names:
            stacked = name in plan.stacked
            view = plan.views.get(name)
            if keep is not None and re.fullmatch(keep, name):
                out.append(ParamRule(re.escape(name), stacked=stacked, keep_dtype=True, why="kept by keep="))
                continue
            if view is None:
                out.append(ParamRule(re.escape(name), stacked=stacked, keep_dtype=True, why=plan.kept[name]))
                continue
            shape = "x".join(map(str, view.shape))
            why = f"weight of {view.op}" + ("" if view.is_identity else
                                           f", its {shape} kernel as [in, out] {view.matrix_shape}")
            recipe = next((r for pattern, r in (recipes or {}).items() if re.fullmatch(pattern, name)), None)
            if recipe is not None:
                why += f"; recipes={{{next(p for p in recipes if re.fullmatch(p, name))!r}: {recipe!r}}}"
            elif name == plan.head:
                recipe, why = "bf16", why + "; the output head (the loss's last contraction) in bf16, as " \
                                            "TransformerEngine and Megatron keep it"
            out.append(ParamRule(re.escape(name), quantize=True if recipe is None else recipe, stacked=stacked,
                                 kernel="in_out", keep_dtype=True, why=why))
        return out

    def __call__(self, weights, batch, **kwargs):
        split = self.split
        leaves = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, ShardedWeight))[0]
        by_path = {}
        for path, leaf in leaves:
            name = dotted_path(path)
            view = self._view(name)
            if isinstance(leaf, ShardedWeight):
                by_path[name] = _box_class()(leaf, name, view)
                continue
            if view is not None:
                leaf = view.from_matrix(leaf)
            if name in split.dtypes and hasattr(leaf, "dtype") and leaf.dtype != split.dtypes[name]:
                leaf = leaf.astype(split.dtypes[name])   # a bf16 copy (rules without keep_dtype): the model's dtype
            by_path[name] = leaf
        if set(by_path) != set(split.names):
            raise ValueError(f"flax_loss: the step's weights must be like jq.flax_params(loss_fn) of this loss; "
                             f"missing {sorted(set(split.names) - set(by_path))[:4]}, unknown "
                             f"{sorted(set(by_path) - set(split.names))[:4]}")
        model = split.build(by_path)
        rng = kwargs.get("rng")
        if rng is not None and self.rng_streams:
            _reseed(model, self.rng_streams, rng)
        if not self.loss_takes_rng:
            kwargs = {k: v for k, v in kwargs.items() if k != "rng"}
        counts = _rng_counts(model) if self.rng_streams and rng is None else None
        with flax_intercept(model):
            out = self.loss(model, batch, **kwargs)
        if counts is not None and any(a is not b for a, b in zip(counts, _rng_counts(model))):
            raise ValueError(f"loss_fn: the model draws random numbers from its nnx.Rngs streams "
                             f"{list(self.rng_streams)} (e.g. nnx.Dropout), which would repeat the same draws every "
                             f"step; call the step with rng=key, a new key each step (jax.random.fold_in(key, step)): "
                             f"the streams are re-seeded from it on each data-parallel rank and microbatch")
        return out


def _rng_streams(split) -> tuple:
    """The names of an NNX model's rng streams (``nnx.Rngs(dropout=...)``), sorted; () for linen."""
    if split.kind != "nnx":
        return ()
    from flax import nnx

    names = set()
    for path, v in nnx.to_flat_state(split.rest):
        if isinstance(v, nnx.RngKey):
            names.add(str(getattr(v, "tag", path[-2] if len(path) > 1 else path[-1])))
    return tuple(sorted(names))


def stream_keys(streams, rng) -> dict:
    """The key each NNX rng stream is re-seeded with from the loss's ``rng=`` (the step's key for this rank and
    microbatch): ``fold_in(rng, i)`` for the i-th stream name in sorted order."""
    return {name: jax.random.fold_in(rng, i) for i, name in enumerate(streams)}


def _reseed(model, streams, rng):
    from flax import nnx

    nnx.reseed(model, **stream_keys(streams, rng))


def _rng_counts(model) -> list:
    from flax import nnx

    return jax.tree.leaves(nnx.state(model, nnx.RngCount))


def _untraced_rules(split, keep, recipes) -> list:
    """Without an example batch: 2-D ``kernel`` leaves quantized as flax's ``[in, out]`` kernels, the rest kept."""
    out = []
    for name in split.names:
        ndim = len(split.shapes[name])
        if keep is not None and re.fullmatch(keep, name):
            out.append(ParamRule(re.escape(name), keep_dtype=True, why="kept by keep="))
        elif name.rsplit(".", 1)[-1] == "kernel" and ndim == 2:
            recipe = next((r for p, r in (recipes or {}).items() if re.fullmatch(p, name)), True)
            out.append(ParamRule(re.escape(name), quantize=recipe, kernel="in_out", keep_dtype=True,
                                 why="a 2-D flax kernel, read as [in, out] (no batch= to trace the loss)"))
        else:
            out.append(ParamRule(re.escape(name), keep_dtype=True, why=(
                "a kernel of more than 2 axes: pass batch= to jq.flax_loss so that its contraction is traced"
                if name.rsplit(".", 1)[-1] == "kernel" else "not a kernel (no batch= to trace the loss)")))
    return out


def flax_loss(model, loss: Callable, *, batch=None) -> FlaxLoss:
    """``loss_fn(weights, batch, **kw)`` for ``jq.make_train_step`` from a loss written on the flax model.

    Args:
      model: the ``nnx.Module`` or linen variables dict whose parameters the step trains, or a function without
        arguments that builds it (``lambda: MyModel(nnx.Rngs(0))``, ``lambda: module.init(key, x)``): then the model
        is only built abstractly here (``nnx.eval_shape``) and ``step.init(jq.flax_params(loss_fn))`` builds the
        parameters straight into their FSDP shards, for models larger than one device. Its other state (rng keys
        and counts, integer variables, other collections) is captured now and handed to the model as it is at
        every call; what the model writes to it during the loss is dropped (rng streams: see ``rng=`` below).
      loss: ``loss(model, batch, **kw)`` (NNX: the model rebuilt around the step's weights) or
        ``loss(variables, batch, **kw)`` (linen: call ``module.apply(variables, ...)`` in it), returning what the
        step's ``loss_fn`` returns (a scalar; ``(loss, aux)`` with ``has_aux``; ...). ``kw``: the step's ``rng=`` /
        ``extra=``.
      batch: an example batch (only its shapes and dtypes are used). The loss is run on it abstractly once, to see
        which parameters are a contraction's weight operand (``jax.lax.dot_general`` / ``jnp.einsum``: nnx.Linear,
        nnx.LinearGeneral, nnx.Einsum, nn.Dense, nn.DenseGeneral, nn.Einsum, attention projections) and on which
        axes: each such kernel is quantized as the 2-D ``[in, out]`` matrix of its contracted x free axes, stacks
        of layers (nnx.scan / nn.scan) are found, and :meth:`FlaxLoss.default_rules` become the step's rules.
        Without it: 2-D ``kernel`` leaves are quantized as ``[in, out]`` and every other leaf is kept.

    Returns:
      A :class:`FlaxLoss`: call it as ``loss_fn(weights, batch, **kw)`` (each quantized leaf, a
      ``jq.ShardedWeight``, reaches flax as its kernel; each other leaf as an array in the model's dtype; ``loss``
      runs inside :func:`flax_intercept`); ``jq.flax_params(loss_fn)`` gives the step's parameters.
    """
    if not callable(loss):
        raise TypeError(f"loss: must be callable, got {type(loss).__name__}")
    return FlaxLoss(model, loss, batch)


def flax_merge(model, params):
    """``model`` with ``params`` (e.g. ``step.params(state)``, a dict like :func:`flax_params`) as its trainable
    parameters, each cast to the dtype it had in ``model``: a new ``nnx.Module`` (NNX; ``model`` is left as it
    is) or a new variables dict (linen, metadata boxes put back). Everything else is ``model``'s. ``model`` may be
    a :class:`FlaxLoss` (then ``params`` are its step's, multi-axis kernels as matrices)."""
    if isinstance(model, FlaxLoss):
        return model.merge(params)
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
        add(keep, keep_dtype=True)
    for pattern, recipe in (recipes or {}).items():
        add(pattern, quantize=recipe, kernel=kernel)
    add(quantize, quantize=True, kernel=kernel)
    add(r".*", keep_dtype=True)    # unquantized leaves reach the model in the dtype it declared
    return rules
