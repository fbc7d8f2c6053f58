"""`python -m pretrain.hf_config DIR`: the [model] section that builds a Hugging Face model directory's model."""
import argparse
import sys
from pathlib import Path

from pretrain.checkpoint.hf import model_section, read_hf_config, toml_value
from pretrain.errors import EXIT_INPUT, CheckpointError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.hf_config", description=__doc__)
    parser.add_argument("directory", type=Path, help="a Hugging Face model directory (its config.json is read)")
    args = parser.parse_args(argv)
    try:
        model = model_section(read_hf_config(args.directory))
    except CheckpointError as err:
        print(f"hf_config: {err}", file=sys.stderr)
        return EXIT_INPUT
    print(f"# {args.directory}: use with train.init_from = \"{args.directory}\"\n[model]")
    print("\n".join(f"{key} = {toml_value(value)}" for key, value in model.items() if value is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
