"""A run's tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json): AutoTokenizer gives zero3d's ids.

`checkpoint_tokenizer(step_dir, manifest, path)` finds the tokenizer a checkpoint was trained with — the spec its
manifest records (older checkpoints: the `[data]` keys naming a file), or `path` (export's `--tokenizer`) in place
of its file — and refuses one whose bytes differ from the checkpoint's `tokenizer_sha256`. `hf_tokenizer(spec)`
builds it as a transformers fast tokenizer, per kind:
  sentencepiece  the BPE pieces and merges as a `tokenizers` BPE with byte fallback; sentencepiece's dummy prefix
                 and its word split (a word starts at the first ▁ of a run) replayed; identity normalisation only
  hf             its tokenizer.json as it is (its own post-processor: a BOS it adds is the tokenizer's choice)
  gpt2_bpe       the byte-level BPE zero3d builds from vocab.json + merges.txt
  tiktoken       the ranks as a byte-level BPE (transformers' TikTokenConverter), zero3d's split pattern
Where zero3d's encoder reads a special token's text as plain text, the HF tokenizer does too (split_special_tokens),
and it adds no BOS zero3d does not: `AutoTokenizer.from_pretrained(out)(text).input_ids` is zero3d's `encode(text)`.
"""
from pathlib import Path
from typing import Optional

from pretrain.data.tokenizers import GPT2_PATTERN, TokenizerSpec, identity_sha256, load_tokenizer
from pretrain.errors import CheckpointError, TokenizerError

SPACE = "\u2581"  # sentencepiece's whitespace symbol


def tokenizer_record(spec: TokenizerSpec) -> dict:
    """What a checkpoint's manifest records of its tokenizer: the spec, its files as absolute paths."""
    return {"kind": spec.kind, "model": str(Path(spec.model).resolve()) if spec.model else None,
            "merges": str(Path(spec.merges).resolve()) if spec.merges else None, "eod": spec.eod}


def checkpoint_tokenizer(step_dir: Path, manifest: dict, path: Optional[Path] = None) -> Optional[TokenizerSpec]:
    """The tokenizer `step_dir` was trained with (None: kind "none", ids made elsewhere), its bytes checked against
    the manifest's tokenizer_sha256; `path` replaces its main file (moved, or not recorded by an older run)."""
    record = manifest.get("tokenizer")
    if record is None:  # written before the manifest recorded its tokenizer: the [data] keys, when they name a file
        data = manifest["config"].get("data")
        data = data if isinstance(data, dict) else {}
        text = lambda key, default=None: data[key] if isinstance(data.get(key), str) else default  # noqa: E731
        record = {"kind": text("tokenizer_kind", "sentencepiece"), "model": text("tokenizer_model"),
                  "merges": text("tokenizer_merges"), "eod": text("tokenizer_eod")}
    if record["kind"] == "none":
        return None
    spec = TokenizerSpec(record["kind"], str(path) if path else record["model"], record["merges"], record["eod"])
    hint = "pass --tokenizer PATH to the file it was trained with, or --no-tokenizer to export the weights alone"
    if spec.model is None:
        raise CheckpointError(f"{step_dir} does not record its {spec.kind} tokenizer's file (trained into "
                              f"data.cache_dir, tokenizer-*.model there); {hint}")
    try:
        found = identity_sha256(load_tokenizer(spec), spec)
    except (TokenizerError, OSError) as err:
        raise CheckpointError(f"the tokenizer of {step_dir}: {err}; {hint}") from None
    if found != manifest["identity"]["tokenizer_sha256"]:
        raise CheckpointError(f"tokenizer {spec.model} is not the one {step_dir} was trained with (its identity "
                              f"SHA-256 {found[:12]}…, the checkpoint's {manifest['identity']['tokenizer_sha256'][:12]}…); "
                              f"{hint}")
    return spec


