"""Command line: tokenize a corpus into Megatron .bin/.idx files, training the tokenizer first if asked.

    python -m pretrain.preprocess --input data/corpus.jsonl --tokenizer-model tok.model --output-prefix out/c
    python -m pretrain.preprocess --input data/corpus.jsonl --tokenizer-model tok.model --output-prefix out/c \
        --train-tokenizer --vocab-size 512
"""
import argparse
import sys
from typing import Optional, Sequence

from pretrain.data import DataError, check_indexed_dataset, preprocess
from pretrain.tokenizer import Tokenizer, TokenizerError, train_tokenizer


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pretrain.preprocess",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="corpus: .jsonl ({\"text\": ...} a line) or .txt")
    parser.add_argument("--tokenizer-model", required=True,
                        help="sentencepiece .model to use, or to write with --train-tokenizer")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--train-tokenizer", action="store_true",
                        help="train a BPE tokenizer on --input first, saved as --tokenizer-model")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of the trained tokenizer")
    args = parser.parse_args(argv)
    if args.train_tokenizer and args.vocab_size is None:
        parser.error("--train-tokenizer needs --vocab-size")
    if args.vocab_size is not None and not args.train_tokenizer:
        parser.error("--vocab-size only applies with --train-tokenizer")
    if args.train_tokenizer and not args.tokenizer_model.endswith(".model"):
        parser.error(f"--tokenizer-model {args.tokenizer_model!r} must end in .model")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.train_tokenizer:
            train_tokenizer(args.input, args.tokenizer_model[: -len(".model")], args.vocab_size)
            print(f"trained tokenizer {args.tokenizer_model} (vocab_size {args.vocab_size})")
        tokenizer = Tokenizer(args.tokenizer_model)
        prefix = preprocess(args.input, tokenizer, args.output_prefix)
        index = check_indexed_dataset(prefix)
    except (DataError, TokenizerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {prefix}.bin and {prefix}.idx: {len(index.document_indices) - 1} documents, "
          f"{int(index.sequence_lengths.sum())} tokens ({index.dtype.__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
