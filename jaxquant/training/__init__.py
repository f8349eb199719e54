"""Training: the per-leaf FSDP step (all ZeRO strategies), sharded weights used by layers, the
quantized dense layer, the precision policy, parameter rules, flax models, and the state dict."""
