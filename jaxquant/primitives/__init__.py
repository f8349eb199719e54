"""Primitives: formats and recipes, the quantize/cast/transpose ops (custom calls with pure-JAX
fallbacks), their references, quantized tensor pytrees, GEMMs on them, sharding rules, the FFI loader."""
