"""GPU-only checks of ``ops.nvfp4_bf16_operand`` (tests/test_nvfp4_bf16_operand.py runs unchanged on a GPU too, for
the small shapes and edge cases): the CUDA kernel == the reference bit for bit on large weights with every tile
scale range (many block items, the grid's full width), and == the two passes it replaces (``nvfp4_stats``,
``nvfp4_quantize`` and ``gemm.nvfp4_operand``, their CUDA kernels)."""

import jax
import jax.numpy as jnp
import pytest

from jaxquant.primitives import gemm, ops
from conftest import assert_bytes_equal, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def _wide(shape, seed):
    """Normal values with a log-uniform magnitude per 16x16 tile over 12 decades (zero, subnormal, normal and
    saturated tile scales)."""
    rows, cols = shape
    k1, k2 = jax.random.split(jax.random.key(seed))
    mag = 10.0 ** jax.random.uniform(k2, (rows // 16, 1, cols // 16, 1), minval=-6, maxval=6)
    return (jax.random.normal(k1, shape).reshape(rows // 16, 16, cols // 16, 16) * mag).reshape(shape)


@pytest.mark.parametrize("shape", [(8192, 8192), (14336, 4096), (4096, 14336), (1040, 4112)])
def test_large_weights_custom_call_equals_reference(shape):
    x = _wide(shape, sum(shape))
    for dtype in (jnp.float32, jnp.bfloat16):
        xi = x.astype(dtype)
        amax = ops.nvfp4_stats(xi)[1]
        cus = jax.jit(lambda v, a: ops.nvfp4_bf16_operand(v, a, impl="custom_call"))(xi, amax)
        ref = jax.jit(lambda v, a: ops.nvfp4_bf16_operand(v, a, impl="reference"))(xi, amax)
        assert_bytes_equal(cus, ref, f"{shape} {jnp.dtype(dtype).name}")
        del ref

        def two_passes(v, a):
            tiles, _, _ = ops.nvfp4_stats(v, impl="custom_call")
            data, scale_inv, _, _ = ops.nvfp4_quantize(v, tiles, a, impl="custom_call")
            return gemm.nvfp4_operand(data, scale_inv)

        assert_bytes_equal(cus, jax.jit(two_passes)(xi, amax), f"{shape} {jnp.dtype(dtype).name} two passes")