def _sentencepiece(path: str):
    """(`tokenizers` BPE, special tokens) replaying sentencepiece's own encoding of `path`; CheckpointError naming a
    setting it does not replay."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    extractor = SentencePieceExtractor(path)
    trainer, normalizer = extractor.proto.trainer_spec, extractor.proto.normalizer_spec
    refusals = {"model_type (BPE only)": (trainer.model_type, 2),
                "normalization_rule_name (identity only)": (normalizer.name, "identity"),
                "remove_extra_whitespaces": (normalizer.remove_extra_whitespaces, False),
                "treat_whitespace_as_suffix": (trainer.treat_whitespace_as_suffix, False),
                "user_defined_symbols": (len([p for p in extractor.proto.pieces if p.type == 4]), 0)}
    for name, (value, supported) in refusals.items():
        if value != supported:
            raise CheckpointError(f"sentencepiece model {path}: {name} = {value!r} has no Hugging Face export here "
                                  f"(supported: {supported!r}, as zero3d trains it); or pass --no-tokenizer")
    pieces = extractor.extract(BPE)
    bpe = Tokenizer(BPE(pieces["vocab"], pieces["merges"], unk_token=extractor.proto.pieces[trainer.unk_id].piece,
                        fuse_unk=True, byte_fallback=trainer.byte_fallback))
    steps = [normalizers.Replace(" ", SPACE)]
    if normalizer.add_dummy_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    bpe.normalizer = normalizers.Sequence(steps)
    # sentencepiece's SplitIntoWords: a word begins at a ▁ (the first of a run when whitespace-only pieces are kept)
    word = f"{SPACE}+[^{SPACE}]*|[^{SPACE}]+" if trainer.allow_whitespace_only_pieces else f"{SPACE}[^{SPACE}]*|[^{SPACE}]+"
    bpe.pre_tokenizer = pre_tokenizers.Split(Regex(word), behavior="isolated")
    bpe.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if normalizer.add_dummy_prefix else []))
    pieces_of = extractor.proto.pieces
    special = {"unk_token": pieces_of[trainer.unk_id].piece}
    special.update({key: pieces_of[i].piece for key, i in (("bos_token", trainer.bos_id), ("eos_token", trainer.eos_id))
                    if 0 <= i < len(pieces_of)})
    return bpe, special


def hf_tokenizer(spec: TokenizerSpec, max_length: int):
    """A transformers fast tokenizer giving zero3d's ids for `spec`; CheckpointError naming what it cannot replay."""
    from tokenizers import Tokenizer
    try:  # the one path of a run that needs transformers (the `hf` extra)
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise CheckpointError("export --format hf writes the tokenizer with transformers, which is not installed: "
                              "pip install 'transformers==5.24.0' (the `hf` extra), or pass --no-tokenizer") from None
    split_special = True  # zero3d's encoder matches no special token in text ...
    if spec.kind == "sentencepiece":
        backend, special = _sentencepiece(spec.model)
    else:
        ours = load_tokenizer(spec)
        special = {"eos_token": ours.eod}
        if spec.kind == "hf":
            backend, split_special = Tokenizer.from_file(spec.model), False  # ... except tokenizers' added tokens
        elif spec.kind == "gpt2_bpe":
            backend = ours.backend
        else:
            from transformers.convert_slow_tokenizer import TikTokenConverter
            backend = TikTokenConverter(spec.model, pattern=GPT2_PATTERN, extra_special_tokens=[ours.eod]).converted()
            if backend.token_to_id(ours.eod) != ours.eod_id:
                raise CheckpointError(f"tiktoken file {spec.model}: its ranks are not contiguous, so {ours.eod!r} "
                                      f"would not keep id {ours.eod_id}; pass --no-tokenizer")
    return PreTrainedTokenizerFast(tokenizer_object=backend, split_special_tokens=split_special,
                                   model_max_length=max_length, clean_up_tokenization_spaces=False, **special)

