"""`python -m pretrain.export <step_dir | save_dir> <out_dir> [--overwrite] [--format hf]`: the whole model, TP/PP merged.

Exit codes: 0 written; 2 the output exists (a file, or an export without --overwrite), refused before
anything is loaded; 3 the checkpoint is missing, incomplete or altered, or (hf) has no Hugging Face class or its
tokenizer is missing or altered; 1 unexpected (traceback).

Writes <out_dir>/model.safetensors (parameter names as a TP 1 × PP 1 megatron GPTModel names them,
in the training dtype) and <out_dir>/config.json (the model section of the run's config, the
vocabulary sizes, the tokenizer's SHA-256 and the step). One process, no process group: DCP reads
only the "model/" tensors, after every file has been checked against the checkpoint's manifest.
`--format hf` writes a Hugging Face model directory instead, with the run's tokenizer (`hf_files`, `hf_tokenizer`);
a run's `train.save_final_hf` is that export after its last step (`write_final_hf`; its target is checked at the
run's start). Every file is written into a staging directory first and all are published together
(pretrain/atomic.py): an export that fails leaves nothing of itself in <out_dir>.
"""
import argparse
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from pretrain.atomic import publishing_directory
from pretrain.checkpoint.hf import architecture, hf_config, to_hf
from pretrain.checkpoint.read import ARCHITECTURE_BEFORE_KEYS, MANIFEST, load_dcp, read_checkpoint, read_manifest
from pretrain.checkpoint.recovery import LATEST, latest_name
from pretrain.checkpoint.tensors import MODEL_PREFIX as MODEL
from pretrain.config import Config
from pretrain.data.tokenizers import GPT2_PATTERN, TokenizerSpec, identity_sha256, load_tokenizer
from pretrain.errors import EXIT_CONFIG, EXIT_INPUT, CheckpointError, ConfigError, TokenizerError
from pretrain.runtime.status import write_status

SPACE = "\u2581"  # sentencepiece's whitespace symbol


def resolve_step_dir(path: Path) -> Path:
    """A step directory as given, or the one a save directory's `latest` names."""
    if (path / MANIFEST).is_file():
        return path
    if (path / LATEST).is_file():
        return path / latest_name(path)
    raise CheckpointError(f"{path} is neither a checkpoint (no {MANIFEST}) nor a save directory (no {LATEST})")


def read_model_tensors(step_dir: Path) -> tuple[dict, dict]:
    """(manifest, {checkpoint key: full global tensor}) of the model parameters, integrity-checked."""
    manifest, metadata = read_checkpoint(step_dir)
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items() if key.startswith(MODEL)}
    load_dcp(state, step_dir, no_dist=True)
    return manifest, {key[len(MODEL):]: tensor for key, tensor in state.items()}


def consolidated(tensors: dict, names: dict) -> dict:
    """{parameter name: tensor}: stacked decoder layers split into one tensor per layer."""
    out = {}
    for key, tensor in tensors.items():
        name = names.get(key)
        if name is None:
            raise CheckpointError(f"checkpoint tensor {key!r} has no parameter name in {MANIFEST}")
        if "{layer}" in name:
            out.update({name.format(layer=i): tensor[i].clone() for i in range(tensor.shape[0])})
        else:
            out[name] = tensor
    return dict(sorted(out.items()))


OUTPUTS = ("model.safetensors", "config.json")


def check_output(out_dir: Path, overwrite: bool) -> None:
    """Before anything is loaded: out_dir is a new (or empty) directory, or with --overwrite one whose
    model.safetensors and config.json are replaced; an existing file is refused."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportUsageError(f"output {str(out_dir)!r} is an existing file, not a directory; "
                               "give a directory path for model.safetensors and config.json")
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if held and not overwrite:
        raise ExportUsageError(f"output directory {str(out_dir)!r} already exists and holds {', '.join(held[:3])}"
                               f"{' ...' if len(held) > 3 else ''}; pass --overwrite to replace "
                               f"{' and '.join(OUTPUTS)} in it, or give a new directory")


class ExportUsageError(Exception):
    """The command line asks for something export refuses (exit 2)."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@dataclass
class ExportFiles:
    """An export before it is written: its safetensors files ({name: (tensors, metadata)}), its JSON files
    ({name: object}) and, in the HF format, the tokenizer (its save_pretrained files); `params`: {name: tensor}."""
    params: dict
    weights: dict
    json_files: dict
    tokenizer: object = None


