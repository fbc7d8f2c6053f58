"""Model wing: megatron-core's GPTModel built from the config (layer spec, norms, ZeRO-R layers), its attention and chunked loss."""
