"""`python -m pretrain.export <step_dir | save_dir> <out_dir>`: the whole model, TP/PP merged, as safetensors.

Writes <out_dir>/model.safetensors (parameter names as a TP 1 × PP 1 megatron GPTModel names them,
in the training dtype) and <out_dir>/config.json (the model section of the run's config, the
vocabulary sizes, the tokenizer's SHA-256 and the step). One process, no process group: DCP reads
only the "model/" tensors, after every file has been checked against the checkpoint's manifest.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pretrain.checkpoint import LATEST, latest_name
from pretrain.checkpoint_files import MANIFEST, CheckpointError
from pretrain.checkpoint_read import load_dcp, read_checkpoint
from pretrain.checkpoint_tensors import PREFIXES

MODEL = PREFIXES["param"]


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


def export(checkpoint: Path, out_dir: Path) -> dict:
    step_dir = resolve_step_dir(Path(checkpoint))
    manifest, tensors = read_model_tensors(step_dir)
    params = consolidated(tensors, manifest["parameter_names"])
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in params.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt", "source": str(step_dir)})
    config = {"model": manifest["config"]["model"], "dtype": manifest["layout"]["dtype"],
              "padded_vocab_size": manifest["identity"]["model"]["padded_vocab_size"],
              "vocab_size": manifest["identity"]["vocab_size"],
              "tokenizer_sha256": manifest["identity"]["tokenizer_sha256"], "step": manifest["step"],
              "parameters": {k: list(v.shape) for k, v in params.items()}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return params


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step_<N> directory, or a save directory (its `latest`)")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        params = export(args.checkpoint, args.out_dir)
    except CheckpointError as err:
        print(f"export: {err}", file=sys.stderr)
        return 1
    print(f"wrote {len(params)} tensors, {sum(p.numel() for p in params.values())} parameters, "
          f"to {args.out_dir / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
