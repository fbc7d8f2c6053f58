"""The run's doors to the Hugging Face format: `train.init_from` (weights in) and `train.save_final_hf` (the final
model out), each checked before any work of the run."""
import importlib.util
from pathlib import Path

from pretrain.checkpoint.export import export
from pretrain.checkpoint.hf import ImportedModel, architecture, check_matches
from pretrain.config import Config
from pretrain.errors import EXIT_INPUT, CheckpointError, ConfigError
from pretrain.runtime.status import write_status


def save_dir_of(cfg: Config) -> Path:
    """Where the run's checkpoints are: train.save_dir, else <run_dir>/checkpoints."""
    return Path(cfg.train.save_dir) if cfg.train.save_dir else cfg.run_dir / "checkpoints"


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
        params = export(save_dir_of(cfg), Path(cfg.train.save_final_hf), fmt="hf")
    except (CheckpointError, OSError) as err:
        write_status(cfg.run_dir, "failed", f"train.save_final_hf: {err}", world_size, end_step, EXIT_INPUT,
                     error=str(err))
        raise
    tokenizer = "and the tokenizer " if (Path(cfg.train.save_final_hf) / "tokenizer.json").is_file() else \
        "(no tokenizer: the run's token files were made elsewhere) "
    print(f"train.save_final_hf: wrote {len(params)} tensors {tokenizer}to {cfg.train.save_final_hf} "
          "(Hugging Face format)", flush=True)


def imported_model(directory: str, m) -> ImportedModel:
    """The HF directory train.init_from names, its model the run's (CheckpointError naming each key that differs)."""
    initial = ImportedModel(Path(directory))
    check_matches(initial.model, m, directory)
    return initial
