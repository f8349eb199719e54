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

import importlib

# Public name -> the module that defines it (tests/test_imports.py holds every entry to that). Loaded on first use
# (PEP 562), so that ``import jaxquant`` (which ``python -m jaxquant`` and the ``jaxquant`` script run before the
# command) does not import jax: the command's signal handlers are in place before the ~1 s import, and a Ctrl-C in
# it is one line, not a traceback.
_EXPORTS = {
    "formats": "jaxquant.primitives.formats", "ops": "jaxquant.primitives.ops",
    "reference": "jaxquant.primitives.reference",
    "quantize_fp8": "jaxquant.primitives.quantize", "quantize_nvfp4": "jaxquant.primitives.quantize",
    "fp8_columnwise": "jaxquant.primitives.quantize", "nvfp4_columnwise": "jaxquant.primitives.quantize",
    "Float8Tensor": "jaxquant.primitives.tensors", "NVFP4Tensor": "jaxquant.primitives.tensors",
    "FlatLayout": "jaxquant.zero.layout", "GatheredWeights": "jaxquant.zero.group_split",
    "NonFiniteReport": "jaxquant.zero.distributed", "gathered_bytes": "jaxquant.zero.distributed",
    "master_sharding": "jaxquant.zero.distributed", "post_all_gather_processing": "jaxquant.zero.distributed",
    "quantize_master_weights": "jaxquant.zero.distributed",
    "quantize_master_weights_local": "jaxquant.zero.distributed",
    "straight_through": "jaxquant.primitives.tensors",
    "dense": "jaxquant.training.dense", "ShardedWeight": "jaxquant.training.fsdp",
    "MixedPrecisionPolicy": "jaxquant.training.policy", "TrainState": "jaxquant.training.policy",
    "raise_if_nonfinite": "jaxquant.training.policy", "make_train_step": "jaxquant.training.train",
    "ParamRule": "jaxquant.training.rules",
    "remat_policy": "jaxquant.training.remat", "REMAT_POLICIES": "jaxquant.training.remat",
    "FlaxKernelError": "jaxquant.training.flax_adapter", "flax_intercept": "jaxquant.training.flax_adapter",
    "flax_loss": "jaxquant.training.flax_adapter", "flax_merge": "jaxquant.training.flax_adapter",
    "flax_params": "jaxquant.training.flax_adapter", "flax_rules": "jaxquant.training.flax_adapter",
    "sp_column_dense": "jaxquant.tp.sp", "sp_dense_reduce_scatter": "jaxquant.tp.sp",
    "sp_layernorm_dense": "jaxquant.tp.sp", "sp_mlp": "jaxquant.tp.sp", "sp_row_dense": "jaxquant.tp.sp",
}
_MODULES = ("formats", "ops", "reference")  # exported as modules (jq.ops.fp8_quantize, ...)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxquant' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if name in _MODULES else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"

__all__ = list(_EXPORTS)   # every public name, once: the table above
