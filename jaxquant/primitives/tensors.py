"""Quantized tensor types: pytrees that travel through jit, device_put and sharding.

Layouts are exactly docs/numerics.md §1.7 (FP8) and §2.7 (NVFP4). The logical shape is static metadata.

Both types describe the tensor they stand for, like an array (and qwix's ``QArray``): ``shape``,
``ndim`` and ``size`` are the logical (dequantized) tensor's, and ``dtype`` is the dtype
``dequantize()`` returns by default, float32 (a fixed property, not pytree metadata, so tensors of the
same layout always have the same treedef). The stored bytes are the fields: ``data`` (``data.dtype``:
float8_e4m3fn / float8_e5m2, or uint8 for two packed E2M1 codes), ``scale_inv``, ``amax``, ``data_t``,
``scale_inv_t``, with their own shapes and dtypes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

# The dtype ``dequantize()`` returns by default, and so the ``dtype`` of every quantized tensor.
DEQUANTIZED_DTYPE = jnp.dtype(jnp.float32)


class _LogicalArray:
    """``ndim``, ``size`` and ``dtype`` of the logical tensor; subclasses give its ``shape``."""

    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self):
        """The dequantized dtype, float32 (``dequantize()``'s default); the stored dtype is ``data.dtype``."""
        return DEQUANTIZED_DTYPE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Float8Tensor(_LogicalArray):
    """FP8 per-tensor current-scaled tensor (docs/numerics.md §1.7), a pytree.

    Built by :func:`jaxquant.quantize_fp8` and :func:`jaxquant.quantize_master_weights`; construct it
    directly only from bytes that follow the layout.

    Attributes:
      data: fp8 ``[M, K]`` (``float8_e4m3fn`` or ``float8_e5m2``; any shape for a 1-D shard).
      scale_inv: fp32 scalar, the dequantization multiplier.
      amax: fp32 scalar, the amax the scale came from.
      data_t: fp8 ``[K, M]``, the byte transpose of ``data``, or None (default) when no columnwise copy
        was built.
      shape, ndim, size: the logical tensor's (``shape`` = ``data.shape``: one fp8 element per logical
        element).
      dtype: float32, the dequantized dtype (the fp8 format is ``data.dtype``).
    """

    data: jax.Array
    scale_inv: jax.Array
    amax: jax.Array
    data_t: Optional[jax.Array] = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def dequantize(self, dtype=DEQUANTIZED_DTYPE) -> jax.Array:
        """The logical tensor, ``float(data) * scale_inv`` (docs/numerics.md §1.8).

        Args:
          dtype: dtype of the result (default float32).

        Returns:
          An array of ``shape`` in ``dtype``.
        """
        return (self.data.astype(jnp.float32) * self.scale_inv).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor(_LogicalArray):
    """NVFP4 tensor with 2D 16x16 block scales (docs/numerics.md §2.7), a pytree.

    Built by :func:`jaxquant.quantize_nvfp4` and :func:`jaxquant.quantize_master_weights`; construct it
    directly only from bytes that follow the layout. ``ru(n, m)``: n rounded up to a multiple of m.

    Attributes:
      data: uint8 ``[M, K/2]``, two E2M1 codes a byte (element 2c in the low nibble).
      scale_inv: uint8 ``[ru(M,128), ru(K/16,4)]``, the tile scales as E4M3 bit patterns.
      amax: fp32 ``[1]``, the global amax.
      data_t: uint8 ``[K, M/2]``, the columnwise copy, or None (default).
      scale_inv_t: uint8 ``[ru(K,128), ru(M/16,4)]``, its scales, or None (default).
      shape: ``(M, K)``, the logical shape (static pytree metadata; taken from ``data`` when not given).
      ndim, size: the logical tensor's.
      dtype: float32, the dequantized dtype (the packed storage is ``data.dtype``, uint8).
    """

    data: jax.Array
    scale_inv: jax.Array
    amax: jax.Array
    data_t: Optional[jax.Array] = None
    scale_inv_t: Optional[jax.Array] = None
    shape: tuple[int, int] = dataclasses.field(default=(0, 0), metadata=dict(static=True))

    def __post_init__(self):
        if self.shape == (0, 0) and hasattr(self.data, "shape") and len(self.data.shape) == 2:
            m, half_k = self.data.shape
            object.__setattr__(self, "shape", (int(m), int(half_k) * 2))

    def dequantize(self, dtype=DEQUANTIZED_DTYPE) -> jax.Array:
        """The logical tensor, ``(value(q) * float(s8)) * (amax * (1/2688))`` (docs/numerics.md §2.8).

        Args:
          dtype: dtype of the result (default float32).

        Returns:
          An array ``[M, K]`` in ``dtype``.
        """
        from jaxquant.primitives import reference

        return reference.nvfp4_dequantize(self.data, self.scale_inv, self.amax, self.shape).astype(dtype)

    def dequantize_t(self, dtype=DEQUANTIZED_DTYPE) -> jax.Array:
        """Dequantize the columnwise copy.

        Args:
          dtype: dtype of the result (default float32).

        Returns:
          x̂.T, an array ``[K, M]`` in ``dtype``.

        Raises:
          ValueError: the tensor has no columnwise copy (``data_t`` or ``scale_inv_t`` is None).
        """
        if self.data_t is None or self.scale_inv_t is None:
            raise ValueError("data_t: this NVFP4Tensor has no columnwise data")
        from jaxquant.primitives import reference

        m, k = self.shape
        return reference.nvfp4_dequantize(self.data_t, self.scale_inv_t, self.amax, (k, m)).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Quantized tensors that carry their straight-through gradient target (``jq.dense``, ``jq.sp_*``)
# ----------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Float8WithMaster(Float8Tensor):
    master: Optional[jax.Array] = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _NVFP4WithMaster(NVFP4Tensor):
    master: Optional[jax.Array] = None


def straight_through(q, master):
    """Attach a straight-through gradient target to a quantized weight.

    The forward never reads ``master``; differentiating ``jq.dense`` (or the ``jq.sp_*`` layers) with
    respect to it gives ``dW`` in ``master.dtype``.

    Args:
      q: the quantized weight, a :class:`Float8Tensor` or :class:`NVFP4Tensor`.
      master: a floating array of the weight's logical shape ``q.shape``; may be a zeros placeholder
        (XLA never builds it).

    Returns:
      ``q`` as a ``Float8Tensor`` / ``NVFP4Tensor`` subclass that also holds ``master``.

    Raises:
      TypeError: ``q`` is not a quantized tensor, or ``master`` is not floating.
      ValueError: ``master``'s shape is not ``q.shape``.
    """
    if not isinstance(q, (Float8Tensor, NVFP4Tensor)):
        raise TypeError(f"q: must be a Float8Tensor or NVFP4Tensor, got {type(q).__name__}")
    if not hasattr(master, "shape") or tuple(master.shape) != tuple(q.shape):
        raise ValueError(f"master: must have the weight's shape {tuple(q.shape)}, got "
                         f"{getattr(master, 'shape', type(master).__name__)}")
    if not jnp.issubdtype(master.dtype, jnp.floating):
        raise TypeError(f"master: must be a floating array, got {master.dtype}")
    if isinstance(q, Float8Tensor):
        return _Float8WithMaster(data=q.data, scale_inv=q.scale_inv, amax=q.amax, data_t=q.data_t, master=master)
    return _NVFP4WithMaster(data=q.data, scale_inv=q.scale_inv, amax=q.amax, data_t=q.data_t,
                            scale_inv_t=q.scale_inv_t, shape=q.shape, master=master)


def split_master(w):
    """(the weight as a plain array / ``Float8Tensor`` / ``NVFP4Tensor``, its straight-through
    ``master`` or None). The plain tensor goes through ``custom_vjp`` and gets no cotangent; the
    master gets ``dW``."""
    if isinstance(w, _Float8WithMaster):
        return Float8Tensor(data=w.data, scale_inv=w.scale_inv, amax=w.amax, data_t=w.data_t), w.master
    if isinstance(w, _NVFP4WithMaster):
        return (NVFP4Tensor(data=w.data, scale_inv=w.scale_inv, amax=w.amax, data_t=w.data_t,
                            scale_inv_t=w.scale_inv_t, shape=w.shape), w.master)
    return w, None
