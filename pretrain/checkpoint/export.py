"""`python -m pretrain.export <step_dir | save_dir> <out_dir> [--overwrite] [--format hf]`: the whole model, TP/PP merged.

Exit codes: 0 written; 2 the output exists (a file, or an export without --overwrite), refused before
anything is loaded; 3 the checkpoint is missing, incomplete or altered, or (hf) has no Hugging Face class or its
tokenizer is missing or altered; 1 unexpected (traceback).

Writes <out_dir>/model.safetensors (parameter names as a TP 1 × PP 1 megatron GPTModel names them,
in the training dtype) and <out_dir>/config.json (the model section of the run's config, the
vocabulary sizes, the tokenizer's SHA-256 and the step). One process, no process group: DCP reads
only the "model/" tensors, after every file has been checked against the checkpoint's manifest.
`--format hf` writes a Hugging Face model directory instead, with the run's tokenizer (`export_hf`).
"""
import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from pretrain.atomic import publish, temporary_name
from pretrain.checkpoint.read import MANIFEST, load_dcp, read_checkpoint
from pretrain.checkpoint.recovery import LATEST, latest_name
from pretrain.checkpoint.tensors import MODEL_PREFIX as MODEL
from pretrain.errors import EXIT_CONFIG, EXIT_INPUT, CheckpointError


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


def _publish(tmp: Path, target: Path) -> None:
    """Give a finished temporary file the mode a new file gets (0666 & ~umask), then rename it in place."""
    os.chmod(tmp, 0o666 & ~_umask())
    publish(tmp, target)


def export(checkpoint: Path, out_dir: Path, overwrite: bool = False, fmt: str = "megatron",
           tokenizer: Optional[Path] = None, with_tokenizer: bool = True) -> dict:
    """Write the export; returns {name: tensor} written. `tokenizer`, `with_tokenizer`: format "hf" only."""
    check_output(out_dir, overwrite)
    step_dir = resolve_step_dir(Path(checkpoint))
    if fmt == "hf":
        return export_hf(step_dir, out_dir, tokenizer, with_tokenizer)
    manifest, tensors = read_model_tensors(step_dir)
    params = consolidated(tensors, manifest["parameter_names"])
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(out_dir / "model.safetensors")
    save_file({k: v.contiguous() for k, v in params.items()}, str(tmp),
              metadata={"format": "pt", "source": str(step_dir)})
    _publish(tmp, out_dir / "model.safetensors")
    config = {"model": manifest["config"]["model"], "dtype": manifest["layout"]["dtype"],
              "padded_vocab_size": manifest["identity"]["model"]["padded_vocab_size"],
              "vocab_size": manifest["identity"]["vocab_size"],
              "tokenizer_sha256": manifest["identity"]["tokenizer_sha256"], "step": manifest["step"],
              "parameters": {k: list(v.shape) for k, v in params.items()}}
    tmp = temporary_name(out_dir / "config.json")
    tmp.write_text(json.dumps(config, indent=1) + "\n")
    _publish(tmp, out_dir / "config.json")
    return params


SHARD_BYTES = 5 * 2**30  # above this, model.safetensors is split into shards with an index (as transformers does)


def export_hf(step_dir: Path, out_dir: Path, tokenizer: Optional[Path] = None, with_tokenizer: bool = True) -> dict:
    """The Hugging Face format (pretrain/checkpoint/hf.py): config.json, generation_config.json, the weights
    (model.safetensors, or shards and model.safetensors.index.json above SHARD_BYTES), the padded vocabulary rows
    dropped, and the run's tokenizer (pretrain/checkpoint/hf_tokenizer.py; `tokenizer` in place of its recorded
    file). A model no HF class computes, or a tokenizer that is missing, altered or not replayable, is refused
    (CheckpointError) before anything is loaded or written."""
    from pretrain.checkpoint.hf import architecture, hf_config, to_hf
    from pretrain.checkpoint.hf_tokenizer import checkpoint_tokenizer, hf_tokenizer
    from pretrain.checkpoint.read import ARCHITECTURE_BEFORE_KEYS, read_manifest
    manifest = read_manifest(step_dir)  # the files are verified once, by read_model_tensors below
    # a checkpoint older than the architecture keys is the GPT-2 their defaults describe
    model = {**ARCHITECTURE_BEFORE_KEYS, **manifest["config"]["model"]}
    vocab = manifest["identity"]["vocab_size"]
    architecture(model)
    spec = checkpoint_tokenizer(step_dir, manifest, tokenizer) if with_tokenizer else None
    text = hf_tokenizer(spec, model["seq_length"]) if spec else None
    manifest, tensors = read_model_tensors(step_dir)
    params = to_hf(consolidated(tensors, manifest["parameter_names"]), model, vocab)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, tensor in params.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensor, size + nbytes
    shards.append(current)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        tmp = temporary_name(out_dir / name)
        save_file(shard, str(tmp), metadata={"format": "pt"})
        _publish(tmp, out_dir / name)
    if text is not None:  # tokenizer.json, tokenizer_config.json: written beside, then renamed in place
        staging = temporary_name(out_dir / "tokenizer")
        text.save_pretrained(staging)
        for path in sorted(staging.iterdir()):
            _publish(path, out_dir / path.name)
        staging.rmdir()
    special = {"bos_token_id": text.bos_token_id if text else None, "eos_token_id": text.eos_token_id if text else None}
    config = {**hf_config(model, vocab), **special}
    config["torch_dtype"] = str(next(iter(params.values())).dtype).removeprefix("torch.")
    files = {"config.json": config, "generation_config.json": {"do_sample": False, "max_length": model["seq_length"],
                                                                **special}}
    if len(shards) > 1:
        files["model.safetensors.index.json"] = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in params.values())},
            "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor in shard}}
    for name, content in files.items():
        tmp = temporary_name(out_dir / name)
        tmp.write_text(json.dumps(content, indent=1) + "\n")
        _publish(tmp, out_dir / name)
    return params


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