def export(checkpoint: Path, out_dir: Path, overwrite: bool = False, fmt: str = "megatron",
           tokenizer: Optional[Path] = None, with_tokenizer: bool = True) -> dict:
    """Write the export; returns {name: tensor} written. `tokenizer`, `with_tokenizer`: format "hf" only."""
    check_output(out_dir, overwrite)
    step_dir = resolve_step_dir(Path(checkpoint))
    files = hf_files(step_dir, tokenizer, with_tokenizer) if fmt == "hf" else megatron_files(step_dir)
    with publishing_directory(out_dir) as staging:
        for name, (tensors, metadata) in files.weights.items():
            save_file(tensors, str(staging / name), metadata=metadata)
        if files.tokenizer is not None:  # tokenizer.json, tokenizer_config.json
            files.tokenizer.save_pretrained(staging)
        for name, content in files.json_files.items():
            (staging / name).write_text(json.dumps(content, indent=1) + "\n")
        mode = 0o666 & ~_umask()  # the mode a new file gets (safetensors writes 0600)
        for path in staging.iterdir():
            os.chmod(path, mode)
    return files.params


def megatron_files(step_dir: Path) -> ExportFiles:
    """model.safetensors (megatron's TP 1 × PP 1 names) and config.json."""
    manifest, tensors = read_model_tensors(step_dir)
    params = consolidated(tensors, manifest["parameter_names"])
    config = {"model": manifest["config"]["model"], "dtype": manifest["layout"]["dtype"],
              "padded_vocab_size": manifest["identity"]["model"]["padded_vocab_size"],
              "vocab_size": manifest["identity"]["vocab_size"],
              "tokenizer_sha256": manifest["identity"]["tokenizer_sha256"], "step": manifest["step"],
              "parameters": {k: list(v.shape) for k, v in params.items()}}
    weights = {"model.safetensors": ({k: v.contiguous() for k, v in params.items()},
                                     {"format": "pt", "source": str(step_dir)})}
    return ExportFiles(params, weights, {"config.json": config})


SHARD_BYTES = 5 * 2**30  # above this, model.safetensors is split into shards with an index (as transformers does)


def hf_files(step_dir: Path, tokenizer: Optional[Path] = None, with_tokenizer: bool = True) -> ExportFiles:
    """The Hugging Face format (pretrain/checkpoint/hf.py): config.json, generation_config.json, the weights
    (model.safetensors, or shards and model.safetensors.index.json above SHARD_BYTES), the padded vocabulary rows
    dropped, and the run's tokenizer (`hf_tokenizer`; `tokenizer` in place of its recorded file). A model no HF
    class computes, or a tokenizer that is missing, altered or not replayable, is refused (CheckpointError) before
    anything is loaded or written."""
    manifest = read_manifest(step_dir)  # the files are verified once, by read_model_tensors below
    # a checkpoint older than the architecture keys is the GPT-2 their defaults describe
    model = {**ARCHITECTURE_BEFORE_KEYS, **manifest["config"]["model"]}
    vocab = manifest["identity"]["vocab_size"]
    architecture(model)
    spec = checkpoint_tokenizer(step_dir, manifest, tokenizer) if with_tokenizer else None
    text = hf_tokenizer(spec, model["seq_length"]) if spec else None
    manifest, tensors = read_model_tensors(step_dir)
    params = to_hf(consolidated(tensors, manifest["parameter_names"]), model, vocab)
    shards, current, size = [], {}, 0
    for name, tensor in params.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensor, size + nbytes
    shards.append(current)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    special = {"bos_token_id": text.bos_token_id if text else None, "eos_token_id": text.eos_token_id if text else None}
    config = {**hf_config(model, vocab), **special}
    config["torch_dtype"] = str(next(iter(params.values())).dtype).removeprefix("torch.")
    files = {"config.json": config, "generation_config.json": {"do_sample": False, "max_length": model["seq_length"],
                                                                **special}}
    if len(shards) > 1:
        files["model.safetensors.index.json"] = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in params.values())},
            "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor in shard}}
    return ExportFiles(params, {name: (shard, {"format": "pt"}) for name, shard in zip(names, shards)}, files, text)


