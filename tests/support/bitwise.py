"""Arrays compared by their bytes."""

import numpy as np


def bits(x):
    """``x``'s bytes as unsigned integers of its width (1, 2 or 4 bytes): bitwise comparisons that tell -0 from +0
    and NaN payloads apart."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
