"""jaxquant: FP8 and NVFP4 weights for sharded JAX training, bit-compatible with TransformerEngine."""

from jaxquant import formats, ops, reference
from jaxquant.quantize import fp8_columnwise, nvfp4_columnwise, quantize_fp8, quantize_nvfp4
from jaxquant.tensors import Float8Tensor, NVFP4Tensor

__version__ = "0.1.0"

__all__ = [
    "Float8Tensor",
    "NVFP4Tensor",
    "quantize_fp8",
    "quantize_nvfp4",
    "fp8_columnwise",
    "nvfp4_columnwise",
    "formats",
    "ops",
    "reference",
]
