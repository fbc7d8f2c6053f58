"""A GPT decoder described once (GPTShape, its FLOPs): read by the config, the analysis and the metrics alike."""
