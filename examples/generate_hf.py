"""Sample from a model exported with `python -m pretrain.export <ckpt> <dir> --format hf`, with transformers alone.

    python examples/generate_hf.py runs/tiny-doc/hf "def main():" --new-tokens 8

Nothing of zero3d is imported: the directory is a plain Hugging Face model with its tokenizer.
"""
import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="an exported Hugging Face model directory")
    parser.add_argument("prompt", help="the text to continue")
    parser.add_argument("--new-tokens", type=int, default=32, help="how many tokens to generate (greedy)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.directory)
    model = AutoModelForCausalLM.from_pretrained(args.directory).eval()
    prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    new = out[0, prompt.shape[1]:]
    print(f"{type(model).__name__}: {len(new)} new tokens after {args.prompt!r}:")
    print(args.prompt + tokenizer.decode(new))


if __name__ == "__main__":
    main()
