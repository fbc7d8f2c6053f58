"""Data wing: JSONL corpora, the sentencepiece tokenizer, preprocessing to Megatron .bin/.idx, datasets, batches."""
