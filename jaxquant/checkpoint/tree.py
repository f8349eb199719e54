"""Pytree <-> DCP keys: dotted flattening, quantized components, and the explicit transpose mapping."""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable

import jax

from jaxquant.checkpoint.errors import CheckpointError, KeyMismatchError
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor

# Reserved DCP key holding {"version": 1, "quantized": {key: {"format", "shape", "columnwise"}}}.
QUANT_INFO_KEY = "__jaxquant__"

# Component attribute -> key suffix. The rowwise data is stored under the bare key.
FP8_COMPONENTS = (("data", ""), ("scale_inv", ".scale_inv"), ("amax", ".amax"), ("data_t", ".data_t"))
NVFP4_COMPONENTS = FP8_COMPONENTS + (("scale_inv_t", ".scale_inv_t"),)


def is_quantized(x) -> bool:
    return isinstance(x, (Float8Tensor, NVFP4Tensor))


SCALARS = (bool, int, float, str)


def is_value_list(x) -> bool:
    """A list or tuple of Python scalars: one DCP byte entry, as torch.distributed.checkpoint stores it (an
    optimizer's ``param_groups[i]["params"]``, Adam's ``betas``), not one entry per element."""
    return isinstance(x, (list, tuple)) and all(isinstance(e, SCALARS) or e is None for e in x)


def components(q) -> list[tuple[str, str, Any]]:
    """[(attribute, key suffix, value)] of the present components of a quantized tensor."""
    spec = NVFP4_COMPONENTS if isinstance(q, NVFP4Tensor) else FP8_COMPONENTS
    return [(attr, suffix, getattr(q, attr)) for attr, suffix in spec if getattr(q, attr) is not None]


def quant_info(q) -> dict:
    if isinstance(q, NVFP4Tensor):
        return {"format": "nvfp4", "shape": [int(d) for d in q.shape], "columnwise": q.data_t is not None}
    return {"format": "fp8", "shape": [int(d) for d in q.data.shape], "columnwise": q.data_t is not None}


def rebuild_quantized(template, values: dict):
    """A quantized tensor of ``template``'s class from {attribute: value}."""
    if isinstance(template, NVFP4Tensor):
        return NVFP4Tensor(shape=template.shape, **values)
    return Float8Tensor(**values)


def key_part(k) -> str:
    """One pytree path entry as a name part (a dict key, a sequence index, an attribute name): what ``save_dcp``
    joins with dots."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flatten(tree, what: str = "tree"):
    """[(dotted key, path parts, leaf)] and the treedef; quantized tensors are leaves here.

    ``{"a": {"b": x}}`` and ``{"a.b": x}`` both give key ``a.b`` (DCP's flattening); lists give indices,
    except lists and tuples of Python scalars, which are one value (:func:`is_value_list`); None is a value
    too (torch's ``foreach=None``), not an empty subtree.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or is_quantized(x)
                                                           or is_value_list(x))
    items, seen = [], {}
    for path, leaf in leaves:
        parts = tuple(key_part(k) for k in path)
        key = ".".join(parts)
        if not key:
            raise CheckpointError(f"{what}: a bare leaf has no key; pass a dict such as {{'params': x}}")
        if key == QUANT_INFO_KEY:
            raise CheckpointError(f"{what}: key {QUANT_INFO_KEY!r} is reserved")
        if key in seen:
            raise CheckpointError(f"{what}: paths {seen[key]} and {parts} both flatten to key {key!r}")
        seen[key] = parts
        items.append((key, parts, leaf))
    return items, treedef


class TransposeMap:
    """Which keys swap ``[out, in]`` (PyTorch Linear, stored in DCP) and ``[in, out]`` (JAX kernel).

    ``patterns`` are fnmatch globs matched against the whole dotted key. Nothing is guessed: a key is
    transposed only if a pattern names it, a pattern that names no key is an error, and only 2-D
    plain tensors may be named.
    """

    def __init__(self, patterns: Iterable[str] | str | None = ()):
        if isinstance(patterns, str):
            patterns = [patterns]
        self.patterns = list(patterns or ())
        self._used = set()

    def __call__(self, key: str) -> bool:
        hit = [p for p in self.patterns if fnmatch.fnmatchcase(key, p)]
        self._used.update(hit)
        return bool(hit)

    def check(self, key: str, shape, *, quantized: bool = False) -> bool:
        """Whether ``key`` is transposed; errors for a named key that cannot be."""
        if not self(key):
            return False
        if quantized:
            raise CheckpointError(f"transpose: key {key!r} is quantized; its packed components cannot be "
                                  f"transposed (use its columnwise data_t, or dequantize first)")
        if len(shape) != 2:
            raise CheckpointError(f"transpose: key {key!r} has shape {tuple(shape)}; only 2-D tensors map "
                                  f"between [out, in] and [in, out]")
        return True

    def finish(self) -> None:
        unused = [p for p in self.patterns if p not in self._used]
        if unused:
            raise KeyMismatchError(f"transpose: pattern(s) {unused} matched no key; the mapping must be explicit")
