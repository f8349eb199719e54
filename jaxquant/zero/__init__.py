"""The flat ZeRO group API: Megatron-style flat master buffers (``FlatLayout``), quantization of
their shards with scales agreed over data-parallel ranks, gathered group bytes split per parameter."""
