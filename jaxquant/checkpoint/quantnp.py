"""Dequantizing stored components block by block in numpy (docs/numerics.md §1.8, §2.8), for streaming conversion."""

from __future__ import annotations

import ml_dtypes
import numpy as np

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
