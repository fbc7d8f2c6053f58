"""`python -m pretrain.export`: a checkpoint to one safetensors file (pretrain/checkpoint/export.py)."""
import sys

from pretrain.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
