"""`python -m pretrain.preprocess`: JSONL corpora to Megatron .bin/.idx (pretrain/data/preprocess.py)."""
import sys

from pretrain.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