# ---- the run's tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json)
def checkpoint_tokenizer(step_dir: Path, manifest: dict, path: Optional[Path] = None) -> Optional[TokenizerSpec]:
    """The tokenizer `step_dir` was trained with (None: kind "none", ids made elsewhere): the spec its manifest records
    (DataFiles.tokenizer_record; older checkpoints: the `[data]` keys naming a file), or `path` (export's
    `--tokenizer`) in place of its main file (moved, or not recorded by an older run); refused when its bytes
    differ from the checkpoint's tokenizer_sha256."""
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
    """A transformers fast tokenizer giving zero3d's ids for `spec`; CheckpointError naming what it cannot replay.

      sentencepiece  the BPE pieces and merges as a `tokenizers` BPE with byte fallback; sentencepiece's dummy prefix
                     and its word split (a word starts at the first ▁ of a run) replayed; identity normalisation only
      hf             its tokenizer.json as it is (its own post-processor: a BOS it adds is the tokenizer's choice)
      gpt2_bpe       the byte-level BPE zero3d builds from vocab.json + merges.txt
      tiktoken       the ranks as a byte-level BPE (transformers' TikTokenConverter), zero3d's split pattern
    Where zero3d's encoder reads a special token's text as plain text, the HF tokenizer does too (split_special_tokens),
    and it adds no BOS zero3d does not: `AutoTokenizer.from_pretrained(out)(text).input_ids` is zero3d's `encode(text)`.
    """
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


# ---- train.save_final_hf: this export after the last step of a run, its target checked at its start
def check_save_final_hf(cfg: Config) -> None:
    """train.save_final_hf is refused at the start, not after the run: a directory holding files, a model no
    Hugging Face class computes."""
    target = Path(cfg.train.save_final_hf)
    held = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if (target.exists() and not target.is_dir()) or held:
        raise ConfigError(f"train.save_final_hf = {str(target)!r} is invalid; it "
                          + (f"holds {', '.join(held[:3])}{' ...' if len(held) > 3 else ''}" if held else "is a file")
                          + ": give a new or empty directory (an export is never written over)")
    if importlib.util.find_spec("transformers") is None:  # it writes the tokenizer files
        raise ConfigError(f"train.save_final_hf = {str(target)!r} is invalid here; transformers is not installed: "
                          "pip install 'transformers==5.24.0' (the `hf` extra)")
    try:
        architecture(cfg.to_dict()["model"])
    except CheckpointError as err:
        raise ConfigError(f"train.save_final_hf = {str(target)!r} is invalid for this model; {err}") from None


def write_final_hf(cfg: Config, world_size: int, end_step: int) -> None:
    """Rank 0, after the run: the final checkpoint in the Hugging Face format (`export --format hf`); a failure is
    the run's status (the checkpoint itself is saved) and its error."""
    try:
        params = export(cfg.save_dir, Path(cfg.train.save_final_hf), fmt="hf")
    except (CheckpointError, OSError) as err:
        write_status(cfg.run_dir, "failed", f"train.save_final_hf: {err}", world_size, end_step, EXIT_INPUT,
                     error=str(err))
        raise
    tokenizer = ("and the tokenizer " if (Path(cfg.train.save_final_hf) / "tokenizer.json").is_file() else
                 "(no tokenizer: the run's token files were made elsewhere) ")
    print(f"train.save_final_hf: wrote {len(params)} tensors {tokenizer}to {cfg.train.save_final_hf} "
          "(Hugging Face format)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step_<N> directory, or a save directory (its `latest`)")
    parser.add_argument("out_dir", type=Path, help="a new directory (an existing export only with --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace model.safetensors and config.json in out_dir")
    parser.add_argument("--format", choices=["megatron", "hf"], default="megatron",
                        help="megatron: TP-1 megatron names (default); hf: a Hugging Face model directory "
                             "with its tokenizer, that transformers' Auto classes load")
    parser.add_argument("--tokenizer", type=Path, help="hf: the run's tokenizer file, where it is no longer where the "
                                                       "checkpoint recorded it (checked against its SHA-256)")
    parser.add_argument("--no-tokenizer", action="store_true", help="hf: write the model alone, no tokenizer files")
    args = parser.parse_args(argv)
    if args.format != "hf" and (args.tokenizer or args.no_tokenizer):
        print("export: --tokenizer and --no-tokenizer apply to --format hf only", file=sys.stderr)
        return EXIT_CONFIG
    try:
        params = export(args.checkpoint, args.out_dir, args.overwrite, args.format, args.tokenizer,
                        not args.no_tokenizer)
    except ExportUsageError as err:
        print(f"export: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except (CheckpointError, OSError) as err:  # missing, incomplete or unreadable checkpoint files
        print(f"export: {err}", file=sys.stderr)
        return EXIT_INPUT
    print(f"wrote {len(params)} tensors, {sum(p.numel() for p in params.values())} parameters, "
          f"to {args.out_dir / 'model.safetensors'}")
    if args.format == "hf":
        print(f"tokenizer: {args.out_dir / 'tokenizer.json'}" if (args.out_dir / "tokenizer.json").is_file()
              else "tokenizer: none written (--no-tokenizer, or a run of token files made elsewhere)")
    return 0

