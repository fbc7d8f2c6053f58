"""Data wing: JSONL/Parquet/Arrow corpora, tokenizers (one interface, five kinds), preprocessing to Megatron
.bin/.idx, datasets, batches."""
