"""GPT pretraining on megatron-core with zero3d: config, data, model, loop, metrics, checkpoints."""
