"""Argument checks of the ops, named for the other packages' ops built on them (zero, tp, training).

Every check runs at trace time on shapes and dtypes only and raises with the argument's name and the rule it
breaks (docs/numerics.md §5): TypeError for a wrong kind of value, ValueError for a wrong shape or range.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxquant.primitives import formats
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor

IMPLS = ("auto", "reference", "custom_call")
INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_impl(impl: str) -> None:
    """ValueError unless ``impl`` is one of ``IMPLS``."""
    if impl not in IMPLS:
        raise ValueError(f"impl: must be one of {IMPLS}, got {impl!r}")


def not_quantized(name: str, x) -> None:
    """TypeError for a quantized tensor, which has an array's ``shape`` and ``dtype`` (the logical
    tensor's) but is not one."""
    if isinstance(x, (Float8Tensor, NVFP4Tensor)):
        raise TypeError(f"{name}: must be an array, got {type(x).__name__}, a quantized tensor "
                        f"(dequantize() it first)")


def check_array_like(name: str, x) -> None:
    """TypeError unless ``x`` is an array (has ``shape`` and ``dtype`` and is not a quantized tensor)."""
    not_quantized(name, x)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name}: must be an array, got {type(x).__name__}")


def check_input(name: str, x, *, rank: int | None = None) -> None:
    """A float32 or bfloat16 array (of rank ``rank`` when given): what every op quantizes."""
    check_array_like(name, x)
    if jnp.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(f"{name}: dtype must be float32 or bfloat16, got {x.dtype}")
    if rank is not None and x.ndim != rank:
        raise ValueError(f"{name}: must have rank {rank}, got shape {tuple(x.shape)}")


def check_array(name: str, x, dtype, shape) -> None:
    """An array of exactly ``dtype`` and ``shape``."""
    check_array_like(name, x)
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{name}: dtype must be {jnp.dtype(dtype)}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: shape must be {tuple(shape)}, got {tuple(x.shape)}")


def check_amax(amax) -> None:
    """A float32 scalar or ``[1]`` array (an amax operand)."""
    if not hasattr(amax, "dtype") or jnp.dtype(amax.dtype) != jnp.float32 or amax.size != 1:
        raise TypeError(f"amax: must be a float32 scalar or [1] array, got "
                        f"{getattr(amax, 'dtype', type(amax).__name__)} {getattr(amax, 'shape', '')}")


def check_compute_dtype(compute_dtype) -> None:
    """None, float32 or bfloat16 (the dtype values are rounded to before quantizing)."""
    if compute_dtype is not None and jnp.dtype(compute_dtype) not in INPUT_DTYPES:
        raise TypeError(f"compute_dtype: must be None, float32 or bfloat16, got {compute_dtype}")


def rounds_to_bf16(x, compute_dtype) -> bool:
    """The fused kernels' ``round_bf16`` attribute: True when the compute dtype rounds x's values (fp32 -> bf16).

    Every other combination leaves the values as they are (bf16 -> fp32 is exact)."""
    check_compute_dtype(compute_dtype)
    return (compute_dtype is not None and jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16)
            and jnp.dtype(x.dtype) == jnp.dtype(jnp.float32))


def check_fp8_cast_args(x, amax_value, dtype, amax_epsilon, columnwise):
    """Checks shared by the FP8 casts; returns the fp8 dtype."""
    check_amax(amax_value)
    formats.fp8_max(dtype)  # validates dtype
    if columnwise and x.ndim != 2:
        raise ValueError(f"x: columnwise=True needs a rank-2 tensor, got shape {tuple(x.shape)}")
    if not np.isfinite(np.float32(amax_epsilon)) or amax_epsilon < 0:
        raise ValueError(f"amax_epsilon: must be finite in float32 and >= 0, got {amax_epsilon}")
    return jnp.dtype(dtype)


def check_range(start: int, length: int, rows: int, cols: int) -> None:
    """Flat elements ``[start, start + length)`` lie inside a ``rows x cols`` tensor."""
    if not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"start: must be a non-negative int, got {start!r}")
    if start + length > rows * cols:
        raise ValueError(
            f"start: shard elements [{start}, {start + length}) lie outside the "
            f"{rows}x{cols} tensor ({rows * cols} elements)"
        )
