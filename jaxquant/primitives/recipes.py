"""The weight recipes, named once (no jax import: the command line reads them before jax loads).

FP8 per-tensor current scaling (docs/numerics.md §1) and NVFP4 16x16 block scaling (§2); ``"bf16"`` is no
quantization (GEMMs in the compute dtype).
"""

QUANTIZED_RECIPES = ("fp8", "nvfp4")
RECIPES = ("bf16",) + QUANTIZED_RECIPES
