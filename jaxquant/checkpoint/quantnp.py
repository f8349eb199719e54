"""Dequantizing stored components block by block in numpy (docs/numerics.md §1.8, §2.8), for streaming conversion."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxquant.checkpoint.errors import CheckpointError
from jaxquant.primitives.formats import nvfp4_scale_shape

# E2M1 code -> value (code 8 is -0)
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def fp8_block(data: np.ndarray, scale_inv: np.ndarray, dtype) -> np.ndarray:
    """float(data) * scale_inv in fp32, then cast (RNE) to ``dtype``."""
    return (data.astype(np.float32) * np.float32(np.asarray(scale_inv).reshape(()))).astype(dtype)


def nvfp4_block(data: np.ndarray, row0: int, byte0: int, scale_inv: np.ndarray, amax: np.ndarray,
                dtype) -> np.ndarray:
    """Dequantize packed rows ``data`` [r, b] whose top-left byte is (row0, byte0) of the full ``data``.

    x = (value(q) * float(s8)) * (amax * (1/2688)), left to right in fp32; s8 = scale_inv[row, col // 16].
    """
    r, b = data.shape
    vals = np.empty((r, 2 * b), np.float32)
    vals[:, 0::2] = _E2M1[data & 0x0F]
    vals[:, 1::2] = _E2M1[data >> 4]
    cols = (2 * byte0 + np.arange(2 * b)) // 16
    s8 = np.asarray(scale_inv).view(ml_dtypes.float8_e4m3fn)[row0:row0 + r][:, cols].astype(np.float32)
    g = np.float32(np.asarray(amax, np.float32).reshape(-1)[0]) * np.float32(1.0 / 2688.0)
    return ((vals * s8) * g).astype(dtype)


def check_nvfp4_scale_layout(key: str, shape, scale_shape) -> None:
    """Dequantizing reads ``scale_inv`` in the whole-tensor layout (docs/numerics.md §2.7); refuse any other
    shape, e.g. the per-TP-rank scale blocks of an FSDP x TP weight whose split is not aligned to it."""
    want = nvfp4_scale_shape(*(int(d) for d in shape))
    if tuple(int(d) for d in scale_shape) != want:
        raise CheckpointError(
            f"key {key!r}: cannot dequantize: scale_inv is {list(scale_shape)}, the whole-tensor layout of an "
            f"NVFP4 {list(shape)} tensor is {list(want)} (docs/numerics.md §2.7); a tensor-parallel weight whose "
            f"TP split is not aligned to the scale layout holds one scale block per TP rank (docs/checkpoint.md, "
            f"FSDP x TP): dequantize it per TP rank or save the fp32 master weights")
