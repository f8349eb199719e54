"""Tensor / sequence parallelism: SP layers on FSDP x TP meshes and the collective-GEMM kernels."""
