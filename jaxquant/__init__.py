"""jaxquant: FP8 and NVFP4 weights for sharded JAX training, bit-compatible with TransformerEngine.

Flat public API: single-tensor quantization (``quantize_fp8``, ``quantize_nvfp4``), the quantized
tensor pytrees, ZeRO master-weight quantization on meshes (``FlatLayout``,
``quantize_master_weights``, ``post_all_gather_processing``), the training step (``make_train_step``,
``MixedPrecisionPolicy``, ``ParamRule``, ``dense``, ``ShardedWeight``), flax models trained unchanged
(``flax_params``, ``flax_loss``, ``flax_rules``, ``flax_merge``), sequence-parallel layers with FP8
and comm/GEMM overlap (``sp_layernorm_dense``, ``sp_dense_reduce_scatter``, ``sp_mlp``), the
primitives in ``jaxquant.primitives.ops`` and their pure-JAX references in ``jaxquant.primitives.reference``.
Checkpoints: ``jaxquant.checkpoint``.
"""

from jaxquant.primitives import formats, ops, reference
from jaxquant.training.dense import dense, straight_through
from jaxquant.zero.distributed import (
    NonFiniteReport,
    gathered_bytes,
    master_sharding,
    post_all_gather_processing,
    quantize_master_weights,
    quantize_master_weights_local,
)
from jaxquant.training.fsdp import ShardedWeight
from jaxquant.zero.group_split import GatheredWeights
from jaxquant.zero.layout import FlatLayout
from jaxquant.training.train import MixedPrecisionPolicy, TrainState, make_train_step, raise_if_nonfinite
from jaxquant.training.rules import ParamRule
from jaxquant.training.flax_adapter import (FlaxKernelError, flax_intercept, flax_loss, flax_merge, flax_params,
                                            flax_rules)
from jaxquant.primitives.quantize import fp8_columnwise, nvfp4_columnwise, quantize_fp8, quantize_nvfp4
from jaxquant.primitives.tensors import Float8Tensor, NVFP4Tensor
from jaxquant.tp.sp import sp_column_dense, sp_dense_reduce_scatter, sp_layernorm_dense, sp_mlp, sp_row_dense

__version__ = "0.1.0"

__all__ = [
    "Float8Tensor",
    "NVFP4Tensor",
    "quantize_fp8",
    "quantize_nvfp4",
    "fp8_columnwise",
    "nvfp4_columnwise",
    "FlatLayout",
    "GatheredWeights",
    "quantize_master_weights",
    "quantize_master_weights_local",
    "post_all_gather_processing",
    "NonFiniteReport",
    "gathered_bytes",
    "master_sharding",
    "formats",
    "ops",
    "reference",
    "dense",
    "straight_through",
    "ShardedWeight",
    "MixedPrecisionPolicy",
    "make_train_step",
    "ParamRule",
    "flax_params",
    "flax_loss",
    "flax_merge",
    "flax_rules",
    "flax_intercept",
    "FlaxKernelError",
    "raise_if_nonfinite",
    "TrainState",
    "sp_layernorm_dense",
    "sp_dense_reduce_scatter",
    "sp_mlp",
    "sp_column_dense",
    "sp_row_dense",
]
