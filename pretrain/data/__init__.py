"""Data wing: JSONL/Parquet/Arrow corpora, tokenizers of five kinds, preprocessing to .bin/.idx, datasets, batches."""
